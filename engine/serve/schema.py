"""OpenAI's request bodies (validated), their mapping onto `SamplingSettings`, and the response bodies.

One check of the sampling ranges: `SamplingSettings.problem()`, its field names mapped back to
OpenAI's (`max_new_tokens` is `max_tokens`). Unknown fields are ignored, as vLLM does, so clients
that send more than MoEScope uses (logprobs off, presence_penalty 0, ...) still work.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import protocol as p

OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


class ApiError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def turn(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(_Open):
    include_usage: bool = False


class _Request(_Open):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra sampling fields
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_routed_experts: bool = False  # SGLang's per-request switch; `moescope serve --return-routed-experts` sets it for all

    def sampling(self, context_length: int) -> p.SamplingSettings:
        """OpenAI's defaults (temperature 1, top_p 1, max_tokens up to the context), checked by `problem()`."""
        if self.n != 1:
            raise ApiError(400, f"n: MoEScope generates one choice per request, got n={self.n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = p.SamplingSettings()
        settings = p.SamplingSettings(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            repetition_penalty=self.repetition_penalty or defaults.repetition_penalty,
            max_new_tokens=max(context_length, 1) if self.max_tokens is None else self.max_tokens,
            seed=self.seed,
            stop=stop,
        )
        if problem := settings.problem():
            name = OPENAI_NAMES.get(problem.field, problem.field)
            raise ApiError(400, f"{name}: {problem.message}", param=name)
        return settings


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def sampling(self, context_length: int) -> p.SamplingSettings:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(context_length)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    def prompt_fields(self) -> dict:
        """Generate's prompt: text, or token ids (a list of one text is the text)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: MoEScope completes one prompt per request, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        return {"prompt_ids": list(prompt)}


def parse(model: type[_Request], body: object) -> _Request:
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


# ---------------------------------------------------------------- responses


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def usage(done: p.Done) -> dict:
    prompt, completion = done.stats.prefill_tokens, len(done.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def routing(done: p.Done) -> list | None:
    """vLLM's `routed_experts`: [tokens, layers, top_k] expert ids as nested lists."""
    return done.routed_experts.numpy().tolist() if done.routed_experts is not None else None


def completion_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id.removeprefix(p.API_REQUEST_PREFIX)}"


def response(kind: str, request_id: str, model: str, done: p.Done, with_routing: bool) -> dict:
    choice: dict = {"index": 0, "finish_reason": FINISH.get(done.finish_reason, done.finish_reason), "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    if with_routing:
        choice["routed_experts"] = routing(done)
    return {"id": completion_id(kind, request_id), "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage(done)}


def chunk(kind: str, request_id: str, model: str, *, text: str | None = None, role: bool = False,
          done: p.Done | None = None, with_routing: bool = False, usage_only: bool = False) -> dict:
    """One streamed chunk: the role, a text delta, the finish (with the routing), or the usage alone."""
    body = {"id": completion_id(kind, request_id), "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model}
    if usage_only:
        assert done is not None
        return {**body, "choices": [], "usage": usage(done)}
    choice: dict = {"index": 0, "finish_reason": None, "logprobs": None}
    if kind == "chat":
        choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text or ""}
    else:
        choice["text"] = text or ""
    if done is not None:
        choice["finish_reason"] = FINISH.get(done.finish_reason, done.finish_reason)
        if kind == "chat":
            choice["delta"] = {}
        if with_routing:
            choice["routed_experts"] = routing(done)
    return {**body, "choices": [choice]}


def models(model: p.ModelLoaded | None) -> dict:
    data = []
    if model is not None:
        data.append({"id": model.name, "object": "model", "created": 0, "owned_by": "moescope",
                     "max_model_len": model.context_length})
    return {"object": "list", "data": data}


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
