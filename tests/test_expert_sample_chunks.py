"""Expert-Sample's fast decode path (probes.routing.NoiseChunks and the fused head/tail choice) gives exactly
what the rule gave before it: the reference below is the rule's `choose` as it was (commit 2b0ac8a), kept
as a plain function, and every comparison is exact equality (same experts, same gates, same tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from probes.routing import (NOISE_CHUNK, ROUTER_STYLES, ExpertSample, NoiseChunks, Positions, RouterSpec,
                            gumbel_noise, gumbel_top_k)
from probes.sampling import Sampling
from thoughtscope.errors import BadInputError


def reference_choose(rule, spec, logits, layer, at):
    """ExpertSample.choose before the noise chunks: per layer and step its own noise draw and transform,
    head and tail sliced, gathered and concatenated apart."""
    k = rule.k or spec.top_k
    if rule.k_h == k:
        choice = spec.choice_scores(logits)[0]
        return rule._weighted(spec, logits, spec.family_topk(choice, k), choice, k)
    by_logits = spec.style.score in ("softmax", "logits") and not spec.n_group
    if by_logits:
        values, ranked = torch.topk(logits, rule.k_h + rule.m, dim=-1)
        pool_logits, choice, allowed = values[:, rule.k_h:].float(), None, None
    else:
        choice, allowed = spec.choice_scores(logits)
        ranked = torch.topk(choice, rule.k_h + rule.m, dim=-1)[1]
        pool_logits = spec.sample_logits(logits).gather(1, ranked[:, rule.k_h:])
        if allowed is not None:
            pool_logits = pool_logits.masked_fill(~allowed.gather(1, ranked[:, rule.k_h:]), -math.inf)
    noise = gumbel_noise(rule.seed, layer, at, rule.m)
    picked = gumbel_top_k(pool_logits, k - rule.k_h, float(rule.t_e), noise)
    if allowed is not None and torch.isinf(pool_logits.gather(1, picked)).any():
        raise BadInputError("the tail pool reaches experts this router's group limit excludes")
    idx = torch.cat([ranked[:, :rule.k_h], ranked[:, rule.k_h:].gather(1, picked)], dim=-1)
    if by_logits and rule.tail_gates == "router" and spec.style.score == "softmax" and spec.normalize:
        chosen = torch.cat([values[:, :rule.k_h], values[:, rule.k_h:].gather(1, picked)], dim=-1)
        gates = torch.softmax(chosen, dim=-1, dtype=torch.float32)
        if spec.style.scaled:
            gates = gates * spec.scaling
        return idx, gates.to(logits.dtype) if spec.style.gate_dtype == "logits" else gates
    return rule._weighted(spec, logits, idx, choice, k)


class ReferenceExpertSample(ExpertSample):
    """The rule with the reference choice (a subclass without its own `kind`: registers nothing)."""

    def choose(self, spec, logits, layer, at):
        return reference_choose(self, spec, logits, layer, at)


@pytest.mark.parametrize("head", [0, 2])
def test_noise_chunks_equal_each_columns_own_gumbel_noise(head):
    chunks = NoiseChunks(seed=7, width=5, head=head)
    # rows shrink, grow back and cross chunk boundaries; two layers interleave as a forward's do
    for column, rows in [(3, 4), (4, 4), (5, 2), (18, 2), (19, 4), (20, 1), (3 + NOISE_CHUNK, 4), (2, 3)]:
        for layer in (0, 2):
            got = chunks.decode(layer, column, rows, torch.device("cpu"))
            want = gumbel_noise(7, layer, Positions.of_forward(rows, 1, column), 5)
            assert got.shape == (rows, head + 5)
            assert torch.equal(got[:, head:], want)
            assert torch.equal(got[:, :head], torch.full((rows, head), math.inf))
    assert not torch.equal(chunks.decode(0, 3, 2, torch.device("cpu")), chunks.decode(2, 3, 2, torch.device("cpu")))


_SPECS = {  # name: (router style, RouterSpec arguments); the sigmoid and grouped ones take the general path
    "qwen3_moe": ("qwen3_moe", dict(normalize=True)), "qwen3_moe_unnormalised": ("qwen3_moe", dict(normalize=False)),
    "mixtral": ("mixtral", dict(normalize=True)), "gpt_oss": ("gpt_oss", dict(normalize=False)),
    "deepseek_v2": ("deepseek_v2", dict(normalize=False, scaling=2.5)),
    "deepseek_v3": ("deepseek_v3", dict(normalize=True, scaling=2.5)),
    "deepseek_v3_grouped": ("deepseek_v3", dict(normalize=True, scaling=2.5, n_group=4, topk_group=2)),
}


def spec_of(name: str) -> RouterSpec:
    style, kwargs = _SPECS[name]
    return RouterSpec(ROUTER_STYLES[style], top_k=4, n_experts=16, **kwargs)


@pytest.mark.parametrize("family", sorted(_SPECS))
@pytest.mark.parametrize("k_h,t_e,tail_gates", [(2, 1.0, "router"), (1, 0.5, "router"), (0, 1.0, "router"),
                                               (2, 1.0, "displaced"), (1, 1e-4, "uniform")])
def test_decode_choice_equals_the_reference_exactly(family, k_h, t_e, tail_gates):
    spec = spec_of(family)
    rule = ExpertSample(k_h=k_h, m=6, t_e=t_e, tail_gates=tail_gates, seed=11)
    reference = ReferenceExpertSample(k_h=k_h, m=6, t_e=t_e, tail_gates=tail_gates, seed=11)
    gen = torch.Generator().manual_seed(0)
    for column in range(9, 9 + 2 * NOISE_CHUNK + 3):  # decode steps across three chunks
        for layer in (0, 1):
            logits = torch.randn(5, 16, generator=gen) * 2
            at = Positions.of_forward(5, 1, column)
            idx, gates = rule.select(spec, logits, layer, at)
            ref_idx, ref_gates = reference.select(spec, logits, layer, at)
            assert torch.equal(idx, ref_idx) and idx.dtype == ref_idx.dtype
            assert torch.equal(gates, ref_gates) and gates.dtype == ref_gates.dtype


def test_seeded_generation_gives_the_references_tokens_exactly(moe, monkeypatch):
    """A sampled generation (token sampler and Expert-Sample both seeded) on a tiny Qwen3-MoE: the same tokens
    and log-probabilities as the reference rule, across more decode steps than one noise chunk."""
    k = moe.arch().experts_top_k
    served = []
    decode = NoiseChunks.decode
    monkeypatch.setattr(NoiseChunks, "decode", lambda self, *a: served.append(a[:2]) or decode(self, *a))

    def run(rule_class):
        rule = rule_class(k_h=1, m=min(moe.arch().n_experts - 1, 2 * k), t_e=1.0, seed=5)
        return [(r.batch_index, r.step, r.token_id, r.logprob) for r in
                moe.generate(prompts=["mixture of experts", "route every token"], n_samples=2, max_new_tokens=NOISE_CHUNK + 4,
                             sampling=Sampling(temperature=1.0), seed=3, stop=[], interventions=[rule])]

    fast, reference = run(ExpertSample), run(ReferenceExpertSample)
    assert len(fast) == 4 * (NOISE_CHUNK + 4)
    assert fast == reference
    n_moe = len(getattr(moe.arch(), "moe_layers", None) or range(moe.arch().n_layers))
    assert len(served) == n_moe * (NOISE_CHUNK + 3)  # every decode step of every MoE layer read the chunks
    # and the rule does route: greedy experts give other tokens
    plain = [(r.batch_index, r.step, r.token_id, r.logprob) for r in
             moe.generate(prompts=["mixture of experts", "route every token"], n_samples=2, max_new_tokens=NOISE_CHUNK + 4,
                          sampling=Sampling(temperature=1.0), seed=3, stop=[])]
    assert plain != fast


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_prefill_and_masked_positions_choose_as_the_reference(family):
    """A prefill's grid of columns and a masked subset of it (`where="generated"` keeps a prefill's last column)
    draw their noise per column as before; the choice is the reference's, exactly."""
    spec = spec_of(family)
    rule, reference = ExpertSample(k_h=1, m=6, seed=2), ReferenceExpertSample(k_h=1, m=6, seed=2)
    logits = torch.randn(3 * 5, 16, generator=torch.Generator().manual_seed(1))
    grid = Positions.of_forward(3, 5, 7)
    keep = grid.cols == 7 + 4
    for at, x in [(grid, logits), (grid[keep], logits[keep])]:
        idx, gates = rule.select(spec, x, 1, at)
        ref_idx, ref_gates = reference.select(spec, x, 1, at)
        assert torch.equal(idx, ref_idx) and torch.equal(gates, ref_gates)
