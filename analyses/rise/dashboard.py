"""RISE feature dashboard: where one SAE latent fires, how strongly, what it writes (SAEDashboard-style [recon])."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from analyses.rise.harvest import Harvest
from analyses.rise.labels import LABELS
from probes.backend import Backend
from saes.stats import encode_all
from thoughtscope.errors import BadInputError

# --------------------------------------------------------------------------- feature dashboard


@dataclass
class FeatureDashboard:
    """What one latent does: where it fires, how strongly, what it writes, which labels it sees."""

    site: str
    latent: int
    density: float
    max_activation: float
    top_steps: list[dict[str, Any]]
    histogram_counts: list[int]
    histogram_edges: list[float]
    promoted_tokens: list[tuple[str, float]]
    suppressed_tokens: list[tuple[str, float]]
    label_frequency: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_dashboard(harvest: Harvest, sae: Any, site: str, latent: int, backend: Backend | None = None, k: int = 8,
                      bins: int = 20, latents: torch.Tensor | None = None) -> FeatureDashboard:
    """Dashboard data for `latent` of the SAE at `site`; with a `backend`, the tokens its decoder
    column promotes and suppresses through the model's unembedding (`Backend.readout`, no final norm)."""
    if not 0 <= latent < sae.cfg.d_sae:
        raise BadInputError(f"latent {latent} out of range; this SAE has latents 0..{sae.cfg.d_sae - 1}")
    z = (latents if latents is not None else encode_all(sae, harvest.acts[site]))[:, latent]
    active = z > 0
    order = z.argsort(descending=True)[:k].tolist()
    top_steps = []
    for row in order:
        if z[row] <= 0:
            break
        t, s = harvest.step_rows[row]
        step = harvest.traces[t].steps[s]
        top_steps.append({"row": row, "trace": t, "step": s, "activation": float(z[row]), "text": step.text,
                          "label": step.label, "problem_id": harvest.traces[t].problem.id})
    values = z[active].numpy()
    counts, edges = np.histogram(values, bins=bins) if values.size else (np.zeros(bins, int), np.linspace(0, 1, bins + 1))
    promoted, suppressed = [], []
    if backend is not None:
        words = backend.readout(sae.W_dec[latent].detach().float().cpu().view(1, -1), norm=False, top_k=10,
                                bottom_k=10)
        promoted = [(backend.decode([int(i)]), float(v)) for i, v in zip(words.top_ids[0], words.top_logits[0])]
        suppressed = [(backend.decode([int(i)]), float(v)) for i, v in zip(words.bottom_ids[0], words.bottom_logits[0])]
    labels = [harvest.step(r).label for r in torch.nonzero(active).flatten().tolist()]
    freq = Counter(labels)
    return FeatureDashboard(site, latent, float(active.float().mean()), float(z.max()) if z.numel() else 0.0,
                            top_steps, counts.tolist(), [float(e) for e in edges], promoted, suppressed,
                            {label: freq.get(label, 0) for label in LABELS})
