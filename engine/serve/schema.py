"""OpenAI's dialect: its request bodies (validated), their mapping onto `SamplingSettings`, and the
response bodies, whole or as server-sent events.

One check of the sampling ranges: `SamplingSettings.problem()`, its field names mapped back to
OpenAI's (`max_new_tokens` is `max_tokens`). Unknown fields are ignored, as vLLM does, so clients
that send more than MoEScope uses (logprobs off, presence_penalty 0, ...) still work.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import protocol as p
from engine.serve.dialect import FINISH, ApiError, Dialect, Reply, checked, routing, sse

OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


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
        return checked(settings, OPENAI_NAMES)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def sampling(self, context_length: int) -> p.SamplingSettings:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(context_length)

    def generate_fields(self) -> dict:
        return {"messages": [m.turn() for m in self.messages]}


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    def generate_fields(self) -> dict:
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


# ---------------------------------------------------------------- responses


def usage(done: p.Done) -> dict:
    prompt, completion = done.stats.prefill_tokens, len(done.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


class OpenAI(Dialect):
    """`/v1/chat/completions` ("chat") or `/v1/completions` ("completion")."""

    def __init__(self, kind: str, request: type[_Request]) -> None:
        self.kind, self.request = kind, request
        self.prompt_param = "messages" if kind == "chat" else "prompt"

    def error_body(self, error: ApiError) -> dict:
        return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}

    def whole(self, reply: Reply, done: p.Done) -> dict:
        return response(self.kind, reply.request_id, reply.model_name, done, reply.with_routing)

    def opening(self, reply: Reply) -> list[dict | str]:
        return [chunk(self.kind, reply.request_id, reply.model_name, role=True)] if self.kind == "chat" else []

    def delta(self, reply: Reply, text: str) -> dict:
        return chunk(self.kind, reply.request_id, reply.model_name, text=text)

    def closing(self, reply: Reply, done: p.Done) -> list[dict | str]:
        out: list[dict | str] = [chunk(self.kind, reply.request_id, reply.model_name, done=done,
                                       with_routing=reply.with_routing)]
        options = reply.req.stream_options
        if options and options.include_usage:
            out.append(chunk(self.kind, reply.request_id, reply.model_name, done=done, usage_only=True))
        return [*out, "[DONE]"]

    def frame(self, payload: dict | str) -> bytes:
        return sse(payload)


CHAT = OpenAI("chat", ChatRequest)
COMPLETION = OpenAI("completion", CompletionRequest)
