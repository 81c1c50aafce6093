"""Anthropic's Messages API dialect (`POST /v1/messages`), on the same request path as OpenAI's and
Ollama's (`app._complete`).

The shapes are those of Anthropic's API reference and its Python client (`anthropic.types`): a
reply is one text block; streamed, it is the named server-sent events `message_start`,
`content_block_start`, `ping`, `content_block_delta` (text deltas), `content_block_stop`,
`message_delta` (stop reason and usage) and `message_stop`; errors are `{"type": "error", "error":
{"type", "message"}}`, mid-stream an `error` event. `max_tokens` is required, as Anthropic requires
it. Its sampling defaults apply (temperature 1); its current client has no sampling arguments, so
`temperature`, `top_p` and `top_k` come through `extra_body`. The API key may come as `x-api-key`, as the
client sends it. What MoEScope cannot do (images, documents, tool use) is refused with 400 naming
the field; `metadata`, `thinking` and `service_tier` are ignored.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import protocol as p
from engine.serve.dialect import ApiError, Dialect, Reply, checked, routing, unsupported

PATH = "/v1/messages"
NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}
STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")  # metadata, thinking, service_tier, ...


class Block(_Open):
    type: str
    text: str | None = None


def _text(content: str | list[Block], param: str) -> str:
    """A content string, or its text blocks joined; a 400 naming the first block of another kind."""
    if isinstance(content, str):
        return content
    for index, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise unsupported(f"{param}[{index}]", f"'{block.type}' content blocks")
    return "".join(block.text for block in content)


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesRequest(_Open):
    model: str
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    return_routed_experts: bool = False  # as in OpenAI's dialect: the message carries routed_experts

    def sampling(self, context_length: int) -> p.SamplingSettings:
        return checked(p.SamplingSettings(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_new_tokens=self.max_tokens,
            stop=list(self.stop_sequences or []),
        ), NAMES)

    def generate_fields(self) -> dict:
        if self.tools or self.tool_choice:
            raise unsupported("tools", "tool use")
        system = _text(self.system or "", "system")
        turns = [{"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
                 for i, m in enumerate(self.messages)]
        return {"messages": ([{"role": "system", "content": system}] if system else []) + turns}


class Anthropic(Dialect):
    request = MessagesRequest

    def error_body(self, error: ApiError) -> dict:
        kind = ERROR_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}

    def whole(self, reply: Reply, done: p.Done) -> dict:
        return {**_message(reply, done), "content": [{"type": "text", "text": done.text}]}

    def opening(self, reply: Reply) -> list[dict | str]:
        start = {**_message(reply, None), "content": []}
        return [{"type": "message_start", "message": start},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "ping"}]

    def delta(self, reply: Reply, text: str) -> dict:
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}

    def closing(self, reply: Reply, done: p.Done) -> list[dict | str]:
        message = _message(reply, done)
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        if "routed_experts" in message:
            delta["routed_experts"] = message["routed_experts"]
        return [{"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": delta, "usage": message["usage"]},
                {"type": "message_stop"}]

    def frame(self, payload: dict | str) -> bytes:
        kind = payload["type"] if isinstance(payload, dict) else "message"
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


MESSAGES = Anthropic()


def _message(reply: Reply, done: p.Done | None) -> dict:
    """The message object but its content: ended (`done`) or about to start."""
    req: MessagesRequest = reply.req
    stop_reason = STOP_REASON.get(done.finish_reason, "end_turn") if done is not None else None
    # the reply's text stops before the stop sequence: which one it was is known when there is one
    sequences = req.stop_sequences or []
    stop_sequence = sequences[0] if stop_reason == "stop_sequence" and len(sequences) == 1 else None
    usage = {"input_tokens": done.stats.prefill_tokens if done is not None else 0,
             "output_tokens": len(done.token_ids) if done is not None else 0}
    out = {"id": f"msg_{reply.request_id.removeprefix(p.API_REQUEST_PREFIX)}", "type": "message",
           "role": "assistant", "model": req.model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
           "usage": usage}
    if done is not None and reply.with_routing:
        out["routed_experts"] = routing(done)
    return out
