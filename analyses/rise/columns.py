"""RISE analysis of trained SAEs: column association, decoder geometry, behaviour vectors (per layer).

Column association [summary]: each labelled step's argmax latent votes for its label; the most
voted columns form the label's column set (vote thresholds are ours [recon]). Geometry: UMAP
(cosine) of the decoder columns and the silhouette of the behaviour groups per layer [summary].
Behaviour vector: the mean of a behaviour's own columns, renormalised [summary].
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from analyses.rise.harvest import Harvest
from analyses.rise.labels import BEHAVIOURS, LABELS
from analyses.rise.quality import latent_auroc, sae_quality, step_silhouette
from saes.io import check_fits
from saes.stats import encode_all, sae_stats
from thoughtscope.errors import BadInputError
from thoughtscope.imports import import_module, importing

@dataclass
class ColumnAssociation:
    """Argmax-latent votes: `votes[label][column]`, the column sets, and one label per column."""

    votes: dict[str, dict[int, int]]
    column_sets: dict[str, list[int]]
    column_labels: list[str | None]  # the label a column got most votes for, None if no votes

    def to_dict(self) -> dict[str, Any]:
        return {"votes": {k: {str(c): n for c, n in v.items()} for k, v in self.votes.items()},
                "column_sets": self.column_sets,
                "n_labelled_columns": sum(label is not None for label in self.column_labels)}


def associate_columns(latents: torch.Tensor, labels: Sequence[str], top_n: int = 8,
                      min_votes: int = 1) -> ColumnAssociation:
    """Each step votes with its argmax latent for its label; a label's set is its `top_n` most
    voted columns with at least `min_votes` votes. Steps where no latent fires do not vote."""
    latents = torch.as_tensor(latents).float()
    if latents.shape[0] != len(labels):
        raise BadInputError(f"{latents.shape[0]} latent rows but {len(labels)} labels")
    winners = latents.argmax(1).tolist()
    fired = (latents.max(1).values > 0).tolist()
    votes: dict[str, Counter] = {label: Counter() for label in LABELS}
    for col, ok, label in zip(winners, fired, labels):
        if ok:
            votes.setdefault(label, Counter())[col] += 1
    sets = {label: [c for c, n in counter.most_common(top_n) if n >= min_votes] for label, counter in votes.items()}
    column_labels: list[str | None] = [None] * latents.shape[1]
    best = np.zeros(latents.shape[1])
    for label in votes:  # LABELS order: on a tie the behaviour wins over `other`
        for col, n in votes[label].items():
            if n > best[col]:
                best[col], column_labels[col] = n, label
    return ColumnAssociation({k: dict(v) for k, v in votes.items()}, sets, column_labels)


def behaviour_vectors(w_dec: torch.Tensor, column_sets: dict[str, list[int]],
                      behaviours: Sequence[str] = BEHAVIOURS) -> dict[str, torch.Tensor]:
    """Unit vector per behaviour: mean of its decoder rows, leaving out rows in several labels' sets."""
    w_dec = torch.as_tensor(w_dec).detach().float()
    owners = Counter(c for cols in column_sets.values() for c in set(cols))
    vectors = {}
    for label in behaviours:
        own = [c for c in column_sets.get(label, []) if owners[c] == 1]
        if own:
            v = w_dec[own].mean(0)
            if float(v.norm()) > 0:
                vectors[label] = v / v.norm()
    return vectors


def decoder_geometry(w_dec: torch.Tensor, column_labels: Sequence[str | None], method: str = "umap",
                     seed: int = 0, n_neighbors: int = 15) -> tuple[np.ndarray, float | None, float | None]:
    """2-D map of the decoder columns (UMAP, cosine; or PCA) and the silhouette of the labelled
    columns' groups: (coords [d_sae, 2], silhouette on the columns (cosine), silhouette on the map)."""
    w = torch.as_tensor(w_dec).detach().float().numpy()
    coords = _project(w, method, seed, n_neighbors)
    keep = [i for i, label in enumerate(column_labels) if label is not None]
    groups = [column_labels[i] for i in keep]
    return coords, _silhouette(w[keep], groups, "cosine"), _silhouette(coords[keep], groups, "euclidean")


def _project(w: np.ndarray, method: str, seed: int, n_neighbors: int) -> np.ndarray:
    if method not in ("umap", "pca"):
        raise BadInputError(f"projection {method!r}; use umap or pca")
    if method == "umap" and w.shape[0] > 4:
        # lazy: umap (numba, pynndescent, scikit-learn) takes seconds to import; only this needs it. Under the
        # heavy-imports lock: the app's job threads reach it while the warm-up thread imports scikit-learn
        umap = import_module("umap")

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # umap warns that a seed disables parallelism
            reducer = umap.UMAP(n_components=2, metric="cosine", random_state=seed,
                                n_neighbors=max(2, min(n_neighbors, w.shape[0] - 1)), init="random")
            return reducer.fit_transform(w).astype(np.float32)
    centred = w - w.mean(0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    coords = u[:, :2] * s[:2]
    return np.pad(coords, ((0, 0), (0, 2 - coords.shape[1]))).astype(np.float32)


def _silhouette(x: np.ndarray, groups: Sequence[str], metric: str) -> float | None:
    with importing("sklearn.metrics"):  # lazy: scikit-learn takes seconds to import
        from sklearn.metrics import silhouette_score

    n_groups = len(set(groups))
    if n_groups < 2 or n_groups > len(groups) - 1:
        return None  # undefined: silhouette needs 2 <= groups <= samples - 1
    return float(silhouette_score(x, list(groups), metric=metric))


# --------------------------------------------------------------------------- per-layer analysis


@dataclass
class LayerAnalysis:
    """One layer: its SAE's quality, column association, geometry and behaviour vectors."""

    site: str
    stats: Any  # saes.stats.SAEStats
    association: ColumnAssociation
    coords: np.ndarray
    silhouette: float | None
    silhouette_map: float | None
    vectors: dict[str, torch.Tensor]
    top_latents: np.ndarray  # [n_steps, k] strongest latents of each step (step timeline)
    quality: dict[str, dict[str, float]] = None  # SAELens' EV / L0 on the training and the held-out steps
    auroc: dict[str, dict[str, Any]] = None  # best latent per label (chosen on training steps), held-out AUROC
    heldout_silhouette: float | None = None  # held-out steps' latent codes grouped by label (cosine)

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "sae": self.stats.to_dict(), "association": self.association.to_dict(),
                "silhouette": self.silhouette, "silhouette_map": self.silhouette_map,
                "heldout_silhouette": self.heldout_silhouette, "quality": self.quality, "auroc": self.auroc,
                "behaviour_vectors": sorted(self.vectors),
                "vector_cosines": _cosines(self.vectors)}


def _cosines(vectors: dict[str, torch.Tensor]) -> dict[str, float]:
    names = sorted(vectors)
    return {f"{a}|{b}": float(vectors[a] @ vectors[b]) for i, a in enumerate(names) for b in names[i + 1:]}


@dataclass
class RiseAnalysis:
    layers: list[LayerAnalysis]
    label_counts: dict[str, int]

    @property
    def best_site(self) -> str:
        """The layer whose behaviour groups separate best (the paper steers at such a layer)."""
        scored = [(la.silhouette if la.silhouette is not None else -2.0, la.site) for la in self.layers]
        return max(scored)[1]

    def layer(self, site: str) -> LayerAnalysis:
        for la in self.layers:
            if la.site == site:
                return la
        raise BadInputError(f"no analysis for {site}; analysed: {[la.site for la in self.layers]}")

    def to_dict(self) -> dict[str, Any]:
        return {"label_counts": self.label_counts, "best_site": self.best_site,
                "silhouette_per_layer": {la.site: la.silhouette for la in self.layers},
                "layers": [la.to_dict() for la in self.layers]}


def analyse(harvest: Harvest, saes: dict[str, Any], method: str = "umap", top_n: int = 8, min_votes: int = 1,
            seed: int = 0, heldout_rows: Sequence[int] = (), classes: Sequence[str] = LABELS,
            geometry: dict[str, dict[str, Any]] | None = None) -> RiseAnalysis:
    """Column association, geometry and behaviour vectors for every layer that has an SAE.

    `geometry[site]` (`coords`, `silhouette`, `silhouette_map`, as an earlier `decoder_geometry` of the
    same SAE returned them) skips the projection: how a stored result redraws without refitting UMAP.

    Rows in `heldout_rows` (the steps of traces the SAEs were not trained on) take no part in the
    association; they measure the SAE (`quality["heldout"]`, `stats`), the best latent per label
    (`auroc`: chosen on the other rows, scored on these) and the held-out silhouette.
    """
    labels = harvest.labels
    held = sorted(set(int(r) for r in heldout_rows))
    train = [r for r in range(len(labels)) if r not in set(held)]
    train_labels, held_labels = [labels[r] for r in train], [labels[r] for r in held]
    layers = []
    for site, sae in saes.items():
        acts = harvest.acts[site]
        check_fits(sae, acts.shape[1], site)
        latents = encode_all(sae, acts)
        assoc = associate_columns(latents[train], train_labels, top_n=top_n, min_votes=min_votes)
        if geometry is not None and site in geometry:
            g = geometry[site]
            coords, sil, sil_map = np.asarray(g["coords"], dtype=float), g["silhouette"], g["silhouette_map"]
        else:
            coords, sil, sil_map = decoder_geometry(sae.W_dec, assoc.column_labels, method=method, seed=seed)
        top = latents.topk(min(3, latents.shape[1]), dim=1).indices.numpy()
        quality = {"train": sae_quality(sae, acts[train]), "heldout": sae_quality(sae, acts[held])}
        stats = sae_stats(sae, acts[held] if held else acts)
        auroc = latent_auroc(latents[train], train_labels, latents[held], held_labels, classes)
        layers.append(LayerAnalysis(site, stats, assoc, coords, sil, sil_map,
                                    behaviour_vectors(sae.W_dec, assoc.column_sets), top, quality, auroc,
                                    step_silhouette(latents[held], held_labels) if held else None))
    return RiseAnalysis(layers, harvest.label_counts())
