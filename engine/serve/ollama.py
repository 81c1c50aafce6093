"""Ollama's dialect, beside OpenAI's: `/api/chat` and `/api/generate` (on the same request path,
`app._complete`), and `/api/tags`, `/api/show`, `/api/ps`, `/api/version` about the one loaded model.

The shapes are those of Ollama's docs/api.md and its Python client (`ollama._types`): streamed as
NDJSON by default (`"stream": false` for one body), durations in nanoseconds, errors as
`{"error": "message"}`. Ollama's sampling defaults apply (temperature 0.8, top_p 0.9, top_k 40);
`num_predict` is the reply's length (-1, -2 or none: up to the context). `num_ctx` is ignored: the
context is the loaded model's, fixed at load (`/api/show` reports it). What MoEScope cannot do
(images, tools, structured `format`, `suffix`, a custom `template`, the deprecated `context`,
`logprobs`) is refused with 400 naming the field rather than ignored; `keep_alive` and `think` are
ignored (the model stays loaded; a thinking model's reasoning stays in the text).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine import protocol as p
from engine.serve.dialect import FINISH, ApiError, Dialect, Reply, checked, routing, unsupported

PREFIX = "/api/"
VERSION = "0.12.0"  # the Ollama version whose API these routes follow, for clients that check it
NAMES = {field: f"options.{name}" for field, name in {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repeat_penalty",
    "max_new_tokens": "num_predict", "stop": "stop"}.items()}


class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Ollama's other options and fields (min_p, mirostat, ...) too


class Options(_Open):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    repeat_penalty: float | None = None
    stop: str | list[str] | None = None
    num_ctx: int | None = None  # ignored: the context is the loaded model's


class _Request(_Open):
    model: str
    stream: bool = True
    options: Options | None = None
    format: str | dict | None = None
    logprobs: bool | None = None
    images: list[str] | None = None
    return_routed_experts: bool = False  # as in OpenAI's dialect: the final object carries routed_experts

    def sampling(self, context_length: int) -> p.SamplingSettings:
        o = self.options or Options()
        predict = o.num_predict
        return checked(p.SamplingSettings(
            temperature=0.8 if o.temperature is None else o.temperature,
            top_p=0.9 if o.top_p is None else o.top_p,
            top_k=40 if o.top_k is None else o.top_k,
            repetition_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
            max_new_tokens=max(context_length, 1) if predict is None or predict in (-1, -2) else predict,
            seed=None if o.seed is None or o.seed < 0 else o.seed,  # Ollama's -1: random
            stop=[o.stop] if isinstance(o.stop, str) else list(o.stop or []),
        ), NAMES)

    def _refuse(self, *more: tuple[str, object, str]) -> None:
        """A 400 for the first field that asks for what MoEScope cannot do: (field, value, what it asks for)."""
        for param, value, what in (("format", self.format, "structured output (format)"),
                                   ("logprobs", self.logprobs, "logprobs"), ("images", self.images, "images"), *more):
            if value:
                raise unsupported(param, what)


class Message(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None


class ChatRequest(_Request):
    messages: list[Message] = []
    tools: list[dict] | None = None

    def generate_fields(self) -> dict:
        self._refuse(("tools", self.tools, "tool calling"),
                     *((f"messages[{i}].images", m.images, "images") for i, m in enumerate(self.messages)))
        return {"messages": [{"role": m.role, "content": m.content or ""} for m in self.messages]}


class GenerateRequest(_Request):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None

    def generate_fields(self) -> dict:
        self._refuse(("suffix", self.suffix, "fill-in-the-middle (suffix)"), ("template", self.template, "a custom template"),
                     ("context", self.context, "the deprecated context"))
        if self.raw:
            return {"prompt": self.prompt}
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"messages": [*system, {"role": "user", "content": self.prompt}]}


class Ollama(Dialect):
    """`/api/chat` ("chat") or `/api/generate` ("generate")."""

    media_type = "application/x-ndjson"

    def __init__(self, kind: str, request: type[_Request]) -> None:
        self.kind, self.request = kind, request
        self.prompt_param = "messages" if kind == "chat" else "prompt"

    def _text(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"response": text}

    def preload(self, req: Any) -> dict | None:
        """Ollama loads the model for a chat without messages or a generate without a prompt: it is loaded."""
        empty = not req.messages if self.kind == "chat" else not req.prompt
        return {**_head(req.model), **self._text(""), "done": True, "done_reason": "load"} if empty else None

    def error_body(self, error: ApiError) -> dict:
        return {"error": error.message}

    def whole(self, reply: Reply, done: p.Done) -> dict:
        return {**_head(reply.req.model), **self._text(done.text), **_final(reply, done)}

    def delta(self, reply: Reply, text: str) -> dict:
        return {**_head(reply.req.model), **self._text(text), "done": False}

    def closing(self, reply: Reply, done: p.Done) -> list[dict | str]:
        return [{**_head(reply.req.model), **self._text(""), **_final(reply, done)}]

    def frame(self, payload: dict | str) -> bytes:
        return (json.dumps(payload, separators=(",", ":")) + "\n").encode()


CHAT = Ollama("chat", ChatRequest)
GENERATE = Ollama("generate", GenerateRequest)


def _head(model: str) -> dict:
    """Every object starts so: the model as the request named it, and when."""
    return {"model": model, "created_at": _iso(time.time())}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _final(reply: Reply, done: p.Done) -> dict:
    """The last object's fields: why it ended and what it cost (`load_duration`: waiting for a (re)load)."""
    stats = done.stats
    out = {"done": True, "done_reason": FINISH.get(done.finish_reason, "stop"),
           "total_duration": _ns(time.perf_counter() - reply.started), "load_duration": _ns(reply.load_s),
           "prompt_eval_count": stats.prefill_tokens, "prompt_eval_duration": _ns(stats.ttft_s),
           "eval_count": len(done.token_ids), "eval_duration": _ns(stats.total_s - stats.ttft_s)}
    if reply.with_routing:
        out["routed_experts"] = routing(done)
    return out


# ---------------------------------------------------------------- the model: tags, show, ps, version


def show_name(body: object) -> str:
    """`/api/show`'s model (older clients call it `name`), or a 400."""
    name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: is required", param="model")
    return name


def tagged(name: str) -> str:
    """Ollama's `name:tag` form: `demo` is `demo:latest`."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _family(model: p.ModelLoaded) -> str:
    """'Qwen3MoeForCausalLM' -> 'qwen3moe', as GGUF and Ollama name it."""
    return re.sub(r"For(CausalLM|ConditionalGeneration)$", "", model.architecture).lower()


def _details(model: p.ModelLoaded) -> dict:
    dtype = model.dtype.removeprefix("torch.")
    level = (model.expert_format.upper() if model.expert_format != "original"
             else {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper()))
    return {"parent_model": "", "format": "gguf" if model.path.lower().endswith(".gguf") else "safetensors",
            "family": _family(model), "families": [_family(model)], "quantization_level": level}


def _listed(model: p.ModelLoaded, loaded_at: float) -> dict:
    return {"name": tagged(model.name), "model": tagged(model.name), "modified_at": _iso(loaded_at),
            "size": model.all_expert_bytes + model.dense_bytes,
            "digest": hashlib.sha256(model.path.encode()).hexdigest(), "details": _details(model)}


def tags(model: p.ModelLoaded | None, loaded_at: float) -> dict:
    return {"models": [_listed(model, loaded_at)] if model is not None else []}


def ps(model: p.ModelLoaded | None, loaded_at: float) -> dict:
    """The loaded model; on a GPU its dense weights and expert cache count as `size_vram`."""
    if model is None:
        return {"models": []}
    listed = _listed(model, loaded_at)
    vram = 0 if model.device == "cpu" else min(listed["size"], model.dense_bytes + model.budget_bytes)
    return {"models": [{**listed, "size_vram": vram, "context_length": model.context_length}]}


def show(model: p.ModelLoaded, loaded_at: float) -> dict:
    family = _family(model)
    info = {"general.architecture": family, "general.basename": model.name,
            f"{family}.context_length": model.context_length, f"{family}.expert_count": model.num_experts,
            f"{family}.expert_used_count": model.top_k}
    return {"modelfile": f"# served by MoEScope\nFROM {model.path}\n", "parameters": "", "template": "",
            "details": _details(model), "model_info": info, "capabilities": ["completion"],
            "modified_at": _iso(loaded_at)}


def version() -> dict:
    return {"version": VERSION}
