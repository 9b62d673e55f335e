"""The model server: one process holds the model (on a GPU box) and serves the engine over HTTP.

`create_app` builds a FastAPI app around an `Engine` (or a model id loaded in the background);
`serve` runs it with uvicorn. Operations, one per method of the Backend protocol
(probes.backend): GET /health, /ready, /info, /sites, /capabilities, /tokenizer; POST /generate
(per-token records as Server-Sent Events), /trace, /capture_batch, /head_means, /readout,
/minimize_entropy, /input_x_gradient, /prefill, /fork, /free/{state_id}, /cancel/{request_id}. The server runs only
these fixed operations, never code sent by a client; tensors travel as safetensors bytes (see
`probes.wire`, the wire format). Prefix states live in a `PrefixStore` (bounded, with a TTL).

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
import base64
import dataclasses
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from probes.engine import Engine, Sampling
from probes.states import DEFAULT_MAX_STATE_BYTES, DEFAULT_MAX_STATES, DEFAULT_STATE_TTL_S, PrefixStore
from probes.tokens import tokenizer_files
from probes.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS_CAP,
    AuthError,
    CaptureBatchRequest,
    EntropyFitRequest,
    ForkRequest,
    GenerateRequest,
    GradientRequest,
    HeadMeansRequest,
    InvalidRequestError,
    PrefillRequest,
    ReadoutRequest,
    RequestTooLargeError,
    ServerBusyError,
    TraceRequest,
    error_body,
    intervention_from_spec,
    one_tensor,
    record_to_json,
    records_to_json,
    dumps,
    sse_event,
    tensors_to_b64,
    trace_to_json,
)
from thoughtscope.errors import BadInputError, ConflictError, ThoughtscopeError, TimeoutExceededError

log = logging.getLogger("thoughtscope.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
OPEN_PATHS = {"/health"}  # what a load balancer may poll without the token
KEEPALIVE_S = 5.0  # a queued stream sends an SSE comment this often, so proxies and clients see it alive
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """How long and how much one request may take. Defaults suit a GPU box; every one is a `serve` option.

    - `send_timeout_s`: a stream whose client does not take a record for this long is cut off and
      the model freed (a stalled reader cannot hold the model);
    - `max_stream_s`: the longest a generation may hold the model;
    - `queue_timeout_s`: the longest a request waits for the model before a 503;
    - `max_sequences` / `max_batch_tokens`: prompts x samples, and that times max_new_tokens, per request;
      `max_capture_tokens`: tokens of one capture_batch / entropy-fit request.
    """

    send_timeout_s: float = 60.0
    max_stream_s: float = 1800.0
    queue_timeout_s: float = 600.0
    max_sequences: int = 64
    max_batch_tokens: int = 262_144
    max_capture_tokens: int = 262_144


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

    async def wait_for(self, timeout_s: float, gone: Callable[[], Any] | None = None,
                       tick_s: float = KEEPALIVE_S) -> AsyncIterator[None]:
        """Wait for the model; yields every `tick_s` seconds while waiting (a stream sends a keep-alive).

        Gives up with `TimeoutExceededError` after `timeout_s`, and silently (holding nothing) when
        `gone()` says the client has disconnected: a client that gave up frees its place at once.
        """
        started = time.monotonic()
        while not self.holding:
            with anyio.move_on_after(tick_s):
                await self.wait()
            if self.holding:
                return
            if gone is not None and await gone():
                self.release()
                return
            if time.monotonic() - started > timeout_s:
                self.release()
                raise TimeoutExceededError(
                    f"waited {timeout_s:g} s for the model without getting it; the server is overloaded. "
                    "Retry later, or start the server with a longer --queue-timeout-s", )
            yield

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
        started = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later messages (http.disconnect) pass through

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except ClientGone:
            return  # it gave up while waiting for the model: nobody to answer
        except Exception as err:  # a bug: answer a JSON 500 and keep the connection (Starlette would drop it)
            log.exception("unexpected error in %s", scope.get("path"))
            if not started:
                await _send_error(send, err)

    def _authorised(self, headers: dict[str, str]) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def _too_large(self, size: int) -> RequestTooLargeError:
        return RequestTooLargeError(
            f"the request body has {size} bytes or more; this server accepts at most {self.max_body_bytes} "
            "(send fewer or smaller tensors, or restart the server with a larger max_body_bytes)")


async def _send_error(send: Callable, err: BaseException) -> None:
    body = dumps(error_body(err)).encode()
    status = err.http_status if isinstance(err, ThoughtscopeError) else 500
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class StrictJSONResponse(JSONResponse):
    """JSON without NaN or Infinity (non-finite numbers become null), as strict parsers read it."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


def _error_response(err: BaseException) -> JSONResponse:
    status = err.http_status if isinstance(err, ThoughtscopeError) else 500
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if isinstance(err, ServerBusyError) else None
    return StrictJSONResponse(error_body(err), status_code=status, headers=headers)


# ----- the app -----


class _ServerState:
    """What the endpoints share: the engine (once loaded), the queue, and the requests in flight."""

    def __init__(self, engine: Engine | None, max_queue: int, max_new_tokens_cap: int, max_body_bytes: int,
                 states: PrefixStore, limits: ServerLimits):
        self.limits = limits
        self.engine = engine
        self.load_error: ThoughtscopeError | None = None
        self.queue = ModelQueue(max_queue)
        self.max_new_tokens_cap = max_new_tokens_cap
        self.max_body_bytes = max_body_bytes
        self.states = states
        self.generations: dict[str, Any] = {}  # request id -> `_Generation`, while queued or running

    async def run(self, request: Request, work: Callable[[], Any]) -> Any:
        """One model call: a place in the queue, the model, the call in a worker thread, the place freed.

        A client that disconnects while waiting gives its place up at once (the call never runs).
        """
        ticket = self.queue.admit()
        try:
            async for _ in ticket.wait_for(self.limits.queue_timeout_s, request.is_disconnected, tick_s=0.5):
                pass
            if not ticket.holding:
                raise ClientGone()
            return await anyio.to_thread.run_sync(work)
        finally:
            ticket.release()

    def reserve(self, request_id: str) -> None:
        """Claim a request id atomically (no await between the check and the claim)."""
        if request_id in self.generations:
            raise ConflictError(f"request id {request_id!r} is already in use by a queued or running request; "
                                "send a fresh one (or none)")
        self.generations[request_id] = None

    def check_batch(self, n_sequences: int, max_new_tokens: int) -> None:
        lim = self.limits
        if n_sequences > lim.max_sequences:
            raise RequestTooLargeError(f"{n_sequences} sequences (prompts x n_samples) in one request; this server "
                                       f"takes at most {lim.max_sequences}: split the batch")
        if n_sequences * max_new_tokens > lim.max_batch_tokens:
            raise RequestTooLargeError(
                f"{n_sequences} sequences x {max_new_tokens} new tokens = {n_sequences * max_new_tokens} tokens; "
                f"this server takes at most {lim.max_batch_tokens} per request: fewer samples or tokens")

    def check_capture(self, sequences: list[list[int]]) -> None:
        total = sum(len(seq) for seq in sequences)
        if total > self.limits.max_capture_tokens:
            raise RequestTooLargeError(f"{total} tokens in one request; this server takes at most "
                                       f"{self.limits.max_capture_tokens}: send fewer or shorter sequences")

    def check_tokens(self, max_new_tokens: int) -> None:
        if max_new_tokens > self.max_new_tokens_cap:
            raise InvalidRequestError(f"max_new_tokens={max_new_tokens} is above this server's cap of "
                                      f"{self.max_new_tokens_cap}; ask for fewer tokens")

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
    max_states: int = DEFAULT_MAX_STATES,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    state_ttl_s: float = DEFAULT_STATE_TTL_S,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The ASGI app. Given a model id, the model loads in a thread at start-up (GET /ready says when);
    `load_kwargs` go to `Engine.from_id` (device, dtype, device_map). Prefix states: at most
    `max_states` of at most `max_state_bytes` in all, each expiring `state_ttl_s` s after its last use."""
    if token is not None and not token:
        raise BadInputError("the token is empty; pass a non-empty secret or none at all")
    preloaded = engine_or_model_id if isinstance(engine_or_model_id, Engine) else None
    if token is not None and not _printable_ascii(token):
        raise BadInputError("the token must be printable ASCII (HTTP headers cannot carry other characters, so a "
                            "client could never send it)")
    state = _ServerState(preloaded, max_queue, max_new_tokens_cap, max_body_bytes,
                         PrefixStore(max_states, max_state_bytes, state_ttl_s), limits or ServerLimits())

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
        ops = (" (operations: /health /ready /info /sites /capabilities /tokenizer /generate /trace /capture_batch "
               "/head_means /readout /minimize_entropy /input_x_gradient /prefill /fork /free/{id} /cancel/{id})")
        hint = ops if err.status_code == 404 else ""
        if err.status_code == 400:  # Starlette could not parse the body (not JSON, not UTF-8)
            hint = ": send a JSON body encoded as UTF-8"
        kind = "InvalidRequestError" if 400 <= err.status_code < 500 else "ServerError"
        return StrictJSONResponse({"error": f"{err.detail}{hint}", "kind": kind}, status_code=err.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return _error_response(err)


def _add_routes(app: FastAPI, state: _ServerState) -> None:
    strict = StrictJSONResponse

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"ready": state.engine is not None, "busy": state.queue.busy, "waiting": state.queue.waiting,
                "max_queue": state.queue.max_queue, "max_new_tokens_cap": state.max_new_tokens_cap,
                "max_body_bytes": state.max_body_bytes, "prefix_states": state.states.stats(),
                "limits": dataclasses.asdict(state.limits)}
        if state.load_error is not None:
            return strict({**body, **error_body(state.load_error)}, status_code=state.load_error.http_status)
        return strict(body, status_code=200 if state.engine is not None else 503)

    @app.get("/info")
    async def info() -> JSONResponse:
        return strict(state.ready_engine().info())

    @app.get("/sites")
    async def sites() -> JSONResponse:
        return strict(state.ready_engine().sites())

    @app.get("/capabilities")
    async def capabilities() -> JSONResponse:
        return strict(state.ready_engine().capabilities())

    @app.get("/tokenizer")
    async def tokenizer() -> JSONResponse:
        """The tokenizer's files (a client encodes locally, with the same checks) and the token facts."""
        engine = state.ready_engine()
        files = await anyio.to_thread.run_sync(lambda: tokenizer_files(engine.tok))
        return strict({"files": {name: base64.b64encode(data).decode("ascii") for name, data in files.items()},
                       "context_length": engine.ops.context_length, "vocab_size": engine.ops.vocab_size,
                       "eos_ids": engine.eos_ids()})

    @app.post("/cancel/{request_id}")
    async def cancel(request_id: str) -> JSONResponse:
        generation = state.generations.get(request_id)
        if generation is not None:
            generation.cancel()
        return strict({"request_id": request_id, "cancelled": generation is not None})

    @app.post("/trace")
    async def trace(body: TraceRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        interventions = [intervention_from_spec(s) for s in body.interventions]
        result = await state.run(request, lambda: engine.trace(body.text, capture=body.capture,
                                                                interventions=interventions, chat=body.chat,
                                                                images=body.images))
        return strict(trace_to_json(result))

    @app.post("/capture_batch")
    async def capture_batch(body: CaptureBatchRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        state.check_capture(body.sequences)
        prefix = state.states.get(body.prefix) if body.prefix else None
        result = await state.run(request, lambda: engine.capture_batch(
            body.sequences, body.capture, prefix=prefix, stop_after_last_site=body.stop_after_last_site,
            positions=body.positions))
        return strict({"activations": tensors_to_b64(result)})

    @app.post("/head_means")
    async def head_means(body: HeadMeansRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        result = await state.run(request, lambda: engine.head_means(body.texts, body.layer))
        return strict({"means": tensors_to_b64({"means": result})})

    @app.post("/readout")
    async def readout(body: ReadoutRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        vectors = one_tensor(body.vectors, "readout vectors")
        result = await state.run(request, lambda: engine.readout(vectors, norm=body.norm, top_k=body.top_k,
                                                                  bottom_k=body.bottom_k, token_ids=body.token_ids))
        return strict({"readout": tensors_to_b64(result.tensors())})

    @app.post("/minimize_entropy")
    async def minimize_entropy(body: EntropyFitRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        state.check_capture(body.sequences)
        basis = one_tensor(body.basis, "the basis")
        fit = await state.run(request, lambda: engine.minimize_entropy(
            body.sequences, body.starts, body.site, basis, iterations=body.iterations, lr=body.lr,
            batch_size=body.batch_size, seed=body.seed))
        return strict({"coefficients": tensors_to_b64({"coefficients": fit.coefficients}),
                       "history": fit.history, "settings": fit.settings})

    @app.post("/input_x_gradient")
    async def input_x_gradient(body: GradientRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        interventions = [intervention_from_spec(s) for s in body.interventions]
        result = await state.run(request, lambda: engine.input_x_gradient(
            body.text, target=body.target, positions=body.positions, token=body.token, foil=body.foil,
            sites=body.sites, interventions=interventions, chat=body.chat, images=body.images))
        out = result.to_dict()
        tensors = {"scores": result.scores, **{f"site/{k}": v for k, v in result.site_scores.items()}}
        return strict({**{k: v for k, v in out.items() if k not in ("scores", "site_scores")},
                       "tensors": tensors_to_b64(tensors)})

    @app.post("/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        base = state.states.get(body.base) if body.base else None
        made = await state.run(request, lambda: engine.prefill(body.prompt, chat=body.chat, base=base,
                                                               images=body.images))
        state.states.put(made)
        return strict(made.describe())

    @app.post("/fork")
    async def fork(body: ForkRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        state.check_tokens(body.max_new_tokens)
        prefix = state.states.get(body.state)
        records = await state.run(request, lambda: engine.fork(
            prefix, body.suffix, max_new_tokens=body.max_new_tokens, capture=body.capture, top_k=body.top_k,
            stop=body.stop, at=body.at))
        return strict({"records": records_to_json(records)})

    @app.post("/free/{state_id}")
    async def free(state_id: str) -> JSONResponse:
        return strict({"state_id": state_id, "freed": state.states.free(state_id)})

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> StreamingResponse:
        engine = state.ready_engine()
        state.check_tokens(body.max_new_tokens)
        n_sequences = (1 if body.prompts is None else len(body.prompts)) * body.n_samples
        state.check_batch(n_sequences, body.max_new_tokens)
        request_id = body.request_id or uuid.uuid4().hex
        state.reserve(request_id)  # before any await: two requests with one id cannot both pass
        try:
            interventions = [intervention_from_spec(s) for s in body.interventions]
            ticket = state.queue.admit()
        except BaseException:
            state.generations.pop(request_id, None)
            raise
        try:
            # Input checks (prompt, sites, interventions) run before the first byte, so a bad request
            # is a 4xx rather than an error event; they touch only the tokenizer, not the model.
            stream = await anyio.to_thread.run_sync(lambda: engine.generate(
                body.prompt, prompts=body.prompts, n_samples=body.n_samples, max_new_tokens=body.max_new_tokens,
                sampling=Sampling(**body.sampling.model_dump()), seed=body.seed, capture=body.capture,
                interventions=interventions, top_k=body.top_k, stop=body.stop, chat=body.chat,
                images=None if body.images is None else body.images[0] if body.prompts is None else body.images))
        except BaseException:
            ticket.release()
            state.generations.pop(request_id, None)
            raise
        generation = _Generation(stream, ticket, request_id, state)
        return _OwnedStream(generation, media_type="text/event-stream",
                            headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})


_DONE = object()
AHEAD = 4  # records the model may compute ahead of the socket: overlap without unbounded memory


class ClientGone(Exception):
    """The client disconnected while its request waited for the model (nothing to answer)."""


class _Generation:
    """One streamed generation: a producer thread runs the model token by token, the event loop
    sends what it made.

    The producer never waits for the network (up to AHEAD records), so the HTTP hop adds no
    latency per token. `stop` (a disconnect, a cancel, `max_stream_s`) is checked before every
    token; the model is handed on only after the producer has closed the engine's stream (hooks off
    the model).
    """

    def __init__(self, stream: Any, ticket: Ticket, request_id: str, state: _ServerState):
        self.stream, self.ticket, self.request_id, self.state = stream, ticket, request_id, state
        self.stop = threading.Event()
        self.n_tokens, self.failed, self.finished = 0, False, False
        self.cancelled, self.exhausted, self.timed_out = False, False, False
        self._room = threading.Semaphore(AHEAD)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._thread: threading.Thread | None = None
        state.generations[request_id] = self

    async def events(self) -> AsyncIterator[bytes]:
        """start, (queue keep-alives), one `token` event per record, then `end` (or `error`)."""
        yield sse_event("start", {"request_id": self.request_id, "queued": self.state.queue.busy})
        try:
            async for _ in self.ticket.wait_for(self.state.limits.queue_timeout_s):
                yield b": waiting for the model\n\n"
        except TimeoutExceededError as err:
            self.failed = True
            yield sse_event("error", {**error_body(err), "status": err.http_status})
            await self.finish()
            return
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
        deadline = time.monotonic() + self.state.limits.max_stream_s
        try:
            while not self.stop.is_set():
                self._room.acquire()
                if self.stop.is_set():
                    break
                if time.monotonic() > deadline:
                    raise TimeoutExceededError(
                        f"the generation held the model for {self.state.limits.max_stream_s:g} s, this server's "
                        f"--max-stream-s; it stopped after {self.n_tokens} tokens")
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
    never started (a client gone before the headers): otherwise its place on the model would leak.

    Every send has a deadline (`send_timeout_s`): a client that stops reading while the model
    writes is cut off, and the model is freed for the next request.
    """

    def __init__(self, generation: _Generation, **kwargs: Any):
        super().__init__(generation.events(), **kwargs)
        self.generation = generation

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        limit = self.generation.state.limits.send_timeout_s

        async def send_with_deadline(message: dict) -> None:
            with anyio.fail_after(limit):
                await send(message)

        try:
            await super().__call__(scope, receive, send_with_deadline)
        except Exception as err:  # noqa: BLE001 - a stalled reader (TimeoutError, maybe in an exception group)
            if not _is_timeout(err):
                raise
            self.generation.timed_out = True
            log.warning("generation %s: the client took no data for %g s; cut off and the model freed",
                        self.generation.request_id, limit)
        finally:
            await self.generation.finish()


def _is_timeout(err: BaseException) -> bool:
    if isinstance(err, TimeoutError):
        return True
    return isinstance(err, BaseExceptionGroup) and any(_is_timeout(e) for e in err.exceptions)


def _printable_ascii(text: str) -> bool:
    return all(32 < ord(c) < 127 for c in text)


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
    max_states: int = DEFAULT_MAX_STATES,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    state_ttl_s: float = DEFAULT_STATE_TTL_S,
    limits: ServerLimits | None = None,
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
                     max_new_tokens_cap=max_new_tokens_cap, load_kwargs=load_kwargs, on_load_error=stop,
                     max_states=max_states, max_state_bytes=max_state_bytes, state_ttl_s=state_ttl_s,
                     limits=limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.run()
    if load_error:
        raise load_error[0]
