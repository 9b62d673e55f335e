"""Stopping a RISE harvest takes effect within one model call (app/jobs.py raises in the progress callback).

The page puts all its problems in one batch, so progress once per batch would let Stop wait for the
whole generation. The harvest reports between any two model calls; a callback that raises there
ends it before the next one. Model calls are counted on a wrapping backend (a pre-hook on the
token embedding: every forward pass, prefix, decoding step or reading pass, embeds its tokens).
"""

from __future__ import annotations

import threading

import pytest

from analyses import rise
from analyses.rise import HarvestSettings
from analyses.tasks import arithmetic_problems

N_PROBLEMS = 12
SETTINGS = HarvestSettings(layers=(0, 1), max_new_tokens=10, batch_size=16, delimiter="sentence")


class Stopped(Exception):
    """Stands in for app.jobs.JobStopped."""


class CountingBackend:
    """The engine, with a count of its model forward passes."""

    def __init__(self, engine):
        self._engine = engine
        self.forwards = 0
        self._hook = engine.model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.forwards += 1

    def remove(self):
        self._hook.remove()

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture()
def backend():
    from probes import Engine

    wrapped = CountingBackend(Engine.from_id("tiny-random:llama"))
    yield wrapped
    wrapped.remove()


def _reference(backend):
    """An uninterrupted harvest: (forwards counted at each progress call, (done, total) of each, total forwards)."""
    at, reports = [], []

    def progress(done, total):
        at.append(backend.forwards)
        reports.append((done, total))

    start = backend.forwards
    result = rise.harvest(backend, arithmetic_problems(N_PROBLEMS, seed=0), SETTINGS, on_progress=progress)
    return [a - start for a in at], reports, backend.forwards - start, result


def test_progress_comes_between_any_two_model_calls(backend):
    at, reports, total, result = _reference(backend)
    n_steps = max(len(t.gen_ids) for t in result.traces)  # decoding steps of the one batch
    assert len(result.traces) == N_PROBLEMS
    # one report per decoding step, one at the end of the generation, after the shared prefix,
    # after the one reading pass, after the batch
    assert at[0] == 1  # the first report follows the first model call
    assert all(b - a <= 1 for a, b in zip(at, at[1:]))
    assert at[-1] == total  # no model call after the last report
    assert all(total == N_PROBLEMS for _, total in reports)
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[-1] == N_PROBLEMS and max(done[:-1]) <= N_PROBLEMS - 1
    # this tiny model never says EOS: every trace runs the full budget, so the sequence is exact:
    # n_steps decoding steps, the end of the generation (no call), the shared one-shot prefix (one
    # call), the one reading pass (one call), the end of the batch (no call)
    assert n_steps == SETTINGS.max_new_tokens and all(len(t.gen_ids) == n_steps for t in result.traces)
    assert at == [*range(1, n_steps + 1), n_steps, n_steps + 1, n_steps + 2, n_steps + 2]
    assert done == [0] * n_steps + [N_PROBLEMS - 1] * 3 + [N_PROBLEMS]


@pytest.mark.parametrize("k", [1, 2, 5, -3, -2])
def test_a_callback_raising_at_its_kth_call_ends_the_harvest_within_one_model_call(backend, k):
    at, _, _, _ = _reference(backend)
    k = k if k > 0 else len(at) + k + 1  # negative: counted from the end (the reading pass)
    calls, start = [], backend.forwards

    def progress(done, total):
        calls.append(backend.forwards - start)
        if len(calls) == k:
            raise Stopped("stopped")

    with pytest.raises(Stopped) as stopped:
        rise.harvest(backend, arithmetic_problems(N_PROBLEMS, seed=0), SETTINGS, on_progress=progress)
    # while the exception (and its traceback, holding the harvest's frames) is alive, the model is free:
    # the trace stream was closed on the way out, not left to be freed with the traceback
    assert stopped.value.__traceback__ is not None and not backend.lock.locked()
    assert len(calls) == k and calls[-1] == at[k - 1]  # the same work as the uninterrupted run had done
    assert backend.forwards - start <= at[k - 1] + 1
    # another thread gets the model
    out = {}

    def generate():
        out["n"] = len(list(backend.generate("2 + 2 =", max_new_tokens=3)))

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and out == {"n": 3}
