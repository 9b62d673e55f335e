"""KV-cache policies: the cache really holds what a policy keeps, and generation equals full-cache
attention with the matching per-head masks (computed here with the stock eager attention)."""

from __future__ import annotations

import warnings

import pytest
import torch

from probes import Engine
from probes.kv_policy import CompressedCache, HeadBudget, KeepAll, KnormPolicy, SinkRecent, SnapKVPolicy
from probes.wire import intervention_from_spec, intervention_to_spec, record_from_json, record_to_json
from thoughtscope.errors import BadInputError

PROMPT = "one two three four five six seven eight nine ten eleven twelve"
ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def engines(llama):
    out = {"llama": llama}
    for arch in ARCHS[1:]:
        out[arch] = Engine.from_id(f"tiny-random:{arch}")
    return out


def per_entry_bytes(engine: Engine) -> int:
    arch = engine.handle.arch
    return 2 * arch.head_dim * engine.model.dtype.itemsize  # a key and a value


def reference_logprobs(engine: Engine, ids: list[int], local: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Full-cache, full-sequence eager forward where the query heads of each local KV head see only
    keys p <= q with p < sink or p > q - recent: log-softmax rows [len(ids), vocab]."""
    arch = engine.handle.arch
    n, rep = len(ids), arch.n_heads // arch.n_kv_heads
    q = torch.arange(n).view(-1, 1)
    p = torch.arange(n).view(1, -1)
    causal = p <= q
    window = causal & ((p < sink) | (p > q - recent))
    low = torch.finfo(torch.float32).min
    logps = []
    model = engine.model
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    hooks = []
    try:
        for layer_idx, layer in enumerate(model.model.layers):
            heads_local = local[layer_idx].repeat_interleave(rep)  # [n_heads]
            allowed = torch.where(heads_local.view(-1, 1, 1), window, causal)  # [n_heads, n, n]
            mask = torch.zeros(1, arch.n_heads, n, n).masked_fill(~allowed, low)

            def pre(module, args, kwargs, mask=mask):
                kwargs["attention_mask"] = mask
                return args, kwargs

            hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        with torch.no_grad():
            logps = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(saved)
    return logps


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_all_equals_the_plain_cache(engines, arch):
    engine = engines[arch]
    prompts = [PROMPT, "hello there", "a b c d e"]
    kw = dict(prompts=prompts, max_new_tokens=6, seed=3, sampling=None)
    plain = list(engine.generate(**kw))
    kept = list(engine.generate(**kw, interventions=[KeepAll()]))
    assert [(r.batch_index, r.token_id, r.top_ids) for r in kept] == [(r.batch_index, r.token_id, r.top_ids) for r in plain]
    torch.testing.assert_close(torch.tensor([r.logprob for r in kept]), torch.tensor([r.logprob for r in plain]),
                               atol=1e-5, rtol=0)
    assert [r.kv_bytes for r in kept] == [r.kv_bytes for r in plain]
    # the plain cache counts each sequence's own tokens, not the batch's left padding
    lengths = [len(engine.encode(p)) for p in prompts]
    arch_ = engine.handle.arch
    first = [r for r in plain if r.step == 0]
    assert [r.kv_bytes for r in first] == [n * arch_.n_layers * arch_.n_kv_heads * per_entry_bytes(engine)
                                           for n in lengths]


def test_sink_recent_holds_exactly_those_entries(llama):
    sink, recent = 2, 4
    ids = llama.encode(PROMPT)
    stream = llama.generate(ids, max_new_tokens=8, interventions=[SinkRecent(sink=sink, recent=recent)])
    recs = list(stream)
    cache = stream.cache
    assert isinstance(cache, CompressedCache)
    fed = len(ids) + len(recs) - 1  # the last record's token was never fed
    expected = list(range(sink)) + list(range(fed - recent, fed))
    for layer in cache.layers:
        for head in range(llama.handle.arch.n_kv_heads):
            assert layer.head_positions(0, head) == expected
        assert layer.groups[0].keys.shape == (1, 2, sink + recent, 16)  # the tensors really are that small
    arch = llama.handle.arch
    for t, r in enumerate(recs):
        entries = min(len(ids) + t, sink + recent)
        assert r.kv_bytes == arch.n_layers * arch.n_kv_heads * entries * per_entry_bytes(llama)
    assert recs[0].interventions == ["KV policy SinkRecent(sink=2, recent=4)"]


@pytest.mark.parametrize("arch", ARCHS)
def test_head_budget_equals_per_head_masks_on_the_full_cache(engines, arch):
    """RLKV's compressed inference: each record's distribution equals a full-cache eager forward with
    the per-head sink + recent masks, and the full heads hold every position."""
    engine = engines[arch]
    info = engine.handle.arch
    full = torch.zeros(info.n_layers, info.n_kv_heads, dtype=torch.bool)
    full[0, 1] = full[1, 0] = True
    sink, recent = 2, 3
    ids = engine.encode(PROMPT)
    stream = engine.generate(ids, max_new_tokens=8, top_k=3,
                             interventions=[HeadBudget(full_heads=full, sink=sink, recent=recent)])
    recs = list(stream)
    generated = [r.token_id for r in recs]
    ref = reference_logprobs(engine, ids + generated[:-1], ~full, sink, recent)
    for t, r in enumerate(recs):
        row = ref[len(ids) - 1 + t]
        assert r.token_id == int(row.argmax())  # greedy under the masked reference too
        assert r.logprob == pytest.approx(float(row[r.token_id]), abs=1e-4)
        assert r.top_ids == row.topk(3).indices.tolist()
    fed = len(ids) + len(recs) - 1
    for layer_idx, layer in enumerate(stream.cache.layers):
        for head in range(info.n_kv_heads):
            held = layer.head_positions(0, head)
            if full[layer_idx, head]:
                assert held == list(range(fed))
            else:
                assert held == list(range(sink)) + list(range(fed - recent, fed))
    n_full = int(full.sum())
    n_local = full.numel() - n_full
    for t, r in enumerate(recs):
        entries = n_full * (len(ids) + t) + n_local * min(len(ids) + t, sink + recent)
        assert r.kv_bytes == entries * per_entry_bytes(engine)


def test_a_batch_of_different_lengths_equals_each_prompt_alone(llama):
    policy = SinkRecent(sink=1, recent=3)
    prompts = [PROMPT, "hello there"]
    together = list(llama.generate(prompts=prompts, max_new_tokens=5, interventions=[policy]))
    for b, prompt in enumerate(prompts):
        alone = list(llama.generate(prompt, max_new_tokens=5, interventions=[policy]))
        mine = [r for r in together if r.batch_index == b]
        assert [r.token_id for r in mine] == [r.token_id for r in alone]
        assert [r.kv_bytes for r in mine] == [r.kv_bytes for r in alone]
        torch.testing.assert_close(torch.tensor([r.logprob for r in mine]), torch.tensor([r.logprob for r in alone]),
                                   atol=1e-5, rtol=0)


def test_head_budget_in_a_padded_sampled_batch_equals_each_prompt_alone(llama):
    """The window layout's rings are per sequence: left padding moves each sequence's slots, not its window."""
    full = torch.tensor([[True, False], [False, False]])
    policy = HeadBudget(full_heads=full, sink=2, recent=3)
    prompts = [PROMPT, "hello there", "a b c d e"]
    together = list(llama.generate(prompts=prompts, max_new_tokens=7, interventions=[policy]))
    for b, prompt in enumerate(prompts):
        alone = list(llama.generate(prompt, max_new_tokens=7, interventions=[policy]))
        mine = [r for r in together if r.batch_index == b]
        assert [r.token_id for r in mine] == [r.token_id for r in alone]
        assert [r.kv_bytes for r in mine] == [r.kv_bytes for r in alone]
        torch.testing.assert_close(torch.tensor([r.logprob for r in mine]), torch.tensor([r.logprob for r in alone]),
                                   atol=1e-5, rtol=0)


def test_a_prompt_shorter_than_the_sink_fills_the_window_while_generating(llama):
    """Two prompt tokens, sink 4 + recent 2: the sink fills up with generated tokens first, then the ring turns."""
    sink, recent = 4, 2
    ids = llama.encode("hello there")
    local = torch.ones(2, 2, dtype=torch.bool)
    stream = llama.generate(ids, max_new_tokens=10, interventions=[SinkRecent(sink=sink, recent=recent)])
    recs = list(stream)
    ref = reference_logprobs(llama, ids + [r.token_id for r in recs[:-1]], local, sink, recent)
    for t, r in enumerate(recs):
        row = ref[len(ids) - 1 + t]
        assert r.token_id == int(row.argmax())
        assert r.logprob == pytest.approx(float(row[r.token_id]), abs=1e-4)
    fed = len(ids) + len(recs) - 1
    assert stream.cache.layers[0].head_positions(0, 0) == [0, 1, 2, 3, fed - 2, fed - 1]


def test_keep_all_and_head_budget_run_without_a_per_head_python_loop(llama):
    """The fast layout: a decode step of a layer whose heads are all full feeds the query to one attention
    call as it comes (no head indexing); positions are computed once per forward, not once per layer."""
    from probes.kv_policy import WindowLayer

    stream = llama.generate(PROMPT, max_new_tokens=3, interventions=[KeepAll()])
    list(stream)
    assert all(isinstance(layer, WindowLayer) and layer.n_local == 0 for layer in stream.cache.layers)
    assert stream.cache.window.plan.seen == stream.cache.layers[1].seen  # one shared plan per forward


def test_knorm_keeps_the_smallest_key_norms(llama):
    """A token-dropping press is one subclass: after the prompt each head holds its `budget` keys with
    the smallest norms (RoPE keeps norms, so the `k.L` site's norms decide)."""
    budget = 5
    ids = llama.encode(PROMPT)
    stream = llama.generate(ids, max_new_tokens=1, capture=[], interventions=[KnormPolicy(budget=budget)])
    list(stream)
    keys = llama.capture(ids, ["k.0", "k.1"])
    for layer_idx, layer in enumerate(stream.cache.layers):
        norms = keys[f"k.{layer_idx}"].norm(dim=-1)  # [seq, kv_heads]
        for head in range(2):
            expected = sorted(norms[:, head].topk(budget, largest=False).indices.tolist())
            assert sorted(layer.head_positions(0, head)) == expected


def test_snapkv_holds_its_budget_and_its_window(llama):
    ids = llama.encode(PROMPT)
    stream = llama.generate(ids, max_new_tokens=4, interventions=[SnapKVPolicy(budget=6, window=2, kernel=3)])
    recs = list(stream)
    fed = len(ids) + len(recs) - 1
    for layer in stream.cache.layers:
        for head in range(2):
            held = layer.head_positions(0, head)
            assert len(held) == 6 and fed - 1 in held  # the newest token is in the observation window
    assert all(r.kv_bytes == 2 * 2 * 6 * per_entry_bytes(llama) for r in recs[1:])


def test_attention_pattern_under_a_policy_shows_what_each_head_reads(llama):
    ids = llama.encode(PROMPT)
    recs = list(llama.generate(ids, max_new_tokens=3, capture=["attn_pattern.1"],
                               interventions=[SinkRecent(sink=2, recent=3)]))
    for t, r in enumerate(recs):
        pattern = r.activations["attn_pattern.1"]  # [heads, kv_len]
        q = len(ids) - 1 + t
        seen = [p for p in range(q + 1) if p < 2 or p > q - 3]
        assert pattern.shape == (4, q + 1)
        assert pattern[:, seen].min() > 0
        assert pattern[:, [p for p in range(q + 1) if p not in seen]].abs().max() == 0
        torch.testing.assert_close(pattern.sum(-1), torch.ones(4), atol=1e-5, rtol=0)


def test_a_trace_inside_a_compressed_generation_is_plain(llama):
    ids = llama.encode(PROMPT)
    plain = llama.trace(ids)
    stream = llama.generate(ids, max_new_tokens=3, interventions=[SinkRecent(sink=1, recent=2)])
    next(stream)
    inside = llama.trace(ids)  # the engine lock is re-entrant; the model's attention is switched meanwhile
    list(stream)
    torch.testing.assert_close(inside.logprobs[1:], plain.logprobs[1:], atol=1e-5, rtol=0)
    assert llama.model.config._attn_implementation == "sdpa"


def test_policies_and_kv_bytes_travel_over_the_wire(llama):
    full = torch.zeros(2, 2, dtype=torch.bool)
    full[1, 1] = True
    back = intervention_from_spec(intervention_to_spec(HeadBudget(full_heads=full, sink=3, recent=5)))
    back.validate(llama.handle.arch)
    assert torch.equal(back.full_heads, full) and (back.sink, back.recent) == (3, 5)
    assert intervention_from_spec(intervention_to_spec(KnormPolicy(budget=7))).budget == 7
    rec = next(iter(llama.generate(PROMPT, max_new_tokens=1, interventions=[back])))
    assert rec.to_dict()["kv_bytes"] == rec.kv_bytes > 0
    assert record_from_json(record_to_json(rec)).kv_bytes == rec.kv_bytes


def test_a_window_longer_than_the_generation_warns(llama):
    with pytest.warns(UserWarning, match="nothing will be dropped"):
        list(llama.generate("a b", max_new_tokens=2, interventions=[SinkRecent(sink=4, recent=60)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(llama.generate(PROMPT, max_new_tokens=2, interventions=[SinkRecent(sink=1, recent=2)]))


# ----- bad input: a project error before any model work -----


@pytest.fixture()
def forwards(llama):
    calls = []
    handle = llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("policy, match", [
    (HeadBudget(full_heads=torch.zeros(2, 4, dtype=torch.bool)), r"shape \(2, 4\).*\(2, 2\)"),
    (HeadBudget(full_heads=torch.zeros(3, 2, dtype=torch.bool)), "needs"),
    (HeadBudget(full_heads=torch.full((2, 2), 0.5)), "booleans"),
    (SinkRecent(sink=200, recent=400), "reaches this model's context"),
    (SinkRecent(sink=-1, recent=4), r"SinkRecent.sink must be an integer >= 0"),
    (SinkRecent(sink=2, recent=0), "recent must be an integer >= 1"),
    (KnormPolicy(budget=0), r"KnormPolicy.budget must be an integer >= 1"),
    (SnapKVPolicy(budget=8, kernel=4), "odd"),
])
def test_bad_policies_are_refused_before_the_model_runs(llama, forwards, policy, match):
    with pytest.raises(BadInputError, match=match):
        llama.generate(PROMPT, max_new_tokens=2, interventions=[policy])
    assert forwards == []


def test_two_policies_or_a_sliding_window_model_are_refused(llama):
    with pytest.raises(BadInputError, match="at most one KV policy"):
        llama.generate(PROMPT, interventions=[KeepAll(), SinkRecent()])
    gemma = Engine.from_id("tiny-random:gemma3")
    with pytest.raises(BadInputError, match="KV policies support"):
        gemma.generate(PROMPT, interventions=[SinkRecent(sink=1, recent=4)])


def test_a_compressed_cache_cannot_be_reused(llama):
    stream = llama.generate(PROMPT, max_new_tokens=2, interventions=[SinkRecent(sink=1, recent=2)])
    list(stream)
    with pytest.raises(BadInputError, match="cannot be forked or reused"):
        llama._forward(torch.tensor([[5]]), torch.ones(1, 20, dtype=torch.long), torch.tensor([[19]]), stream.cache)


@pytest.mark.model
def test_head_budget_on_smollm2_equals_per_head_masks(smollm2):
    """The embedded model (Llama, 9 query heads on 3 KV heads, 30 layers)."""
    info = smollm2.handle.arch
    gen = torch.Generator().manual_seed(0)
    full = torch.rand(info.n_layers, info.n_kv_heads, generator=gen) < 0.5
    ids = smollm2.encode("Question: what is 12 + 7? Answer step by step.", chat=True)
    recs = list(smollm2.generate(ids, max_new_tokens=6, interventions=[HeadBudget(full_heads=full, sink=4, recent=8)]))
    ref = reference_logprobs(smollm2, ids + [r.token_id for r in recs[:-1]], ~full, 4, 8)
    for t, r in enumerate(recs):
        row = ref[len(ids) - 1 + t]
        assert r.token_id == int(row.argmax())
        assert r.logprob == pytest.approx(float(row[r.token_id]), abs=1e-3)
