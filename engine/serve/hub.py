"""One engine, many HTTP requests: requests become protocol commands on one shared client, and its
events are routed back to the request that asked, by request id.

Events may arrive on any thread (the client's reader thread, or the window's GUI thread); each
request waits on an asyncio queue of its own event loop, fed with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine import protocol as p

SendFn = Callable[[object], None]

# Retry-After until a request has finished here: what one request is taken to need, in seconds
DEFAULT_SERVICE_S = 10.0


class QueueFull(Exception):
    """Every place in the queue is taken; try again in `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class EngineUnavailable(Exception):
    """No model is loaded (it is still loading, or the engine crashed and is not back)."""


@dataclass
class LogEntry:
    """One answered request, for the window's request log and the server's console."""

    request_id: str
    endpoint: str
    status: int
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    message: str = ""

    def line(self) -> str:
        what = f"{self.finish_reason}, {self.prompt_tokens}+{self.completion_tokens} tokens" if self.status == 200 else self.message
        return f"{time.strftime('%H:%M:%S')} {self.endpoint} {self.status} {self.seconds:.2f} s · {what}"


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, event) -> None:
        with contextlib.suppress(RuntimeError):  # the request's loop is gone: nobody listens any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class _Pending:
    """A request submitted and not yet released: where its events go, and when the engine took it up."""

    waiter: _Waiter
    submitted: float
    started: float | None = None  # set at its first event: when the engine finished what ran before it


class RequestStream:
    """The events of one request: Token... then Done, or an Error."""

    def __init__(self, hub: EngineHub, request_id: str, waiter: _Waiter) -> None:
        self.hub, self.request_id, self._waiter = hub, request_id, waiter
        self.finished = False

    async def next(self):
        event = await self._waiter.queue.get()
        if isinstance(event, (p.Done, p.Error)):
            self.finished = True
        return event

    async def __aiter__(self) -> AsyncIterator:
        while not self.finished:
            yield await self.next()

    def close(self) -> None:
        """Leave the queue; a request that has not finished is cancelled (the engine stops it between two
        tokens, or drops it before it starts)."""
        self.hub._release(self.request_id, cancel=not self.finished)


class EngineHub:
    def __init__(self, send: SendFn, *, max_queue: int = 16, aliases: tuple[str, ...] = (),
                 on_log: Callable[[LogEntry], None] | None = None,
                 on_crash: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self.max_queue = max_queue  # requests waiting or running, the running one included
        self.aliases = set(aliases)
        self.on_log = on_log
        self.on_crash = on_crash  # `moescope serve` restarts its engine here; the window leaves it to the user
        self.clock = clock
        self.model: p.ModelLoaded | None = None
        self.model_loaded_at = 0.0  # wall-clock time (time.time) of the last ModelLoaded
        self.snapshot: p.TelemetrySnapshot | None = None
        self._lock = threading.Lock()
        self._requests: dict[str, _Pending] = {}
        self._model_waiters: list[_Waiter] = []
        self._telemetry: list[_Waiter] = []
        self._service_s: deque[float] = deque(maxlen=16)  # the last finished requests', first event to Done

    # ----- what the engine says (any thread) -----
    def on_event(self, event) -> None:
        if isinstance(event, (p.Token, p.Done, p.PromptContext)) or (isinstance(event, p.Error) and event.request_id):
            with self._lock:
                pending = self._timed(event)
            if pending is not None and not isinstance(event, p.PromptContext):  # the context only marks the start
                pending.waiter.put(event)
        elif isinstance(event, p.ModelLoaded):
            with self._lock:
                self.model, waiters, self._model_waiters = event, self._model_waiters, []
                self.model_loaded_at = time.time()
            for waiter in waiters:
                waiter.put(event)
        elif isinstance(event, p.TelemetrySnapshot):
            self.snapshot = event
            with self._lock:
                listeners = list(self._telemetry)
            for waiter in listeners:
                waiter.put(event)
        elif isinstance(event, p.Error) and (event.kind == "engine-crashed" or not event.recoverable):
            self._engine_lost(event)

    def _timed(self, event) -> _Pending | None:
        """Note when the engine took the request up and, at its Done, its service time (under the lock).

        The engine opens a request when a place in its batch is free and says so with its first event
        (the worker's PromptContext, before the prefill), so the service time leaves out the wait in
        the queue."""
        now = self.clock()
        pending = self._requests.get(event.request_id)
        if pending is not None and pending.started is None:
            pending.started = now
        if (pending is not None and isinstance(event, p.Done) and event.finish_reason != "cancelled"):
            self._service_s.append(now - pending.started)
        return pending

    def _engine_lost(self, event: p.Error) -> None:
        """Every request in flight ends with the error (the worker lost its queue with it)."""
        with self._lock:
            self.model = None
            running = [(request_id, pending.waiter) for request_id, pending in self._requests.items()]
        for request_id, waiter in running:
            waiter.put(p.Error(event.kind, event.message, False, request_id))
        if event.kind == "engine-crashed" and self.on_crash is not None:
            self.on_crash()

    # ----- requests (the server's event loop) -----
    def model_ids(self) -> list[str]:
        return [self.model.name] if self.model is not None else []

    def knows_model(self, name: str) -> bool:
        """`name` names the loaded model: its name, path or an alias, or one of them with Ollama's `:latest` tag."""
        m = self.model
        known = {m.name, m.path, *self.aliases} if m is not None else set()
        return name in known or (name.endswith(":latest") and name.removesuffix(":latest") in known)

    async def wait_for_model(self, timeout: float) -> p.ModelLoaded:
        if self.model is not None:
            return self.model
        waiter = _Waiter(asyncio.get_running_loop())
        with self._lock:
            if self.model is not None:
                return self.model
            self._model_waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter.queue.get(), timeout)
        except TimeoutError:
            raise EngineUnavailable("no model is loaded yet; try again when it is") from None
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._model_waiters.remove(waiter)

    def submit(self, generate: p.Generate) -> RequestStream:
        """Queue `generate` on the engine (FIFO for a place in its batch), or raise QueueFull / EngineUnavailable."""
        waiter = _Waiter(asyncio.get_running_loop())
        with self._lock:
            if len(self._requests) >= self.max_queue:
                raise QueueFull(self._retry_after())
            self._requests[generate.request_id] = _Pending(waiter, self.clock())
        try:
            self._send(generate)
        except RuntimeError:  # the client has no engine process right now
            self._release(generate.request_id, cancel=False)
            raise EngineUnavailable("the engine is not running; try again in a moment") from None
        return RequestStream(self, generate.request_id, waiter)

    def _release(self, request_id: str, cancel: bool) -> None:
        with self._lock:
            self._requests.pop(request_id, None)
        if cancel:
            with contextlib.suppress(RuntimeError):
                self._send(p.Cancel(request_id))

    def retry_after(self) -> int:
        """Seconds until the requests now waiting or running are likely done: the median service time of
        the last 16 finished requests (DEFAULT_SERVICE_S before any has) times their number over the
        replies the engine runs at once (ModelLoaded.parallel), rounded up, at least 1. (A reply in a
        batch of N takes longer than alone; its measured service time already says by how much.)"""
        with self._lock:
            return self._retry_after()

    def _retry_after(self) -> int:
        typical = statistics.median(self._service_s) if self._service_s else DEFAULT_SERVICE_S
        parallel = max(1, self.model.parallel) if self.model is not None else 1
        return max(1, math.ceil(round(typical * len(self._requests) / parallel, 3)))  # 0.7 s x 10 is 7 s, not 8

    @property
    def busy(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return len(self._requests)

    def log(self, entry: LogEntry) -> None:
        if self.on_log is not None:
            self.on_log(entry)

    # ----- telemetry listeners -----
    def listen_telemetry(self) -> _Waiter:
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue(maxsize=0))
        with self._lock:
            self._telemetry.append(waiter)
        return waiter

    def stop_listening(self, waiter: _Waiter) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._telemetry.remove(waiter)


def new_request_id() -> str:
    return f"{p.API_REQUEST_PREFIX}{uuid.uuid4().hex[:16]}"
