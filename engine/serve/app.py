"""The FastAPI application: OpenAI's `/v1/models`, `/v1/chat/completions`, `/v1/completions`, Anthropic's
`/v1/messages`, Ollama's `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`, and MoEScope's telemetry stream, over one `EngineHub`. Every API's completions take
one path (`_complete`); a `Dialect` says how each reads its body and writes its answer and errors.

No endpoint reads or writes files or loads a model: `model` only has to name the loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import protocol as p
from engine.serve import anthropic, ollama, schema
from engine.serve.dialect import ApiError, Dialect, Reply, engine_error, sse
from engine.serve.hub import EngineHub, EngineUnavailable, LogEntry, QueueFull, RequestStream, new_request_id

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
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request.url.path, exc)

    if settings.api_key is not None:
        app.add_middleware(RequireKey, key=settings.api_key)
    for path, dialect in COMPLETIONS.items():
        _completion_route(app, hub, settings, path, dialect)
    _model_routes(app, hub, settings)

    @app.get("/moescope/v1/telemetry")
    async def telemetry(request: Request) -> StreamingResponse:
        """What the panels show, as server-sent events: one JSON snapshot per engine snapshot (at most ~10 a second)."""
        return StreamingResponse(_telemetry_events(hub), media_type="text/event-stream")

    return app


COMPLETIONS: dict[str, Dialect] = {"/v1/chat/completions": schema.CHAT, "/v1/completions": schema.COMPLETION,
                                   anthropic.PATH: anthropic.MESSAGES, "/api/chat": ollama.CHAT,
                                   "/api/generate": ollama.GENERATE}


def _completion_route(app: FastAPI, hub: EngineHub, settings: ServerSettings, path: str, dialect: Dialect) -> None:
    async def complete(request: Request):
        return await _complete(hub, settings, request, dialect)

    app.post(path)(complete)


def _model_routes(app: FastAPI, hub: EngineHub, settings: ServerSettings) -> None:
    """What OpenAI's and Ollama's clients ask about the loaded model."""

    @app.get("/v1/models")
    async def list_models() -> dict:
        return schema.models(hub.model)

    @app.get("/api/tags")
    async def tags() -> dict:
        return ollama.tags(hub.model, hub.model_loaded_at)

    @app.get("/api/ps")
    async def ps() -> dict:
        return ollama.ps(hub.model, hub.model_loaded_at)

    @app.post("/api/show")
    async def show(request: Request) -> dict:
        name = ollama.show_name(await _read_json(request, settings.max_body_bytes))
        return ollama.show(await _model(hub, name, settings.model_wait_s), hub.model_loaded_at)

    @app.get("/api/version")
    async def version() -> dict:
        return ollama.version()


def _error_response(path: str, error: ApiError) -> JSONResponse:
    """The error in the shape of the API the path belongs to."""
    dialect = ollama.CHAT if path.startswith(ollama.PREFIX) else anthropic.MESSAGES if path == anthropic.PATH \
        else schema.CHAT
    return JSONResponse(dialect.error_body(error), status_code=error.status, headers=error.headers)


async def _complete(hub: EngineHub, settings: ServerSettings, request: Request, dialect: Dialect):
    """One completion request, in either API: parsed and submitted, then answered whole or streamed."""
    started = time.perf_counter()
    request_id = new_request_id()
    try:
        reply = await _submit_request(hub, settings, request, dialect, request_id, started)
    except ApiError as exc:
        hub.log(LogEntry(request_id, request.url.path, exc.status, seconds=time.perf_counter() - started,
                         message=exc.message))
        raise
    if isinstance(reply, dict):  # nothing to generate
        return JSONResponse(reply)
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


async def _submit_request(hub: EngineHub, settings: ServerSettings, request: Request, dialect: Dialect,
                          request_id: str, started: float) -> Reply | dict:
    """Read and check the request, wait for its model and hand it to the engine (or the whole answer to a
    request that only asks for the model to be loaded)."""
    req = dialect.parse(await _read_json(request, settings.max_body_bytes))
    waiting = time.perf_counter()
    model = await _model(hub, req.model, settings.model_wait_s)
    load_s = time.perf_counter() - waiting
    if (loaded := dialect.preload(req)) is not None:
        return loaded
    sampling = req.sampling(model.context_length)
    prompt = req.generate_fields()
    with_routing = req.return_routed_experts or settings.return_routed_experts
    stream = _submit(hub, p.Generate(request_id, sampling=sampling, return_routing=with_routing, **prompt))
    return Reply(request_id, dialect, request.url.path, started, req, model.name, with_routing, stream, load_s)


async def _answer(hub: EngineHub, request: Request, reply: Reply):
    """The engine's first event, then the reply: streamed in the dialect's frames, or one JSON body at the end."""
    stream = reply.stream
    first = await _unless_disconnected(request, stream.next())
    if isinstance(first, p.Error):
        raise engine_error(first, reply.dialect.prompt_param)
    if reply.req.stream:
        return StreamingResponse(_streamed(hub, reply, first), media_type=reply.dialect.media_type,
                                 headers={"Cache-Control": "no-cache"})
    done = await _unless_disconnected(request, _last(stream, first))
    if isinstance(done, p.Error):
        raise engine_error(done, reply.dialect.prompt_param)
    stream.close()
    hub.log(reply.answered(done))
    return JSONResponse(reply.dialect.whole(reply, done))


class RequireKey:
    """Every HTTP request must carry `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's
    client sends it (plain ASGI, so streaming and disconnects pass through untouched)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if b"x-api-key" in headers:
                scheme, token = b"bearer", headers[b"x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                                 code="invalid_api_key", type="authentication_error")
                await _error_response(scope["path"], error)(scope, receive, send)
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


async def _streamed(hub: EngineHub, reply: Reply, first) -> AsyncIterator[bytes]:
    """The streamed answer; closing it early (the client went away) cancels the generation."""
    dialect, stream = reply.dialect, reply.stream
    try:
        for payload in dialect.opening(reply):
            yield dialect.frame(payload)
        event = first
        while True:
            if isinstance(event, p.Token):
                yield dialect.frame(dialect.delta(reply, event.text))
            elif isinstance(event, p.Done):
                for payload in dialect.closing(reply, event):
                    yield dialect.frame(payload)
                hub.log(reply.answered(event))
                return
            elif isinstance(event, p.Error):  # mid-stream: the status line is sent, so the error is an event
                error = engine_error(event, dialect.prompt_param)
                yield dialect.frame(dialect.error_body(error))
                hub.log(reply.failed(error.status, error.message))
                return
            event = await stream.next()
    finally:
        if not stream.finished:
            hub.log(reply.failed(499, "the client went away; cancelled"))
        stream.close()


async def _telemetry_events(hub: EngineHub) -> AsyncIterator[bytes]:
    waiter = hub.listen_telemetry()
    try:
        if hub.snapshot is not None:
            yield sse(snapshot_json(hub.snapshot))
        while True:
            snapshot = await waiter.queue.get()
            while not waiter.queue.empty():  # a slow reader gets the latest, not a backlog
                snapshot = waiter.queue.get_nowait()
            yield sse(snapshot_json(snapshot))
    finally:
        hub.stop_listening(waiter)


def snapshot_json(snapshot: p.TelemetrySnapshot) -> dict:
    """The snapshot's fields as JSON; matrices as nested lists ([layers, experts])."""
    out = {}
    for f in fields(snapshot):
        value = getattr(snapshot, f.name)
        out[f.name] = value.numpy().tolist() if isinstance(value, p.Array) else value
    out["streams"] = [asdict(stream) for stream in snapshot.streams]
    out["sharing"] = asdict(snapshot.sharing) if snapshot.sharing is not None else None
    with contextlib.suppress(TypeError):
        json.dumps(out["extra"])
        return out
    out["extra"] = {k: v for k, v in out["extra"].items() if isinstance(v, int | float | str | bool | None)}
    return out
