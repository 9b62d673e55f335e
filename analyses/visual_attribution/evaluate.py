"""Faithfulness of visual attribution on toy-vlm scenes, where the true region of every span is known.

The study (issue 14, item 7, the part built so far): toy-vlm's description spans ("top-left red
ring") each name one grid cell, which is one visual token. Regions are the nine cells, or each
object's true box plus the background (`regions="objects"`, the same table), or K Ward clusters; any
supported VLM family runs it on the same scenes (`scene_text_and_spans`, `scene_regions`). On training
scenes the exhaustive effects (teacher-forced on the reference trace) train the amortized estimator;
on held-out scenes each method's scores are compared with the exhaustive effects:

- Pearson and Spearman correlation over a span's regions (averaged over spans), and R^2 of the
  calibrated amortized predictions (raw attention has no scale: no R^2);
- ground-truth hit rate: the top-scored region is the span's true cell (exhaustive included);
- linear datamodeling score (LDS): over random half-size sets of cells, the Spearman correlation
  between the sum of a method's scores over the set and the span's actual drop with the set masked;
- deletion: the span's drop with a method's top-k cells masked (higher = the method found what matters);
- per-span cost (seconds) of each method on this machine.

The estimator's settings (feature transform, epochs, penalty) are chosen on development-split scenes
(`choose_settings`, with `n_dev`), never on the evaluation scenes; the choice and every candidate's
development score go into the result's settings.

95% percentile-bootstrap intervals over held-out spans (analyses.evaluation); the amortized estimator
against raw attention with paired sign tests (Spearman, LDS, deletion), and against input x gradient
(the gradient slot, probes.gradients, read at the image tokens) on Spearman. Not measured here:
Captum's FeatureAblation.

Example:
    >>> from probes import Engine
    >>> result = run_study(Engine.from_id("toy-vlm:small"), n_train=4, n_eval=4)  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analyses.evaluation import bootstrap_interval, sign_test
from analyses.visual_attribution.attribution import (attention_features_batch, exhaustive_effects,
                                                     gradient_scores, masked_drops as drops, raw_attention)
from analyses.visual_attribution.estimator import AmortizedAttribution
from analyses.visual_attribution.regions import (Region, cluster_regions, grid_regions, object_regions,
                                                 positions)
from probes.image_regions import region_cells
from probes.backend import Backend, require
from probes.toys import vlm
from probes.vision import expand, image_token_groups, spec_of
from thoughtscope import checks
from thoughtscope.errors import BadInputError, RequestTooLargeError
from thoughtscope.imports import importing


@dataclass
class SceneResult:
    """One scene: its spans' true cells, exhaustive effects and attention features [spans, regions, ...]."""

    true_cells: list[int]
    effects: np.ndarray
    features: np.ndarray
    seconds_exhaustive: float
    seconds_features: float
    text: str = ""
    image: Any = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    regions: list[Any] = field(default_factory=list)


@dataclass
class StudyResult:
    settings: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    costs: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    example: dict[str, Any] = field(default_factory=dict)
    estimator: Any = field(default=None, repr=False)  # the fitted AmortizedAttribution (not in to_dict)

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "metrics": self.metrics, "costs": self.costs,
                "comparison": self.comparison, "example": self.example}


REGION_KINDS = ("grid", "objects")
REGION_NOTES = {"grid": "the 9 grid cells (one visual token each)",
                "objects": "each object's true pixel box (the visual tokens it overlaps) and the background (the "
                           "tokens no object box touches)"}


def _is_toy(backend: Backend) -> bool:
    return str(backend.info().get("model_id", "")).startswith("toy-vlm")


def scene_text_and_spans(backend: Backend, example: Any) -> tuple[str, list[tuple[int, int]]]:
    """The scene's prompt and reference trace as one text for this backend, and each description span's
    token positions [start, end) in the traced (expanded) sequence. toy-vlm: its word-level layout; any
    other VLM: the model's image placeholder, its own tokenizer, spans from the tokens' character offsets."""
    if _is_toy(backend):
        text = f"{vlm.prompt_text(example.question)} {example.trace} <eos>"
        return text, [(example.input_positions(s).start, example.input_positions(s).stop) for s in example.spans]
    spec = spec_of(backend)
    head = f"{spec.placeholder} {example.question}\n"
    text = head + example.trace
    ids = backend.encode(text)
    shift = len(expand(spec, ids, 1)[0]) - len(ids)  # the spans follow the image
    ends = np.cumsum([len(t) for t in backend.token_texts(ids)])
    lead = int(ends[-1]) - len(text)  # characters the tokenizer put before the text (a BOS token's text)
    spans = []
    for s in example.spans:
        a, b = lead + len(head) + s.start, lead + len(head) + s.end
        first = int(np.searchsorted(ends, a, side="right"))  # the token holding character a
        last = int(np.searchsorted(ends, b - 1, side="right"))  # the token holding character b - 1
        spans.append((first + shift, last + 1 + shift))
    return text, spans


def scene_regions(backend: Backend, spec: Any, example: Any, text: str, k: int | None = None,
                  regions: str = "grid") -> tuple[list[Region], list[int]]:
    """(regions, each span's true region index) of a scene: `regions="grid"` the 9 scene cells (on toy-vlm
    exactly its 9 visual tokens; on another family the tokens whose centres lie in the cell),
    `"objects"` the objects' true boxes plus the background (`object_regions`), or with `k` k Ward clusters
    of the visual tokens' features (`resid_pre.0`, the projected patch features). A span's true region is
    the one holding its object: its box, or (grid, clusters) its cell's centre token."""
    checks.choice("regions", regions, REGION_KINDS)
    if regions == "objects":
        return object_regions(spec, example), [s.object_index for s in example.spans]
    size = (int(example.image.shape[1]), int(example.image.shape[0]))
    cell_boxes = [(c * vlm.CELL, r * vlm.CELL, (c + 1) * vlm.CELL, (r + 1) * vlm.CELL)
                  for r in range(vlm.GRID) for c in range(vlm.GRID)]
    centre = [region_cells(spec, (x0 + vlm.CELL / 2 - 0.5, y0 + vlm.CELL / 2 - 0.5, x0 + vlm.CELL / 2 + 0.5,
                                  y0 + vlm.CELL / 2 + 0.5), size)[0] for x0, y0, _, _ in cell_boxes]
    if k:
        trace = backend.trace(text, capture=["resid_pre.0"], images=[example.image])
        group = image_token_groups(spec, trace.token_ids)[0]
        found = cluster_regions(spec, trace.activations["resid_pre.0"][group][spec.lead:].double().numpy(), k)
    elif spec.grid == vlm.GRID:
        found = grid_regions(spec, vlm.GRID, vlm.GRID)
    else:  # each token to the scene cell holding its centre; a cell holding no token's centre gets its centre's token
        owner = [min(int((t % spec.grid + 0.5) / spec.grid * vlm.GRID), vlm.GRID - 1)
                 + vlm.GRID * min(int((t // spec.grid + 0.5) / spec.grid * vlm.GRID), vlm.GRID - 1)
                 for t in range(spec.grid ** 2)]
        found = [Region(vlm.CELL_NAMES[c], tuple(t for t in range(spec.grid ** 2) if owner[t] == c) or (centre[c],),
                        cell_boxes[c]) for c in range(vlm.GRID ** 2)]
    if not k:  # the grid's regions are the scene's cells in reading order
        return found, [s.cell for s in example.spans]
    return found, [next(j for j, r in enumerate(found) if centre[s.cell] in r.cells) for s in example.spans]


def toy_scene(backend: Backend, example: Any, k: int | None = None, regions: str = "grid") -> SceneResult:
    """Exhaustive effects and attention features of one toy-vlm example's description spans, over the
    scene's 9 cells, its objects (`regions="objects"`) or, with `k`, over k Ward clusters of the visual
    tokens' features (`scene_regions`); any VLM family runs it (the scene image resized to its input).
    `toy_scenes` of one scene: its features from its own pass."""
    return toy_scenes(backend, [example], k, regions)[0]


# Scenes a forward of the amortized side's attention pass: the row budget exhaustive ablation gets for its
# K + 1 masked rows (`exhaustive_effects`' `batch_size`), given to the features as one row per scene.
FEATURE_BATCH = 32


def toy_scenes(backend: Backend, examples: Sequence[Any], k: int | None = None, regions: str = "grid",
               progress: Callable[[int, int], None] | None = None) -> list[SceneResult]:
    """`toy_scene` of many examples, as a researcher attributes a set of scenes: each scene's exhaustive
    effects (its K + 1 masked rows in one forward), then every scene's attention features in forwards of
    `FEATURE_BATCH` scenes (`attention_features_batch`: each scene's features equal its own pass within float
    rounding, tests/test_visual_attribution_engine.py). A scene's `seconds_features` is its batch's time
    divided by the scenes in it. A batch refused as too large (the memory budget, a server's images per request)
    is halved until it fits. `progress(done, total)` after each scene's effects (the features' forwards are a
    small share of the time: one per `FEATURE_BATCH` scenes)."""
    spec = spec_of(backend)
    prepared, effects, seconds = [], [], []
    for i, ex in enumerate(examples):
        text, spans = scene_text_and_spans(backend, ex)
        found, true = scene_regions(backend, spec, ex, text, k, regions)
        start = time.perf_counter()
        effects.append(exhaustive_effects(backend, text, ex.image, spans, found))
        seconds.append(time.perf_counter() - start)
        prepared.append((text, ex.image, spans, found, true))
        if progress is not None:
            progress(i + 1, len(examples))
    feats, per_scene = [], []
    size = FEATURE_BATCH
    first = 0
    while first < len(prepared):
        chunk = prepared[first:first + size]
        start = time.perf_counter()
        try:
            feats.extend(attention_features_batch(backend, [(t, im, sp, rg) for t, im, sp, rg, _ in chunk],
                                                  batch_size=size))
        except RequestTooLargeError:  # over the memory budget or a server's bound (images per request): both
            if size == 1:  # refuse before any model work, so a smaller batch costs nothing but the refusal
                raise
            size = max(1, size // 2)
            continue
        per_scene.extend([(time.perf_counter() - start) / len(chunk)] * len(chunk))
        first += len(chunk)
    return [SceneResult(true, eff, f, sec, f_sec, text, image, spans, list(found))
            for (text, image, spans, found, true), eff, f, sec, f_sec in zip(prepared, effects, feats, seconds,
                                                                              per_scene)]


def masked_drops(backend: Backend, scene: SceneResult, region_sets: list[tuple[int, ...]]) -> np.ndarray:
    """[sets, spans]: each span's log-prob drop (nats) with attention to a set of the scene's regions
    masked in every layer, all of them at once (the sets batched as rows of few forwards, every span
    read from them)."""
    spec = spec_of(backend)
    ids = expand(spec, backend.encode(scene.text), 1)[0]
    sets = [positions(spec, ids, Region("set", tuple(sorted(c for j in chosen for c in scene.regions[j].cells))))
            for chosen in region_sets]
    return drops(backend, scene.text, scene.image, scene.spans, sets)


def faithfulness(backend: Backend, scene: SceneResult, scores: dict[str, np.ndarray], n_subsets: int = 8,
                 deletion_k: tuple[int, ...] = (1, 2), seed: int = 0) -> dict[str, list[float]]:
    """Per span and method: the linear datamodeling score (Spearman, over `n_subsets` random half-size
    sets of regions, between the sum of the method's scores over the set and the span's actual drop
    with the whole set masked) and the drop after deleting the method's top-k regions."""
    rng = np.random.default_rng([seed, len(scene.text)])
    n_cells = scene.effects.shape[1]
    subsets = [tuple(sorted(rng.choice(n_cells, size=n_cells // 2, replace=False).tolist())) for _ in range(n_subsets)]
    out: dict[str, list[float]] = {}
    if n_subsets >= 3:
        actual = masked_drops(backend, scene, subsets)  # [subsets, spans]
        for name, sc in scores.items():
            out[f"{name}_lds"] = [_spearman(np.array([sc[i, list(c)].sum() for c in subsets]), actual[:, i])
                                  for i in range(len(scene.spans))]
    wanted: dict[tuple[int, ...], None] = {}
    tops = {(name, i, k): tuple(sorted(np.argsort(-sc[i])[:k].tolist()))
            for name, sc in scores.items() for i in range(len(scene.spans)) for k in deletion_k}
    for cells in tops.values():
        wanted.setdefault(cells)
    sets = list(wanted)
    drops = masked_drops(backend, scene, sets) if sets else np.zeros((0, len(scene.spans)))
    index = {c: j for j, c in enumerate(sets)}
    for (name, i, k), cells in tops.items():
        out.setdefault(f"{name}_deletion_top{k}", []).append(float(drops[index[cells], i]))
    return out


# The development grid: what `choose_settings` tries (lr stays 0.05: Adam on ~20 standardised features).
DEV_GRID: dict[str, tuple[Any, ...]] = {"features": ("raw", "log"), "epochs": (100, 300, 1000),
                                        "l2": (0.0, 1e-3, 1e-1)}


def _pairs(scenes: list[SceneResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X [pairs, F], y [pairs], groups [pairs]: one group per span) of scenes' (span, region) pairs."""
    X = np.concatenate([s.features.reshape(-1, s.features.shape[-1]) for s in scenes])
    y = np.concatenate([s.effects.reshape(-1) for s in scenes])
    groups, offset = [], 0
    for s in scenes:  # one group per span: the loss ranks a span's regions
        n_spans_k, n_regions = s.effects.shape
        groups.append(np.repeat(offset + np.arange(n_spans_k), n_regions))
        offset += n_spans_k
    return X, y, np.concatenate(groups)


def choose_settings(train: list[SceneResult], dev: list[SceneResult], seed: int = 0,
                    grid: dict[str, tuple[Any, ...]] | None = None,
                    progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The estimator's settings chosen on development scenes: every combination of `grid` (DEV_GRID) is
    fit on `train` and scored by the mean per-span Spearman correlation of its predictions with the
    exhaustive effects of `dev` (ties: the first in grid order). Returns {"chosen": params, "criterion",
    "candidates": [{params, dev_spearman}], "n_dev_scenes", "n_dev_spans"}; the evaluation scenes are
    never seen here."""
    grid = dict(DEV_GRID if grid is None else grid)
    if not dev:
        raise BadInputError("choosing settings needs at least one development scene")
    X, y, groups = _pairs(train)
    names = list(grid)
    combos = list(itertools.product(*(grid[n] for n in names)))
    candidates = []
    for i, values in enumerate(combos):
        params = dict(zip(names, values))
        est = AmortizedAttribution(seed=seed, **params).fit(X, y, groups)
        rhos = []
        for s in dev:
            pred = est.predict(s.features.reshape(-1, s.features.shape[-1])).reshape(s.effects.shape)
            rhos.extend(_spearman(pred[k], s.effects[k]) for k in range(len(pred)))
        candidates.append({"params": params, "dev_spearman": float(np.mean(rhos))})
        if progress is not None:
            progress("dev choice", i + 1, len(combos))
    best = max(range(len(candidates)), key=lambda k: (candidates[k]["dev_spearman"], -k))
    return {"chosen": candidates[best]["params"], "criterion": "mean per-span Spearman of the predictions vs the "
            "exhaustive effects on the development scenes", "grid": {k: list(v) for k, v in grid.items()},
            "candidates": candidates, "n_dev_scenes": len(dev), "n_dev_spans": int(sum(len(s.spans) for s in dev))}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import spearmanr

    if np.std(a) == 0 or np.std(b) == 0:
        return 0.0
    return float(spearmanr(a, b).statistic)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if np.std(a) == 0 or np.std(b) == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def run_study(backend: Backend, n_train: int = 40, n_eval: int = 40, seed: int = 0, epochs: int = 300,
              n_subsets: int = 8, deletion_k: tuple[int, ...] = (1, 2), k: int | None = None,
              progress: Callable[[str, int, int], None] | None = None, n_dev: int = 0,
              regions: str = "grid") -> StudyResult:
    """Train the estimator on `n_train` training scenes, score every method on `n_eval` eval scenes
    (with `n_subsets` random cell sets per scene for the LDS, 0 to skip it, and top-k deletion).
    With `n_dev` > 0 the estimator's settings (features, epochs, l2: DEV_GRID) are chosen on that many
    development-split scenes (`choose_settings`) and `epochs` is unused; else the defaults with `epochs`.
    `regions`: "grid" (the scene's 9 cells) or "objects" (the objects' true boxes and the background), the
    same protocol and table either way; `k` clusters instead of either."""
    require(backend, "vision", "trace", "interventions")
    clusters = k  # `k` is also the comprehension variable below
    checks.integer("n_train", n_train, low=2)
    checks.integer("n_eval", n_eval, low=2)
    checks.integer("n_dev", n_dev, low=0, why="0: no development choice")
    if not n_dev:  # the estimator's epochs, checked before any scene is read (it was said after all of them)
        checks.integer("epochs", epochs, low=1)
    checks.integer("n_subsets (LDS cell sets per scene)", n_subsets, low=0, why="0 skips the LDS")
    for top in deletion_k:
        checks.integer("a deletion k", top, low=1)
    checks.choice("regions", regions, REGION_KINDS)
    n_tokens = spec_of(backend).grid ** 2
    if clusters is not None and not (isinstance(clusters, int) and 2 <= clusters <= n_tokens):
        raise BadInputError(f"K={clusters} regions: this model has {n_tokens} visual tokens, so K must be "
                            f"2..{n_tokens}")
    if clusters is not None and regions != "grid":
        raise BadInputError(f"K clusters replace the regions: give K or regions={regions!r}, not both")
    scenes: dict[str, list[SceneResult]] = {}
    for split, n in (("train", n_train), ("dev", n_dev), ("eval", n_eval)):
        report = (lambda done, total, split=split: progress(f"{split} scenes", done, total)) if progress else None
        scenes[split] = toy_scenes(backend, vlm.examples(split, n, seed=seed), k=clusters, regions=regions,
                                   progress=report) if n else []
    train = scenes["train"]
    X, y, groups = _pairs(train)
    dev_choice = choose_settings(train, scenes["dev"], seed=seed, progress=progress) if n_dev else None
    params = dev_choice["chosen"] if dev_choice else {"epochs": epochs}
    start = time.perf_counter()
    est = AmortizedAttribution(seed=seed, **params).fit(
        X, y, groups, on_progress=(lambda d, t: progress("fit", d, t)) if progress else None)
    fit_seconds = time.perf_counter() - start

    rows: dict[str, list[float]] = {k: [] for k in (
        "amortized_pearson", "amortized_spearman", "attention_pearson", "attention_spearman",
        "gradient_pearson", "gradient_spearman", "amortized_hit", "attention_hit", "gradient_hit",
        "exhaustive_hit")}
    gradient_seconds = 0.0
    predicted, truth = [], []
    predict_seconds = 0.0
    for n_done, s in enumerate(scenes["eval"]):
        t0 = time.perf_counter()
        pred = est.predict(s.features.reshape(-1, s.features.shape[-1])).reshape(s.effects.shape)
        predict_seconds += time.perf_counter() - t0
        raw = raw_attention(s.features)
        t0 = time.perf_counter()
        grad = gradient_scores(backend, s.text, s.image, s.spans, s.regions)
        gradient_seconds += time.perf_counter() - t0
        faith = faithfulness(backend, s, {"amortized": pred, "attention": raw, "gradient": grad,
                                          "exhaustive": s.effects}, n_subsets=n_subsets, deletion_k=deletion_k,
                             seed=seed)
        for key, values in faith.items():
            rows.setdefault(key, []).extend(values)
        if progress is not None:
            progress("faithfulness", n_done + 1, len(scenes["eval"]))
        for i, cell in enumerate(s.true_cells):
            e = s.effects[i]
            rows["amortized_pearson"].append(_pearson(pred[i], e))
            rows["amortized_spearman"].append(_spearman(pred[i], e))
            rows["attention_pearson"].append(_pearson(raw[i], e))
            rows["attention_spearman"].append(_spearman(raw[i], e))
            rows["gradient_pearson"].append(_pearson(grad[i], e))
            rows["gradient_spearman"].append(_spearman(grad[i], e))
            rows["gradient_hit"].append(float(np.argmax(grad[i]) == cell))
            rows["amortized_hit"].append(float(np.argmax(pred[i]) == cell))
            rows["attention_hit"].append(float(np.argmax(raw[i]) == cell))
            rows["exhaustive_hit"].append(float(np.argmax(e) == cell))
            predicted.extend(pred[i].tolist())
            truth.extend(e.tolist())
    predicted_a, truth_a = np.array(predicted), np.array(truth)
    r2 = 1 - float(((truth_a - predicted_a) ** 2).sum() / ((truth_a - truth_a.mean()) ** 2).sum())
    metrics = {k: bootstrap_interval(v, seed=seed).to_dict() for k, v in rows.items()}
    metrics["amortized_r2_all_pairs"] = r2
    n_spans = len(rows["amortized_hit"])
    n_train_spans = sum(len(s.true_cells) for s in train)
    exhaustive_s = sum(s.seconds_exhaustive for s in scenes["eval"]) / n_spans
    features_s = sum(s.seconds_features for s in scenes["eval"]) / n_spans
    amortized_s = features_s + predict_seconds / n_spans
    costs = {
        "exhaustive_s_per_span": exhaustive_s,
        "amortized_s_per_span": amortized_s,
        "attention_s_per_span": features_s,
        "gradient_s_per_span": gradient_seconds / n_spans,
        "speedup_exhaustive_over_amortized": exhaustive_s / amortized_s if amortized_s > 0 else None,
        "fit_seconds": fit_seconds,
        "note": "per span = per scene cost / spans in the scene; the amortized cost counts one extra pass "
                f"capturing attention, up to {FEATURE_BATCH} scenes a forward as exhaustive ablation gets "
                f"{FEATURE_BATCH} rows a forward (during streaming generation those rows already exist)",
    }
    test = sign_test(rows["amortized_spearman"], rows["attention_spearman"], lower_is_better=False)
    comparison = {"amortized_vs_attention_spearman": test.to_dict(),
                  "amortized_vs_gradient_spearman": sign_test(rows["amortized_spearman"], rows["gradient_spearman"],
                                                              lower_is_better=False).to_dict()}
    for metric in [m for m in ("lds", *(f"deletion_top{k}" for k in deletion_k)) if f"amortized_{m}" in rows]:
        comparison[f"amortized_vs_attention_{metric}"] = sign_test(
            rows[f"amortized_{metric}"], rows[f"attention_{metric}"], lower_is_better=False).to_dict()
    settings = {"n_train_scenes": n_train, "n_eval_scenes": n_eval, "n_train_spans": n_train_spans,
                "n_eval_spans": n_spans, "seed": seed,
                "regions": (f"{clusters} Ward clusters of resid_pre.0 at the image tokens, per scene" if clusters
                            else REGION_NOTES[regions] if regions != "grid" or _is_toy(backend) else
                            "the 9 scene cells, each the visual tokens whose centres lie in it"),
                "estimator": {"epochs": est.epochs, "lr": est.lr, "l2": est.l2, "features": est.features},
                "n_dev_scenes": n_dev,
                "dev_choice": dev_choice if dev_choice else "none: the estimator's default settings, not tuned",
                "epochs": est.epochs, "model": backend.info().get("model_id"), "split_rule": vlm.__name__ + ".split_of",
                "spans": "description phrases of the reference trace (teacher-forced)",
                "lds": f"{n_subsets} random sets of half the cells per scene (Spearman of summed scores vs the "
                       "span's drop with the set masked)" if n_subsets >= 3 else "skipped",
                "deletion": f"drop with the method's top-k cells masked, k in {list(deletion_k)}"}
    first = scenes["eval"][0]
    example = {"true_cells": first.true_cells, "effects": first.effects.round(4).tolist(),
               "amortized": est.predict(first.features.reshape(-1, first.features.shape[-1]))
               .reshape(first.effects.shape).round(4).tolist(),
               "attention": raw_attention(first.features).round(4).tolist()}
    return StudyResult(settings, metrics, costs, comparison, example, est)


def fit_estimator(backend: Backend, n_train: int = 10, seed: int = 0, epochs: int = 300,
                  progress: Callable[[str, int, int], None] | None = None) -> AmortizedAttribution:
    """The amortized estimator fitted on `n_train` toy-vlm training scenes with exhaustive effects as targets:
    the same scenes, pairs and settings as `run_study(n_train=..., epochs=..., seed=...)` without a development
    choice, so it equals that study's estimator. `progress(stage, done, total)` after each scene and epoch."""
    checks.integer("n_train", n_train, low=1)
    checks.integer("epochs", epochs, low=1)  # before the scenes
    scenes = toy_scenes(backend, vlm.examples("train", n_train, seed=seed),
                        progress=(lambda done, total: progress("train scenes", done, total)) if progress else None)
    X, y, groups = _pairs(scenes)
    return AmortizedAttribution(seed=seed, epochs=epochs).fit(
        X, y, groups, on_progress=(lambda d, t: progress("fit", d, t)) if progress else None)
