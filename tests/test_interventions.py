"""Each intervention changes exactly what it should; bad vectors and files are refused up front."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from probes import AddVector, HeadAblation, MaskAttention, ProjectionRescale, load_vector
from thoughtscope.errors import BadInputError
from probes.interventions import load_vector_bytes

PROMPT = "Steering vectors change what the model says next"


def unit(seed: int, d: int = 64) -> torch.Tensor:
    v = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def test_add_vector_adds_exactly_scale_times_v(llama):
    v = unit(0)
    base = llama.trace(PROMPT, capture=["resid_post.0"]).activations["resid_post.0"]
    steered = llama.trace(PROMPT, capture=["resid_post.0"],
                          interventions=[AddVector("resid_post.0", v, scale=3.0)]).activations["resid_post.0"]
    torch.testing.assert_close(steered - base, (3.0 * v).expand_as(base), atol=1e-5, rtol=0)


def test_add_vector_changes_downstream_but_not_upstream(llama):
    v = unit(1)
    iv = [AddVector("resid_post.0", v, scale=5.0)]
    base = llama.trace(PROMPT, capture=["resid_pre.0", "resid_post.1"])
    steered = llama.trace(PROMPT, capture=["resid_pre.0", "resid_post.1"], interventions=iv)
    torch.testing.assert_close(steered.activations["resid_pre.0"], base.activations["resid_pre.0"])
    assert (steered.activations["resid_post.1"] - base.activations["resid_post.1"]).abs().max() > 1e-2


def test_rescale_alpha_one_leaves_h_orthogonal_to_w(llama):
    w = unit(2)
    trace = llama.trace(PROMPT, capture=["resid_post.1"], interventions=[ProjectionRescale("resid_post.1", w, alpha=1.0)])
    assert (trace.activations["resid_post.1"] @ w).abs().max() < 1e-4


def test_rescale_alpha_minus_one_doubles_the_component(llama):
    w = unit(3)
    base = llama.trace(PROMPT, capture=["resid_post.1"]).activations["resid_post.1"]
    doubled = llama.trace(PROMPT, capture=["resid_post.1"],
                          interventions=[ProjectionRescale("resid_post.1", 5 * w, alpha=-1.0)]).activations["resid_post.1"]
    torch.testing.assert_close(doubled @ w, 2 * (base @ w), atol=1e-4, rtol=1e-4)
    # the part orthogonal to w is untouched
    torch.testing.assert_close(doubled - (doubled @ w)[:, None] * w, base - (base @ w)[:, None] * w, atol=1e-4, rtol=0)


def test_interventions_compose_in_order(llama):
    v, w = unit(4), unit(5)
    ivs = [AddVector("resid_post.1", w, scale=10.0), ProjectionRescale("resid_post.1", w, alpha=1.0)]
    trace = llama.trace(PROMPT, capture=["resid_post.1"], interventions=ivs)
    assert (trace.activations["resid_post.1"] @ w).abs().max() < 1e-4
    del v


def test_zero_head_ablation_zeroes_only_those_heads(llama):
    trace = llama.trace(PROMPT, capture=["z.1"], interventions=[HeadAblation(1, heads=[0, 2])])
    z = trace.activations["z.1"]
    assert z[:, [0, 2]].abs().max() == 0
    assert z[:, [1, 3]].abs().max() > 0


def test_mean_head_ablation_writes_the_means(llama):
    means = llama.head_means(["some text", "more text here"], layer=0)
    trace = llama.trace(PROMPT, capture=["z.0"], interventions=[HeadAblation(0, [1], mode="mean", means=means)])
    torch.testing.assert_close(trace.activations["z.0"][:, 1], means[1].expand(trace.activations["z.0"].shape[0], -1))


def test_generated_only_leaves_the_prompt_untouched(llama):
    v = unit(6)
    plain = llama.generate(PROMPT, max_new_tokens=3, capture=["resid_post.0"])
    steered = llama.generate(PROMPT, max_new_tokens=3, capture=["resid_post.0"],
                             interventions=[AddVector("resid_post.0", v, scale=2.0, where="generated")])
    a, b = list(plain), list(steered)
    # the first record's activation is the last prompt position, which predicts a generated token
    torch.testing.assert_close(b[0].activations["resid_post.0"] - a[0].activations["resid_post.0"], 2 * v,
                               atol=1e-5, rtol=0)
    assert b[0].interventions == ["add 2 * v (|v|=1) at resid_post.0"]


def test_steering_changes_generated_text(llama):
    v = unit(7)
    plain = [r.token_id for r in llama.generate(PROMPT, max_new_tokens=6)]
    steered = [r.token_id for r in llama.generate(PROMPT, max_new_tokens=6,
                                                  interventions=[AddVector("resid_post.1", v, scale=50.0)])]
    assert plain != steered


def test_mask_attention_hides_the_positions(llama):
    """With positions masked, the generated tokens' attention to them is exactly zero."""
    ids = llama.encode(PROMPT)
    recs = list(llama.generate(ids, max_new_tokens=3, capture=["attn_pattern.0"],
                               interventions=[MaskAttention([1, 2, 3])]))
    for r in recs:
        pattern = r.activations["attn_pattern.0"]  # [heads, kv_len]
        assert pattern[:, [1, 2, 3]].abs().max() == 0
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[0]), atol=1e-5, rtol=0)
    plain = list(llama.generate(ids, max_new_tokens=3, capture=["attn_pattern.0"]))
    assert plain[0].activations["attn_pattern.0"][:, [1, 2, 3]].sum() > 0


# ----- bad input -----

def test_wrong_width_vector_is_refused(llama):
    with pytest.raises(BadInputError, match="width 10"):
        llama.generate(PROMPT, interventions=[AddVector("resid_post.0", torch.ones(10))])


def test_nan_vector_is_refused(llama):
    v = torch.ones(64)
    v[3] = float("nan")
    with pytest.raises(BadInputError, match="NaN"):
        llama.generate(PROMPT, interventions=[AddVector("resid_post.0", v)])


def test_nan_scale_and_zero_direction_are_refused(llama):
    with pytest.raises(BadInputError):
        llama.generate(PROMPT, interventions=[AddVector("resid_post.0", torch.ones(64), scale=float("nan"))])
    with pytest.raises(BadInputError, match="zero vector"):
        llama.generate(PROMPT, interventions=[ProjectionRescale("resid_post.0", torch.zeros(64))])


def test_intervention_on_wrong_site_kind_is_refused(llama):
    with pytest.raises(BadInputError, match="applies to"):
        llama.generate(PROMPT, interventions=[AddVector("q.0", torch.ones(64))])
    with pytest.raises(BadInputError, match="out of range"):
        llama.generate(PROMPT, interventions=[HeadAblation(0, heads=[7])])


def test_vectors_load_from_safetensors_only(tmp_path):
    good = tmp_path / "v.safetensors"
    save_file({"vector": torch.arange(4.0)}, str(good))
    torch.testing.assert_close(load_vector(good), torch.arange(4.0))
    assert load_vector_bytes(good.read_bytes()).tolist() == [0, 1, 2, 3]
    bad = tmp_path / "v.pt"
    torch.save({"vector": torch.ones(3)}, bad)
    with pytest.raises(BadInputError, match="safetensors"):
        load_vector(bad)
    with pytest.raises(BadInputError, match="safetensors"):
        load_vector_bytes(b"not a tensor file")
    two = tmp_path / "two.safetensors"
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, str(two))
    with pytest.raises(BadInputError, match="key="):
        load_vector(two)
