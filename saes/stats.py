"""What an SAE user checks first: reconstruction (explained variance), sparsity (L0), dead latents.

Measured on a set of activations with the SAE in inference mode. Explained variance is SAELens'
definition, 1 - E||x - x_hat||^2 / E||x - mean(x)||^2; L0 is the mean number of non-zero
latents per input; a latent is dead when it is zero on every input of the set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class SAEStats:
    """Quality of one SAE on one activation set."""

    n_samples: int
    d_in: int
    d_sae: int
    explained_variance: float
    mse: float
    l0: float
    density: float  # l0 / d_sae
    dead_latents: int
    dead_fraction: float
    decoder_norm_mean: float
    train_seconds: float | None = None
    activations_per_second: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def encode_all(sae: Any, acts: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """Latent activations [n, d_sae] (dense), in batches."""
    rows = [sae.encode(acts[i:i + batch_size].to(sae.device)) for i in range(0, acts.shape[0], batch_size)]
    out = torch.cat(rows) if rows else torch.zeros(0, sae.cfg.d_sae)
    return (out.to_dense() if out.is_sparse else out).float().cpu()


@torch.no_grad()
def sae_stats(sae: Any, acts: torch.Tensor, batch_size: int = 4096) -> SAEStats:
    """Explained variance, L0 and dead latents of `sae` on `acts` [n, d_in]."""
    was_training = sae.training
    sae.eval()
    acts = acts.float()
    sq_err, active, fired = 0.0, 0.0, torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    for i in range(0, acts.shape[0], batch_size):
        x = acts[i:i + batch_size].to(sae.device)
        z = sae.encode(x)
        z = z.to_dense() if z.is_sparse else z
        x_hat = sae.decode(z)
        sq_err += float((x_hat - x).pow(2).sum())
        nz = z != 0
        active += float(nz.sum())
        fired |= nz.any(0).cpu()
    n = acts.shape[0]
    total_var = float((acts - acts.mean(0)).pow(2).sum())
    if was_training:
        sae.train()
    l0 = active / n
    dead = int((~fired).sum())
    return SAEStats(
        n_samples=n, d_in=acts.shape[1], d_sae=sae.cfg.d_sae,
        explained_variance=1.0 - sq_err / total_var if total_var > 0 else float("nan"),
        mse=sq_err / (n * acts.shape[1]), l0=l0, density=l0 / sae.cfg.d_sae,
        dead_latents=dead, dead_fraction=dead / sae.cfg.d_sae,
        decoder_norm_mean=float(sae.W_dec.norm(dim=1).mean()),
    )
