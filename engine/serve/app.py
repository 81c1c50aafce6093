"""The FastAPI application: OpenAI's `/v1/models`, `/v1/chat/completions`, `/v1/completions`, and
MoEScope's telemetry stream, over one `EngineHub`.

No endpoint reads or writes files or loads a model: `model` only has to name the loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import protocol as p
from engine.serve import schema
from engine.serve.hub import EngineHub, EngineUnavailable, LogEntry, QueueFull, RequestStream, new_request_id
from engine.serve.schema import ApiError

MiB = 2**20


@dataclass
class ServerSettings:
    api_key: str | None = None  # required on every request when set (Authorization: Bearer KEY)
    max_body_bytes: int = 4 * MiB
    model_wait_s: float = 300.0  # how long a request waits for a model that is (re)loading
    return_routed_experts: bool = False  # every response carries `routed_experts`, as vLLM started with the flag


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


def create_app(hub: EngineHub, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="MoEScope", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    if settings.api_key is not None:
        app.add_middleware(RequireKey, key=settings.api_key)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return schema.models(hub.model)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(hub, settings, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(hub, settings, request, "completion")

    @app.get("/moescope/v1/telemetry")
    async def telemetry(request: Request) -> StreamingResponse:
        """What the panels show, as server-sent events: one JSON snapshot per engine snapshot (at most ~10 a second)."""
        return StreamingResponse(_telemetry_events(hub), media_type="text/event-stream")

    return app


@dataclass
class _Reply:
    """A request accepted and submitted to the engine: what answering it needs."""

    request_id: str
    kind: str  # "chat" or "completion"
    endpoint: str
    started: float  # perf_counter when the request arrived
    req: schema.ChatRequest | schema.CompletionRequest
    model_name: str
    with_routing: bool
    stream: RequestStream  # the engine's events for this request

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def failed(self, status: int, message: str) -> LogEntry:
        return LogEntry(self.request_id, self.endpoint, status, seconds=time.perf_counter() - self.started,
                        message=message)


async def _complete(hub: EngineHub, settings: ServerSettings, request: Request, kind: str):
    """One OpenAI completion request: parsed and submitted, then answered whole or streamed."""
    started = time.perf_counter()
    request_id = new_request_id()
    try:
        reply = await _submit_request(hub, settings, request, kind, request_id, started)
    except ApiError as exc:
        hub.log(LogEntry(request_id, request.url.path, exc.status, seconds=time.perf_counter() - started,
                         message=exc.message))
        raise
    try:
        return await _answer(hub, request, reply)
    except ApiError as exc:
        reply.stream.close()
        hub.log(reply.failed(exc.status, exc.message))
        raise
    except (ClientGone, asyncio.CancelledError):
        reply.stream.close()  # cancels the generation
        hub.log(reply.failed(499, "the client went away; cancelled"))
        raise


async def _submit_request(hub: EngineHub, settings: ServerSettings, request: Request, kind: str, request_id: str,
                          started: float) -> _Reply:
    """Read and check the request, wait for its model and hand it to the engine."""
    body = await _read_json(request, settings.max_body_bytes)
    req = schema.parse(schema.ChatRequest if kind == "chat" else schema.CompletionRequest, body)
    model = await _model(hub, req.model, settings.model_wait_s)
    sampling = req.sampling(model.context_length)
    prompt = {"messages": [m.turn() for m in req.messages]} if kind == "chat" else req.prompt_fields()
    with_routing = req.return_routed_experts or settings.return_routed_experts
    stream = _submit(hub, p.Generate(request_id, sampling=sampling, return_routing=with_routing, **prompt))
    return _Reply(request_id, kind, request.url.path, started, req, model.name, with_routing, stream)


async def _answer(hub: EngineHub, request: Request, reply: _Reply):
    """The engine's first event, then the reply: server-sent events, or one JSON body at the end."""
    stream = reply.stream
    first = await _unless_disconnected(request, stream.next())
    if isinstance(first, p.Error):
        raise schema.engine_error(first, reply.prompt_param)
    if reply.req.stream:
        options = reply.req.stream_options
        events = _sse(reply.kind, reply.request_id, reply.model_name, first, stream,
                      bool(options and options.include_usage), reply.with_routing,
                      lambda entry: hub.log(entry), reply.endpoint, reply.started)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    done = await _unless_disconnected(request, _last(stream, first))
    if isinstance(done, p.Error):
        raise schema.engine_error(done, reply.prompt_param)
    stream.close()
    hub.log(_entry(reply.request_id, reply.endpoint, done, reply.started))
    return JSONResponse(schema.response(reply.kind, reply.request_id, reply.model_name, done, reply.with_routing))


class RequireKey:
    """Every HTTP request must carry `Authorization: Bearer KEY` (plain ASGI, so streaming and disconnects
    pass through untouched)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                                 code="invalid_api_key", type="authentication_error")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_json(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than the server's limit of {limit // 1024} KiB",
                       code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def _model(hub: EngineHub, name: str, wait_s: float) -> p.ModelLoaded:
    try:
        model = await hub.wait_for_model(wait_s)
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), type="server_error", code="model_not_loaded") from None
    if not hub.knows_model(name):
        raise ApiError(404, f"model: '{name}' is not served here; this server serves '{model.name}'",
                       param="model", code="model_not_found")
    return model


def _submit(hub: EngineHub, generate: p.Generate) -> RequestStream:
    try:
        return hub.submit(generate)
    except QueueFull as exc:
        raise ApiError(429, f"the server is busy: {hub.max_queue} requests are already waiting or running; "
                       f"retry in {exc.retry_after} s", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from None


async def _unless_disconnected(request: Request, awaitable):
    """Await `awaitable`, or raise ClientGone as soon as the client closes the connection."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":  # the body is read: only the disconnect is left
        pass


async def _last(stream: RequestStream, first):
    """The Done (or Error) that ends the stream; the Tokens before it are in it already."""
    event = first
    while not isinstance(event, (p.Done, p.Error)):
        event = await stream.next()
    return event


def _entry(request_id: str, endpoint: str, done: p.Done, started: float) -> LogEntry:
    usage = schema.usage(done)
    return LogEntry(request_id, endpoint, 200, done.finish_reason, usage["prompt_tokens"], usage["completion_tokens"],
                    time.perf_counter() - started)


def _data(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


async def _sse(kind: str, request_id: str, model: str, first, stream: RequestStream, include_usage: bool,
               with_routing: bool, log, endpoint: str, started: float) -> AsyncIterator[bytes]:
    """The streamed answer; closing it early (the client went away) cancels the generation."""
    try:
        if kind == "chat":
            yield _data(schema.chunk(kind, request_id, model, role=True))
        event = first
        while True:
            if isinstance(event, p.Token):
                yield _data(schema.chunk(kind, request_id, model, text=event.text))
            elif isinstance(event, p.Done):
                yield _data(schema.chunk(kind, request_id, model, done=event, with_routing=with_routing))
                if include_usage:
                    yield _data(schema.chunk(kind, request_id, model, done=event, usage_only=True))
                yield _data("[DONE]")
                log(_entry(request_id, endpoint, event, started))
                return
            elif isinstance(event, p.Error):  # mid-stream: the status line is sent, so the error is an event
                error = schema.engine_error(event, "messages" if kind == "chat" else "prompt")
                yield _data(error.body())
                log(LogEntry(request_id, endpoint, error.status, seconds=time.perf_counter() - started,
                             message=error.message))
                return
            event = await stream.next()
    finally:
        if not stream.finished:
            log(LogEntry(request_id, endpoint, 499, seconds=time.perf_counter() - started,
                         message="the client went away; cancelled"))
        stream.close()


async def _telemetry_events(hub: EngineHub) -> AsyncIterator[bytes]:
    waiter = hub.listen_telemetry()
    try:
        if hub.snapshot is not None:
            yield _data(snapshot_json(hub.snapshot))
        while True:
            snapshot = await waiter.queue.get()
            while not waiter.queue.empty():  # a slow reader gets the latest, not a backlog
                snapshot = waiter.queue.get_nowait()
            yield _data(snapshot_json(snapshot))
    finally:
        hub.stop_listening(waiter)


def snapshot_json(snapshot: p.TelemetrySnapshot) -> dict:
    """The snapshot's fields as JSON; matrices as nested lists ([layers, experts])."""
    out = {}
    for f in fields(snapshot):
        value = getattr(snapshot, f.name)
        out[f.name] = value.numpy().tolist() if isinstance(value, p.Array) else value
    with contextlib.suppress(TypeError):
        json.dumps(out["extra"])
        return out
    out["extra"] = {k: v for k, v in out["extra"].items() if isinstance(v, int | float | str | bool | None)}
    return out
