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
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from probes.attention_masks import rows_needed
from probes.engine import Engine, Sampling
from probes.memory_budget import check_handle as check_memory_of
from probes.states import DEFAULT_MAX_STATE_BYTES, DEFAULT_MAX_STATES, DEFAULT_STATE_TTL_S, PrefixStore
from probes.tokens import tokenizer_files
from probes.vision import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MAX_IMAGES, open_image
from probes.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS_CAP,
    MAX_INTERVENTIONS,
    MAX_SEQUENCES,
    QUEUE_TICKET_HEADER,
    SERVER_INFO_KEYS,
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
from thoughtscope import checks
from thoughtscope.errors import (
    BadInputError,
    ConflictError,
    RequestTimeoutError,
    ThoughtscopeError,
    TimeoutExceededError,
)

log = logging.getLogger("thoughtscope.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
OPEN_PATHS = {"/health"}  # what a load balancer may poll without the token
KEEPALIVE_S = 5.0  # a queued stream sends an SSE comment this often, so proxies and clients see it alive
RETRY_AFTER_S = 1
MIN_RETRY_S = 0.05  # the shortest wait a refusal asks for
TICKET_GRACE_S = 2.0  # a refused client's place in line is kept this long past its Retry-After
SERVICE_EWMA = 0.2  # weight of the latest request in the mean service time (and in its mean deviation)
DEVIATIONS = 4  # a refusal's wait adds this many mean deviations x sqrt(places), as TCP's timeout does
# A holder past the estimated service time has an unknown remainder: the first place is then guessed at this
# fraction of how far it has overrun the estimate, so a refused client's retries space out geometrically
# instead of coming every MIN_RETRY_S (on a fresh server, where the guess is 1 s, one client retried 44 times
# while 32-token SmolLM2 streams ran; 11 with this). A mild overrun still gets the floor, as before.
OVERRUN_FRACTION = 0.5


@dataclass(frozen=True)
class ServerLimits:
    """How long and how much one request may take. Defaults suit a GPU box; every one is a `serve` option.

    - `send_timeout_s`: a stream whose client does not take a record for this long is cut off and
      the model freed (a stalled reader cannot hold the model);
    - `max_stream_s`: the longest a generation or an entropy fit (/minimize_entropy) may hold the model;
    - `queue_timeout_s`: the longest a request waits for the model before a 503;
    - `read_timeout_s`: the longest a client may pause while sending its request body before a 408 (a
      stalled upload cannot keep a body buffer for ever);
    - the request budget (`BUDGET`, what each field bounds): checked before any model work and before
      a queue place is taken, so an oversized request is a 413 that costs the model nothing.
    """

    send_timeout_s: float = 60.0
    max_stream_s: float = 1800.0
    queue_timeout_s: float = 600.0
    read_timeout_s: float = 30.0
    max_sequences: int = 64
    max_batch_tokens: int = 262_144
    max_capture_tokens: int = 262_144
    max_capture_sequences: int = MAX_SEQUENCES
    max_interventions: int = MAX_INTERVENTIONS
    max_images: int = MAX_IMAGES
    max_image_side: int = MAX_IMAGE_SIDE
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_request_pixels: int = 2 * MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        # an operator's typo (a NaN, a negative or zero timeout or bound) is said at start, not at the first request
        for name in ("send_timeout_s", "max_stream_s", "queue_timeout_s", "read_timeout_s"):
            checks.number(name, getattr(self, name), low=0, low_open=True)
        for name in BUDGET:
            checks.integer(name, getattr(self, name), low=1)

    def budget(self) -> dict[str, int]:
        """The request budget's numbers, as `GET /info` reports them."""
        return {name: getattr(self, name) for name in BUDGET}


# The request budget: one line per bound (serve --help, GET /info and docs/server.md say the same).
BUDGET = {
    "max_sequences": "rows one model call runs side by side: prompts x n_samples in /generate, mask rows "
                     "(mask_attention_rows: max(rows) + 1) in /trace and /input_x_gradient",
    "max_batch_tokens": "a generation's sequences x (longest prompt + image tokens + max_new_tokens); /fork's "
                        "suffix + max_new_tokens",
    "max_capture_tokens": "tokens of a teacher-forced request: mask rows x text tokens (/trace), all sequences "
                          "(/capture_batch, /minimize_entropy, /head_means), the prompt of /prefill",
    "max_capture_sequences": "sequences or texts of one /capture_batch, /minimize_entropy or /head_means",
    "max_interventions": "interventions (steering, ablations, masks, a KV policy) per request",
    "max_images": "images per request, all prompts together",
    "max_image_side": "the longest side an image may declare in its header (read before decoding)",
    "max_image_pixels": "pixels one image may declare (width x height, from the header)",
    "max_request_pixels": "pixels all images of one request may declare together (from the headers)",
}


# ----- the waiting room -----


def clock() -> float:
    """The waiting room's clock, in seconds: `time.monotonic`, under a name of its own, so that a test can
    move this clock alone. (A test that moved `time.monotonic` itself moved every event loop's clock in the
    process: an in-thread server's loop then computed its next wake-up against the fake time and slept in
    `select` for up to a day, until a request woke it; such servers took 10-20 s to stop.)"""
    return time.monotonic()


class ModelQueue:
    """One model call at a time; at most `max_queue` requests wait for their turn (FIFO).

    Beyond that a request is refused (503), but its client keeps a place in line: the refusal carries
    a ticket (`X-Queue-Ticket`) and a wait estimated from the measured service time (Retry-After; the
    body's `retry_after_s` to the millisecond). Places that free up go to ticket holders before any
    newcomer (a newcomer gets a place only beyond one kept for each of them), and among holders to the
    earlier refused ones due back by then; each holder's wait is estimated from its place in line, so a
    client that keeps retrying cannot be starved by faster ones. A ticket whose holder does not come back
    expires `TICKET_GRACE_S` after its wait; until then it holds up the holders behind it.
    """

    def __init__(self, max_queue: int, max_backlog: int = 1024):
        if max_queue < 0:
            raise BadInputError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue, self.max_backlog = max_queue, max_backlog
        self.waiting = 0
        self.mean_service_s = float(RETRY_AFTER_S)  # seconds between requests leaving (this until measured)
        self.dev_service_s = 0.0  # its mean deviation
        self._measured = False
        self._last_release: float | None = None  # when the model was last let go, if others were waiting then
        # Time since that release when the model sat free with nobody admitted (the refused clients still
        # asleep): not service, so not in the estimate. Counted, it fed on itself (longer waits, a model free
        # longer, longer waits): with 16 clients and --max-queue 2 the model was busy under half the time.
        self._idle_s, self._idle_from = 0.0, None
        self._held_since: float | None = None  # when the request holding the model took it
        self._lock = asyncio.Lock()
        self._backlog: dict[str, float] = {}  # ticket -> expiry (monotonic s), oldest refusal first
        self._due: dict[str, float] = {}  # ticket -> when its holder was asked to come back

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def backlog(self) -> int:
        """Refused clients holding a place in line."""
        self._expire(clock())
        return len(self._backlog)

    def admit(self, ticket: str | None = None) -> "Ticket":
        """A place in the waiting room, or `ServerBusyError` (503) with a place in line when it is full."""
        now = clock()
        self._expire(now)
        # `waiting` counts every admitted request not yet holding the model, so a burst that
        # arrives before the first one takes the lock is still bounded.
        occupied, capacity = self.waiting + self.busy, self.max_queue + 1
        holder = ticket in self._backlog
        order = list(self._backlog)
        ahead = order.index(ticket) if holder else len(order)  # refused before this client
        # A newcomer needs a place beyond those kept for every ticket holder. A holder needs one beyond those
        # kept for the holders refused before it that are due back by now: one back a moment early is not
        # overtaken by a later one (when any holder could take a free place, that race cost up to 6 retries a
        # request in the fair-queue test once waits came from the service time alone), and one still asleep
        # holds up nobody.
        kept = len(order) if not holder else sum(self._due.get(t, now) <= now for t in order[:ahead])
        if occupied + kept < capacity:
            self._backlog.pop(ticket, None)
            self._due.pop(ticket, None)
            self.waiting += 1
            return Ticket(self)
        # n places free after the holder's remaining time and n - 1 more service times; a whole service time
        # for the first overshot it whenever the holder was part-way through (a client back a moment early
        # then waited a whole service time more, and its place sat free). A holder past the estimate: the
        # first place is OVERRUN_FRACTION of its overrun.
        places = occupied + ahead + 1 - capacity
        held = 0.0 if self._held_since is None else now - self._held_since
        first = max(self.mean_service_s - held, OVERRUN_FRACTION * (held - self.mean_service_s))
        wait_s = max(MIN_RETRY_S, first + (places - 1) * self.mean_service_s
                     + DEVIATIONS * self.dev_service_s * math.sqrt(places))
        if ticket not in self._backlog:
            ticket = uuid.uuid4().hex if len(self._backlog) < self.max_backlog else None
        if ticket is not None:  # a retry refreshes the expiry; the place (insertion order) stays
            self._backlog[ticket] = now + math.ceil(wait_s) + TICKET_GRACE_S
            self._due[ticket] = now + wait_s
        err = ServerBusyError(
            f"the model is busy and {self.waiting} requests are already waiting (max_queue={self.max_queue}); "
            f"retry in {wait_s:.2f} s" + (f" sending the header {QUEUE_TICKET_HEADER}: {ticket} to keep your place "
                                          "in line" if ticket else "") +
            ", or start the server with a larger --max-queue", retry_after=wait_s)
        err.queue_ticket = ticket
        raise err

    def served(self, held_s: float) -> None:
        """A request let go of the model after holding it `held_s`: the estimate behind Retry-After.

        Under contention the time between two requests leaving is what one place in line costs (it
        includes the work around the model call: parsing, checks, the answer), so that is measured
        then, less any time the model sat free with nobody admitted; otherwise the hold time. A moving
        average of either, and of its mean deviation."""
        now = clock()
        gap = None if self._last_release is None else now - self._last_release - self._idle_s
        sample = held_s if gap is None else max(held_s, gap)
        weight = SERVICE_EWMA if self._measured else 1.0
        if self._measured:
            self.dev_service_s += SERVICE_EWMA * (abs(sample - self.mean_service_s) - self.dev_service_s)
        self.mean_service_s += weight * (sample - self.mean_service_s)
        self._measured = True
        self._last_release = now if (self.waiting or self._backlog) else None
        self._idle_s, self._idle_from, self._held_since = 0.0, (now if self.waiting == 0 else None), None

    def _taken(self) -> None:
        """The model was just taken: the time it sat free with nobody admitted ends here."""
        now = clock()
        if self._idle_from is not None:
            self._idle_s += now - self._idle_from
            self._idle_from = None
        self._held_since = now

    def _expire(self, now: float) -> None:
        for ticket in [t for t, expiry in self._backlog.items() if expiry < now]:
            del self._backlog[ticket]
            self._due.pop(ticket, None)


class Ticket:
    """A request's place in the queue: wait for the model, then hold it until `release`."""

    def __init__(self, queue: ModelQueue):
        self.queue, self.holding, self.done = queue, False, False
        self.since = 0.0

    async def wait(self) -> None:
        await self.queue._lock.acquire()  # cancellation-safe: a cancelled waiter never ends up holding it
        self.queue.waiting -= 1
        self.queue._taken()
        self.holding, self.since = True, clock()

    async def wait_for(self, timeout_s: float, gone: Callable[[], Any] | None = None,
                       tick_s: float | None = None) -> AsyncIterator[None]:
        """Wait for the model; yields every `tick_s` seconds (default `KEEPALIVE_S`) while waiting (a stream
        sends a keep-alive, which also lets a client that stopped wanting it notice: probes.cancel).

        Gives up with `TimeoutExceededError` after `timeout_s`, and silently (holding nothing) when
        `gone()` says the client has disconnected: a client that gave up frees its place at once.

        One acquire waits the whole time and keeps the request's place in the lock's line across the ticks.
        (Cancelling the acquire at each tick and starting another sent the waiter to the back of the line:
        a trace, which ticks every 0.5 s to notice a gone client, was overtaken by every stream admitted
        after it, and the server curve's p95 at 16 clients was 1.45x its linear shape.)
        """
        tick_s = KEEPALIVE_S if tick_s is None else tick_s
        started = clock()
        acquire = asyncio.ensure_future(self.wait())
        try:
            while True:
                done, _ = await asyncio.wait({acquire}, timeout=tick_s)
                if done:
                    acquire.result()
                    return
                if gone is not None and await gone():
                    await self._give_up(acquire)
                    return
                if clock() - started > timeout_s:
                    await self._give_up(acquire)
                    raise TimeoutExceededError(
                        f"waited {timeout_s:g} s for the model without getting it; the server is overloaded. "
                        "Retry later, or start the server with a longer --queue-timeout-s", )
                yield
        finally:
            if not acquire.done():  # the caller stopped waiting (a stream closed, a cancelled request)
                await self._give_up(acquire)

    async def _give_up(self, acquire: "asyncio.Future[None]") -> None:
        """Stop waiting: the acquire is cancelled (or, had it just got the model, the model let go)."""
        acquire.cancel()
        try:
            await acquire
        except asyncio.CancelledError:
            pass
        self.release()

    def release(self) -> None:
        """Idempotent: a ticket may be released by the stream's end and again by the response's cleanup."""
        if self.done:
            return
        self.done = True
        if self.holding:
            self.holding = False
            self.queue.served(clock() - self.since)
            self.queue._lock.release()
        else:
            self.queue.waiting -= 1


# ----- the gate every request passes: token, then body size -----


class _Gate:
    """ASGI middleware: 401 without the right bearer token, 413 for a body over the limit, 408 for a body
    whose client stops sending it for `read_timeout_s` (a stalled upload holds no buffer for long).

    Checked before any endpoint runs, so an unauthenticated or oversized request never reaches
    the model or the JSON parser.
    """

    def __init__(self, app: Any, token: str | None, max_body_bytes: int, read_timeout_s: float):
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.token is not None and scope["path"] not in OPEN_PATHS and not self._authorised(headers):
            return await _send_error(send, AuthError(
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the token the server "
                "was started with (--token)"))
        length = headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, self._too_large(int(length)))
        body, more = bytearray(), True
        while more:  # read the body up front: a chunked upload has no content-length to check
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await _send_error(send, RequestTimeoutError(
                    f"the request body stopped arriving after {len(body)} bytes: nothing came for "
                    f"{self.read_timeout_s:g} s; send the whole body at once"))
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
    body, headers = error_body(err), None
    if isinstance(err, ServerBusyError):  # Retry-After is whole seconds; the body says it to the millisecond
        headers = {"Retry-After": str(max(1, math.ceil(err.retry_after)))}
        body["retry_after_s"] = round(float(err.retry_after), 3)
        ticket = getattr(err, "queue_ticket", None)
        if ticket:
            headers[QUEUE_TICKET_HEADER] = body["queue_ticket"] = ticket
    return StrictJSONResponse(body, status_code=status, headers=headers)


# ----- the request budget -----


class RequestBudget:
    """One request's size against the budget of `ServerLimits`, before any model work and any queue place.

    Each `check_*` method counts what an endpoint's body asks for (rows, tokens x rows, interventions,
    images and their pixels as the image headers declare them: nothing is decoded) and raises
    `RequestTooLargeError` (413) beyond a bound; prompts are tokenized with the engine's own checks.
    """

    def __init__(self, limits: ServerLimits, engine: Engine):
        self.limits, self.engine = limits, engine

    # --- one per endpoint ---

    def check_generate(self, body: GenerateRequest, interventions: list[Any]) -> None:
        prompts = [body.prompt] if body.prompts is None else body.prompts
        rows = len(prompts) * body.n_samples
        self._bound(rows, "max_sequences", "sequences (prompts x n_samples)", "split the batch")
        self._bound(len(interventions), "max_interventions", "interventions", "send fewer")
        image_tokens = self.images([im for entry in body.images or [] for im in entry])
        longest = max((len(self.engine.encode(p, chat=body.chat)) for p in prompts if p is not None), default=0)
        per_row = longest + image_tokens + body.max_new_tokens
        self._bound(rows * per_row, "max_batch_tokens",
                    f"tokens ({rows} sequences x ({longest} prompt + {image_tokens} image + {body.max_new_tokens} "
                    "new tokens))", "fewer samples or tokens")
        self.check_memory("generate", [longest + image_tokens] * rows, body.capture, max_new_tokens=body.max_new_tokens)

    def check_trace(self, body: Any, interventions: list[Any]) -> None:
        """/trace and /input_x_gradient: a text, its images, and mask rows (each row reruns the text)."""
        rows = self.mask_rows(interventions)
        self._bound(rows, "max_sequences", "rows (mask_attention_rows: max(rows) + 1)", "mask fewer rows per "
                    "request (visual attribution: a smaller batch_size)")
        self._bound(len(interventions), "max_interventions", "interventions", "send fewer")
        n_tokens = len(self.engine.encode(body.text, chat=body.chat)) + self.images(body.images or [])
        self._bound(rows * n_tokens, "max_capture_tokens", f"tokens ({rows} rows x {n_tokens} tokens)",
                    "a shorter text or fewer mask rows")
        gradient = not hasattr(body, "capture")  # /input_x_gradient reads `sites`
        self.check_memory("gradient" if gradient else "trace", [n_tokens],
                          getattr(body, "sites", None) or [] if gradient else body.capture, rows=rows)

    def check_sequences(self, sequences: list[list[int]], what: str = "sequences", images: Any = None) -> None:
        """/capture_batch (token ids, each row's images) and /minimize_entropy (token ids), /head_means (texts,
        tokenized here)."""
        self._bound(len(sequences), "max_capture_sequences", what, "split the request")
        total = sum(len(seq) if isinstance(seq, list) else len(self.engine.encode(seq)) for seq in sequences)
        total += self.images([im for entry in images or [] for im in entry])
        self._bound(total, "max_capture_tokens", f"tokens in all {what}", "send fewer or shorter ones")

    def check_prefill(self, body: PrefillRequest) -> None:
        n_tokens = len(self.engine.encode(body.prompt, chat=body.chat)) + self.images(body.images or [])
        self._bound(n_tokens, "max_capture_tokens", "prompt tokens", "a shorter prompt")
        self.check_memory("prefill", [n_tokens], [])

    def check_memory(self, mode: str, lengths: list[int], capture: list[str], rows: int = 1,
                     max_new_tokens: int = 0) -> None:
        """Sequence length x sites (attention patterns: length squared), the KV cache and the logits the
        call would hold, against the memory budget (probes.memory_budget: THOUGHTSCOPE_MEMORY_BUDGET);
        a 413 `MemoryBudgetError` with the estimate, before a queue place."""
        check_memory_of(self.engine.handle, mode=mode, lengths=lengths, rows=rows, sites=capture,
                        max_new_tokens=max_new_tokens, what=f"this {mode} request")

    def check_fork(self, body: ForkRequest) -> None:
        n_suffix = len(body.suffix) if isinstance(body.suffix, list) else len(
            self.engine.encode(body.suffix, add_special_tokens=False))
        self._bound(n_suffix + body.max_new_tokens, "max_batch_tokens", "tokens (suffix + max_new_tokens)",
                    "a shorter suffix or fewer new tokens")

    # --- the counts ---

    def mask_rows(self, interventions: list[Any]) -> int:
        """Rows a teacher-forced pass runs for these interventions (row masks: max row + 1), their rows checked
        to be row indices (the engine checks the rest when the call is made)."""
        return rows_needed(interventions)

    def images(self, images: list[Any]) -> int:
        """Check the images by their headers (count, sides, pixels, all of them together); their image tokens."""
        self._bound(len(images), "max_images", "images", "send fewer")
        total = 0
        for image in images:
            width, height = open_image(image, check=False).size  # the header only: no pixel is decoded
            self._bound(max(width, height), "max_image_side", f"pixels on the longest side of a {width}x{height} "
                        "image", "resize it")
            self._bound(width * height, "max_image_pixels", f"pixels in a {width}x{height} image", "resize it")
            total += width * height
            self._bound(total, "max_request_pixels", "image pixels (all images, as their headers declare them)",
                        "send fewer or smaller images")
        spec = getattr(self.engine.handle, "vision", None)
        return len(images) * spec.n_tokens if spec is not None and images else 0

    def _bound(self, count: int, name: str, what: str, remedy: str) -> None:
        limit = getattr(self.limits, name)
        if count > limit:
            raise RequestTooLargeError(f"{count} {what} in one request; this server takes at most {limit} "
                                       f"(--{name.replace('_', '-')}): {remedy}")


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

    async def run(self, request: Request, work: Callable[[], Any], gone: threading.Event | None = None) -> Any:
        """One model call: a place in the queue, the model, the call in a worker thread, the place freed.

        A client that disconnects while waiting gives its place up at once (the call never runs). With
        `gone`, a long call is watched too: the event is set when its client disconnects (the work checks it
        between its steps and stops), and the request ends without an answer.
        """
        ticket = self.queue.admit(request.headers.get(QUEUE_TICKET_HEADER))
        try:
            async for _ in ticket.wait_for(self.limits.queue_timeout_s, request.is_disconnected, tick_s=0.5):
                pass
            if not ticket.holding:
                raise ClientGone()
            if gone is None:
                return await anyio.to_thread.run_sync(work)
            worker = asyncio.ensure_future(anyio.to_thread.run_sync(work))
            while not (await asyncio.wait({worker}, timeout=0.5))[0]:
                if await request.is_disconnected():
                    gone.set()
            if gone.is_set():
                worker.exception()  # retrieved: the work stopped because nobody waits for it
                raise ClientGone()
            return worker.result()
        finally:
            ticket.release()

    def reserve(self, request_id: str) -> None:
        """Claim a request id atomically (no await between the check and the claim)."""
        if request_id in self.generations:
            raise ConflictError(f"request id {request_id!r} is already in use by a queued or running request; "
                                "send a fresh one (or none)")
        self.generations[request_id] = None

    async def within_budget(self, check: Callable[["RequestBudget"], None]) -> None:
        """Run a budget check (it may tokenize and read image headers) in a worker thread, before any queue place."""
        budget = RequestBudget(self.limits, self.ready_engine())
        await anyio.to_thread.run_sync(lambda: check(budget))

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
    on_ready: Callable[[Engine], None] | None = None,
) -> FastAPI:
    """The ASGI app. Given a model id, the model loads in a thread at start-up (GET /ready says when);
    `load_kwargs` go to `Engine.from_id` (device, dtype, device_map). Prefix states: at most
    `max_states` of at most `max_state_bytes` in all, each expiring `state_ttl_s` s after its last use."""
    if token is not None and not token:
        raise BadInputError("the token is empty; pass a non-empty secret or none at all")
    preloaded = engine_or_model_id if isinstance(engine_or_model_id, Engine) else None
    checks.integer("max_body_bytes", max_body_bytes, low=1)
    checks.integer("max_new_tokens_cap", max_new_tokens_cap, low=1)
    checks.integer("max_states", max_states, low=1)
    checks.integer("max_state_bytes", max_state_bytes, low=1)
    checks.number("state_ttl_s", state_ttl_s, low=0, low_open=True)
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
            if on_ready is not None:
                on_ready(state.engine)
        except Exception as err:
            state.load_error = err if isinstance(err, ThoughtscopeError) else ThoughtscopeError(
                f"loading {engine_or_model_id} failed: {type(err).__name__}: {err}")
            log.error("model %s failed to load: %s", engine_or_model_id, state.load_error)
            if on_load_error:
                on_load_error(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None if preloaded else asyncio.create_task(load())
        if preloaded is not None and on_ready is not None:
            on_ready(preloaded)
        yield
        if task and not task.done():
            task.cancel()

    app = FastAPI(title="thoughtscope model server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(_Gate, token=token, max_body_bytes=max_body_bytes, read_timeout_s=state.limits.read_timeout_s)
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


def server_info_sections(state: _ServerState) -> dict[str, Any]:
    """What GET /info adds to `Engine.info()`: one entry per name of `SERVER_INFO_KEYS` (a new section is one
    more line here and one more name there)."""
    sections = {"request_budget": state.limits.budget()}
    return {key: sections[key] for key in SERVER_INFO_KEYS if key in sections}


def _add_routes(app: FastAPI, state: _ServerState) -> None:
    strict = StrictJSONResponse

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"ready": state.engine is not None, "busy": state.queue.busy, "waiting": state.queue.waiting,
                "max_queue": state.queue.max_queue,
                "backlog": state.queue.backlog, "mean_service_s": round(state.queue.mean_service_s, 4),
                "max_new_tokens_cap": state.max_new_tokens_cap,
                "max_body_bytes": state.max_body_bytes, "prefix_states": state.states.stats(),
                "limits": dataclasses.asdict(state.limits)}
        if state.load_error is not None:
            return strict({**body, **error_body(state.load_error)}, status_code=state.load_error.http_status)
        return strict(body, status_code=200 if state.engine is not None else 503)

    @app.get("/info")
    async def info() -> JSONResponse:
        """`Engine.info()` plus the server's own sections, each named in `probes.wire.SERVER_INFO_KEYS`."""
        return strict({**state.ready_engine().info(), **server_info_sections(state)})

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
        await state.within_budget(lambda budget: budget.check_trace(body, interventions))
        result = await state.run(request, lambda: engine.trace(body.text, capture=body.capture,
                                                                interventions=interventions, chat=body.chat,
                                                                images=body.images))
        return strict(trace_to_json(result))

    @app.post("/capture_batch")
    async def capture_batch(body: CaptureBatchRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        await state.within_budget(lambda budget: (budget.check_sequences(body.sequences, images=body.images), budget.check_memory(
            "capture_batch", [len(seq) for seq in body.sequences], body.capture)))
        prefix = state.states.get(body.prefix) if body.prefix else None
        result = await state.run(request, lambda: engine.capture_batch(
            body.sequences, body.capture, prefix=prefix, stop_after_last_site=body.stop_after_last_site,
            positions=body.positions, images=body.images))
        return strict({"activations": tensors_to_b64(result)})

    @app.post("/head_means")
    async def head_means(body: HeadMeansRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        await state.within_budget(lambda budget: budget.check_sequences(body.texts, "texts"))
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
        await state.within_budget(lambda budget: budget.check_sequences(body.sequences))
        basis = one_tensor(body.basis, "the basis")
        gone, limit_s = threading.Event(), state.limits.max_stream_s
        deadline = [math.inf]  # set when the fit gets the model

        def steps(done: int, _entropy: float) -> None:  # between two iterations: a gone client, the time limit
            if gone.is_set():
                raise ClientGone()
            if time.monotonic() > deadline[0]:
                raise TimeoutExceededError(
                    f"the entropy fit held the model for {limit_s:g} s, this server's --max-stream-s, and stopped after "
                    f"{done} of {body.iterations} iterations; ask for fewer iterations or a smaller batch_size")

        def fit_now() -> Any:
            deadline[0] = time.monotonic() + limit_s
            return engine.minimize_entropy(body.sequences, body.starts, body.site, basis, iterations=body.iterations,
                                           lr=body.lr, batch_size=body.batch_size, seed=body.seed, on_step=steps)

        fit = await state.run(request, fit_now, gone=gone)
        if not (torch.isfinite(fit.coefficients).all() and all(math.isfinite(h) for h in fit.history)):
            raise BadInputError(f"the fit diverged (NaN or infinite coefficients or entropies) with lr={body.lr:g} "
                                f"over {body.iterations} iterations; use a smaller lr")
        return strict({"coefficients": tensors_to_b64({"coefficients": fit.coefficients}),
                       "history": fit.history, "settings": fit.settings})

    @app.post("/input_x_gradient")
    async def input_x_gradient(body: GradientRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        interventions = [intervention_from_spec(s) for s in body.interventions]
        await state.within_budget(lambda budget: budget.check_trace(body, interventions))
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
        await state.within_budget(lambda budget: budget.check_prefill(body))
        base = state.states.get(body.base) if body.base else None
        made = await state.run(request, lambda: engine.prefill(body.prompt, chat=body.chat, base=base,
                                                               images=body.images))
        state.states.put(made)
        return strict(made.describe())

    @app.post("/fork")
    async def fork(body: ForkRequest, request: Request) -> JSONResponse:
        engine = state.ready_engine()
        state.check_tokens(body.max_new_tokens)
        await state.within_budget(lambda budget: budget.check_fork(body))
        prefix = state.states.get(body.state)
        interventions = [intervention_from_spec(s) for s in body.interventions]
        records = await state.run(request, lambda: engine.fork(
            prefix, body.suffix, max_new_tokens=body.max_new_tokens, capture=body.capture, top_k=body.top_k,
            stop=body.stop, at=body.at, interventions=interventions))
        return strict({"records": records_to_json(records)})

    @app.post("/free/{state_id}")
    async def free(state_id: str) -> JSONResponse:
        return strict({"state_id": state_id, "freed": state.states.free(state_id)})

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> StreamingResponse:
        engine = state.ready_engine()
        state.check_tokens(body.max_new_tokens)
        request_id = body.request_id or uuid.uuid4().hex
        state.reserve(request_id)  # before any await: two requests with one id cannot both pass
        try:
            interventions = [intervention_from_spec(s) for s in body.interventions]
            await state.within_budget(lambda budget: budget.check_generate(body, interventions))
            ticket = state.queue.admit(request.headers.get(QUEUE_TICKET_HEADER))
        except BaseException:
            state.generations.pop(request_id, None)
            raise
        try:
            # Input checks (prompt, images, sites, interventions, attention masks) run before the first
            # byte, so a bad request is a 4xx rather than an error event; no forward pass runs here.
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


def _start_validation(engine: Engine) -> None:
    from probes.validate import badge

    badge(engine, background=True)


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "info") -> Any:
    """uvicorn's configuration for `app` (from `create_app`), with a deadline for each request's line and
    headers: the app's `read_timeout_s` (see `header_deadline_protocol`)."""
    import uvicorn

    limits = app.state.server.limits
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2,
                          http=header_deadline_protocol(limits.read_timeout_s))


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for a request's line and headers: a client that connects and
    stops before its headers end gets a 408 after `timeout_s` and the connection is closed. (uvicorn times
    out neither; its keep-alive timer stops at a request's first byte, so a client sending headers a byte
    at a time held its connection and buffer for ever. The body's own deadline is `_Gate`'s.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # between a request's first byte and its headers' end
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(timeout_s, self._stalled)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _stalled(self) -> None:
            self._deadline = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being sent: uvicorn's own cycle owns the connection
            body = json.dumps(error_body(RequestTimeoutError(
                f"the request line and headers did not arrive within {timeout_s:g} s; send the whole request "
                "at once"))).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return HeaderDeadline


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
    validate: bool = False,
) -> None:
    """Load `model_id` and serve it until interrupted. A model that fails to load stops the server
    and raises its error (the CLI prints the message). With `validate`, the model's validation
    (probes.validate) starts in the background once it is loaded, unless one is cached, so `/info`
    carries the correctness badge the pages show; each reader takes the engine's lock for one pass."""
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
                     limits=limits, on_ready=_start_validation if validate else None)
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
    server.run()
    if load_error:
        raise load_error[0]
