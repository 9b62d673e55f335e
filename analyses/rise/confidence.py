"""RISE confidence vectors: decoder-column coefficients that lower next-token entropy (METHODS.md 1, item 10).

The fit needs gradients through the frozen model, which is the backend's `minimize_entropy`
operation (in this process or on the model server); this module prepares its inputs and reads
its result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from analyses.rise.harvest import Harvest
from probes.backend import Backend
from thoughtscope.errors import BadInputError

@dataclass
class ConfidenceResult:
    """Coefficients over decoder columns that lower next-token entropy; top columns by |S|."""

    site: str
    coefficients: torch.Tensor  # [d_sae]
    top_columns: list[int]
    entropy_history: list[float]
    settings: dict[str, Any]

    def vector(self, w_dec: torch.Tensor, n: int = 3) -> torch.Tensor:
        """The enhancement direction: sum of up to `n` top columns weighted by their coefficients."""
        cols = self.top_columns[:n]
        return (self.coefficients[cols, None] * torch.as_tensor(w_dec).detach().float()[cols]).sum(0)

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "top_columns": self.top_columns,
                "top_coefficients": [float(self.coefficients[c]) for c in self.top_columns],
                "entropy_start": self.entropy_history[0] if self.entropy_history else None,
                "entropy_end": self.entropy_history[-1] if self.entropy_history else None,
                "entropy_history": self.entropy_history, "settings": self.settings}


def confidence_vectors(backend: Backend, harvest: Harvest, sae: Any, site: str, iterations: int = 30, lr: float = 0.01,
                       batch_size: int = 8, top: int = 10, seed: int = 0,
                       on_progress: Callable[[int, int], None] | None = None) -> ConfidenceResult:
    """Minimise the mean next-token entropy over the generated tokens of harvested traces when
    `S @ W_dec` is added at `site` at the positions predicting them; the model stays frozen,
    only S [d_sae] learns (Adam, cosine schedule) [summary]. Added at generated positions only,
    no regulariser [recon]; the paper's 1000 iterations at batch 256 are a GPU budget, the CPU
    default is 30 x 8.
    """
    traces = [t for t in harvest.traces if t.gen_ids]
    if not traces:
        raise BadInputError("no traces with generated tokens to fit confidence vectors on")
    fit = backend.minimize_entropy([t.prompt_ids + t.gen_ids for t in traces], [len(t.prompt_ids) for t in traces],
                                   site, sae.W_dec.detach().float().cpu(), iterations=iterations, lr=lr,
                                   batch_size=batch_size, seed=seed,
                                   on_step=(lambda i, _: on_progress(i, iterations)) if on_progress else None)
    order = fit.coefficients.abs().argsort(descending=True)[:top].tolist()
    return ConfidenceResult(site, fit.coefficients, order, list(fit.history), dict(fit.settings))
