"""The model server, round two (issue 21): each test failed on the server as it was.

The request budget refuses before any model work and before a queue place: mask rows beyond
`--max-sequences`, images too large by their headers (never decoded); `/generate` refuses a bad
attention mask with a 400 before its stream; gradient-fit settings must be finite and bounded; a
2-D steering vector is refused with its shape; a fair queue serves every retrying client; HEAD
/health answers. The servers run in this process (`serving_in_thread`), so a test can count the
model's forward calls and PIL's decodes.
"""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib

import httpx
import pytest
import torch

from probes import Engine
from probes.attention_masks import RowMask
from probes.client import RemoteBackend
from probes.interventions import AddVector, MaskAttention
from probes.server import ServerLimits, create_app
from probes.server_bench import serving_in_thread
from probes.wire import ServerBusyError, intervention_to_spec, tensors_to_b64
from tests.counting import ForwardCounter, counted_tiny_server

LIMITS = ServerLimits(max_sequences=16, max_request_pixels=2 * 4096 * 4096)


@pytest.fixture(scope="module")
def llama():
    with counted_tiny_server(LIMITS) as served:
        yield served


def _trace(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/trace", json={"text": "2 + 2", **body}, timeout=60)


# ----- 1. mask rows are bounded by --max-sequences, before any model work -----


def test_mask_rows_beyond_the_budget_are_413_with_no_model_work(llama):
    url, engine, counter = llama
    before = counter.calls
    r = _trace(url, interventions=[intervention_to_spec(RowMask([0], rows=[1999]))])
    assert r.status_code == 413, r.text
    assert r.json()["error"].startswith("2000 rows (mask_attention_rows: max(rows) + 1) in one request; "
                                        "this server takes at most 16 (--max-sequences)")
    assert counter.calls == before  # refused before the engine ran a forward
    r = _trace(url, interventions=[intervention_to_spec(RowMask([0], rows=[3]))])  # 4 rows: within the budget
    assert r.status_code == 200 and counter.calls == before + 1


# ----- 2. images are refused by the size their headers declare, never decoded -----


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGBA pixels; its data stream holds a few zero rows and stops
    (a decoder would have to inflate the whole declared image to find out)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compressobj().compress(bytes(4 * (width * 4 + 1)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava():
    engine = Engine.from_id("tiny-random:llava", device="cpu")
    counter = ForwardCounter(engine.model)
    with serving_in_thread(create_app(engine, limits=LIMITS)) as url:
        yield url, engine, counter


@pytest.fixture
def decodes(monkeypatch):
    """Calls of PIL's ImageFile.load, which inflates the pixel data (opening reads the header only)."""
    from PIL import ImageFile

    count, real_load = [0], ImageFile.ImageFile.load

    def counted(self):
        count[0] += 1
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return count


def test_an_image_bomb_is_refused_from_its_header(llava, decodes):
    url, engine, counter = llava
    bomb = _png_header(13000, 13000)
    assert len(bomb) < 4096  # a small file that declares 676 MB of RGBA pixels
    before = counter.calls
    for path, body in (("/trace", {"text": "look <image> here", "images": [_b64(bomb)]}),
                       ("/generate", {"prompt": "look <image> here", "images": [[_b64(bomb)]], "max_new_tokens": 2})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"] == ("13000 pixels on the longest side of a 13000x13000 image in one request; this "
                                     "server takes at most 4096 (--max-image-side): resize it")
    assert decodes[0] == 0 and counter.calls == before


def test_many_large_images_in_a_small_body_are_refused_by_their_pixel_total(llava, decodes):
    url, engine, counter = llava
    image = _b64(_png_header(4096, 4096))  # each allowed alone (16.8 M pixels); 3 of them are 50.3 M pixels
    r = httpx.post(f"{url}/trace", json={"text": "<image> <image> <image>", "images": [image] * 3}, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["error"].startswith(f"{3 * 4096 * 4096} image pixels (all images, as their headers declare "
                                        f"them) in one request; this server takes at most {2 * 4096 * 4096}")
    assert decodes[0] == 0 and counter.calls == 0
    # a small real image still goes through: PIL decodes it (load runs) and the model runs once
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="PNG")
    r = httpx.post(f"{url}/trace", json={"text": "look <image> here", "images": [_b64(buf.getvalue())]}, timeout=60)
    assert r.status_code == 200, r.text
    assert decodes[0] >= 1 and counter.calls == 1


# ----- 3. /generate checks attention masks before its stream -----


@pytest.mark.parametrize("mask, words", [
    (MaskAttention([50]), "MaskAttention positions [50] are beyond a prompt of"),
    (MaskAttention([1], queries=[2]), "queries= applies to teacher-forced trace/capture"),
])
def test_a_bad_generate_mask_is_a_400_before_the_stream(llama, mask, words):
    url, engine, counter = llama
    before = counter.calls
    r = httpx.post(f"{url}/generate", json={"prompt": "one two three", "max_new_tokens": 4,
                                             "interventions": [intervention_to_spec(mask)]}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert words in r.json()["error"]
    assert counter.calls == before


# ----- 4. gradient fits take finite, bounded settings and never answer NaN -----


def _fit_body(engine: Engine, **settings) -> dict:
    ids = engine.encode("2 + 2 = 4 and 3 + 3 = 6")
    return {"sequences": [ids], "starts": [3], "site": "resid_post.0", "iterations": 2,
            "basis": tensors_to_b64({"basis": torch.randn(4, 64, generator=torch.Generator().manual_seed(0))}),
            **settings}


@pytest.mark.parametrize("raw_lr, words", [("1e308", "less than or equal to 10"), ("1e400", "finite number"),
                                           ("NaN", "finite number"), ("Infinity", "finite number")])
def test_huge_or_non_finite_learning_rates_are_refused(llama, raw_lr, words):
    url, engine, counter = llama
    before = counter.calls
    text = httpx.Request("POST", "/", json=_fit_body(engine, lr=0.5)).content.decode().replace("0.5", raw_lr)
    r = httpx.post(f"{url}/minimize_entropy", content=text, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 422, r.text
    assert "lr" in r.json()["error"] and words in r.json()["error"]
    assert counter.calls == before


def test_a_fit_that_diverges_is_an_error_not_nan_coefficients(llama):
    url, engine, _ = llama
    body = _fit_body(engine, lr=10.0)
    body["basis"] = tensors_to_b64({"basis": torch.full((2, 64), 3e38)})  # finite, but any step overflows
    r = httpx.post(f"{url}/minimize_entropy", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("the fit diverged (NaN or infinite coefficients or entropies) with lr=10")


# ----- 5. a 2-D vector is refused with its shape; HEAD /health; the budget in /info -----


def test_a_2d_steering_vector_is_refused_with_its_shape(llama):
    url, engine, counter = llama
    spec = intervention_to_spec(AddVector("resid_post.0", torch.ones(64)))
    spec["vector"] = tensors_to_b64({"vector": torch.ones(8, 8)})  # 64 numbers, the width of d_model, as a matrix
    before = counter.calls
    r = _trace(url, interventions=[spec])
    assert r.status_code == 400, r.text
    assert r.json()["error"] == ("add.vector must be a 1-D vector of d_model values; got a tensor of shape [8, 8] "
                                 "(send one vector, not a matrix)")
    assert counter.calls == before


def test_head_health_answers_like_get_and_info_reports_the_budget(llama):
    url, engine, _ = llama
    assert httpx.head(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/info").json()
    assert info["request_budget"] == LIMITS.budget()
    assert info["request_budget"]["max_sequences"] == 16
    with RemoteBackend(url) as remote:
        assert remote.info() == engine.info()  # the server's sections are set aside
        assert remote.server_info["request_budget"] == LIMITS.budget()


# ----- 6. the fair queue: 16 clients, at most 5 retries a request, none lost -----


@pytest.mark.alone  # Retry-After is estimated from the measured service time: a neighbour's load makes it short
def test_a_fair_queue_serves_16_clients_with_at_most_5_retries_each(llama, capsys):
    url, engine, counter = llama  # max_queue=2: at most 3 requests in, so most arrivals are refused at first
    n_clients, per_client, max_retries = 16, 12, 5
    retries, lost, tickets_seen = [], [], []
    lock = threading.Lock()

    def client(k: int) -> None:
        with RemoteBackend(url, timeout=60) as backend:
            for i in range(per_client):
                for attempt in range(max_retries + 1):
                    try:
                        if (k + i) % 2:
                            records = list(backend.generate(f"client {k} asks {i}", max_new_tokens=4))
                            ok = len(records) == 4
                        else:
                            ok = len(backend.trace(f"client {k} asks {i}").token_ids) > 3
                        with lock:
                            retries.append(attempt)
                            if not ok:
                                lost.append((k, i, "wrong answer"))
                        break
                    except ServerBusyError as err:
                        with lock:
                            tickets_seen.append(err.queue_ticket)
                        time.sleep(err.retry_after_s)  # the server's estimate, to the millisecond
                else:
                    with lock:
                        lost.append((k, i, f"refused {max_retries + 1} times"))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert lost == []
    assert len(retries) == n_clients * per_client and max(retries) <= max_retries
    assert tickets_seen and all(tickets_seen)  # there was contention, and every refusal kept a place in line
    ready = httpx.get(f"{url}/ready").json()
    assert (ready["busy"], ready["waiting"]) == (False, 0)
    with capsys.disabled():
        print(f"\nfair queue: {len(retries)} requests from {n_clients} clients, {len(tickets_seen)} 503s, "
              f"most retries of one request {max(retries)}")


def test_a_refused_client_keeps_its_place_ahead_of_newcomers():
    from probes.server import ModelQueue

    queue = ModelQueue(max_queue=0)  # one place: the model itself
    holder = queue.admit()
    with pytest.raises(ServerBusyError) as first:
        queue.admit()
    ticket = first.value.queue_ticket
    assert ticket and queue.backlog == 1
    holder.release()
    with pytest.raises(ServerBusyError) as newcomer:  # the freed place is kept for the refused client
        queue.admit()
    assert newcomer.value.queue_ticket != ticket and queue.backlog == 2
    queue.admit(ticket)  # the refused client comes back first in line and gets it
    assert queue.backlog == 1 and queue.waiting == 1


class _Clock:
    """The waiting room's clock (`probes.server.clock`), moved by hand."""

    def __init__(self, monkeypatch):
        import probes.server

        self.now = 100.0
        monkeypatch.setattr(probes.server, "clock", lambda: self.now)


def test_moving_the_waiting_rooms_clock_leaves_the_event_loops_clocks_alone(monkeypatch):
    """The tests below move the waiting room's clock by hand. They used to move `time.monotonic` itself,
    every event loop's clock in the process: a timer set then never came due, and the module's in-thread
    servers, whose loops had computed their next wake-up against the fake time, took 10-20 s to stop."""
    import asyncio

    import probes.server

    clock = _Clock(monkeypatch)
    assert probes.server.clock() == 100.0
    slept = threading.Event()
    thread = threading.Thread(target=lambda: (asyncio.run(asyncio.sleep(0.05)), slept.set()), daemon=True)
    thread.start()
    thread.join(30)  # a hang detector, not a timing: on the moved clock this sleep never ends
    assert slept.is_set(), "an event loop's 0.05 s sleep did not end while the waiting room's clock was moved"
    clock.now += 5
    assert probes.server.clock() == 105.0


def test_the_service_estimate_leaves_out_the_time_the_model_sat_free(monkeypatch):
    """Two requests each hold the model 0.1 s; between them it sits free 2 s while the refused client sleeps
    its Retry-After. The estimate counted those 2 s as service (0.5 s after one such gap), so the next refusals
    asked for longer waits and the model sat free longer: with 16 clients and --max-queue 2 it was busy under
    half the time (the fair-queue test above took 27 s of the serial tier; 5-14 s now)."""
    import asyncio

    from probes.server import ModelQueue, ServerBusyError

    clock = _Clock(monkeypatch)

    async def scenario() -> tuple[float, float, str | None]:
        queue = ModelQueue(max_queue=0)
        first = queue.admit()
        await first.wait()
        with pytest.raises(ServerBusyError) as refused:  # keeps a place in line: contention
            queue.admit()
        clock.now += 0.1
        first.release()
        measured = queue.mean_service_s  # the first hold, 0.1 s
        clock.now += 2.0  # nobody admitted: the refused client is asleep
        back = queue.admit(refused.value.queue_ticket)  # the refused client, back in its place
        await back.wait()
        clock.now += 0.1
        back.release()
        return measured, queue.mean_service_s, refused.value.queue_ticket

    measured, after_idle, ticket = asyncio.run(scenario())
    assert ticket and measured == pytest.approx(0.1)
    assert after_idle == pytest.approx(0.1)


def test_a_refusal_waits_for_the_holders_remaining_time_and_holders_keep_their_order(monkeypatch):
    """The first place frees when the request holding the model is done: the wait asked for is what remains
    of its service time (it was a whole service time, however far along the holder was). A ticket holder back
    on time is not overtaken by one refused after it; one still asleep holds up nobody."""
    import asyncio

    from probes.server import ModelQueue, ServerBusyError

    clock = _Clock(monkeypatch)

    def refused(queue: ModelQueue, ticket: str | None = None) -> ServerBusyError:
        with pytest.raises(ServerBusyError) as err:
            queue.admit(ticket)
        return err.value

    async def scenario() -> None:
        queue = ModelQueue(max_queue=0)
        holder = queue.admit()
        await holder.wait()
        clock.now += 0.1
        holder.release()  # measured: 0.1 s a request, no deviation yet
        holder = queue.admit()
        await holder.wait()
        clock.now += 0.03
        first = refused(queue)  # the holder is 0.03 s into its 0.1 s
        assert first.retry_after == pytest.approx(0.07)
        second = refused(queue)  # one place more: 0.07 + 0.1
        assert second.retry_after == pytest.approx(0.17)
        clock.now += 0.07
        holder.release()  # the place frees as estimated
        # the second holder is not due yet and the first one is: the first keeps the place
        assert isinstance(refused(queue, second.queue_ticket), ServerBusyError)
        taken = queue.admit(first.queue_ticket)
        await taken.wait()
        clock.now += 0.1
        taken.release()
        assert queue.backlog == 1  # the second holder, still in line

    async def asleep() -> None:
        queue = ModelQueue(max_queue=0)  # nothing measured yet: a place is guessed at 1 s
        holder = queue.admit()
        await holder.wait()
        early = refused(queue)
        assert early.retry_after == pytest.approx(1.0)
        clock.now += 0.1
        holder.release()  # measured: 0.1 s
        late = refused(queue)  # a newcomer: the early holder's place is kept
        assert late.retry_after == pytest.approx(0.1)
        clock.now += 0.1
        back = queue.admit(late.queue_ticket)  # the early holder is not due for 0.8 s: it holds up nobody
        await back.wait()
        back.release()

    asyncio.run(scenario())
    asyncio.run(asleep())


def test_a_holder_past_the_estimate_spaces_the_retries_out_instead_of_inviting_a_storm(monkeypatch):
    """Once the request holding the model has run past the estimated service time, its remainder is unknown: the
    first place is guessed at half the overrun. Before, the wait fell to the 0.05 s floor, and on a fresh
    server (guess 1 s) a client retried 44 times while SmolLM2 streams ran. Before the overrun the
    remaining-time rule holds as it was."""
    import asyncio

    from probes.server import MIN_RETRY_S, ModelQueue

    clock = _Clock(monkeypatch)

    def wait_now(queue: ModelQueue, ticket: str | None = None) -> ServerBusyError:
        with pytest.raises(ServerBusyError) as err:
            queue.admit(ticket)
        return err.value

    async def fresh() -> list[float]:
        queue = ModelQueue(max_queue=0)  # nothing measured: a place is guessed at 1 s
        holder = queue.admit()
        await holder.wait()
        waits, ticket = [], None
        for held in (0.4, 3.0, 4.5, 6.75):
            clock.now = 100.0 + held
            refusal = wait_now(queue, ticket)
            ticket = refusal.queue_ticket
            waits.append(refusal.retry_after)
        holder.release()
        return waits

    async def measured() -> tuple[float, float]:
        queue = ModelQueue(max_queue=0)
        holder = queue.admit()
        await holder.wait()
        clock.now += 0.1
        holder.release()  # 0.1 s a request, no deviation yet
        holder = queue.admit()
        await holder.wait()
        clock.now += 0.5  # five times the estimate
        first = wait_now(queue)
        second = wait_now(queue)  # one place more: one service time more
        return first.retry_after, second.retry_after

    # 0.6 s left of the guess, then half the overrun past it: 2 s over -> 1 s, 3.5 s -> 1.75 s, 5.75 s -> 2.875 s
    assert asyncio.run(fresh()) == pytest.approx([0.6, 1.0, 1.75, 2.875])
    first, second = asyncio.run(measured())  # 0.4 s over the 0.1 s estimate: 0.2 s, and one service time more
    assert first == pytest.approx(0.2) and second == pytest.approx(0.3) and first > MIN_RETRY_S


def test_waiting_requests_are_served_in_the_order_they_were_admitted_across_keep_alive_ticks():
    """A trace waits with a 0.5 s tick (to notice a gone client), a stream with a 5 s one (its keep-alive).
    Each tick used to cancel the lock's acquire and start another at the back of the line, so the trace
    admitted first was served after the streams admitted behind it. Order of service, not time, is checked."""
    import asyncio

    from probes.server import ModelQueue

    async def scenario() -> tuple[list[str], list[int], int]:
        queue = ModelQueue(max_queue=8)
        holder = queue.admit()
        await holder.wait()
        served: list[str] = []
        ticks = {"trace": 0, "stream": 0}

        async def request(name: str, tick_s: float) -> None:
            ticket = queue.admit()
            async for _ in ticket.wait_for(60.0, tick_s=tick_s):
                ticks[name.split("-")[0]] += 1
            served.append(name)
            await asyncio.sleep(0)
            ticket.release()

        tasks = [asyncio.create_task(request("trace-1", 0.005))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(request(f"stream-{i}", 5.0)) for i in range(3)]
        tasks.append(asyncio.create_task(request("trace-2", 0.005)))
        while ticks["trace"] < 20:  # the traces' waits span many ticks before the model is let go
            await asyncio.sleep(0.005)
        waiting = queue.waiting
        holder.release()
        await asyncio.gather(*tasks)
        return served, [queue.waiting, int(queue.busy)], waiting

    served, after, waiting = asyncio.run(scenario())
    assert waiting == 5
    assert served == ["trace-1", "stream-0", "stream-1", "stream-2", "trace-2"]
    assert after == [0, 0]  # every place given back


def test_a_waiter_that_gives_up_frees_its_place_and_never_holds_the_model():
    import asyncio

    from probes.server import ModelQueue
    from thoughtscope.errors import TimeoutExceededError

    async def scenario() -> tuple[int, bool, list[str]]:
        queue = ModelQueue(max_queue=8)
        holder = queue.admit()
        await holder.wait()
        gone = {"now": False}

        async def is_gone() -> bool:
            return gone["now"]

        leaving, late = queue.admit(), queue.admit()
        log: list[str] = []

        async def leave() -> None:
            async for _ in leaving.wait_for(60.0, is_gone, tick_s=0.005):
                gone["now"] = True  # the client disconnects after one tick
            log.append(f"leaving holds {leaving.holding}")

        async def timeout() -> None:
            with pytest.raises(TimeoutExceededError, match="waited 0.02 s for the model"):
                async for _ in late.wait_for(0.02, tick_s=0.005):
                    pass
            log.append(f"late holds {late.holding}")

        await asyncio.gather(leave(), timeout())
        waiting_before_release = queue.waiting
        holder.release()
        return waiting_before_release, queue.busy, log

    waiting, busy, log = asyncio.run(scenario())
    assert waiting == 0 and not busy  # both places freed; the lock went to nobody when the holder let go
    assert sorted(log) == ["late holds False", "leaving holds False"]
