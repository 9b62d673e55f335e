"""The three compute targets of issue 28 (fuzzy fit, Expert-Sample, visual attribution's attention rows):
each faster path computes what the direct one computed.

Unit tier: synthetic tensors and tiny random models only.
"""

from __future__ import annotations

import math

import torch

from analyses.fuzzy_concepts import rules as fuzzy_rules
from analyses.fuzzy_concepts.rules import FuzzyRuleLayer


# ----------------------------------------------------------------------------- fuzzy fit: the expanded loss


def _direct_loss(rows, P, C, log_sigma, U, sparsity):
    """The loss as it reads on paper: |wbar U - x|^2 (an [n, d] residual) plus the firing entropy."""
    wbar = torch.softmax(fuzzy_rules._log_memberships(rows @ P.T, C, log_sigma), dim=-1)
    return (wbar @ U - rows).pow(2).sum(1).mean() + sparsity * fuzzy_rules._entropy(wbar).mean()


def test_the_expanded_fit_loss_and_its_gradients_equal_the_direct_residual_form():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 12, generator=g, dtype=torch.float64)
    params = [torch.randn(3, 12, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64),
              0.3 * torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, 12, generator=g, dtype=torch.float64)]
    direct_params = [p.clone().requires_grad_(True) for p in params]
    fused_params = [p.clone().requires_grad_(True) for p in params]
    direct = _direct_loss(rows, *direct_params, sparsity=0.03)
    fused = fuzzy_rules._fit_loss(rows, rows.pow(2).sum(1).mean(), *fused_params, sparsity=0.03)
    direct.backward()
    fused.backward()
    assert math.isclose(float(fused.detach()), float(direct.detach()), rel_tol=1e-12)
    for a, b in zip(fused_params, direct_params):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_a_fit_follows_the_direct_loss_trajectory_step_by_step():
    """The whole Adam run, replayed with the direct residual loss from the same start: the same losses.
    Overlapping clusters, so the loss keeps falling (at a flat optimum Adam's normalised steps turn float32
    rounding into jitter of either form, about 1e-3 relative, and no two summation orders agree there)."""
    g = torch.Generator().manual_seed(1)
    centres = 3 * torch.randn(4, 10, generator=g)
    Z = centres[torch.randint(0, 4, (240,), generator=g)] + 2.0 * torch.randn(240, 10, generator=g)
    layer = FuzzyRuleLayer(n_rules=4, n_features=3, steps=40, tol=0.0, seed=0).fit(Z)

    ref = FuzzyRuleLayer(n_rules=4, n_features=3, steps=40, tol=0.0, seed=0)
    mean, scale = fuzzy_rules.standardiser(Z)
    x = (Z - mean) / scale
    params = ref._init(x, 3)
    for p in params:
        p.requires_grad_(True)
    P, C, log_sigma, U = params
    opt = torch.optim.Adam([{"params": [C, log_sigma], "lr": 0.01}, {"params": [P, U], "lr": 0.01 / math.sqrt(10)}])
    history = []
    for step in range(41):
        loss = _direct_loss(x, P, C, log_sigma, U, 0.03)
        history.append(float(loss.detach()))
        if step == 40:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert layer.n_iter_ == 40 and len(layer.loss_history_) == 41
    assert torch.allclose(torch.tensor(layer.loss_history_), torch.tensor(history), rtol=1e-5, atol=1e-6)
    assert history[0] - history[-1] > 3e-3  # the replay moved (0.3045 -> 0.3006): a trajectory, not 41 copies
