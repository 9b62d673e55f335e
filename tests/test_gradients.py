"""Input x gradient: exact on a model linear in its embeddings, deterministic and finite on a transformer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from probes import MaskAttention
from probes.gradients import input_x_gradient
from thoughtscope.errors import BadInputError, UnknownSiteError

TEXT = "two plus two is four"


class LinearLM(nn.Module):
    """logits[t] = W @ mean(x[0..t]) + b: every logit is linear (affine) in the input embeddings."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.embed.weight.data = torch.randn(vocab, d, generator=gen)
        self.head = nn.Linear(d, vocab)
        self.head.weight.data = torch.randn(vocab, d, generator=gen)
        self.head.bias.data = torch.randn(vocab, generator=gen)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, inputs_embeds: torch.Tensor, **_):
        steps = torch.arange(1, inputs_embeds.shape[1] + 1).view(1, -1, 1)
        return SimpleNamespace(logits=self.head(inputs_embeds.cumsum(1) / steps))


@pytest.fixture(scope="module")
def linear():
    model = LinearLM()
    arch = SimpleNamespace(vocab_size=11, n_layers=0)
    return SimpleNamespace(model=model, arch=arch, family="decoder", device="cpu")


def test_linear_toy_sums_to_the_logit_difference_from_zero(linear):
    ids = [3, 1, 4, 1, 5, 9]
    att = input_x_gradient(linear, ids, target="logit_diff", positions=[4], token=2, foil=7)
    with torch.no_grad():
        x = linear.model.embed(torch.tensor([ids]))
        logits = linear.model(x).logits[0, 3]
        zero = linear.model(torch.zeros_like(x)).logits[0, 3]
    diff, diff0 = float(logits[2] - logits[7]), float(zero[2] - zero[7])
    assert att.target_value == pytest.approx(diff, abs=1e-5)
    assert att.baseline_value == pytest.approx(diff0, abs=1e-5)
    assert float(att.scores.sum()) == pytest.approx(diff - diff0, abs=1e-5)
    assert att.completeness_gap == pytest.approx(0.0, abs=1e-5)
    # by hand: token s <= 3 contributes (w_2 - w_7) . x_s / 4; later tokens nothing
    w = linear.model.head.weight.detach()
    by_hand = torch.zeros(len(ids))
    by_hand[:4] = (x[0, :4] @ (w[2] - w[7])) / 4
    torch.testing.assert_close(att.scores, by_hand, atol=1e-6, rtol=0)


def test_linear_toy_logit_over_several_positions(linear):
    ids = [3, 1, 4, 1, 5, 9]
    att = input_x_gradient(linear, ids, target="logit", positions=[2, 5, 6], token=4)
    assert att.completeness_gap == pytest.approx(0.0, abs=1e-5)
    assert att.positions == [2, 5, 6] and att.scores.shape == (6,)


def test_tiny_llama_is_deterministic_finite_and_reads_the_trace(llama):
    a = llama.input_x_gradient(TEXT, target="logprob", sites=["resid_post.0", "resid_pre.1"])
    b = llama.input_x_gradient(TEXT, target="logprob", sites=["resid_post.0", "resid_pre.1"])
    assert torch.equal(a.scores, b.scores) and a.target_value == b.target_value
    assert torch.isfinite(a.scores).all() and a.scores.abs().sum() > 0
    n = len(a.token_ids)
    assert a.positions == [n - 1]
    assert a.target_value == pytest.approx(float(llama.trace(TEXT).logprobs[-1]), abs=1e-5)
    assert a.scores[-1] == 0  # the target token's own embedding cannot change its prediction
    # resid_post.0 and resid_pre.1 are the same tensor, so they get the same scores
    torch.testing.assert_close(a.site_scores["resid_post.0"], a.site_scores["resid_pre.1"], atol=1e-6, rtol=0)
    assert set(a.to_dict()) == {"token_ids", "target", "positions", "scores", "target_value", "baseline_value",
                                "site_scores"}


def test_tiny_llama_scores_match_a_finite_difference(llama):
    """x . dF/dx at token i is the derivative of F when embedding i is scaled by (1 + eps).
    (A central difference with a large eps: the RMS norms compute in float32 whatever the input.)"""
    att = llama.input_x_gradient(TEXT, target="logit_diff", token=7, foil=11)
    ids = torch.tensor([att.token_ids])
    model = llama.model
    with torch.no_grad():
        x = model.get_input_embeddings()(ids)

        def objective(emb: torch.Tensor) -> float:
            row = model(inputs_embeds=emb, use_cache=False).logits[0, -1]
            return float(row[7] - row[11])

        eps = 1e-2
        for i in range(ids.shape[1]):
            up, down = x.clone(), x.clone()
            up[0, i] *= 1 + eps
            down[0, i] *= 1 - eps
            fd = (objective(up) - objective(down)) / (2 * eps)
            assert float(att.scores[i]) == pytest.approx(fd, abs=2e-3, rel=1e-2)


def test_interventions_apply_to_the_gradient(llama):
    """With every other position barred from reading token 1, its embedding no longer matters."""
    plain = llama.input_x_gradient(TEXT, target="logprob")
    masked = llama.input_x_gradient(TEXT, target="logprob", interventions=[MaskAttention([1])])
    assert plain.scores[1] != 0 and masked.scores[1] == 0


@pytest.fixture()
def forwards(llama):
    calls = []
    handle = llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("kwargs, match", [
    (dict(target="entropy"), "use one of"),
    (dict(target="logit_diff", token=3), "needs foil"),
    (dict(positions=[0]), "outside 1.."),
    (dict(positions=[5]), "needs token="),
    (dict(token=10**7), "token must be a token id"),
    (dict(positions=[]), "at least one"),
    (dict(sites=["attn_pattern.0"]), "gradient scores are defined at"),
    (dict(sites=["resid_post.9"]), "out of range"),
    (dict(interventions=[MaskAttention([9])]), "beyond the text"),
])
def test_bad_targets_are_refused_before_the_model_runs(llama, forwards, kwargs, match):
    with pytest.raises((BadInputError, UnknownSiteError), match=match):
        llama.input_x_gradient(TEXT, **kwargs)
    assert forwards == []
