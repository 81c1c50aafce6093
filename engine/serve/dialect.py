"""What the server's APIs share, and where they differ: one request path (`app._complete`) reads a body,
waits for the model, submits a `Generate` and answers, whole or streamed; a `Dialect` (OpenAI's in
`schema`, Ollama's in `ollama`) says how the body reads and how the answer and its errors are written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from engine import protocol as p
from engine.serve.hub import LogEntry, RequestStream


class ApiError(Exception):
    """A refused request: an HTTP status and one line for a person (each dialect writes its own body;
    `param`, `code` and `type` are OpenAI's fields)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}


def parse(model: type[BaseModel], body: object) -> Any:
    """The body as `model`, or a 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error.get("loc", ()))
        what = "is required" if error.get("type") == "missing" else error.get("msg", "is not valid").lower()
        raise ApiError(400, f"{param}: {what}", param=param) from None


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (pydantic appends the union member tried)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "list[int]", "function-after", "literal_error"):
            break
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def checked(settings: p.SamplingSettings, names: dict[str, str]) -> p.SamplingSettings:
    """`settings`, or a 400 naming the first one out of range (`SamplingSettings.problem()`) by the API's name."""
    if problem := settings.problem():
        name = names.get(problem.field, problem.field)
        raise ApiError(400, f"{name}: {problem.message}", param=name)
    return settings


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: MoEScope does not support {what}", param=param)


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}  # both APIs' names

ENGINE_ERRORS = {  # protocol Error kinds -> HTTP status, OpenAI type, code
    "prompt-too-long": (400, "invalid_request_error", "context_length_exceeded"),
    "error": (400, "invalid_request_error", None),  # a MoEScopeError about the request (empty prompt, no chat template)
    "engine-crashed": (503, "server_error", "engine_crashed"),
    "out-of-memory": (503, "server_error", "out_of_memory"),
}


def engine_error(error: p.Error, prompt_param: str) -> ApiError:
    status, kind, code = ENGINE_ERRORS.get(error.kind, (500, "server_error", error.kind))
    param = prompt_param if error.kind == "prompt-too-long" else None
    return ApiError(status, error.message, param=param, code=code, type=kind)


def routing(done: p.Done) -> list | None:
    """vLLM's `routed_experts`: [tokens, layers, top_k] expert ids as nested lists."""
    return done.routed_experts.numpy().tolist() if done.routed_experts is not None else None


def sse(payload: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


@dataclass
class Reply:
    """A request accepted and submitted to the engine: what answering it needs."""

    request_id: str
    dialect: Dialect
    endpoint: str
    started: float  # perf_counter when the request arrived
    req: Any  # the dialect's request model
    model_name: str  # the loaded model's name
    with_routing: bool
    stream: RequestStream  # the engine's events for this request
    load_s: float = 0.0  # how long it waited for the model to (re)load

    def failed(self, status: int, message: str) -> LogEntry:
        return LogEntry(self.request_id, self.endpoint, status, seconds=time.perf_counter() - self.started,
                        message=message)

    def answered(self, done: p.Done) -> LogEntry:
        return LogEntry(self.request_id, self.endpoint, 200, done.finish_reason, done.stats.prefill_tokens,
                        len(done.token_ids), time.perf_counter() - self.started)


class Dialect:
    """One API's shapes. Its request model has `model`, `stream` and `return_routed_experts`, and
    `sampling(context_length)` and `generate_fields()` (Generate's messages, prompt or prompt_ids)."""

    request: type[BaseModel]
    prompt_param = "messages"  # what a prompt too long for the context is blamed on
    media_type = "text/event-stream"  # of a streamed answer

    def parse(self, body: object) -> Any:
        return parse(self.request, body)

    def preload(self, req: Any) -> dict | None:
        """The whole answer to a request that only asks for the model to be loaded, else None."""
        return None

    def error_body(self, error: ApiError) -> dict:
        raise NotImplementedError

    def whole(self, reply: Reply, done: p.Done) -> dict:
        """The answer in one body."""
        raise NotImplementedError

    def opening(self, reply: Reply) -> list[dict | str]:
        """What a stream sends before the first token."""
        return []

    def delta(self, reply: Reply, text: str) -> dict:
        raise NotImplementedError

    def closing(self, reply: Reply, done: p.Done) -> list[dict | str]:
        """What a stream ends with."""
        raise NotImplementedError

    def frame(self, payload: dict | str) -> bytes:
        raise NotImplementedError
