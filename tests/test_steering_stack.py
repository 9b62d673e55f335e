"""The steering stack (analyses.steering_stack): terms from every direction source, compiled to interventions,
checked before any model work, saved to and loaded from a JSON preset. Tiny models only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from analyses.steering_stack import (MAX_TERMS, SteeringStack, StackTerm, from_diff_of_means, from_feature_browser,
                                     from_fuzzy_concept, from_preset, from_rise_behaviour, from_rise_confidence,
                                     from_sae_latent, from_vector_bytes, from_vector_file, load_preset,
                                     preset_from_bytes, reference_norms, save_preset, to_preset)
from thoughtscope.errors import BadInputError

D = 64  # tiny-random:llama's d_model


def _v(seed: int, d: int = D) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sae_folder(tmp_path_factory):
    from saes.io import save_sae
    from saes.train import SAETrainSettings, train_sae

    sae, _ = train_sae(torch.randn(256, D, generator=torch.Generator().manual_seed(0)),
                       SAETrainSettings(d_sae=8, batch_size=64, steps=3, progress=False),
                       metadata={"model_name": "tiny", "hook_name": "resid_post.1"})
    return save_sae(sae, tmp_path_factory.mktemp("sae") / "sae")


# ----------------------------------------------------------------------------- compiling and applying

def test_a_stack_compiles_to_one_edit_per_term_with_strength_times_multiplier():
    v1, v2 = _v(1), _v(2)
    stack = SteeringStack([StackTerm("resid_post.0", v1, 2.0, unit="raw", label="up"),
                           StackTerm("resid_post.1", v2, -1.0, unit="norm", tokens="generated", start=2, stop=9),
                           StackTerm("resid_post.1", v2, 0.5, method="project_out", skip_special=False),
                           StackTerm("resid_post.0", v1, 0.0, unit="raw"),
                           StackTerm("resid_post.1", v1, 1.0, method="projection_cap", params={"high": 0.5}),
                           StackTerm("resid_post.1", v1, 1.0, method="norm_scaled")], multiplier=0.5)
    ivs = stack.interventions({"resid_post.1": 10.0}, d_model=D)
    # the zero-strength term is left out
    assert [iv.kind for iv in ivs] == ["additive", "additive", "project_out", "projection_cap", "norm_scaled"]
    assert ivs[0].strength == 1.0 and torch.equal(ivs[0].vector, v1) and ivs[0].term == "1. up"
    assert ivs[1].strength == -0.5 and torch.allclose(ivs[1].vector, v2 / v2.norm() * 10.0)
    assert (ivs[1].tokens, ivs[1].start, ivs[1].stop, ivs[1].skip_special) == ("generated", 2, 9, True)
    assert ivs[2].strength == 0.25 and torch.equal(ivs[2].vector, v2) and ivs[2].skip_special is False
    assert (ivs[3].low, ivs[3].high) == (None, 0.5)
    assert len({iv.term for iv in stack.interventions({"resid_post.1": 10.0}, skip_zero=False)}) == 6


def test_additive_terms_add_up_to_the_hand_computed_sum(llama):
    prompt = "Today I feel"
    v1, v2 = _v(1), _v(2)
    stack = SteeringStack([StackTerm("resid_post.0", v1, 2.0, unit="raw"),
                           StackTerm("resid_post.0", v2, -3.0, unit="raw")], multiplier=0.5)
    plain = llama.capture(prompt, ["resid_post.0"])["resid_post.0"]
    steered = llama.capture(prompt, ["resid_post.0"], interventions=stack.interventions(d_model=D))["resid_post.0"]
    assert torch.allclose(steered, plain + 1.0 * v1 - 1.5 * v2, atol=1e-5)


def test_norm_unit_uses_the_sites_mean_activation_norm(llama):
    from analyses.steering import site_norm

    stack = SteeringStack([StackTerm("resid_post.1", _v(3), 1.0), StackTerm("resid_post.0", _v(4), 1.0, unit="raw")])
    norms = reference_norms(llama, "Today I feel", stack)
    assert list(norms) == ["resid_post.1"]  # only the norm-unit term's site
    assert norms["resid_post.1"] == pytest.approx(site_norm(llama, "Today I feel", "resid_post.1"), rel=1e-6)
    with pytest.raises(BadInputError, match="mean activation norm"):
        stack.interventions({})


# ----------------------------------------------------------------------------- bad input

def test_bound_width_strength_and_site_are_checked():
    term = StackTerm("resid_post.0", _v(1), 1.0)
    with pytest.raises(BadInputError, match=f"at most {MAX_TERMS}"):
        SteeringStack([term] * (MAX_TERMS + 1))
    full = SteeringStack([term] * MAX_TERMS)
    with pytest.raises(BadInputError, match="full"):
        full.add(term)
    assert len(SteeringStack([term] * (MAX_TERMS - 1)).add(term).terms) == MAX_TERMS
    with pytest.raises(BadInputError, match="width 3 but resid_post.0 has width 64"):
        SteeringStack([StackTerm("resid_post.0", torch.ones(3))]).check(D)
    for bad in (float("nan"), float("inf"), "1", True):
        with pytest.raises(BadInputError, match="strength"):
            SteeringStack([StackTerm("resid_post.0", _v(1), bad)]).check(D)
        with pytest.raises(BadInputError, match="strength"):
            full.with_strength(0, bad)
    with pytest.raises(BadInputError, match="multiplier"):
        SteeringStack([term], float("nan")).check(D)
    with pytest.raises(BadInputError, match="NaN"):
        StackTerm("resid_post.0", torch.tensor([1.0, float("nan")]))
    with pytest.raises(BadInputError, match="zero vector"):
        StackTerm("resid_post.0", torch.zeros(D))
    with pytest.raises(BadInputError, match="unknown site"):
        StackTerm("nowhere.0", _v(1)).check(D)
    with pytest.raises(BadInputError, match="acts at"):
        StackTerm("z.0", _v(1)).check(D)
    with pytest.raises(BadInputError, match="edit method"):
        StackTerm("resid_post.0", _v(1), method="multiply").check(D)
    with pytest.raises(BadInputError, match="term index"):
        full.with_strength(MAX_TERMS, 1.0)
    with pytest.raises(BadInputError, match="not an SAE latent"):
        StackTerm("resid_post.0", _v(1), method="sae_clamp", params={"value": 1.0}).check(D)
    with pytest.raises(BadInputError, match="projection cap needs"):
        StackTerm("resid_post.0", _v(1), method="projection_cap", params={"low": 2.0, "high": 1.0}).check(D)
    with pytest.raises(BadInputError, match="tokens"):
        StackTerm("resid_post.0", _v(1), tokens="some").check(D)
    with pytest.raises(BadInputError, match="empty"):
        StackTerm("resid_post.0", _v(1), start=4, stop=4).check(D)


def test_unknown_sae_and_latent_are_clear_errors(sae_folder, tmp_path):
    with pytest.raises(BadInputError, match="not a SAELens SAE folder"):
        from_sae_latent(tmp_path, 0, "resid_post.1", D)
    with pytest.raises(BadInputError, match="out of range"):
        from_sae_latent(sae_folder, 8, "resid_post.1", D)
    with pytest.raises(BadInputError, match="SAE latent"):
        from_sae_latent(sae_folder, -1, "resid_post.1", D)
    with pytest.raises(BadInputError, match="width"):
        from_sae_latent(sae_folder, 0, "resid_post.1", 32)


# ----------------------------------------------------------------------------- one adapter per source

def test_diff_of_means_source_is_the_steering_modules_direction(llama):
    from analyses.steering import diff_of_means_direction

    term = from_diff_of_means(llama, ["I love it", " "], ["I hate it"], "resid_post.1", strength=0.5)
    assert torch.equal(term.direction, diff_of_means_direction(llama, ["I love it"], ["I hate it"], "resid_post.1"))
    assert (term.site, term.strength, term.source["set_a"], term.source["set_b"]) == \
        ("resid_post.1", 0.5, ["I love it"], ["I hate it"])


def test_vector_sources_read_safetensors(tmp_path):
    from safetensors.torch import save, save_file

    v = _v(5)
    term = from_vector_bytes(save({"vector": v}), "resid_post.0", file_name="v.safetensors")
    assert torch.equal(term.direction, v) and term.source["kind"] == "upload"
    save_file({"a": v, "b": -v}, str(tmp_path / "two.safetensors"))
    term = from_vector_file(tmp_path / "two.safetensors", "resid_post.0", key="b")
    assert torch.equal(term.direction, -v) and len(term.source["sha256"]) == 64
    with pytest.raises(BadInputError, match="not a valid .safetensors"):
        from_vector_bytes(b"garbage", "resid_post.0")


def test_sae_latent_source_is_its_decoder_row(sae_folder):
    from saes.io import load_sae

    term = from_sae_latent(sae_folder, 3, "resid_post.1", D, strength=2.0)
    assert torch.equal(term.direction, load_sae(sae_folder).W_dec[3].float())
    assert term.source["latent"] == 3 and term.source["folder"] == str(sae_folder)


def test_rise_behaviour_and_confidence_sources():
    from analyses.rise import ConfidenceResult, behaviour_vectors

    w_dec = torch.stack([_v(i) for i in range(6)])
    layer = SimpleNamespace(site="resid_post.1", vectors=behaviour_vectors(w_dec, {"reflection": [0, 2]}))
    term = from_rise_behaviour(layer, "reflection")
    expected = (w_dec[0] + w_dec[2]) / 2
    assert torch.allclose(term.direction, expected / expected.norm()) and term.site == "resid_post.1"
    with pytest.raises(BadInputError, match="no 'backtracking' vector"):
        from_rise_behaviour(layer, "backtracking")
    result = ConfidenceResult("resid_post.1", torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0, 0.0]), [1, 3], [1.0], {})
    term = from_rise_confidence(result, w_dec, n=2)
    assert torch.allclose(term.direction, 2.0 * w_dec[1] - 1.0 * w_dec[3]) and term.source["columns"] == [1, 3]


def test_fuzzy_concept_source_is_the_concepts_direction():
    from analyses.fuzzy_concepts.rules import FuzzyRuleLayer

    layer = FuzzyRuleLayer(n_rules=2, n_features=4, steps=3).fit(torch.randn(40, D, generator=torch.Generator().manual_seed(0)))
    term = from_fuzzy_concept(layer, 1, "resid_post.1")
    assert torch.equal(term.direction, layer.directions_[1].float()) and term.source == {"kind": "fuzzy_concept", "rule": 1}
    with pytest.raises(BadInputError, match="fuzzy concept"):
        from_fuzzy_concept(layer, 2, "resid_post.1")


def test_feature_browser_sources(sae_folder):
    from analyses.feature_browser.directions import Neuron, SAELatent, VectorDirection
    from saes.io import load_sae

    v = _v(6)
    term = from_feature_browser(VectorDirection(v, "resid_post.0", "concept"), D)
    assert torch.allclose(term.direction, v / v.norm()) and term.site == "resid_post.0"
    term = from_feature_browser(Neuron(5, "resid_post.1"), D)
    assert term.direction.tolist() == [1.0 if i == 5 else 0.0 for i in range(D)]
    sae = load_sae(sae_folder)
    term = from_feature_browser(SAELatent(sae, 2, "resid_post.1", source=str(sae_folder)), D)
    assert torch.equal(term.direction, sae.W_dec[2].float()) and term.source["kind"] == "sae"  # kept by reference
    with pytest.raises(BadInputError, match="out of range"):
        from_feature_browser(Neuron(D, "resid_post.1"), D)


# ----------------------------------------------------------------------------- presets

def _stack(sae_folder, tmp_path) -> SteeringStack:
    from safetensors.torch import save_file

    save_file({"vector": _v(8)}, str(tmp_path / "v.safetensors"))
    return SteeringStack([StackTerm("resid_post.0", _v(7), 0.75, unit="raw", label="inline one", tokens="generated",
                                    start=1, stop=5, skip_special=False),
                          from_sae_latent(sae_folder, 4, "resid_post.1", D, strength=-1.25),
                          from_vector_file(tmp_path / "v.safetensors", "resid_post.1", strength=0.5),
                          StackTerm("resid_post.1", _v(9), 1.0, method="projection_cap", params={"low": -1.0})],
                         multiplier=1.5)


def _same(a: SteeringStack, b: SteeringStack) -> None:
    assert a.multiplier == b.multiplier and len(a.terms) == len(b.terms)
    for x, y in zip(a.terms, b.terms):
        assert (x.site, x.strength, x.method, x.unit, x.tokens, x.start, x.stop, x.skip_special, x.label, x.source,
                x.params) == (y.site, y.strength, y.method, y.unit, y.tokens, y.start, y.stop, y.skip_special, y.label,
                              y.source, y.params)
        assert torch.equal(x.direction, y.direction)


def test_a_preset_round_trip_is_exact_inline_and_by_reference(sae_folder, tmp_path):
    stack = _stack(sae_folder, tmp_path)
    saved = to_preset(stack, model_id="tiny-random:llama")
    kinds = [next(iter(t["direction"])) for t in saved["terms"]]
    assert kinds == ["inline", "sae", "file", "inline"]
    _same(from_preset(json.loads(json.dumps(saved)), D), stack)
    _same(load_preset(save_preset(stack, tmp_path / "p.json", inline=True), D), stack)
    assert stack.key() == from_preset(to_preset(stack), D).key()


def test_a_reference_to_a_changed_file_is_refused(sae_folder, tmp_path):
    stack = _stack(sae_folder, tmp_path)
    saved = to_preset(stack)
    from safetensors.torch import save_file

    save_file({"vector": _v(10)}, str(tmp_path / "v.safetensors"))
    with pytest.raises(BadInputError, match="preset term 3: .* has changed"):
        from_preset(saved, D)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(format="other"), "not a steering-stack preset"),
    (lambda p: p.update(version=7), "version 7"),
    (lambda p: p.update(terms={}), "must be a list"),
    (lambda p: p.update(multiplier="x"), "multiplier"),
    (lambda p: p["terms"].__setitem__(0, 3), "preset term 1 is not a JSON object"),
    (lambda p: p["terms"][0].update(colour="red"), r"unknown field\(s\) \['colour'\]"),
    (lambda p: p["terms"][0].pop("direction"), r"missing \['direction'\]"),
    (lambda p: p["terms"][0].update(strength=float("nan")), "preset term 1's strength"),
    (lambda p: p["terms"][0].update(direction={"inline": "%%%"}), "not valid base64"),
    (lambda p: p["terms"][0].update(direction={"inline": "Z2FyYmFnZQ=="}), "not a valid .safetensors"),
    (lambda p: p["terms"][0].update(direction={"url": "x"}), "'direction' must be one of"),
    (lambda p: p["terms"][1]["direction"]["sae"].update(latent=99), "out of range"),
    (lambda p: p["terms"][1]["direction"]["sae"].update(folder="/nonexistent"), "does not exist here"),
    (lambda p: p["terms"][0].update(site="resid_post.x"), "unknown site"),
    (lambda p: p["terms"][0].update(method=3), "'method' must be text"),
    (lambda p: p.update(terms=p["terms"] * 9), "at most 32"),
])
def test_a_malformed_preset_is_a_clear_error(sae_folder, tmp_path, edit, message):
    preset = json.loads(json.dumps(to_preset(_stack(sae_folder, tmp_path))))
    edit(preset)
    with pytest.raises(BadInputError, match=message):
        from_preset(preset, D)


def test_preset_bytes_that_are_not_json_are_a_clear_error(tmp_path):
    with pytest.raises(BadInputError, match="not a JSON file"):
        preset_from_bytes(b"\xff\x00")
    with pytest.raises(BadInputError, match="does not exist"):
        load_preset(tmp_path / "missing.json")
    width = to_preset(SteeringStack([StackTerm("resid_post.0", torch.ones(3))]))
    with pytest.raises(BadInputError, match="width 3"):
        from_preset(width, D)


def test_every_steered_token_records_which_terms_acted(llama):
    from analyses.steering import generate_text
    from analyses.steering_stack import stack_generation
    from probes.edits import Additive

    v1, v2 = _v(1), _v(2)
    stack = SteeringStack([StackTerm("resid_post.0", v1, 4.0, unit="raw", label="a"),
                           StackTerm("resid_post.1", v2, 1.0, unit="raw", label="b", start=0, stop=1)], multiplier=0.5)
    gen = stack_generation(llama, "Today I feel", stack, max_new_tokens=4)
    assert len(gen.applied) == len(gen.steered.token_ids) == 4
    assert all(a["1. a"] == pytest.approx(2.0 * float(v1.norm()), rel=1e-5) for a in gen.applied)
    assert all("2. b" not in a for a in gen.applied) and gen.never_acted() == ["2. b"]  # it acts on position 0 only
    plain = generate_text(llama, "Today I feel", max_new_tokens=4,
                          interventions=[Additive("resid_post.0", v1, 2.0, term="x")])
    assert gen.steered.token_ids == plain.token_ids
    assert gen.unsteered.token_ids == generate_text(llama, "Today I feel", max_new_tokens=4).token_ids
    off = stack_generation(llama, "Today I feel", SteeringStack(stack.terms, 0.0), max_new_tokens=4)
    assert off.steered.token_ids == off.unsteered.token_ids and off.never_acted() == []


def test_frozen_attention_beside_the_steered_text(llama):
    from analyses.steering import generate_text
    from analyses.steering_stack import stack_generation, token_divergence
    from probes.edits import Additive
    from probes.frozen_attention import FrozenAttention

    v = _v(1)
    stack = SteeringStack([StackTerm("resid_post.0", v, 3.0, unit="raw", label="a")])
    gen = stack_generation(llama, "Today I feel", stack, max_new_tokens=4, frozen=True)
    frozen = generate_text(llama, "Today I feel", max_new_tokens=4,
                           interventions=[Additive("resid_post.0", v, 3.0, term="x"), FrozenAttention()])
    assert gen.frozen.token_ids == frozen.token_ids and len(gen.frozen_applied) == len(frozen.token_ids)
    data = gen.to_dict()
    assert data["frozen_divergence"] == token_divergence(gen.unsteered, gen.frozen)
    assert data["divergence"] == [int(a != b) for a, b in zip(gen.unsteered.token_ids, gen.steered.token_ids)]
    empty = stack_generation(llama, "Today I feel", SteeringStack(stack.terms, 0.0), max_new_tokens=4, frozen=True)
    assert empty.unsteered.token_ids == empty.steered.token_ids == empty.frozen.token_ids  # an empty stack: all three agree
    from analyses.steering import GeneratedText

    assert token_divergence(GeneratedText(["a"], [0.0], [0.0], [1]), GeneratedText(["a", "b"], [0.0] * 2, [0.0] * 2, [1, 2])) == [0, 1]


def test_a_terms_grid_rows_are_the_single_row_stack_generations(llama):
    from analyses.steering_stack import grid_key, stack_generation, stack_grid

    stack = SteeringStack([StackTerm("resid_post.0", _v(1), 0.5, label="a"),
                           StackTerm("resid_post.1", _v(2), 1.0, label="b", method="norm_scaled")], multiplier=2.0)
    stops = [-1.0, 0.0, 0.5, 1.5]
    grid = stack_grid(llama, "Today I feel", stack, 0, stops, max_new_tokens=5, frozen=True)
    assert grid.stops == stops and grid.key == grid_key(stack.with_strength(0, 1.5), 0) != grid_key(stack, 1)
    for s in stops:
        alone = stack_generation(llama, "Today I feel", stack.with_strength(0, s), max_new_tokens=5, frozen=True)
        row = grid.generation(s)
        assert row.steered.token_ids == alone.steered.token_ids, s
        assert row.frozen.token_ids == alone.frozen.token_ids, s
        assert row.active == alone.active and row.stack_key == alone.stack_key
        assert [sorted(a) for a in row.applied] == [sorted(a) for a in alone.applied]
        for got, want in zip(row.applied, alone.applied):
            assert got == pytest.approx(want, rel=1e-4)
    assert grid.generation(0.0).active == ["2. b"]  # a term at strength 0 does not act
    with pytest.raises(BadInputError, match="not a stop"):
        grid.generation(0.25)


def test_a_server_process_knows_every_steering_kind():
    """`thoughtscope serve` imports probes.server and nothing of the steering modules: their kinds must register
    through the wire (a served stack once failed with "unknown intervention kind 'additive'")."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import probes.server; from probes.interventions import KINDS; "
                          "print(' '.join(sorted(KINDS)))"], capture_output=True, text=True, check=True, timeout=300)
    from analyses.steering_stack import METHODS

    assert set(METHODS) | {"frozen_attention", "swap"} <= set(out.stdout.split())


@pytest.mark.slow
def test_a_stack_through_a_model_server_equals_in_process():
    from analyses.steering_stack import stack_generation, stack_grid
    from probes.server_bench import served

    stack = SteeringStack([StackTerm("resid_post.0", _v(1), 0.5, label="a"),
                           StackTerm("resid_post.1", _v(2), 0.5, label="b", method="project_out", tokens="generated")])
    with served("tiny-random:llama") as (engine, remote):
        local = stack_generation(engine, "Today I feel", stack, max_new_tokens=5)
        there = stack_generation(remote, "Today I feel", stack, max_new_tokens=5)
        assert there.steered.token_ids == local.steered.token_ids and there.reference_norms == local.reference_norms
        assert [sorted(a) for a in there.applied] == [sorted(a) for a in local.applied]
        grid_there = stack_grid(remote, "Today I feel", stack, 1, [0.0, 1.0], max_new_tokens=5)
        grid_here = stack_grid(engine, "Today I feel", stack, 1, [0.0, 1.0], max_new_tokens=5)
        assert {s: r.steered.token_ids for s, r in grid_there.rows.items()} == \
            {s: r.steered.token_ids for s, r in grid_here.rows.items()}


def test_per_token_kl_is_the_distance_between_the_steered_and_the_plain_hf_next_token_distributions(llama):
    """`stack_token_kl`: at every steered token, KL(steered || unsteered) equals the one computed by hand from
    plain Hugging Face forwards of the model over the same prefix, with and without the term added at the
    layer's output (a forward hook, not the engine); 0 everywhere for a stack whose strengths are 0."""
    from analyses.steering_stack import stack_generation, stack_token_kl

    v = _v(3)
    stack = SteeringStack([StackTerm("resid_post.0", v, 2.0, unit="raw", label="a")])
    gen = stack_generation(llama, "Today I feel", stack, max_new_tokens=6)
    got = stack_token_kl(llama, "Today I feel", stack, gen)
    prompt = llama.encode("Today I feel")
    model = llama.model
    layer = model.model.layers[0]

    def add(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + 2.0 * v.to(hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    want = []
    for t in range(len(gen.steered.token_ids)):
        ids = torch.tensor([prompt + gen.steered.token_ids[:t]])
        with torch.no_grad():
            plain = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            hook = layer.register_forward_hook(add)
            try:
                steered = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            finally:
                hook.remove()
        want.append(float((steered.exp() * (steered - plain)).sum()))
    assert max(want) > 1e-3  # the term moves the distribution
    assert got["kl"] == pytest.approx(want, rel=1e-3, abs=1e-6)
    assert got["mean_kl"] == pytest.approx(sum(want) / len(want), rel=1e-3)
    assert got["same_token"] == [int(a == b) for a, b in zip(gen.unsteered.token_ids, gen.steered.token_ids)]
    off = SteeringStack(stack.terms, 0.0)
    none = stack_token_kl(llama, "Today I feel", off, stack_generation(llama, "Today I feel", off, max_new_tokens=6))
    assert none["kl"] == [0.0] * 6 and none["same_token"] == [1] * 6
    other = SteeringStack([StackTerm("resid_post.0", v, -2.0, unit="raw", label="a")])
    with pytest.raises(BadInputError, match="did not give the same steered text"):
        stack_token_kl(llama, "Today I feel", other, gen)


def test_per_token_kl_through_a_server_equals_in_process(llama):
    from analyses.steering_stack import stack_generation, stack_token_kl
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    stack = SteeringStack([StackTerm("resid_post.1", _v(4), 0.5, label="a")])  # norm-scaled: reference norms too
    local = stack_token_kl(llama, "Today I feel", stack, stack_generation(llama, "Today I feel", stack, max_new_tokens=5))
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url) as remote:
        gen = stack_generation(remote, "Today I feel", stack, max_new_tokens=5)
        served = stack_token_kl(remote, "Today I feel", stack, gen)
    assert served["token_ids"] == local["token_ids"] and max(local["kl"]) > 0
    assert served["kl"] == pytest.approx(local["kl"], rel=1e-4, abs=1e-7)
