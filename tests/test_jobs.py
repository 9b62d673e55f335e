"""Long work as a job (app/jobs.py): progress, Stop between batches, ids that cannot be forged, reaping."""

from __future__ import annotations

import threading

import pytest

from app.jobs import DONE, FAILED, RUNNING, STOPPED, JobRegistry
from thoughtscope.errors import BadInputError


def batches(n: int, gate: threading.Event | None = None, ran: list[int] | None = None):
    """Work of `n` batches; each waits for `gate` (so the test decides when a batch ends)."""

    def work(job):
        for i in range(n):
            if gate is not None:
                assert gate.wait(30), "the test never released the batch"
                gate.clear()
            if ran is not None:
                ran.append(i)
            job.progress("batches", i + 1, n)
        return sum(range(n))

    return work


def test_a_job_runs_to_its_result_and_keeps_it_by_key(tmp_path):
    reg = JobRegistry(costs_path=tmp_path / "costs.json")
    job = reg.start("k", batches(4), label="four batches", kind="demo")
    job.thread.join(30)
    assert (job.status, job.result, job.done, job.total, job.stage) == (DONE, 6, 4, 4, "batches")
    assert reg.finished("k") == 6
    assert reg.finished("other") is None
    # the cost per unit is learnt, so the next job of the kind has an estimate before its first report
    nxt = reg.start("k2", batches(2, gate=threading.Event()), label="two", kind="demo")
    nxt.total = 2
    assert nxt.prior_s_per_unit is not None and nxt.eta_s() == pytest.approx(2 * nxt.prior_s_per_unit)
    nxt.stop()


def test_stop_ends_the_work_at_the_next_batch_boundary(tmp_path):
    gate, ran = threading.Event(), []
    reg = JobRegistry(costs_path=None)
    job = reg.start("k", batches(100, gate, ran), label="long", kind="demo")
    gate.set()  # let one batch through
    while job.done < 1:
        job.thread.join(0.01)
    job.stop()
    gate.set()  # the batch under way finishes; its progress report raises JobStopped
    job.thread.join(30)
    assert not job.thread.is_alive()
    assert job.status == STOPPED and job.stop_reason == "stopped by the user"
    assert ran == [0, 1]  # no batch started after the Stop


def test_one_running_job_per_key(tmp_path):
    gate = threading.Event()
    reg = JobRegistry(costs_path=None)
    first = reg.start("k", batches(3, gate), label="a", kind="demo")
    assert reg.start("k", batches(3, gate), label="b", kind="demo") is first
    first.stop()
    gate.set()
    first.thread.join(30)
    assert first.status == STOPPED


def test_job_ids_are_signed_and_belong_to_a_page(tmp_path):
    reg = JobRegistry(costs_path=None)
    job = reg.start("k", batches(1), label="x", kind="demo", page="rise")
    job.thread.join(30)
    assert reg.get(job.id, page="rise") is job
    raw, _, sig = job.id.partition(".")
    with pytest.raises(BadInputError, match="not one this app made"):
        reg.get(f"{raw}.{'0' * len(sig)}")
    with pytest.raises(BadInputError, match="not one this app made"):
        JobRegistry(costs_path=None).get(job.id)  # another app process: another secret
    with pytest.raises(BadInputError, match="belongs to the rise page"):
        reg.get(job.id, page="cot_entropy")


def test_a_registry_nobody_holds_ends_its_reaper_thread():
    import gc

    reg = JobRegistry(costs_path=None)
    reaper = reg._reaper
    assert reaper.is_alive()
    del reg
    gc.collect()
    reaper.join(timeout=30)  # it wakes once a second; 30 s only keeps a broken build from hanging
    assert not reaper.is_alive()


def test_unwatched_jobs_are_stopped_unless_kept(tmp_path, caplog):
    gate = threading.Event()
    reg = JobRegistry(grace_s=5.0, costs_path=None)
    watched = reg.start("a", batches(3, gate), label="Calibrating", kind="demo")
    kept = reg.start("b", batches(3, gate), label="b", kind="demo", keep_running=True)
    now = watched.last_seen + 6.0
    with caplog.at_level("WARNING", logger="app.jobs"):
        assert reg.reap(now=now) == [watched]
    assert watched.stopping and "no open page watched it" in watched.stop_reason
    # the terminal says so too (the browser test waits for this line instead of sleeping past the grace)
    assert [r.getMessage() for r in caplog.records] == [
        f"thoughtscope: job {watched.id.partition('.')[0]} (Calibrating) stopped: no open page watched it for 5 s"]
    assert not kept.stopping and kept.status == RUNNING
    kept.stop()
    for _ in range(6):
        gate.set()
        watched.thread.join(0.2)
        kept.thread.join(0.2)
    assert {watched.status, kept.status} == {STOPPED}


def test_a_user_error_in_the_work_is_kept_as_its_message():
    reg = JobRegistry(costs_path=None)

    def bad(job):
        raise BadInputError("give more calibration problems")

    job = reg.start("k", bad, label="x", kind="demo")
    job.thread.join(30)
    assert job.status == FAILED and job.error == "give more calibration problems"
    assert reg.finished("k") is None


def test_after_a_stop_the_page_says_whether_starting_again_goes_on(tmp_path):
    """Work that keeps what it has done (a RISE harvest's store, RLKV's checkpoints) says so after a Stop;
    the message once told everyone to "go on from scratch", a stopped 5-step RLKV training too."""
    from app.jobs import stopped_message

    gates = {"k": threading.Event(), "p": threading.Event()}
    reg = JobRegistry(costs_path=None)
    kept = reg.start("k", batches(10, gates["k"]), label="Training", kind="demo", resumes="checkpointed after every step")
    plain = reg.start("p", batches(10, gates["p"]), label="Generating", kind="demo2")
    for job in (kept, plain):
        job.stop()
        gates[job.key].set()  # the batch under way ends; its progress report raises JobStopped
        job.thread.join(30)
    assert kept.status == plain.status == STOPPED
    said = stopped_message(kept)
    assert said.startswith("Training: stopped by the user after ") and "(1/10 batches)" in said
    assert said.endswith("Start it again to go on where it stopped: checkpointed after every step.")
    assert stopped_message(plain).endswith("(1/10 batches). Start it again to go on from scratch.")


def test_a_job_starts_after_pandas_is_imported_whole(tmp_path):
    """A job may import pandas (RISE: sae_lens -> transformer_lens -> datasets), which plotly in the page's thread
    reads half-imported (thoughtscope.imports.PEEKED): `start` imports it in the caller first. In a fresh
    interpreter, right after starting a job that imports nothing, pandas is loaded and not initialising."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; from app.jobs import JobRegistry; before = 'pandas' in sys.modules; "
              "job = JobRegistry(grace_s=60).start('k', lambda job: 1, label='nothing'); job.thread.join(); "
              "m = sys.modules.get('pandas'); print(before, m is not None and not m.__spec__._initializing)")
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "THOUGHTSCOPE_CACHE_DIR": str(tmp_path)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "True"]


def _stoppable_page() -> None:
    """A page with one job that runs until stopped, checking for Stop as often as a model forward would."""
    import time

    import streamlit as st

    from app.jobs import one_step, run_job
    from probes import cancel

    def work() -> None:
        while True:  # a long model call: the engine checks before each forward
            cancel.check()
            time.sleep(0.01)

    run_job("demo-endless", one_step("generate", work), label="An endless generation", kind="demo-endless",
            page="demo", start=st.button("Start", key="start"), keep_running_option=False)


def test_a_stop_press_shows_the_stopped_message_in_the_same_rerun():
    """The job ends within one forward of a Stop, so the press itself draws the page's message; before, the page
    went on polling and said so at the next poll (0.5 s later) plus a whole rerun of the page."""
    from streamlit.testing.v1 import AppTest

    from app import jobs

    jobs.registry.clear()
    at = AppTest.from_function(_stoppable_page, default_timeout=30).run()
    at.button(key="start").click().run()
    (job,) = jobs.registry().running()
    assert not any("stopped" in str(i.value) for i in at.info)
    at.button(key=f"stop-{job.id}").click().run()
    assert job.status == STOPPED
    assert [str(i.value).split(" after ")[0] for i in at.info] == ["An endless generation: stopped by the user"]
    jobs.registry.clear()
