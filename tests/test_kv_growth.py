"""probes.kv_growth: the engine's KV cache grows in place, a few buffers per layer instead of one per step,
with the tokens plain transformers generation gives, and a state that forks share is never written by them."""

from __future__ import annotations

import copy

import pytest
import torch

from probes.engine import Engine
from probes.kv_growth import GrowingLayer, capacity_after, next_capacity

PROMPT = list(range(5, 15))


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_id("tiny-random:llama")
    e._eos = set()  # every stream runs to max_new_tokens, as HF generate's min_new_tokens does
    return e


def test_the_growth_schedule():
    assert next_capacity(0, 10, None) == 64  # a first buffer: what it holds, rounded up to 64 positions
    assert next_capacity(10, 1, 64) == 64  # room left: no new buffer
    assert next_capacity(64, 1, 64) == 128  # full: half again (96), rounded up
    assert next_capacity(64, 1, None) == 128  # a foreign tensor (a fork's view): exactly what is needed, rounded
    assert next_capacity(128, 1, 128) == 192
    assert [capacity_after(10, n) for n in (10, 64, 65, 129, 193)] == [64, 64, 128, 192, 320]


def test_a_stream_allocates_two_buffers_per_layer_for_109_positions_and_matches_hf_generate(engine):
    stream = engine.generate(PROMPT, max_new_tokens=100, top_k=0)
    ours = [r.token_id for r in stream]
    x = torch.tensor([PROMPT])
    hf = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=100, min_new_tokens=100,
                               do_sample=False, pad_token_id=engine.tok.pad_token_id)[0, len(PROMPT):].tolist()
    assert ours == hf  # transformers' own generate, with its own (concatenating) cache
    layers = stream.cache.layers
    assert layers and all(isinstance(layer, GrowingLayer) for layer in layers)
    # the prompt and 99 fed tokens (the last one is chosen, not fed): 64 then 128 positions, where
    # concatenation made a new tensor at each of the 100 forwards
    assert {layer.keys.shape[-2] for layer in layers} == {109}
    assert {layer.allocations for layer in layers} == {2}
    assert {layer._buffers[0].shape[-2] for layer in layers} == {capacity_after(len(PROMPT), 109)} == {128}


def test_forks_of_one_state_do_not_write_into_each_other_or_the_state(engine):
    state = engine.prefill(PROMPT)
    before = [layer.keys.clone() for layer in state.cache.layers]
    first = engine.fork(state, [20, 21], max_new_tokens=8)
    engine.fork(state, [30, 31, 32], max_new_tokens=8)  # writes the same positions, in its own buffers
    again = engine.fork(state, [20, 21], max_new_tokens=8)
    assert [r.token_id for r in again] == [r.token_id for r in first]
    assert [r.logprob for r in again] == [r.logprob for r in first]
    assert all(torch.equal(layer.keys, b) for layer, b in zip(state.cache.layers, before))


def test_a_fork_from_a_live_stream_leaves_the_stream_as_it_would_have_been(engine):
    whole = [r.token_id for r in engine.generate(PROMPT, max_new_tokens=40, top_k=0)]
    stream = engine.generate(PROMPT, max_new_tokens=40, top_k=0)
    head = [next(stream).token_id for _ in range(20)]
    forked = engine.fork(stream.state(), [7, 8], max_new_tokens=8)
    rest = [r.token_id for r in stream]
    assert head + rest == whole
    fresh = engine.fork(engine.prefill(PROMPT + head), [7, 8], max_new_tokens=8)
    assert [r.token_id for r in forked] == [r.token_id for r in fresh]
    assert [r.logprob for r in forked] == pytest.approx([r.logprob for r in fresh], abs=1e-4)


def test_a_copied_layer_starts_its_own_buffer():
    layer = GrowingLayer()
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    layer.update(k, k + 100)
    twin = copy.copy(layer)  # what a fork's view of a state does
    twin.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert torch.equal(twin.keys[..., 3, :], torch.zeros(1, 2, 4))
    assert torch.equal(layer.keys[..., 3, :], torch.ones(1, 2, 4))
    assert torch.equal(twin.keys[..., :3, :], k) and torch.equal(layer.keys[..., :3, :], k)
    assert layer.allocations == 1 and twin.allocations == 2


def test_a_copy_made_after_its_original_was_freed_does_not_write_into_the_originals_buffer():
    """CPython hands a freed object's address to the next object of its size, so a copy made after the layer
    that made a buffer was freed had that layer's id(); while ownership was checked by id() such a copy wrote
    in place over positions another copy of the freed layer still showed (every one of 200 trials). The
    engine's own paths kept the maker alive (a state from a live stream holds the stream's cache itself), so
    this is the layer's contract, checked where it lives."""
    for _ in range(20):
        layer = GrowingLayer()
        layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
        early = copy.copy(layer)  # a state at 10 positions
        layer.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
        late = copy.copy(layer)  # a state at 15: positions 10..14 live in the same buffer
        shown = late.keys.clone()
        del layer  # the stream that made the buffer ends
        fork = copy.copy(early)
        fork.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
        assert torch.equal(late.keys, shown)
        assert torch.equal(fork.keys[..., 10, :], torch.ones(1, 2, 4))
        assert fork.allocations == 2  # its own buffer (the copied count was 1)
