"""A job's Stop ends its work at the next model call (probes.cancel), not at the end of the item in progress.

A page's one-step jobs (a steered comparison, a compressed generation, exhaustive effects) are one long
model call with no progress report inside; before, a Stop waited for the whole call. Model calls are
counted with a pre-hook on the model's forward (tests.counting.ForwardCounter), which presses Stop during a
chosen forward, as a user would while it runs.
"""

from __future__ import annotations

import threading
import time

import pytest

from app.jobs import DONE, STOPPED, JobRegistry, one_step
from probes import cancel
from tests.counting import ForwardCounter

N_NEW = 60  # the tiny model never says EOS in 60 greedy tokens of this prompt (asserted by the full run)


@pytest.fixture()
def forwards(llama):
    counter = ForwardCounter(llama.model)
    yield counter
    counter.remove()


def _generation_job(reg, backend, stop_at=None, forwards=None):
    """A job of one generation of N_NEW tokens (one step, as the pages run theirs)."""
    if stop_at is not None:
        forwards.on(stop_at, lambda: reg.for_key("gen").stop())
    job = reg.start("gen", one_step("generate", lambda: list(backend.generate("2 + 2 =", max_new_tokens=N_NEW))),
                    label="one generation", kind="demo")
    job.thread.join(60)
    assert not job.thread.is_alive()
    return job


def test_a_stop_during_a_generation_ends_it_at_the_next_forward(llama, forwards):
    reg = JobRegistry(costs_path=None)
    full = _generation_job(reg, llama)
    assert full.status == DONE and len(full.result) == N_NEW and forwards.calls == N_NEW  # prefill + 59 steps
    forwards.calls = 0
    stopped = _generation_job(reg, llama, stop_at=3, forwards=forwards)
    assert stopped.status == STOPPED and stopped.stop_reason == "stopped by the user"
    assert forwards.calls == 3  # the 4th forward never ran (the old code ran all 60, then stopped)
    assert not llama.lock.locked()  # the generation let go of the model
    assert len(list(llama.generate("2 + 2 =", max_new_tokens=2))) == 2  # and it works for the next caller
    # outside a job (another thread, no check installed) the same call runs to its end
    forwards.calls = 0
    assert len(list(llama.generate("2 + 2 =", max_new_tokens=5))) == 5 and forwards.calls == 5


def test_a_stop_ends_a_trace_or_capture_before_its_forward(llama, forwards):
    reg = JobRegistry(costs_path=None)

    def work(job):
        llama.trace("2 + 2 = 4")
        job.stop()  # pressed between two calls that report no progress
        llama.capture("2 + 2 = 4", ["resid_post.0"])
        raise AssertionError("the capture ran after the Stop")

    job = reg.start("two", work, label="two calls", kind="demo")
    job.thread.join(60)
    assert job.status == STOPPED and forwards.calls == 1


def test_a_stop_ends_a_remote_stream_and_frees_the_server_model(llama, forwards):
    """Through `thoughtscope serve`: the client checks before each record, closes the stream, and the server
    frees the model at its next token (it may have computed a few records ahead: probes.server.AHEAD)."""
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    reg = JobRegistry(costs_path=None)
    n_new = 200
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url) as remote:
        # past the Stop each token takes 10 ms: the rest of the full run would take 2 s more
        forwards.on(3, lambda: (setattr(forwards, "pace_s", 0.01), reg.for_key("remote").stop()))
        job = reg.start("remote", one_step("generate", lambda: list(remote.generate("2 + 2 =", max_new_tokens=n_new))),
                        label="a remote generation", kind="demo")
        job.thread.join(60)
        assert job.status == STOPPED
        deadline = time.monotonic() + 30
        while llama.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not llama.lock.locked()
        assert forwards.calls < n_new // 2  # the old client read all 200 records before the job saw its Stop
        assert len(list(remote.generate("2 + 2 =", max_new_tokens=3))) == 3


def test_checks_are_per_thread_and_nest():
    calls = []

    def outer():
        calls.append("outer")

    def inner():
        calls.append("inner")
        raise KeyError("stop")

    cancel.check()  # nothing installed: nothing happens
    with cancel.checking(outer):
        seen = []
        t = threading.Thread(target=lambda: seen.append(cancel.check()))
        t.start()
        t.join()
        assert calls == [] and seen == [None]  # another thread runs no check of this one
        with cancel.checking(inner), pytest.raises(KeyError):
            cancel.check()
        assert calls == ["outer", "inner"]
        cancel.check()
    assert calls == ["outer", "inner", "outer"]
    cancel.check()
    assert calls == ["outer", "inner", "outer"]


def test_a_stop_while_the_stream_waits_in_the_servers_queue_ends_it_at_the_next_keep_alive(llama, forwards,
                                                                                            monkeypatch):
    """A job whose remote generation waits behind another client's (the server's queue sends it keep-alives)
    ends at the next keep-alive after its Stop, while the other generation still runs, and never runs a
    forward; before, it waited for the model and its first token."""
    import probes.server as server
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    monkeypatch.setattr(server, "KEEPALIVE_S", 0.05)
    forwards.pace_s = 0.02  # the other client's 150 tokens hold the model for 3 s or more
    reg = JobRegistry(costs_path=None)
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url) as first, RemoteBackend(url) as second:
        other = threading.Thread(target=lambda: list(first.generate("2 + 2 =", max_new_tokens=150)))
        other.start()
        while forwards.calls < 2:  # the other client holds the model
            time.sleep(0.01)
        job = reg.start("queued", one_step("generate", lambda: list(second.generate("1 + 1 =", max_new_tokens=5))),
                        label="a queued remote generation", kind="demo")
        time.sleep(0.3)  # the job's stream is queued behind the other: keep-alives arrive
        assert job.status == "running"
        job.stop()
        job.thread.join(60)
        assert job.status == STOPPED
        assert other.is_alive()  # ended while the model was still busy with the other client's generation
        other.join(60)
        assert forwards.calls == 150  # the stopped job's generation never ran a forward
