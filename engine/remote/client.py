"""A remote OpenAI-compatible server behind `EngineClient`'s interface: `start`, `send(command)`,
`restart`, `stop`, events to a callback on a background thread.

`Generate` becomes a streamed `/v1/chat/completions` (or `/v1/completions` for a raw prompt), its
chunks `Token` events and its end a `Done` with the usage and timings; `Cancel` closes the stream.
The routing the server reports becomes `RoutingSnapshot` events for the heatmap. Commands that
need MoEScope's own cache (budget, policy, kernels, the model library) are answered with an error
saying they do not apply.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from engine import protocol as p
from engine.remote.routing import RoutingCounts, decode_distribution, decode_routed_experts

EventFn = Callable[[object], None]
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a long prefill on a busy server
FINISH = {"stop": "stop", "length": "length", "eos": "eos"}


@dataclass(frozen=True)
class RemoteTarget:
    url: str  # the server, with or without /v1
    api_key: str | None = None
    model: str = ""  # "" = the first the server lists

    @property
    def base(self) -> str:
        url = self.url.strip().rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def root(self) -> str:
        return self.base.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class RemoteError(Exception):
    """One line for the user: why the server could not be used."""


def list_models(target: RemoteTarget, timeout: float = CONNECT_TIMEOUT_S) -> list[dict]:
    """The server's `/v1/models` entries, or RemoteError with the reason."""
    try:
        response = httpx.get(target.base + "/models", headers=target.headers(), timeout=timeout)
    except httpx.HTTPError as exc:
        raise RemoteError(f"cannot reach {target.base}: {exc}") from None
    if response.status_code in (401, 403):
        raise RemoteError(f"{target.base} refused the API key ({response.status_code}): {_message(response)}")
    if response.status_code != 200:
        raise RemoteError(f"{target.base}/models answered {response.status_code}: {_message(response)}")
    try:
        return list(response.json()["data"])
    except (ValueError, KeyError, TypeError):
        raise RemoteError(f"{target.base}/models did not answer like an OpenAI-compatible server") from None


def _message(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        body = response.json()
        error = body.get("error", body)
        return str(error.get("message") or error.get("detail") or body).splitlines()[0]
    return response.text.strip().splitlines()[0] if response.text.strip() else response.reason_phrase


class RemoteClient:
    def __init__(self, on_event: EventFn, target: RemoteTarget) -> None:
        self.on_event = on_event
        self.target = target
        self.last_load: p.LoadModel | None = None  # nothing to reload: the server holds the model
        self.pid: int | None = None
        self.model = ""
        self.routing = RoutingCounts()
        self.sglang_record = False  # the server answers SGLang's expert-distribution record endpoints
        self._alive = False
        self._running: dict[str, _Reply] = {}
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None

    @property
    def alive(self) -> bool:
        return self._alive

    # ----- lifecycle -----
    def start(self) -> None:
        self._alive = True
        self._http = httpx.Client(headers=self.target.headers(),
                                  timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        threading.Thread(target=self._connect, name="moescope-remote-connect", daemon=True).start()

    def _connect(self) -> None:
        started = time.perf_counter()
        self.on_event(p.LoadProgress(0.0, f"connecting to {self.target.base}"))
        try:
            entries = list_models(self.target)
        except RemoteError as exc:
            self.on_event(p.Error("remote-unreachable", str(exc), False))
            return
        ids = [str(e.get("id")) for e in entries]
        if not ids:
            self.on_event(p.Error("remote-unreachable", f"{self.target.base} serves no model", False))
            return
        if self.target.model and self.target.model not in ids:
            self.on_event(p.Error("remote-unreachable", f"{self.target.base} does not serve '{self.target.model}'; "
                                  f"it serves {', '.join(ids)}", False))
            return
        self.model = self.target.model or ids[0]
        entry = entries[ids.index(self.model)]
        self.sglang_record = self._post_ok("/start_expert_distribution_record")
        self.on_event(p.LoadProgress(1.0, "connected"))
        self.on_event(p.ModelLoaded(
            name=self.model, path=self.target.base, architecture="remote", num_layers=0, num_experts=0, top_k=0,
            expert_bytes=0, all_expert_bytes=0, dense_bytes=0, min_budget_bytes=0, max_budget_bytes=0,
            budget_bytes=0, slots_per_layer=[], device="remote", store="remote", dtype="",
            context_length=int(entry.get("max_model_len") or entry.get("context_length") or 0), policy="",
            policies=[], load_seconds=time.perf_counter() - started, remote=self.target.base))

    def send(self, command) -> None:
        if not self._alive:
            raise RuntimeError("not connected to the server")
        if isinstance(command, p.Generate):
            reply = _Reply(command)
            with self._lock:
                self._running[command.request_id] = reply
            threading.Thread(target=self._generate, args=(reply,), name="moescope-remote-reply", daemon=True).start()
        elif isinstance(command, p.Cancel):
            with self._lock:
                replies = [r for rid, r in self._running.items() if command.request_id in (None, rid)]
            for reply in replies:
                reply.cancel()
        elif isinstance(command, (p.SetBudget, p.SetPolicy, p.SetFastDecode, p.SetInt8Inputs)):
            self.on_event(p.Error("remote", "the budget, policy and kernels are MoEScope's own engine's; they do "
                                  "not apply to a remote server", True))
        elif isinstance(command, p.LIBRARY_COMMANDS):
            self.on_event(p.Error("remote", "the model library loads models into MoEScope's own engine; open a "
                                  "model from it to leave the remote server", True, command.request_id))
        elif isinstance(command, p.LoadModel):
            self.on_event(p.Error("remote", "connected to a remote server: it loads its own models", True))
        # SetTelemetry, Unload, Shutdown: nothing to do for a server we do not own

    def restart(self, reload: bool = True) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        self._alive = False
        self.send_cancel_all()
        if self._http is not None:
            self._http.close()

    def send_cancel_all(self) -> None:
        with self._lock:
            replies = list(self._running.values())
        for reply in replies:
            reply.cancel()

    # ----- one reply -----
    def _generate(self, reply: _Reply) -> None:
        command = reply.command
        try:
            if self.sglang_record:
                self._post_ok("/start_expert_distribution_record")
            self.routing.start_reply()
            done = self._stream(reply)
            if self.sglang_record and not reply.cancelled:
                self._read_record()
            self.on_event(done)
        except RemoteError as exc:
            self.on_event(p.Error("remote", str(exc), True, command.request_id))
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if reply.cancelled:  # the stream was closed under the reading thread
                self.on_event(self._done(reply, "cancelled"))
            else:
                self.on_event(p.Error("remote", f"the server connection failed: {exc}", True, command.request_id))
        except Exception as exc:  # an answer we could not read: the reply ends with the reason, never hangs
            self.on_event(p.Error("remote", f"could not read the server's answer: {type(exc).__name__}: {exc}", True,
                                  command.request_id))
        finally:
            with self._lock:
                self._running.pop(command.request_id, None)

    def _request_body(self, command: p.Generate) -> tuple[str, dict]:
        s = command.sampling
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens,
                      "return_routed_experts": True}  # SGLang's per-request switch; vLLM returns them when started so
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        if s.top_k:
            body["top_k"] = s.top_k
        if s.repetition_penalty != 1.0:
            body["repetition_penalty"] = s.repetition_penalty
        if command.messages is not None:
            return "/chat/completions", {**body, "messages": command.messages}
        return "/completions", {**body, "prompt": command.prompt if command.prompt is not None else command.prompt_ids}

    def _stream(self, reply: _Reply) -> p.Done:
        assert self._http is not None
        path, body = self._request_body(reply.command)
        reply.started = time.perf_counter()
        with self._http.stream("POST", self.target.base + path, json=body) as response:
            reply.response = response
            if response.status_code != 200:
                response.read()
                raise RemoteError(f"the server answered {response.status_code}: {_message(response)}")
            for chunk in _events(response.iter_lines()):
                if reply.cancelled:
                    break
                if "error" in chunk:
                    error = chunk["error"]
                    raise RemoteError(str(error.get("message", error) if isinstance(error, dict) else error))
                self._take(reply, chunk)
        return self._done(reply, "cancelled" if reply.cancelled else reply.finish)

    def _take(self, reply: _Reply, chunk: dict) -> None:
        if chunk.get("usage"):
            reply.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            if text:
                now = time.perf_counter()
                reply.first = reply.first or now
                reply.last, reply.chunks = now, reply.chunks + 1
                reply.text += text
                self.on_event(p.Token(reply.command.request_id, text, []))
            if choice.get("finish_reason"):
                reply.finish = FINISH.get(choice["finish_reason"], choice["finish_reason"])
            routed = decode_routed_experts(choice.get("routed_experts"))
            if routed is not None:
                self.routing.add_routed(routed)
                self._routing_event(reply.command.request_id, "the server's routed_experts (vLLM)")

    def _done(self, reply: _Reply, finish: str) -> p.Done:
        end = time.perf_counter()
        prompt = int(reply.usage.get("prompt_tokens") or 0)
        completion = int(reply.usage.get("completion_tokens") or reply.chunks)
        first = reply.first or end
        decode_s = (reply.last or end) - first
        stats = p.ReplyStats(
            prefill_tokens=prompt, decode_tokens=completion, ttft_s=first - reply.started,
            prefill_tokens_per_s=prompt / max(first - reply.started, 1e-9) if prompt else 0.0,
            decode_tokens_per_s=(completion - 1) / decode_s if completion > 1 and decode_s > 0 else 0.0,
            total_s=end - reply.started)
        return p.Done(reply.command.request_id, finish, reply.text, [], stats)

    # ----- SGLang's expert-distribution record -----
    def _post_ok(self, path: str) -> bool:
        assert self._http is not None
        try:
            return self._http.post(self.target.root + path, timeout=CONNECT_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def _read_record(self) -> None:
        """Stop and dump the record. SGLang itself writes the dump to its own disk and answers a line of
        text; a server that answers the record as JSON ({"logical_count": [layers, experts]}) feeds the heatmap."""
        assert self._http is not None
        with contextlib.suppress(httpx.HTTPError):
            self._http.post(self.target.root + "/stop_expert_distribution_record", timeout=CONNECT_TIMEOUT_S)
            response = self._http.post(self.target.root + "/dump_expert_distribution_record", timeout=CONNECT_TIMEOUT_S)
            try:
                counts = decode_distribution(response.json())
            except ValueError:
                counts = None
            if counts is not None:
                self.routing.add_counts(counts)
                self._routing_event(None, "SGLang's expert distribution record")

    def _routing_event(self, request_id: str | None, source: str) -> None:
        self.on_event(p.RoutingSnapshot(request_id, p.Array.of(self.routing.reply.astype("int32")),
                                        p.Array.of(self.routing.total.copy()), source))


@dataclass
class _Reply:
    command: p.Generate
    text: str = ""
    finish: str = "stop"
    chunks: int = 0
    started: float = 0.0
    first: float | None = None
    last: float | None = None
    cancelled: bool = False
    response: httpx.Response | None = None

    def __post_init__(self) -> None:
        self.usage: dict = {}

    def cancel(self) -> None:
        self.cancelled = True
        if self.response is not None:
            with contextlib.suppress(Exception):  # the reading thread sees the closed stream and ends the reply
                self.response.close()


def _events(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, until [DONE]."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        with contextlib.suppress(ValueError):
            yield json.loads(data)
