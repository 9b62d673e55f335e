"""The model server: one process holds the model (on a GPU box) and serves the engine over HTTP.

`create_app` builds a FastAPI app around an `Engine` (or a model id loaded in the background);
`serve` runs it with uvicorn. Operations: GET /health, /ready, /info, /sites; POST /generate
(per-token records as Server-Sent Events), /trace, /cancel/{request_id}. The server runs only
these fixed operations, never code sent by a client; tensors travel as safetensors bytes (see
`probes.wire`, the wire format).

One model serves many browser tabs: one model call at a time (the torch work runs in a worker
thread, so the event loop keeps answering), a waiting room of `max_queue` requests, and a 503
with Retry-After beyond it. A client that disconnects or is cancelled frees the model at the
next token.

Security: `serve` binds 127.0.0.1 by default and refuses any other address without a token;
with a token every operation but /health needs `Authorization: Bearer <token>`.

Example:
    >>> from probes.server import serve
    >>> serve("smollm2-135m", port=8765)  # doctest: +SKIP
    $ curl -N -X POST localhost:8765/generate -H 'content-type: application/json' \\
        -d '{"prompt": "2 + 2 =", "max_new_tokens": 8}'
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from probes.engine import Engine, Sampling
from thoughtscope.errors import BadInputError, ThoughtscopeError
from probes.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS_CAP,
    AuthError,
    GenerateRequest,
    InvalidRequestError,
    RequestTooLargeError,
    ServerBusyError,
    TraceRequest,
    error_body,
    intervention_from_spec,
    record_to_json,
    sse_event,
    trace_to_json,
)

log = logging.getLogger("thoughtscope.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
OPEN_PATHS = {"/health"}  # what a load balancer may poll without the token
KEEPALIVE_S = 5.0  # a queued stream sends an SSE comment this often, so proxies and clients see it alive
RETRY_AFTER_S = 1


# ----- the waiting room -----


class ModelQueue:
    """One model call at a time; at most `max_queue` requests wait for their turn (FIFO)."""

    def __init__(self, max_queue: int):
        if max_queue < 0:
            raise BadInputError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.waiting = 0
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def admit(self) -> "Ticket":
        """A place in the waiting room, or `ServerBusyError` (503) when it is full."""
        # `waiting` counts every admitted request not yet holding the model, so a burst that
        # arrives before the first one takes the lock is still bounded.
        if self.waiting + self.busy >= self.max_queue + 1:
            raise ServerBusyError(
                f"the model is busy and {self.waiting} requests are already waiting (max_queue={self.max_queue}); "
                f"retry in {RETRY_AFTER_S} s or start the server with a larger --max-queue",
                retry_after=RETRY_AFTER_S,
            )
        self.waiting += 1
        return Ticket(self)


class Ticket:
    """A request's place in the queue: wait for the model, then hold it until `release`."""

    def __init__(self, queue: ModelQueue):
        self.queue, self.holding, self.done = queue, False, False

    async def wait(self) -> None:
        await self.queue._lock.acquire()  # cancellation-safe: a cancelled waiter never ends up holding it
        self.queue.waiting -= 1
        self.holding = True

    async def wait_with_keepalive(self) -> AsyncIterator[bytes]:
        """Wait for the model, yielding an SSE comment every KEEPALIVE_S s until it is ours."""
        while not self.holding:
            with anyio.move_on_after(KEEPALIVE_S):
                await self.wait()
            if not self.holding:
                yield b": waiting for the model\n\n"

    def release(self) -> None:
        """Idempotent: a ticket may be released by the stream's end and again by the response's cleanup."""
        if self.done:
            return
        self.done = True
        if self.holding:
            self.holding = False
            self.queue._lock.release()
        else:
            self.queue.waiting -= 1


# ----- the gate every request passes: token, then body size -----


class _Gate:
    """ASGI middleware: 401 without the right bearer token, 413 for a body over the limit.

    Checked before any endpoint runs, so an unauthenticated or oversized request never reaches
    the model or the JSON parser.
    """

    def __init__(self, app: Any, token: str | None, max_body_bytes: int):
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.token is not None and scope["path"] not in OPEN_PATHS and not self._authorised(headers):
            return await _send_error(send, AuthError(
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the token the server "
                "was started with (--token)"))
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, self._too_large(int(length)))
        body, more = bytearray(), True
        while more:  # read the body up front: a chunked upload has no content-length to check
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _send_error(send, self._too_large(len(body)))
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later messages (http.disconnect) pass through

        await self.app(scope, replay, send)

    def _authorised(self, headers: dict[str, str]) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def _too_large(self, size: int) -> RequestTooLargeError:
        return RequestTooLargeError(
            f"the request body has {size} bytes or more; this server accepts at most {self.max_body_bytes} "
            "(send fewer or smaller tensors, or restart the server with a larger max_body_bytes)")


async def _send_error(send: Callable, err: ThoughtscopeError) -> None:
    body = json.dumps(error_body(err)).encode()
    await send({"type": "http.response.start", "status": err.http_status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error_response(err: BaseException) -> JSONResponse:
    status = err.http_status if isinstance(err, ThoughtscopeError) else 500
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if isinstance(err, ServerBusyError) else None
    return JSONResponse(error_body(err), status_code=status, headers=headers)


# ----- the app -----


class _ServerState:
    """What the endpoints share: the engine (once loaded), the queue, and the requests in flight."""

    def __init__(self, engine: Engine | None, max_queue: int, max_new_tokens_cap: int, max_body_bytes: int):
        self.engine = engine
        self.load_error: ThoughtscopeError | None = None
        self.queue = ModelQueue(max_queue)
        self.max_new_tokens_cap = max_new_tokens_cap
        self.max_body_bytes = max_body_bytes
        self.generations: dict[str, Any] = {}  # request id -> `_Generation`, while queued or running

    def ready_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise self.load_error
        raise ServerBusyError("the model is still loading; poll GET /ready and retry", retry_after=RETRY_AFTER_S)


def create_app(
    engine_or_model_id: Engine | str,
    token: str | None = None,
    max_queue: int = 8,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP,
    load_kwargs: dict[str, Any] | None = None,
    on_load_error: Callable[[ThoughtscopeError], None] | None = None,
) -> FastAPI:
    """The ASGI app. Given a model id, the model loads in a thread at start-up (GET /ready says when);
    `load_kwargs` go to `Engine.from_id` (device, dtype, device_map)."""
    if token is not None and not token:
        raise BadInputError("the token is empty; pass a non-empty secret or none at all")
    preloaded = engine_or_model_id if isinstance(engine_or_model_id, Engine) else None
    state = _ServerState(preloaded, max_queue, max_new_tokens_cap, max_body_bytes)

    async def load() -> None:
        try:
            state.engine = await anyio.to_thread.run_sync(
                lambda: Engine.from_id(engine_or_model_id, **(load_kwargs or {})))
            log.info("model %s ready", engine_or_model_id)
        except Exception as err:
            state.load_error = err if isinstance(err, ThoughtscopeError) else ThoughtscopeError(
                f"loading {engine_or_model_id} failed: {type(err).__name__}: {err}")
            log.error("model %s failed to load: %s", engine_or_model_id, state.load_error)
            if on_load_error:
                on_load_error(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None if preloaded else asyncio.create_task(load())
        yield
        if task and not task.done():
            task.cancel()

    app = FastAPI(title="thoughtscope model server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(_Gate, token=token, max_body_bytes=max_body_bytes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ThoughtscopeError)
    async def on_project_error(request: Request, err: ThoughtscopeError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in err.errors())
        return _error_response(InvalidRequestError(f"invalid request body: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        ops = " (operations: /health /ready /info /sites /generate /trace /cancel/{id})"
        hint = ops if err.status_code == 404 else ""
        return JSONResponse({"error": f"{err.detail}{hint}", "kind": "ServerError"}, status_code=err.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return _error_response(err)


def _add_routes(app: FastAPI, state: _ServerState) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"ready": state.engine is not None, "busy": state.queue.busy, "waiting": state.queue.waiting,
                "max_queue": state.queue.max_queue, "max_new_tokens_cap": state.max_new_tokens_cap,
                "max_body_bytes": state.max_body_bytes}
        if state.load_error is not None:
            return JSONResponse({**body, **error_body(state.load_error)}, status_code=state.load_error.http_status)
        return JSONResponse(body, status_code=200 if state.engine is not None else 503)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return state.ready_engine().info()

    @app.get("/sites")
    async def sites() -> list[dict[str, Any]]:
        return state.ready_engine().sites()

    @app.post("/cancel/{request_id}")
    async def cancel(request_id: str) -> dict[str, Any]:
        generation = state.generations.get(request_id)
        if generation is not None:
            generation.cancel()
        return {"request_id": request_id, "cancelled": generation is not None}

    @app.post("/trace")
    async def trace(body: TraceRequest) -> JSONResponse:
        engine = state.ready_engine()
        interventions = [intervention_from_spec(s) for s in body.interventions]
        ticket = state.queue.admit()
        try:
            await ticket.wait()
            result = await anyio.to_thread.run_sync(
                lambda: engine.trace(body.text, capture=body.capture, interventions=interventions, chat=body.chat))
        finally:
            ticket.release()
        return JSONResponse(trace_to_json(result))

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> StreamingResponse:
        engine = state.ready_engine()
        if body.max_new_tokens > state.max_new_tokens_cap:
            raise InvalidRequestError(f"max_new_tokens={body.max_new_tokens} is above this server's cap of "
                                      f"{state.max_new_tokens_cap}; ask for fewer tokens")
        request_id = body.request_id or uuid.uuid4().hex
        if request_id in state.generations:
            raise BadInputError(f"request id {request_id!r} is already in use; send a fresh one (or none)")
        interventions = [intervention_from_spec(s) for s in body.interventions]
        ticket = state.queue.admit()
        try:
            # Input checks (prompt, sites, interventions) run before the first byte, so a bad request
            # is a 4xx rather than an error event; they touch only the tokenizer, not the model.
            stream = await anyio.to_thread.run_sync(lambda: engine.generate(
                body.prompt, prompts=body.prompts, n_samples=body.n_samples, max_new_tokens=body.max_new_tokens,
                sampling=Sampling(**body.sampling.model_dump()), seed=body.seed, capture=body.capture,
                interventions=interventions, top_k=body.top_k, stop=body.stop, chat=body.chat))
        except BaseException:
            ticket.release()
            raise
        generation = _Generation(stream, ticket, request_id, state)
        return _OwnedStream(generation, media_type="text/event-stream",
                            headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})


_DONE = object()
AHEAD = 4  # records the model may compute ahead of the socket: overlap without unbounded memory


class _Generation:
    """One streamed generation: a producer thread runs the model token by token, the event loop
    sends what it made.

    The producer never waits for the network (up to AHEAD records), so the HTTP hop adds no
    latency per token. `stop` (a disconnect, a cancel) is checked before every token; the model
    is handed on only after the producer has closed the engine's stream (hooks off the model).
    """

    def __init__(self, stream: Any, ticket: Ticket, request_id: str, state: _ServerState):
        self.stream, self.ticket, self.request_id, self.state = stream, ticket, request_id, state
        self.stop = threading.Event()
        self.n_tokens, self.failed, self.finished = 0, False, False
        self.cancelled, self.exhausted = False, False
        self._room = threading.Semaphore(AHEAD)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._thread: threading.Thread | None = None
        state.generations[request_id] = self

    async def events(self) -> AsyncIterator[bytes]:
        """start, (queue keep-alives), one `token` event per record, then `end` (or `error`)."""
        yield sse_event("start", {"request_id": self.request_id, "queued": self.state.queue.busy})
        async for keepalive in self.ticket.wait_with_keepalive():
            yield keepalive
        if self.finished:
            return
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._produce, args=(loop,), name=f"generate-{self.request_id}",
                                        daemon=True)
        self._thread.start()
        try:
            while (item := await self._queue.get()) is not _DONE:
                yield item
                self._room.release()
        finally:
            await self.finish()  # also on a disconnect: Starlette cancels this generator at its await
        if not self.failed:
            yield sse_event("end", {"request_id": self.request_id, "n_tokens": self.n_tokens,
                                    "cancelled": self.cancelled and not self.exhausted})

    def cancel(self) -> None:
        self.cancelled = True
        self.stop.set()

    def _produce(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while not self.stop.is_set():
                self._room.acquire()
                if self.stop.is_set():
                    break
                rec = next(self.stream, None)
                if rec is None:
                    self.exhausted = True
                    break
                self.n_tokens += 1
                self._put(loop, sse_event("token", record_to_json(rec)))  # encoded here, off the event loop
        except Exception as err:  # the headers are gone: say it in-band
            if not isinstance(err, ThoughtscopeError):
                log.exception("generation %s failed", self.request_id)
            self.failed = True
            self._put(loop, sse_event("error", {**error_body(err), "status": getattr(err, "http_status", 500)}))
        finally:
            self.stream.close()  # the engine's `finally`s: hooks come off the model
            self._put(loop, _DONE)

    def _put(self, loop: asyncio.AbstractEventLoop, item: Any) -> None:
        try:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody to tell
            pass

    async def finish(self) -> None:
        """Stop the producer, wait for it to let go of the model, free the queue place. Idempotent."""
        if self.finished:
            return
        self.finished = True
        self.stop.set()
        self._room.release()  # a producer waiting for room must see `stop`
        with anyio.CancelScope(shield=True):  # a disconnect has cancelled us; the wait must still happen
            if self._thread is not None:
                await anyio.to_thread.run_sync(self._thread.join)
            else:
                self.stream.close()
        self.ticket.release()
        self.state.generations.pop(self.request_id, None)


class _OwnedStream(StreamingResponse):
    """The SSE response of a `_Generation`; it always finishes the generation, even when the body
    never started (a client gone before the headers): otherwise its place on the model would leak."""

    def __init__(self, generation: _Generation, **kwargs: Any):
        super().__init__(generation.events(), **kwargs)
        self.generation = generation

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.finish()


# ----- running it -----


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """The one security rule of binding: beyond loopback, a token is required."""
    if not is_loopback(host) and not token:
        raise BadInputError(
            f"refusing to listen on {host} without a token: anyone who can reach that address could drive the "
            "model. Pass --token <secret> (or set THOUGHTSCOPE_TOKEN), or keep --host 127.0.0.1 and reach it "
            "through an SSH tunnel (ssh -L 8765:127.0.0.1:8765 gpu-box)")


def serve(
    model_id: str = "smollm2-135m",
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    max_queue: int = 8,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP,
    device: str = "auto",
    dtype: str | None = None,
    device_map: str | None = None,
    log_level: str = "info",
    trust_remote_code: bool = False,
) -> None:
    """Load `model_id` and serve it until interrupted. A model that fails to load stops the server
    and raises its error (the CLI prints the message)."""
    import uvicorn

    check_bind(host, token)
    load_error: list[ThoughtscopeError] = []
    server: uvicorn.Server | None = None

    def stop(err: ThoughtscopeError) -> None:
        load_error.append(err)
        server.should_exit = True

    load_kwargs = {"device": device, "dtype": dtype, "device_map": device_map, "trust_remote_code": trust_remote_code}
    app = create_app(model_id, token=token, max_queue=max_queue, max_body_bytes=max_body_bytes,
                     max_new_tokens_cap=max_new_tokens_cap, load_kwargs=load_kwargs, on_load_error=stop)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.run()
    if load_error:
        raise load_error[0]
