"""Router maps and router selection rules (probes.routing) on every tiny MoE family.

What a newcomer learns here: `router.L` captures the router logits a family computes; a rule
(`TopK`, `ExpertSample`, `ForceExperts`) at `router.L` or `router.*` replaces the model's top-k
choice with indices and gates computed the way that family's router computes them; with the model's
own k it changes nothing, bit for bit; Expert-Sample's noise is seeded per (seed, layer, sample,
token); bad parameters are refused before any model work; rules travel over the wire.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from scipy.stats import chisquare

from probes import Engine
from probes.routing import (EVERY_LAYER, ROUTER_STYLES, ExpertSample, ForceExperts, Positions, RouterSpec, TopK,
                            gumbel_noise, gumbel_top_k, uniform_noise)
from probes.sites import get_module, list_sites, validate_site
from probes.wire import intervention_from_spec, intervention_to_spec
from probes.zoo import TINY_ARCHS, arch_from_config
from thoughtscope.errors import BadInputError, UnknownSiteError

MOE_ARCHS = ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
PROMPT = "mixture of experts route every token to a few experts"
_ENGINES: dict[str, Engine] = {}


def engine_for(arch: str) -> Engine:
    if arch not in _ENGINES:
        _ENGINES[arch] = Engine.from_id(f"tiny-random:{arch}")
    return _ENGINES[arch]


def router_module(engine: Engine, layer: int):
    site = validate_site(f"router.{layer}", engine.handle.arch)
    return get_module(engine.model, site.module_path(engine.handle.family))


def test_every_listed_moe_family_has_a_tiny_config_and_a_router_style():
    assert set(MOE_ARCHS) <= set(TINY_ARCHS)
    assert set(MOE_ARCHS) == set(ROUTER_STYLES)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_capture_equals_the_models_own_router_logits(arch):
    engine = engine_for(arch)
    ids = engine.encode(PROMPT)
    n = engine.handle.arch.n_layers
    trace = engine.trace(ids, capture=[f"router.{layer}" for layer in range(n)])
    with torch.no_grad():
        own = engine.model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False).router_logits
    for layer in range(n):
        assert trace.activations[f"router.{layer}"].shape == (len(ids), engine.handle.arch.n_experts)
        assert torch.equal(trace.activations[f"router.{layer}"], own[layer].view(len(ids), -1))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_sites_capture_what_the_moe_block_uses(arch):
    """`experts.L` and `expert_gates.L` are the router's own (indices, gates), as the MoE block receives them."""
    engine = engine_for(arch)
    ids = engine.encode(PROMPT)
    layers = engine.handle.arch.moe_layers or range(engine.handle.arch.n_layers)
    own: dict[int, tuple] = {}
    hooks = [router_module(engine, layer).register_forward_hook(
        lambda mod, args, out, layer=layer: own.__setitem__(layer, (out[1].detach().clone(), out[2].clone())))
        for layer in layers]
    try:
        trace = engine.trace(ids, capture=[f"{kind}.{layer}" for layer in layers for kind in ("experts", "expert_gates")])
    finally:
        for hook in hooks:
            hook.remove()
    k = engine.handle.arch.experts_top_k
    for layer in layers:
        assert trace.activations[f"experts.{layer}"].shape == (len(ids), k)
        assert torch.equal(trace.activations[f"experts.{layer}"], own[layer][1].view(len(ids), k))
        assert torch.equal(trace.activations[f"expert_gates.{layer}"], own[layer][0].view(len(ids), k))


def test_experts_sites_show_a_rules_choice():
    """After Expert-Sample the captured experts are the rule's: the head is the router's top expert, the rest
    come from the next m, and the gates are the family's renormalised probabilities over that set."""
    engine = engine_for("qwen2_moe")  # norm_topk_prob: gates are the chosen probabilities, summing to 1
    rule = ExpertSample(k_h=1, m=5, t_e=1.0, seed=7)
    trace = engine.trace(PROMPT, capture=["router.1", "experts.1", "expert_gates.1"], interventions=[rule])
    logits, experts, gates = (trace.activations[s] for s in ("router.1", "experts.1", "expert_gates.1"))
    ranked = logits.argsort(-1, descending=True)
    assert torch.equal(experts[:, 0], ranked[:, 0])
    for row, ranks in zip(experts[:, 1:].tolist(), ranked[:, 1:6].tolist()):
        assert set(row) <= set(ranks)
    probs = torch.softmax(logits, -1).gather(1, experts)
    torch.testing.assert_close(gates, probs / probs.sum(-1, keepdim=True))
    plain = engine.trace(PROMPT, capture=["experts.1"]).activations["experts.1"]
    assert not torch.equal(experts, plain)  # the rule did change the choice


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_rule_arithmetic_equals_the_router_modules_own_output(arch):
    """For random hidden states, TopK with the model's k gives the module's own (gates, indices)."""
    engine = engine_for(arch)
    module = router_module(engine, 0)
    hidden = torch.randn(50, engine.handle.arch.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, gates, idx = module(hidden)[:3]
    spec = RouterSpec.of(module, arch)
    got_gates, got_idx = TopK().select(spec, logits, 0, Positions.of(50))
    assert torch.equal(got_idx, idx) and torch.equal(got_gates, gates) and got_gates.dtype == gates.dtype


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_rules_with_the_models_own_k_reproduce_its_output_exactly(arch):
    engine = engine_for(arch)
    k = engine.handle.arch.experts_top_k
    base = engine.trace(PROMPT)
    plain = list(engine.generate(PROMPT, max_new_tokens=6))
    for rule in (TopK(), TopK(k=k), ExpertSample(k_h=k, m=0), ExpertSample("router.1", k_h=k, m=2, seed=5)):
        assert torch.equal(engine.trace(PROMPT, interventions=[rule]).logprobs[1:], base.logprobs[1:]), rule
        got = list(engine.generate(PROMPT, max_new_tokens=6, interventions=[rule]))
        assert [r.token_id for r in got] == [r.token_id for r in plain]
        assert [r.logprob for r in got] == [r.logprob for r in plain]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_sampled_tails_and_fewer_experts_change_the_output(arch):
    engine = engine_for(arch)
    k = engine.handle.arch.experts_top_k
    base = engine.trace(PROMPT).logprobs[1:]
    m = min(4, engine.handle.arch.n_experts - (k - 1))
    for rule in (TopK(k=k - 1), ExpertSample(k_h=k - 1, m=m, t_e=1.0, seed=1)):
        assert not torch.equal(engine.trace(PROMPT, interventions=[rule]).logprobs[1:], base), rule


def test_gates_are_renormalised_as_each_family_does():
    """Qwen2-MoE here has norm_topk_prob (gates of the chosen sum to 1); Qwen3-MoE's tiny config has
    not (the chosen probabilities as they are); Mixtral always renormalises; DeepSeek-V2 scales by
    routed_scaling_factor without renormalising; gpt-oss softmaxes the chosen logits."""
    sums = {}
    for arch in ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "gpt_oss"):
        engine = engine_for(arch)
        module = router_module(engine, 0)
        hidden = torch.randn(20, engine.handle.arch.d_model, generator=torch.Generator().manual_seed(1))
        logits = module(hidden)[0].detach()
        spec = RouterSpec.of(module, arch)
        gates, idx = TopK(k=1).select(spec, logits, 0, Positions.of(20))
        probs = torch.softmax(logits.float(), dim=-1)
        sums[arch] = gates.float().sum(-1)
        if arch == "qwen3_moe":
            torch.testing.assert_close(gates.float(), probs.max(-1, keepdim=True).values)
        if arch == "deepseek_v2":
            assert spec.scaling == 1.5
            torch.testing.assert_close(gates.float(), 1.5 * probs.gather(1, idx))
    for arch in ("qwen2_moe", "mixtral", "gpt_oss"):
        torch.testing.assert_close(sums[arch], torch.ones(20))
    assert (sums["qwen3_moe"] < 1).all()


def test_deepseek_v3_bias_moves_the_choice_but_not_the_gates():
    engine = Engine.from_id("tiny-random:deepseek_v3")  # its own copy: the bias is edited
    module = router_module(engine, 0)
    bias = torch.zeros(8)
    bias[7] = 5.0  # expert 7 always wins the choice (and its group always wins the group limit)
    module.e_score_correction_bias.copy_(bias)
    hidden = torch.randn(30, engine.handle.arch.d_model, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, gates, idx = module(hidden)
    spec = RouterSpec.of(module, "deepseek_v3")
    got_gates, got_idx = TopK().select(spec, logits, 0, Positions.of(30))
    assert torch.equal(got_idx, idx) and torch.equal(got_gates, gates)
    assert (idx == 7).any(-1).all()
    chosen_sigmoid = logits.sigmoid().gather(1, idx)  # gates use the sigmoid without the bias
    torch.testing.assert_close(gates, 2.5 * chosen_sigmoid / chosen_sigmoid.sum(-1, keepdim=True))
    samples = ExpertSample(k_h=1, m=3, seed=0).select(spec, logits, 0, Positions.of(30))[1]
    assert (samples[:, 0] == 7).all()


# ----- Expert-Sample's sampling -----


def _synthetic_spec(n_experts: int = 16, top_k: int = 4, normalize: bool = True) -> RouterSpec:
    return RouterSpec(ROUTER_STYLES["qwen3_moe"], top_k=top_k, n_experts=n_experts, normalize=normalize)


def test_gumbel_top_k_frequencies_match_the_target_distribution():
    """Gumbel-top-k on seeded noise: the first draw follows softmax(g / T_e) and the unordered pair of
    two draws follows the Plackett-Luce (sampling without replacement) probabilities."""
    g = torch.tensor([1.0, 0.6, 0.3, 0.0, -0.4, -1.0])
    t_e, n = 0.7, 30000
    logits = g.expand(n, -1)
    noise = gumbel_noise(seed=11, layer=2, at=Positions.of_forward(n, 1, start=5), width=6)
    picks = gumbel_top_k(logits, 2, t_e, noise)
    p = torch.softmax(g.double() / t_e, dim=0)
    first = torch.bincount(picks[:, 0], minlength=6).double()
    assert chisquare(first.numpy(), (p * n).numpy()).pvalue > 1e-3
    pairs = list(itertools.combinations(range(6), 2))
    expected = torch.tensor([p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j]) for i, j in pairs]) * n
    observed = torch.zeros(len(pairs))
    index = {pair: k for k, pair in enumerate(pairs)}
    for i, j in picks.sort(dim=1).values.tolist():
        observed[index[(i, j)]] += 1
    assert abs(float(expected.sum()) - n) < 1e-6
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    # and the noise is not degenerate: a wrong temperature is detected
    wrong = torch.softmax(g.double() / 1.4, dim=0)
    assert chisquare(first.numpy(), (wrong * n).numpy()).pvalue < 1e-6


def test_expert_sample_draws_its_tail_in_proportion_to_exp_logit_over_t_e():
    """The rule itself, end to end on router logits: with one expert to sample (k - k_h = 1) from a pool of
    m, the sampled expert follows softmax(pool logits / T_e); the head is the top k_h, always."""
    spec = _synthetic_spec(n_experts=12, top_k=3)
    g = torch.tensor([3.0, 2.5, 1.0, 0.8, 0.5, 0.1, -0.3, -0.6, -1.0, -1.5, -2.0, -3.0])
    n, t_e = 20000, 1.5
    at = Positions.of_forward(n, 1, start=9)  # n samples of one token: one stream, n rows
    rule = ExpertSample(k_h=2, m=5, t_e=t_e, seed=2)
    _, idx = rule.select(spec, g.expand(n, -1), 0, at)
    assert (idx[:, :2] == torch.tensor([0, 1])).all()
    counts = torch.bincount(idx[:, 2], minlength=12).double()
    assert counts[:2].sum() == 0 and counts[7:].sum() == 0  # only the pool: experts 2..6
    target = torch.softmax(g[2:7].double() / t_e, dim=0) * n
    assert chisquare(counts[2:7].numpy(), target.numpy()).pvalue > 1e-3
    assert chisquare(counts[2:7].numpy(), (torch.softmax(g[2:7].double(), 0) * n).numpy()).pvalue < 1e-6  # T_e matters


def test_noise_of_a_row_does_not_depend_on_the_batch_or_the_device_layout():
    """A sample's noise is a function of (seed, layer, column, row, slot): the same with 4 rows or 128,
    in a forward over many columns or one at a time, and different for another seed, layer or column."""
    one = uniform_noise(3, 1, Positions.of_forward(4, 1, start=7), 12)
    assert torch.equal(one, uniform_noise(3, 1, Positions.of_forward(128, 1, start=7), 12)[:4])
    wide = uniform_noise(3, 1, Positions.of_forward(4, 3, start=6), 12).view(4, 3, 12)
    assert torch.equal(wide[:, 1], one)
    picked = Positions(torch.tensor([2, 0]), torch.tensor([7, 7]))  # a masked subset (where="generated")
    assert torch.equal(uniform_noise(3, 1, picked, 12), one[[2, 0]])
    for other in (uniform_noise(4, 1, Positions.of_forward(4, 1, 7), 12), uniform_noise(3, 2, Positions.of_forward(4, 1, 7), 12),
                  uniform_noise(3, 1, Positions.of_forward(4, 1, 8), 12)):
        assert not torch.equal(other, one)
    assert ((one >= 0) & (one < 1)).all() and len(set(one.flatten().tolist())) == one.numel()


def test_head_is_never_dropped_and_the_tail_comes_from_the_pool():
    spec = _synthetic_spec(n_experts=32, top_k=8)
    logits = torch.randn(2000, 32, generator=torch.Generator().manual_seed(3))
    rule = ExpertSample(k_h=3, m=10, t_e=2.0, seed=4)
    gates, idx = rule.select(spec, logits, 1, Positions(torch.arange(2000) % 7, torch.arange(2000)))
    ranked = logits.argsort(dim=-1, descending=True)
    assert idx.shape == (2000, 8)
    assert torch.equal(idx[:, :3].sort(-1).values, ranked[:, :3].sort(-1).values)  # the head, always
    for row, ranks in zip(idx.tolist(), ranked.tolist()):
        assert len(set(row)) == 8 and set(row[3:]) <= set(ranks[3:13])  # tail: distinct, from the pool
    torch.testing.assert_close(gates.sum(-1), torch.ones(2000))  # norm_topk_prob: renormalised over the chosen
    assert (idx[:, 3:] != ranked[:, 3:8]).any()  # sampling did pick beyond the model's own top-k


def test_tail_gate_weightings():
    spec = _synthetic_spec(n_experts=16, top_k=4)
    logits = torch.randn(300, 16, generator=torch.Generator().manual_seed(5))
    at = Positions.of(300)
    own_gates, own_idx = TopK().select(spec, logits, 0, at)
    router = ExpertSample(k_h=2, m=6, seed=1, tail_gates="router").select(spec, logits, 0, at)
    displaced = ExpertSample(k_h=2, m=6, seed=1, tail_gates="displaced").select(spec, logits, 0, at)
    uniform = ExpertSample(k_h=2, m=6, seed=1, tail_gates="uniform").select(spec, logits, 0, at)
    # the same experts, whatever the weighting
    assert torch.equal(router[1].sort(-1).values, displaced[1].sort(-1).values)
    assert torch.equal(router[1], uniform[1])
    # displaced: exactly the model's own top-k gates, rank by rank (head first, then the sampled)
    assert torch.equal(displaced[0], own_gates)
    assert torch.equal(displaced[1][:, :2], own_idx[:, :2])
    # uniform: one gate per token, a quarter of the total
    torch.testing.assert_close(uniform[0], torch.full((300, 4), 0.25))
    # router: the sampled (lower-ranked) experts get smaller renormalised gates than under `displaced`
    assert router[0][:, 2:].sum() < displaced[0][:, 2:].sum()


def test_noise_is_seeded_per_sample_and_step_and_reproducible():
    engine = engine_for("qwen2_moe")
    rule = ExpertSample(k_h=1, m=5, t_e=1.0, seed=0)
    run = lambda r: [(x.batch_index, x.token_id, x.logprob) for x in  # noqa: E731
                     engine.generate(PROMPT, n_samples=4, max_new_tokens=6, interventions=[r])]
    first, again = run(rule), run(ExpertSample(k_h=1, m=5, t_e=1.0, seed=0))
    assert first == again
    other_seed = run(ExpertSample(k_h=1, m=5, t_e=1.0, seed=1))
    assert other_seed != first
    by_sample = {b: [(t, lp) for bb, t, lp in first if bb == b] for b in range(4)}
    assert len({tuple(v) for v in by_sample.values()}) == 4  # every sample routed differently
    # a teacher-forced trace of sample 0's text sees the noise its generation saw (same columns)
    ids = engine.encode(PROMPT) + [t for t, _ in by_sample[0]]
    traced = engine.trace(ids, interventions=[rule]).logprobs[-6:]
    torch.testing.assert_close(traced, torch.tensor([lp for _, lp in by_sample[0]]), atol=1e-4, rtol=0)


def test_where_generated_spares_the_prompt():
    engine = engine_for("mixtral")
    one_token = engine.encode(PROMPT)[:1]
    for rule_kind in (lambda w: TopK(k=1, where=w), lambda w: TopK(k=3, where=w),
                      lambda w: ExpertSample(k_h=1, m=2, seed=2, where=w)):
        lp = {w: [r.logprob for r in engine.generate(prompt, max_new_tokens=5, interventions=[rule_kind(w)])]
              for prompt, w in ((one_token, "all"), (one_token, "generated"))}
        # with a one-token prompt, every prompt position predicts a generated token: the same run
        assert lp["all"] == lp["generated"]
        long = {w: [r.logprob for r in engine.generate(PROMPT, max_new_tokens=5, interventions=[rule_kind(w)])]
                for w in ("all", "generated")}
        assert long["all"] != long["generated"]


def test_force_experts_routes_every_token_to_the_given_experts():
    engine = engine_for("olmoe")
    module = router_module(engine, 1)
    hidden = torch.randn(10, engine.handle.arch.d_model, generator=torch.Generator().manual_seed(6))
    logits = module(hidden)[0].detach()
    spec = RouterSpec.of(module, "olmoe")
    at = Positions.of(10)
    gates, idx = ForceExperts("router.1", [5, 2]).select(spec, logits, 1, at)
    assert idx.tolist() == [[5, 2]] * 10
    torch.testing.assert_close(gates, torch.softmax(logits, -1)[:, [5, 2]])  # olmoe: norm_topk_prob off
    gates, _ = ForceExperts("router.1", [5, 2], gates=[0.7, 0.3]).select(spec, logits, 1, at)
    assert gates.tolist() == [[pytest.approx(0.7), pytest.approx(0.3)]] * 10
    assert not torch.equal(engine.trace(PROMPT, interventions=[ForceExperts("router.1", [5, 2])]).logprobs[1:],
                           engine.trace(PROMPT).logprobs[1:])


# ----- bad input: a project error before any model work -----


@pytest.mark.parametrize("rule, message", [
    (ExpertSample(k_h=3, m=4), "k_h=3 is larger than k=2"),
    (ExpertSample(k_h=0, m=1), "tail pool m=1 is smaller than the 2 experts"),
    (ExpertSample(k_h=1, m=8), "k_h \\+ m = 9"),
    (ExpertSample(k_h=1, m=3, t_e=0.0), "T_e must be a finite number > 0"),
    (ExpertSample(k_h=1, m=3, t_e=-1.0), "T_e must be a finite number > 0"),
    (ExpertSample(k_h=1, m=3, t_e=float("nan")), "T_e must be a finite number > 0"),
    (ExpertSample(k_h=1, m=3, t_e="hot"), "T_e must be a number"),
    (ExpertSample(k_h=1, m=3, k=0), "at least one expert"),
    (ExpertSample(k_h=1, m=3, tail_gates="loud"), "tail_gates"),
    (ExpertSample(k_h=1, m=3, seed=-1), "seed"),
    (TopK(k=0), "at least one expert"),
    (TopK(k=9), "k=9 but this model has 8 experts"),
    (ForceExperts("router.0", []), "at least one expert"),
    (ForceExperts("router.0", [1, 8]), r"experts must be a non-empty list of integers in 0\.\.7, got 8"),
    (ForceExperts("router.0", [1, 2], gates=[0.5, float("nan")]), "NaN or infinite"),
    (TopK(site="resid_post.0"), "applies at router.L"),
    (TopK(where="sometimes"), "where="),
])
def test_bad_rules_are_refused_before_any_model_work(rule, message):
    engine = engine_for("qwen3_moe")
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(BadInputError, match=message):
            engine.generate(PROMPT, max_new_tokens=2, interventions=[rule])  # raises before iterating
        with pytest.raises(BadInputError, match=message):
            engine.trace(PROMPT, interventions=[rule])
    finally:
        hook.remove()
    assert not calls


def test_router_rules_on_a_dense_model_or_layer_are_unknown_sites():
    llama = Engine.from_id("tiny-random:llama")
    with pytest.raises(UnknownSiteError, match="dense"):
        llama.generate(PROMPT, interventions=[ExpertSample(k_h=1, m=3)])
    with pytest.raises(UnknownSiteError, match="dense"):
        llama.trace(PROMPT, interventions=[TopK("router.0")])
    with pytest.raises(UnknownSiteError, match="layer 5 is out of range"):
        engine_for("qwen3_moe").trace(PROMPT, interventions=[TopK("router.5")])
    # DeepSeek-V3 keeps its first layers dense: no router there, and `router.*` skips them
    from transformers import DeepseekV3Config

    arch = arch_from_config(DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1))
    assert arch.moe_layers == (1, 2, 3)
    with pytest.raises(UnknownSiteError, match="layer 0 of this model is a dense MLP layer"):
        validate_site("router.0", arch)
    assert [s.name for s in TopK().sites(arch)] == ["router.1", "router.2", "router.3"]
    assert "router.0" not in {row["site"] for row in list_sites(arch)}


def test_mla_models_have_no_key_or_value_sites():
    engine = engine_for("deepseek_v3")
    names = {row["site"] for row in engine.sites()}
    assert {"q.0", "z.0", "router.0", "attn_pattern.0"} <= names and not {"k.0", "v.0"} & names
    with pytest.raises(UnknownSiteError, match="no k_proj module"):
        engine.trace(PROMPT, capture=["k.0"])


# ----- the wire -----


@pytest.mark.parametrize("rule", [
    ExpertSample("router.*", k_h=1, m=4, t_e=0.5, tail_gates="displaced", seed=9, where="generated"),
    TopK("router.1", k=1),
    ForceExperts("router.0", [3, 1], gates=[0.6, 0.4]),
])
def test_rules_travel_over_the_wire(rule):
    spec = intervention_to_spec(rule)
    assert json.loads(json.dumps(spec)) == spec
    back = intervention_from_spec(spec)
    assert type(back) is type(rule) and back.spec() == rule.spec()
    engine = engine_for("qwen2_moe")
    run = lambda r: [(x.token_id, x.logprob, x.interventions) for x in  # noqa: E731
                     engine.generate(PROMPT, n_samples=2, max_new_tokens=4, interventions=[r])]
    assert run(back) == run(rule)
    assert run(rule)[0][2] == [rule.describe()]


def test_expert_sample_through_the_server_equals_in_process():
    from probes.client import RemoteBackend
    from probes.server_bench import free_port, server_log, start_server, stop_server, wait_ready

    model = "tiny-random:qwen2_moe"
    port = free_port()
    proc = start_server(model, port, device="cpu")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout=180)
        rule = ExpertSample(EVERY_LAYER, k_h=1, m=5, t_e=0.8, seed=3)
        kwargs = dict(n_samples=3, max_new_tokens=6, interventions=[rule], capture=["router.1", "experts.1"])
        with RemoteBackend(url, timeout=60) as remote:
            got = list(remote.generate(PROMPT, **kwargs))
            with pytest.raises(BadInputError, match="tail pool"):
                list(remote.generate(PROMPT, max_new_tokens=2, interventions=[ExpertSample(k_h=0, m=1)]))
            assert remote.info()["model_id"] == model  # still serving
        want = list(engine_for("qwen2_moe").generate(PROMPT, **kwargs))
        assert [(r.batch_index, r.token_id) for r in got] == [(r.batch_index, r.token_id) for r in want]
        for a, b in zip(got, want):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)
            torch.testing.assert_close(a.activations["router.1"], b.activations["router.1"])
            assert torch.equal(a.activations["experts.1"], b.activations["experts.1"])
    finally:
        stop_server(proc)
    assert "Traceback" not in server_log(proc), server_log(proc)[-3000:]


def test_rules_leave_the_shared_model_untouched():
    """A rule is a hook for one call: afterwards the model routes as before, and its modules keep top_k."""
    engine = engine_for("qwen3_moe")
    before = engine.trace(PROMPT).logprobs
    list(engine.generate(PROMPT, max_new_tokens=3, interventions=[TopK(k=1)]))
    assert torch.equal(engine.trace(PROMPT).logprobs[1:], before[1:])
    assert router_module(engine, 0).top_k == engine.handle.arch.experts_top_k == 2
    # the rule replaced the routers' forward for that call only: the class's forward is back
    assert all("forward" not in router_module(engine, layer).__dict__ for layer in range(engine.handle.arch.n_layers))


def test_a_rule_router_computes_only_its_logits_and_the_rules_choice(monkeypatch):
    """With a rule in place the router's own softmax and top-k never run (a rule discards them); the
    router's hooks still see the logits, which equal the router's own."""
    engine = engine_for("qwen3_moe")
    own = engine.capture(PROMPT, ["router.0"])["router.0"]
    calls = []
    monkeypatch.setattr(type(router_module(engine, 0)), "forward",
                        lambda self, h: calls.append(1) or (_ for _ in ()).throw(AssertionError("own forward ran")))
    routed = engine.capture(PROMPT, ["router.0"], interventions=[TopK(k=1)])["router.0"]
    assert calls == [] and torch.equal(routed, own)
