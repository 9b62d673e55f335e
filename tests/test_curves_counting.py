"""Work counted on the hot paths the growth curves measure (benchmarks/curves.py): a regression that
recomputes a prefix, copies a capture every step or feeds the whole sequence again shows up here as a
count, not as a time. And the curves' shape check on hand-worked numbers."""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.curves import shape_ratio
from probes.hooks import StepBlocks


@contextlib.contextmanager
def fed_tokens(engine):
    """Columns of input_ids fed to each call of the model's forward (a prefix recomputed shows up here)."""
    widths = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(int(ids.shape[-1]))

    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield widths
    finally:
        handle.remove()


def test_the_shape_check_extrapolates_the_lower_points_by_hand():
    linear = shape_ratio([1, 2, 3, 4], [2, 4, 6, 10], "linear")  # a line through 2, 4, 6 predicts 8
    assert linear["predicted_top"] == pytest.approx(8.0) and linear["ratio"] == 1.25 and linear["holds"]
    quad = shape_ratio([1, 2, 3, 4, 5], [1, 4, 9, 16, 50], "quadratic")  # n^2 predicts 25: twice over
    assert quad["predicted_top"] == pytest.approx(25.0) and quad["ratio"] == 2.0 and not quad["holds"]
    flat = shape_ratio([1, 2, 4, 8], [10, 10, 10, 5], "flat", higher_is_worse=False)  # throughput halved
    assert flat["ratio"] == 2.0 and not flat["holds"]


def test_a_stream_feeds_one_token_per_step_and_keeps_one_position_per_record(llama):
    prompt = list(range(5, 45))
    with fed_tokens(llama) as widths:
        records = list(llama.generate(prompt, max_new_tokens=12, capture=["resid_post.0", "resid_post.1"]))
    n = len(records)
    assert widths == [40] + [1] * (n - 1)  # the prompt once, then one token per step
    d = llama.arch().d_model
    held = storages_held(records)
    for rec in records:  # each record holds its own position, never a copy of the sequence so far
        for v in rec.activations.values():
            assert v.shape == (d,) and v.dtype == torch.float32
    # the 12 positions of each site share the site's first block of StepBlocks.FIRST slots
    assert {name: list(sizes.values()) for name, sizes in held.items()} == {
        name: [StepBlocks.FIRST * d * 4] for name in ("resid_post.0", "resid_post.1")}


def storages_held(records):
    """{site: {storage address: bytes}} of the activation tensors a stream's records hold."""
    held = {}
    for rec in records:
        for name, v in rec.activations.items():
            storage = v.untyped_storage()
            held.setdefault(name, {})[storage.data_ptr()] = storage.nbytes()
    return held


def test_a_long_stream_keeps_its_captures_in_a_few_growing_blocks_not_one_tensor_per_step(llama):
    """A stream's captured steps go into blocks that double (16, 32, 64, ... slots): 100 positions take 3
    blocks per site, not 100 small tensors (which fragmented glibc's heap: a long stream's peak memory grew
    faster than its data, docs/curves.md), and the bytes held stay within twice the data. The values are the
    ones a capture of the whole sequence reads at each position."""
    prompt = list(range(5, 25))
    sites = ["resid_post.0", "resid_post.1"]
    records = list(llama.generate(prompt, max_new_tokens=100, capture=sites, stop=[]))
    n, d = len(records), llama.arch().d_model
    held = storages_held(records)
    blocks = 0
    while StepBlocks.FIRST * (2 ** blocks - 1) < n:  # 16 + 32 + 64 = 112 slots hold 100 positions
        blocks += 1
    for name in sites:
        assert len(held[name]) == blocks
        assert n * d * 4 <= sum(held[name].values()) <= 2 * n * d * 4 + StepBlocks.FIRST * d * 4
        # what the memory budget counts for a stream (the last block's unused slots too) is what was allocated
        assert sum(held[name].values()) == StepBlocks.slots_for(n, d * 4) * d * 4 == 112 * d * 4
    # each record's value is its own position's (fed token = the record's input position)
    tokens = prompt + [r.token_id for r in records]
    full = llama.capture(tokens[:-1], sites)
    for name in sites:
        streamed = torch.stack([r.activations[name] for r in records])
        torch.testing.assert_close(streamed, full[name][len(prompt) - 1:], rtol=1e-4, atol=1e-5)


def test_a_site_whose_shape_grows_each_step_is_copied_on_its_own():
    """Attention patterns gain a key each step: such a site leaves the blocks after its first step."""
    blocks = StepBlocks()
    first = blocks.keep(torch.ones(1, 1, 2, 3))
    second = blocks.keep(torch.full((1, 1, 2, 4), 2.0))
    third = blocks.keep(torch.full((1, 1, 2, 5), 3.0))
    assert blocks.varying and first.shape == (1, 1, 2, 3) and second.shape == (1, 1, 2, 4)
    assert second.untyped_storage().nbytes() == 8 * 4 and third.untyped_storage().nbytes() == 10 * 4
    assert float(first.sum()) == 6.0 and float(second.sum()) == 16.0 and float(third.sum()) == 30.0
    # a block of the same shape fills slot after slot, each written once
    same = StepBlocks()
    kept = [same.keep(torch.full((2, 1, 3), float(i))) for i in range(20)]
    assert [float(k.mean()) for k in kept] == [float(i) for i in range(20)]
    assert len({k.untyped_storage().data_ptr() for k in kept}) == 2  # 16 slots, then a block of 32


def test_a_fork_computes_the_suffix_and_its_new_tokens_never_the_prefix(llama):
    prefix = list(range(5, 305))
    state = llama.prefill(prefix)
    with fed_tokens(llama) as widths:
        records = llama.fork(state, list(range(400, 416)), max_new_tokens=4)
        llama.fork(state, list(range(400, 416)), max_new_tokens=1, at=150)  # from inside the prefix: no recompute
    assert widths == [16] + [1] * (len(records) - 1) + [16]


def test_a_live_prefix_extends_by_the_new_tokens_only(llama):
    from analyses.cot_entropy.probing import LivePrefix

    live = LivePrefix(llama, list(range(5, 37)))
    with fed_tokens(llama) as widths:
        for end in (10, 25, 60):
            live.at(list(range(100, 100 + end)))
    live.close()
    assert widths == [32 + 10, 15, 35]


def test_probes_over_a_trace_run_one_prefill_and_one_fork_per_position(llama):
    from analyses.cot_entropy.probing import probe_positions
    from analyses.families import family_for

    family = family_for("tiny-random:llama")
    suffix = len(llama.encode(family.answer_suffix, add_special_tokens=False))
    prompt, trace = list(range(5, 37)), list(range(100, 228))  # 32 + 128 tokens
    with fed_tokens(llama) as widths:
        probes = probe_positions(llama, prompt, trace, range(32, 129, 32), family)
    assert len(probes) == 4
    assert widths[0] == 32 + 128  # the longest prefix, once
    # each fork feeds the suffix alone (never the prefix), then one token per decoded answer token
    assert suffix > 1 and widths[1:].count(suffix) == 4 and set(widths[1:]) <= {1, suffix}


def test_a_saved_curve_redraws_from_its_json_with_its_numbers():
    import json
    from pathlib import Path

    from app.export import build_figure

    saved = json.loads((Path(__file__).resolve().parents[1] / "docs" / "curves" / "fork_prefix.json").read_text())
    fig = build_figure("growth_curve", saved)
    fork = next(t for t in fig.data if t.name == "fork s")
    assert list(fork.x) == saved["x"] and list(fork.y) == saved["series"]["fork_s"]
    assert saved["provenance"]["settings"]["curve"] == "fork_prefix"
    shape = next(t for t in fig.data if t.name.endswith("shape from the lower points"))
    assert shape.y[-1] == saved["fit"]["predicted_top"]
    # log axes labelled at the measured sizes and at 1-2-5 steps of the seconds drawn (no unlabelled minor digits)
    assert list(fig.layout.xaxis.tickvals) == saved["x"] and list(fig.layout.xaxis.ticktext) == \
        [f"{x:,}" for x in saved["x"]]
    drawn = [y for t in fig.data if t.yaxis in (None, "y") for y in t.y]
    ticks = list(fig.layout.yaxis.tickvals)
    assert ticks and all(min(drawn) <= t <= max(drawn) for t in ticks)
    assert all(f"{t:e}"[0] in "125" and f"{t:e}"[1:5] == ".000" for t in ticks) and list(fig.layout.yaxis.ticktext) == [f"{t:g}" for t in ticks]


def test_log_ticks_are_the_1_2_5_steps_inside_the_values():
    from app.figures.curves import log_ticks

    assert log_ticks([0.15, 3.8]) == [0.2, 0.5, 1.0, 2.0]
    assert log_ticks([7.0, 780.0]) == [10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
    assert log_ticks([3.0, 4.0]) == [2.0, 5.0]  # no step inside: the nearest ones around
    assert log_ticks([0.0, float("nan")]) == []
