"""RISE checked against the `toy-reasoner` organism's ground truth (issue 11): `thoughtscope eval rise-organism`.

The organism plants reflection and backtracking steps at known rates that depend on what it computes
(more after a hard step), and its generator's labeller reads every step exactly. So each claim of
RISE can be checked:

1. **Latents separate the behaviours.** The pipeline (analyses.rise.pipeline) harvests the
   organism's own sampled traces from the generator's calibration split, keeps a seeded share of
   the traces out of SAE training, and trains one SAE per layer. On the held-out traces' steps:
   SAE quality as SAELens computes it (explained variance, L0), the silhouette of the steps'
   latent codes by label, and for each planted kind (compute, reflection, backtrack, redundant)
   the AUROC of the single latent that best separates it on the training steps.
2. **The vectors steer.** At the layer whose behaviour groups separate best (chosen on the
   harvest, never on the steering problems), the reflection and backtracking vectors are added
   to the residual stream while the organism samples on the generator's eval split; the labeller
   counts the behaviours per trace. Rates, accuracy and length get 95% bootstrap intervals over
   problems, each alpha is compared with alpha = 0 on the same problems (Wilcoxon signed-rank on
   the per-problem counts), and the report says whether the rate moves monotonically in alpha.

Steering is additive, h + alpha s w, with the unit vector w scaled by s = the mean norm of the
harvested step vectors at that layer, so alpha is a fraction of the residual norm (the paper's
projection mode, h - alpha w (w.h), is `mode="projection"` and scale-free). A control steers with
a random unit direction (seeded) at the same alphas: a behaviour vector is only specific if it
moves its behaviour more than a random push of the same size does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from analyses.evaluation import wilcoxon_test
from analyses.families import default_task
from analyses.organism import is_organism, step_kinds
from analyses.rise.pipeline import RiseOptions, RisePipeline
from analyses.rise.quality import latent_auroc
from analyses.rise.steer import SteeringResult, check_steering, steer
from probes.backend import Backend
from saes.stats import encode_all
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing
from thoughtscope.provenance import provenance

DEFAULT_ALPHAS = (-0.4, -0.2, -0.1, 0.0, 0.1, 0.2, 0.4)
DEFAULT_PROJECTION_ALPHAS = (-2.0, -1.0, 0.0, 1.0, 1.5)
KINDS = ("compute", "reflection", "backtrack", "redundant")

Progress = Callable[[str, int, int], None]


@dataclass
class RiseOrganismReport:
    """Everything `eval rise-organism` measured (see the module docstring)."""

    model: str
    task: str
    site: str
    layers: list[dict[str, Any]]  # per layer: SAE quality (train / held-out), silhouettes, AUROC tables
    steering: dict[str, SteeringResult]  # per behaviour vector
    comparisons: dict[str, list[dict[str, Any]]]  # per behaviour: each alpha vs 0 on the same problems
    harvest: dict[str, Any]
    settings: dict[str, Any]
    seconds: dict[str, float]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"command": "eval rise-organism", "model": self.model, "task": self.task, "site": self.site,
                "layers": self.layers, "steering": {k: v.to_dict() for k, v in self.steering.items()},
                "comparisons": self.comparisons, "harvest": self.harvest, "settings": self.settings,
                "seconds": self.seconds, "provenance": self.provenance}


def _kinds_and_rows(pipeline: RisePipeline, found: dict[str, Any]) -> tuple[list[str], list[int], list[int]]:
    """Each harvested step's planted kind (the organism's labeller), the training rows and the held-out rows."""
    h = found["harvest"]
    kinds = []
    for r in range(len(h.step_rows)):
        read = step_kinds(h.step(r).text)
        kinds.append(read[0] if read else "other")
    held = set(pipeline.heldout_rows(h))
    return kinds, [r for r in range(len(kinds)) if r not in held], sorted(held)


def kind_auroc(pipeline: RisePipeline, found: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per site, per planted kind: the best latent on the training steps and its held-out AUROC."""
    h = found["harvest"]
    kinds, train, rows = _kinds_and_rows(pipeline, found)
    out = {}
    for site, sae in found["saes"].items():
        z = encode_all(sae, h.acts[site])
        out[site] = latent_auroc(z[train], [kinds[r] for r in train], z[rows], [kinds[r] for r in rows], KINDS)
    return out


def probe_auroc(pipeline: RisePipeline, found: dict[str, Any], seed: int = 0) -> dict[str, dict[str, float | None]]:
    """The ceiling for `kind_auroc`: a logistic-regression probe on the raw step vectors (one per kind, fitted
    on the training steps), scored by AUROC on the held-out steps. A latent far below it means the
    information is in the residual stream but the SAE spread it over several latents."""
    # lazy: scikit-learn takes seconds to import
    with importing("sklearn.linear_model", "sklearn.metrics", "sklearn.pipeline", "sklearn.preprocessing"):
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import roc_auc_score
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

    h = found["harvest"]
    kinds, train, rows = _kinds_and_rows(pipeline, found)
    y_train, y_held = np.asarray([kinds[r] for r in train]), np.asarray([kinds[r] for r in rows])
    out: dict[str, dict[str, float | None]] = {}
    for site in found["saes"]:
        x = h.acts[site].float().numpy()
        out[site] = {}
        for kind in KINDS:
            pos_train, pos_held = y_train == kind, y_held == kind
            if pos_train.all() or not pos_train.any() or pos_held.all() or not pos_held.any():
                out[site][kind] = None
                continue
            model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed))
            model.fit(x[train], pos_train)
            out[site][kind] = float(roc_auc_score(pos_held, model.predict_proba(x[rows])[:, 1]))
    return out


def compare_alphas(result: SteeringResult, key: str) -> list[dict[str, Any]]:
    """Each alpha against alpha = 0 on the same problems: mean difference with its interval, Wilcoxon p."""
    base = next((r for r in result.rows if r.alpha == 0.0), None)
    if base is None:
        return []
    ref = [float(t[key]) for t in base.per_trace]
    out = []
    for row in result.rows:
        if row.alpha == 0.0:
            continue
        values = [float(t[key]) for t in row.per_trace]
        test = wilcoxon_test(values, ref, lower_is_better=False, what=f"{key} steps")
        out.append({"alpha": row.alpha, "key": key, "mean": float(np.mean(values)), "mean_at_0": float(np.mean(ref)),
                    "difference": test.difference.to_dict(), "p_value": test.p_value, "verdict": test.verdict})
    return out


def evaluate_rise_organism(backend: Backend, *, n_harvest: int = 400, n_steer: int = 150,
                           alphas: Sequence[float] = DEFAULT_ALPHAS, mode: str = "add", layers: Sequence[int] = (),
                           temperature: float = 1.0, heldout: float = 0.25, sae_steps: int | None = None,
                           d_sae: int | None = None, l1: float | None = None, seed: int = 0,
                           max_new_tokens: int = 96, batch_size: int = 32, saes: str | None = None,
                           store: str | None = None, layer: int | None = None, control: bool = True,
                           progress: Progress | None = None) -> RiseOrganismReport:
    """RISE on the organism against its ground truth (module docstring). `layer` forces the steering layer;
    `control` adds the random-direction control. A behaviour without a vector of its own at the steering
    layer (no SAE column voted for it alone) is reported by its absence from `steering`."""
    if not is_organism(backend):
        raise BadInputError("eval rise-organism needs the organism: --model toy-reasoner (or toy-reasoner:small)")
    alphas = check_steering(alphas, mode)  # before the harvest
    if 0.0 not in alphas:
        alphas = sorted([*alphas, 0.0])  # every alpha is compared with the unsteered organism
    task = default_task(backend)
    n_layers = backend.arch().n_layers
    options = RiseOptions(task=task, n=n_harvest, seed=seed, layers=tuple(layers or range(n_layers)),
                          max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                          heldout=heldout, sae_steps=sae_steps, d_sae=d_sae, l1=l1, projection="pca", saes=saes,
                          store=store)
    pipeline = RisePipeline(backend, options, on_progress=progress)
    pipeline.check_layer(layer)  # before the harvest, not after it and the SAEs' training
    if n_steer < 1:
        raise BadInputError(f"steer on at least one eval problem, got n_steer={n_steer!r}")
    t0 = time.perf_counter()
    found = pipeline.run()
    t1 = time.perf_counter()
    h, analysis = found["harvest"], found["analysis"]
    kinds = kind_auroc(pipeline, found)
    probes = probe_auroc(pipeline, found, seed=seed)
    layer_rows = []
    for la in analysis.layers:
        d = la.to_dict()
        layer_rows.append({"site": la.site, "quality": la.quality, "decoder_silhouette": la.silhouette,
                           "heldout_step_silhouette": la.heldout_silhouette, "auroc_rise_labels": la.auroc,
                           "auroc_kinds": kinds[la.site], "probe_auroc_kinds": probes[la.site],
                           "behaviour_vectors": sorted(la.vectors),
                           "vector_cosines": d["vector_cosines"], "column_sets": la.association.column_sets})
    site = f"resid_post.{layer}" if layer is not None else analysis.best_site
    la = analysis.layer(site)
    scale = float(h.acts[site].norm(dim=1).mean()) if mode == "add" else 1.0
    _, problems = pipeline.problems(n_steer)
    directions = {b: la.vectors[b] for b in ("reflection", "backtracking") if b in la.vectors}
    if control:
        noise = torch.randn(h.acts[site].shape[1], generator=torch.Generator().manual_seed(seed + 991))
        directions["random direction"] = noise / noise.norm()
    steering, comparisons = {}, {}
    for behaviour, direction in directions.items():
        stage = None if progress is None else (lambda d, t, b=behaviour: progress(f"steer {b}", d, t))
        result = steer(backend, problems, direction * scale, site, list(alphas), mode=mode,
                       settings=h.settings, behaviour=behaviour, seed=seed + 77, split="eval", on_progress=stage)
        steering[behaviour] = result
        comparisons[behaviour] = compare_alphas(result, "reflection") + compare_alphas(result, "backtracking")
    t2 = time.perf_counter()
    settings = {"n_harvest": n_harvest, "n_steer": n_steer, "alphas": [float(a) for a in alphas], "mode": mode,
                "alpha_unit": f"fraction of the mean step-vector norm at {site} ({scale:.1f})" if mode == "add"
                else "projection coefficient", "scale": scale, "temperature": temperature, "heldout": heldout,
                "seed": seed, "max_new_tokens": max_new_tokens, "options": options.to_dict(),
                "steering_site_choice": "forced" if layer is not None else "best decoder-column silhouette on the "
                                                                          "harvest (calibration split)"}
    record = provenance(backend.info(), data=task, split="harvest: calibration (held-out traces measure the SAE); "
                        "steering: eval", seed=seed, settings=settings, command="eval rise-organism")
    return RiseOrganismReport(backend.info()["model_id"], task, site, layer_rows, steering, comparisons,
                              h.to_dict(), settings, {"pipeline": t1 - t0, "steering": t2 - t1}, record)
