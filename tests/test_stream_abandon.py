"""A generation abandoned mid-stream (no close()) must hand the model on, whichever thread frees it.

app/jobs.py stops work by raising `JobStopped` inside a progress callback, i.e. out of the consumer's
`for rec in stream` loop: the stream is then dropped without `close()`. The engine's model lock
must be released then, even when the garbage collector finalises the stream in another thread.
"""

from __future__ import annotations

import gc
import threading

import pytest

from probes import Engine

PROMPT = "Once upon a time"
N_NEW = 8
JOIN_S = 120.0  # generous: the threads do a few tiny-model steps; a deadlock never finishes


class Stopped(Exception):
    """Stands in for app.jobs.JobStopped: raised out of the consumer loop."""


@pytest.fixture()
def engine():
    # a fresh engine per test: a test that fails leaves its lock held, and must not hang the session's
    return Engine.from_id("tiny-random:llama")


def _run_in_thread(target) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def body():
        try:
            out["value"] = target()
        except BaseException as err:  # reported to the test, not swallowed
            out["error"] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


class _Lingering:
    """Runs `target` in a thread that stays alive afterwards (as a server's or the app's threads do).

    A thread that ended may have its identifier reused by the next one, and `threading.RLock`
    knows its owner by that identifier only: the next thread would then pass the lock of a dead
    owner by chance. A live abandoning thread rules that out."""

    def __init__(self, target):
        self.out: dict = {}
        self._returned, self._leave = threading.Event(), threading.Event()

        def body():
            try:
                self.out["value"] = target()
            except BaseException as err:
                self.out["error"] = err
            self._returned.set()
            self._leave.wait(JOIN_S)

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def result(self):
        assert self._returned.wait(JOIN_S), "the abandoning thread did not return"
        assert "error" not in self.out, self.out.get("error")
        return self.out["value"]

    def leave(self):
        self._leave.set()
        self.thread.join(JOIN_S)


def _abandon(engine: Engine, keep_alive: list | None = None) -> list[int]:
    """Consume 3 records, then leave the loop by an exception, as a stopped job does; no close()."""
    stream = engine.generate(PROMPT, max_new_tokens=N_NEW)
    if keep_alive is not None:  # a consumer object in a reference cycle: only the collector frees it
        holder: dict = {"stream": stream}
        holder["self"] = holder
        keep_alive.append(None)  # marks that a cycle was built
    seen = []
    try:
        for rec in stream:
            seen.append(rec.token_id)
            if len(seen) == 3:
                raise Stopped("stop")
    except Stopped:
        pass
    return seen


def _complete(engine: Engine) -> list[int]:
    return [rec.token_id for rec in engine.generate(PROMPT, max_new_tokens=N_NEW)]


def _check_next_generation(engine: Engine, expected: list[int]) -> None:
    thread, out = _run_in_thread(lambda: _complete(engine))
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the next generation waits forever for the engine lock"
    assert "error" not in out, out.get("error")
    assert out["value"] == expected


def test_abandoned_stream_releases_the_lock_in_its_own_thread(engine):
    expected = _complete(engine)
    assert len(expected) == N_NEW
    gc_was = gc.isenabled()
    gc.disable()  # the stream must be freed by reference counting, not wait for a collection
    try:
        worker = _Lingering(lambda: _abandon(engine))
        try:
            assert worker.result() == expected[:3]
            _check_next_generation(engine, expected)
        finally:
            worker.leave()
    finally:
        if gc_was:
            gc.enable()


def test_stream_finalised_by_the_collector_in_another_thread_releases_the_lock(engine):
    """The abandoned stream sits in a reference cycle; the collector runs in this (main) thread."""
    expected = _complete(engine)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        cycles: list = []
        worker = _Lingering(lambda: _abandon(engine, cycles))
        try:
            assert worker.result() == expected[:3] and cycles == [None]
            gc.collect()  # finalises the stream here, not in the thread that held the lock
            _check_next_generation(engine, expected)
        finally:
            worker.leave()
    finally:
        if gc_was:
            gc.enable()


def test_stream_dropped_before_its_first_record_holds_nothing(engine):
    expected = _complete(engine)
    thread, out = _run_in_thread(lambda: engine.generate(PROMPT, max_new_tokens=N_NEW) and None)
    thread.join(JOIN_S)
    assert not thread.is_alive() and "error" not in out
    _check_next_generation(engine, expected)



def test_a_waiting_caller_frees_a_stream_abandoned_in_a_cycle(engine, monkeypatch):
    """Nobody collects: the next generation's own wait runs the collector, which frees the stream."""
    from probes.engine import ModelLock

    monkeypatch.setattr(ModelLock, "COLLECT_EVERY_S", 0.05)
    expected = _complete(engine)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        cycles: list = []
        worker = _Lingering(lambda: _abandon(engine, cycles))
        try:
            assert worker.result() == expected[:3] and cycles == [None]
            assert engine.lock.locked()  # the abandoned stream still holds the model
            _check_next_generation(engine, expected)
            assert not engine.lock.locked()
        finally:
            worker.leave()
    finally:
        if gc_was:
            gc.enable()


def test_lock_stays_reentrant_and_refuses_a_stranger_release(engine):
    lock = engine.lock
    with lock:
        with lock:  # re-entrant in one thread, as threading.RLock
            assert lock.locked()
        thread, out = _run_in_thread(lambda: lock.acquire(timeout=0.01))
        thread.join(JOIN_S)
        assert out == {"value": False}  # another thread cannot take it
        thread, out = _run_in_thread(lock.release)
        thread.join(JOIN_S)
        assert isinstance(out["error"], RuntimeError)  # nor release it without the owner
        assert lock.locked()
    assert not lock.locked()
