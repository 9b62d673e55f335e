"""How good a RISE SAE and its latents are, measured on held-out steps (issue 11).

- `sae_quality(sae, acts)`: explained variance and L0 as SAELens computes them in
  `sae_lens.evals.get_sparsity_and_variance_metrics`: its own `ExplainedVarianceCalculator`
  (1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2), accumulated in float64), the legacy per-sample
  form beside it, and L0 = mean number of non-zero latents. On the steps the SAE was trained on
  these numbers flatter it; the pipeline reports them on the held-out traces' steps.
- `latent_auroc`: for each behaviour, the latent whose activation best separates its steps from the
  rest on the training steps (AUROC), then that same latent's AUROC on held-out steps: a number the
  choice of latent cannot have inflated.
- `step_silhouette`: silhouette (cosine) of held-out steps' latent codes grouped by label.

Example:
    >>> import torch
    >>> z = torch.tensor([[0.0, 2.0], [0.0, 1.5], [1.0, 0.0], [0.8, 0.1]])
    >>> labels = ["reflection", "reflection", "other", "other"]
    >>> latent_auroc(z, labels, z, labels, ["reflection"])["reflection"]["latent"]
    1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from thoughtscope.imports import import_from, importing

POOR_EXPLAINED_VARIANCE = 0.5  # below this on held-out steps, the page warns that the SAE reconstructs poorly


@torch.no_grad()
def sae_quality(sae: Any, acts: torch.Tensor, batch_size: int = 4096) -> dict[str, float]:
    """Explained variance (SAELens' calculator and its legacy form), L0 and MSE of `sae` on `acts` [n, d]."""
    # lazy: sae_lens takes seconds to import; only this needs it (under the heavy-imports lock: jobs run in threads)
    ExplainedVarianceCalculator = import_from("sae_lens.evals", "ExplainedVarianceCalculator")

    if acts.shape[0] == 0:
        return {"n": 0, "explained_variance": float("nan"), "explained_variance_legacy": float("nan"),
                "l0": float("nan"), "mse": float("nan")}
    was_training = sae.training
    sae.eval()
    calc = ExplainedVarianceCalculator()
    l0, legacy, mse = [], [], []
    for i in range(0, acts.shape[0], batch_size):
        x = acts[i:i + batch_size].float().to(sae.device)
        z = sae.encode(x)
        z = z.to_dense() if z.is_sparse else z
        x_hat = sae.decode(z)
        calc.add_batch(sae_output=x_hat, hidden_acts=x)
        # SAELens' legacy explained variance and L0, line for line (evals.get_sparsity_and_variance_metrics)
        resid = (x - x_hat).pow(2).sum(dim=-1)
        legacy.append(1 - resid / (x - x.mean(dim=0)).pow(2).sum(dim=-1))
        l0.append((z != 0).sum(dim=-1).float())
        mse.append(resid)
    if was_training:
        sae.train()
    return {"n": int(acts.shape[0]), "explained_variance": float(calc.compute()),
            "explained_variance_legacy": float(torch.cat(legacy).mean()), "l0": float(torch.cat(l0).mean()),
            "mse": float(torch.cat(mse).mean())}


def quality_warning(heldout_ev: float | None, threshold: float = POOR_EXPLAINED_VARIANCE) -> str | None:
    """A sentence for the page when the held-out explained variance is poor (or unknown)."""
    if heldout_ev is None or not np.isfinite(heldout_ev):
        return "no held-out steps to measure this SAE on: its quality is unknown (harvest more problems)"
    if heldout_ev < threshold:
        return (f"this SAE explains only {heldout_ev:.1%} of the variance of held-out steps (below "
                f"{threshold:.0%}): its latents describe the step vectors poorly, so read the columns and vectors "
                "below with care (harvest more problems, train longer, or widen the dictionary)")
    return None


def _auroc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    with importing("sklearn.metrics"):  # lazy: scikit-learn takes seconds to import
        from sklearn.metrics import roc_auc_score

    if positive.all() or not positive.any():
        return None
    return float(roc_auc_score(positive, scores))


def latent_auroc(train_latents: torch.Tensor, train_labels: Sequence[str], heldout_latents: torch.Tensor,
                 heldout_labels: Sequence[str], classes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per class: the latent with the highest training AUROC (class vs rest), its training AUROC, and
    its AUROC on the held-out steps (None where a split lacks positives or negatives)."""
    with importing("sklearn.metrics"):  # lazy: scikit-learn takes seconds to import
        from sklearn.metrics import roc_auc_score

    z_train = torch.as_tensor(train_latents).float().numpy()
    z_held = torch.as_tensor(heldout_latents).float().numpy()
    y_train, y_held = np.asarray(train_labels), np.asarray(heldout_labels)
    out: dict[str, dict[str, Any]] = {}
    for label in classes:
        pos = y_train == label
        n_pos_held = int((y_held == label).sum())
        row: dict[str, Any] = {"latent": None, "train_auroc": None, "heldout_auroc": None,
                               "train_positives": int(pos.sum()), "heldout_positives": n_pos_held}
        if pos.any() and not pos.all():
            live = np.flatnonzero(z_train.std(0) > 0)
            if live.size:
                scores = [roc_auc_score(pos, z_train[:, j]) for j in live]
                best = int(live[int(np.argmax(scores))])
                row.update(latent=best, train_auroc=float(max(scores)),
                           heldout_auroc=_auroc(z_held[:, best], y_held == label) if len(y_held) else None)
        out[label] = row
    return out


def step_silhouette(latents: torch.Tensor, labels: Sequence[str]) -> float | None:
    """Silhouette (cosine) of steps' latent codes grouped by label; None when undefined (one group,
    or as many groups as steps). Steps where no latent fires have no direction and are left out."""
    with importing("sklearn.metrics"):  # lazy: scikit-learn takes seconds to import
        from sklearn.metrics import silhouette_score

    z = torch.as_tensor(latents).float().numpy()
    keep = np.linalg.norm(z, axis=1) > 0
    groups = np.asarray(labels)[keep]
    n_groups = len(set(groups.tolist()))
    if n_groups < 2 or n_groups > len(groups) - 1:
        return None
    return float(silhouette_score(z[keep], groups, metric="cosine"))
