"""One fuzzy-concepts run: harvest, split, tune on development, fit over seeds, every metric on held-out samples.

The evaluation protocol of DESIGN.md (Conventions) for METHODS.md section 2:
1. Harvest Z (`harvest`), split the samples (seeded) into train / development / evaluation.
2. Tune the K-independent settings of the fuzzy layer (projection width m, sparsity weight, learning
   rate) and the semi-NMF L1 weight on the development split with one rule, reported with every
   candidate: the lowest development reconstruction error among the settings whose mean number of
   active concepts per sample is at most `max_active`; if none is that sparse, the sparsest.
3. For each seed: fit the fuzzy layer and the baselines (semi-NMF, k-means, PCA) on a seeded
   `subsample` of the training split, then measure on the evaluation split, all through the same
   code (`metrics`): reconstruction error, active concepts, overlap of grounded words, AMI with known
   labels (when the samples have them), and stability (matched concept similarity to the other seeds).
4. 95% t-intervals over seeds (a handful of seeds is too few for a percentile bootstrap); paired
   Wilcoxon and sign tests of the per-sample reconstruction errors (mean over seeds) of the fuzzy layer
   against each baseline on the same evaluation samples, with a bootstrap interval of the difference
   (the shared protocol's `analyses.evaluation`, which also cuts the splits and records the choices).

`run_study` is what the page and `thoughtscope eval fuzzy-concepts` call; `FuzzyStudy.to_dict()` is the
JSON both export. Nothing here prints; progress goes through `on_progress(stage, done, total)`.

Example:
    >>> from probes import Engine
    >>> study = run_study(Engine.from_id("tiny-random:llama"), FuzzyOptions(word="dog", n=24, k=3, seeds=2))  # doctest: +SKIP
    >>> sorted(study.summary)  # doctest: +SKIP
    ['PCA', 'fuzzy', 'k-means', 'semi-NMF']
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from analyses.evaluation import choose_on_dev, sign_test, split_three, wilcoxon_test
from analyses.fuzzy_concepts import metrics
from analyses.fuzzy_concepts.baselines import KMeansConcepts, PCAConcepts, SemiNMFConcepts
from analyses.fuzzy_concepts.grounding import KEEP, TOP_K, ground_words, top_samples
from analyses.fuzzy_concepts.harvest import Representations, TextSource, check_layer, default_layer, harvest
from analyses.fuzzy_concepts.rules import MEMBERSHIPS, FuzzyRuleLayer, Rule, check_rules_fit
from analyses.fuzzy_concepts.scenes import SceneSource
from cache.store import ActivationStore
from probes.backend import Backend
from thoughtscope import checks
from thoughtscope.errors import BadInputError

Progress = Callable[[str, int, int], None]
METHODS = ("fuzzy", "semi-NMF", "k-means", "PCA")
METRICS = ("reconstruction_error", "active_concepts", "word_overlap", "stability")
LOWER_IS_BETTER = {"reconstruction_error": True, "active_concepts": True, "word_overlap": True, "stability": False,
                   "ami": False}


@dataclass
class FuzzyOptions:
    """Everything a run depends on. `layer=None` is two thirds of the depth; grids are the development search."""

    word: str = "water"
    source: str = "generate"
    n: int = 200
    texts: tuple[str, ...] = ()
    where: str = "generated"
    layer: int | None = None
    k: int = 20
    seeds: int = 5
    membership: str = "gaussian"
    steps: int = 400
    sparsity_grid: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1)
    features_grid: tuple[int, ...] = (8, 16, 32)
    lr_grid: tuple[float, ...] = (0.01, 0.03)
    nmf_alpha_grid: tuple[float, ...] = (0.01, 0.03, 0.1)
    nmf_max_iter: int = 200
    max_active: float = 2.0
    dev_fraction: float = 0.2
    eval_fraction: float = 0.2
    subsample: float = 0.9
    max_new_tokens: int = 40
    temperature: float = 0.8
    batch_size: int = 16
    top_words: int = KEEP
    seed: int = 0
    store: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["texts"] = len(self.texts)
        return d

    def text_source(self) -> TextSource:
        return TextSource(word=self.word, kind=self.source, n=self.n, texts=tuple(self.texts), where=self.where,
                          max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                          batch_size=self.batch_size, seed=self.seed)

    def representation_source(self) -> Any:
        """Where the rows come from: text (`text_source`), or toy-vlm scenes read at the answer mark."""
        if self.source == SceneSource.kind:
            return SceneSource(n=self.n, seed=self.seed)
        return self.text_source()

    def resolved_layer(self, n_layers: int) -> int:
        return default_layer(n_layers) if self.layer is None else self.layer

    def validate(self, n_layers: int) -> None:
        """Every mistake that needs no model work: raised before anything is generated or fitted."""
        check_layer(self.resolved_layer(n_layers), n_layers)
        self.representation_source().validate()
        if not 0 < self.dev_fraction < 1 or not 0 < self.eval_fraction < 1 or self.dev_fraction + self.eval_fraction >= 1:
            raise BadInputError("dev_fraction and eval_fraction must be in (0, 1) and leave samples for training")
        checks.number("subsample", self.subsample, low=0, high=1, low_open=True)
        checks.integer("seeds", self.seeds, low=1)
        if not (self.sparsity_grid and self.features_grid and self.lr_grid and self.nmf_alpha_grid):
            raise BadInputError("every tuning grid needs at least one value")
        # the fit's own settings: each was checked only when the first fit began, after the harvest
        checks.choice("membership", self.membership, MEMBERSHIPS)
        checks.integer("steps (gradient steps of the fuzzy layer)", self.steps, low=1)
        checks.integer("nmf_max_iter", self.nmf_max_iter, low=1)
        checks.number("max_active (the development rule's bound on active concepts)", self.max_active, low=0,
                      low_open=True)
        for value in self.sparsity_grid:
            checks.number("a sparsity of the development grid", value, low=0)
        for value in self.features_grid:
            checks.integer("a feature count m of the development grid", value, low=1)
        for value in self.lr_grid:
            checks.number("a learning rate of the development grid", value, low=0, low_open=True)
        for value in self.nmf_alpha_grid:
            checks.number("a semi-NMF L1 weight of the development grid", value, low=0)
        # The most training rows n samples can give; the exact count is checked again after the harvest.
        check_rules_fit(self.k, max(0, self.train_size(self.n)))

    def train_size(self, n: int) -> int:
        n_dev, n_eval = split_sizes(n, self.dev_fraction, self.eval_fraction)
        return int((n - n_dev - n_eval) * self.subsample)


def split_sizes(n: int, dev_fraction: float, eval_fraction: float) -> tuple[int, int]:
    return max(1, round(n * dev_fraction)), max(1, round(n * eval_fraction))


def split_rows(n: int, dev_fraction: float, eval_fraction: float, seed: int) -> dict[str, list[int]]:
    """Seeded train / dev / eval row indices (disjoint, covering all rows), cut by the shared protocol's
    `split_three` (its calibration part is our training part: what the concept models are fitted on)."""
    n_dev, n_eval = split_sizes(n, dev_fraction, eval_fraction)
    if n - n_dev - n_eval < 1:
        raise BadInputError(f"{n} samples cannot be split into train, development and evaluation; harvest more")
    parts = split_three(list(range(n)), n - n_dev - n_eval, n_dev, n_eval, seed=seed)
    return {"train": list(parts.calibration), "dev": list(parts.development), "eval": list(parts.evaluation)}


# --------------------------------------------------------------------------- tuning


def sparse_then_accurate(max_active: float) -> Callable[[dict[str, Any]], tuple]:
    """The development objective (maximised): settings whose mean active concepts per sample are at most
    `max_active` beat every other; among them the lowest reconstruction error wins; if none is that
    sparse, the sparsest (then the most accurate)."""
    def score(row: dict[str, Any]) -> tuple:
        ok = row["dev_active_concepts"] <= max_active + 1e-12
        return (1, -row["dev_reconstruction_error"]) if ok else (0, -row["dev_active_concepts"],
                                                                 -row["dev_reconstruction_error"])

    score.__doc__ = (f"lowest development reconstruction error with at most {max_active:g} active concepts per "
                     "sample (else the sparsest)")
    return score


def tune_fuzzy(Z_train: torch.Tensor, Z_dev: torch.Tensor, options: FuzzyOptions,
               on_progress: Callable[[int, int], None] | None = None) -> Any:
    """The fuzzy layer's m, sparsity weight and learning rate, chosen on development (`evaluation.Choice`)."""
    widths = sorted({min(int(m), Z_train.shape[1]) for m in options.features_grid})
    grid = [{"n_features": m, "sparsity": float(sp), "lr": float(lr)}
            for m, sp, lr in itertools.product(widths, options.sparsity_grid, options.lr_grid)]
    done = [0]

    def measure(setting: dict[str, Any]) -> dict[str, Any]:
        layer = FuzzyRuleLayer(n_rules=options.k, membership=options.membership, steps=options.steps,
                               seed=options.seed, **setting).fit(Z_train)
        done[0] += 1
        if on_progress:
            on_progress(done[0], len(grid))
        return {"dev_reconstruction_error": metrics.reconstruction_error(layer, Z_dev),
                "dev_active_concepts": metrics.active_concepts(layer.transform(Z_dev)), "steps_run": layer.n_iter_}

    return choose_on_dev(grid, measure, sparse_then_accurate(options.max_active), name="fuzzy settings")


def tune_semi_nmf(Z_train: torch.Tensor, Z_dev: torch.Tensor, options: FuzzyOptions,
                  on_progress: Callable[[int, int], None] | None = None) -> Any:
    """Semi-NMF's L1 weight, chosen on development by the same objective."""
    grid = [{"alpha": float(a)} for a in options.nmf_alpha_grid]
    done = [0]

    def measure(setting: dict[str, Any]) -> dict[str, Any]:
        model = SemiNMFConcepts(options.k, max_iter=options.nmf_max_iter, seed=options.seed, **setting).fit(Z_train)
        done[0] += 1
        if on_progress:
            on_progress(done[0], len(grid))
        return {"dev_reconstruction_error": metrics.reconstruction_error(model, Z_dev),
                "dev_active_concepts": metrics.active_concepts(model.transform(Z_dev))}

    return choose_on_dev(grid, measure, sparse_then_accurate(options.max_active), name="semi-NMF settings")


def make_models(options: FuzzyOptions, tuned: dict[str, Any], seed: int) -> dict[str, Any]:
    """The four concept models of one seed with the development choices filled in."""
    f, s = tuned["fuzzy"].chosen, tuned["semi-NMF"].chosen  # `evaluation.Choice`s
    return {
        "fuzzy": FuzzyRuleLayer(n_rules=options.k, n_features=f["n_features"], membership=options.membership,
                                sparsity=f["sparsity"], lr=f["lr"], steps=options.steps, seed=seed),
        "semi-NMF": SemiNMFConcepts(options.k, alpha=s["alpha"], max_iter=options.nmf_max_iter, seed=seed),
        "k-means": KMeansConcepts(options.k, seed=seed),
        "PCA": PCAConcepts(options.k, seed=seed),
    }


# --------------------------------------------------------------------------- evaluation


def evaluate_model(model: Any, Z_eval: torch.Tensor, words: Sequence[Sequence[str]],
                   labels: dict[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Every per-fit metric of one fitted concept model on evaluation rows (the same code for every method)."""
    codes = model.transform(Z_eval)
    matrix, overlap = metrics.word_overlap(words)
    out = {"reconstruction_error": metrics.reconstruction_error(model, Z_eval),
           "active_concepts": metrics.active_concepts(codes), "word_overlap": overlap,
           "overlap_matrix": matrix.tolist(), "per_sample_errors": metrics.per_sample_errors(model, Z_eval).tolist(),
           "concepts_used": int(len(set(metrics.assignments(codes).tolist())))}
    for kind, values in (labels or {}).items():
        out[f"ami_{kind}"] = metrics.adjusted_mutual_information(codes, values)
    return out


@dataclass
class FuzzyStudy:
    """A finished run: the harvest, splits, development choices, per-seed metrics and their summary, and the
    seed-0 models with their grounding (words, top samples, readable rules)."""

    options: FuzzyOptions
    reps: Representations
    splits: dict[str, list[int]]
    tuning: dict[str, Any]  # method -> analyses.evaluation.Choice
    per_seed: list[dict[str, Any]]
    summary: dict[str, dict[str, dict[str, float]]]
    paired: dict[str, dict[str, Any]]
    models: dict[str, Any]
    words: dict[str, list[list[str]]]
    overlap_matrix: dict[str, list[list[float]]]
    top_samples: dict[str, list[list[int]]]
    rules: list[Rule]
    feature_names: list[str]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def fuzzy(self) -> FuzzyRuleLayer:
        return self.models["fuzzy"]

    def metric_table(self) -> list[dict[str, Any]]:
        """One row per method: each metric's mean and 95% interval over seeds."""
        rows = []
        for method in METHODS:
            row: dict[str, Any] = {"method": method}
            for name, (mean, low, high) in ((k, (v["mean"], v["low"], v["high"])) for k, v in self.summary[method].items()):
                row[name] = mean
                row[f"{name}_low"], row[f"{name}_high"] = low, high
            rows.append(row)
        return rows

    def explain(self, row: int) -> dict[str, Any]:
        """The fuzzy layer's explanation of sample `row` (firing strengths and the rule chain), with its text."""
        if not 0 <= row < len(self.reps.samples):
            raise BadInputError(f"sample {row} out of range 0..{len(self.reps.samples) - 1}")
        e = self.fuzzy.explain(self.reps.Z[row])
        return {**e.to_dict(), "text": e.text(self.feature_names), "sample": self.reps.samples[row].to_dict(),
                "split": next(k for k, rows in self.splits.items() if row in rows)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options.to_dict(), "representations": self.reps.to_dict(with_samples=True),
            "splits": self.splits, "tuning": {k: c.to_dict() for k, c in self.tuning.items()},
            "metric_table": self.metric_table(), "summary": self.summary, "paired_tests": self.paired,
            "per_seed": [{k: v for k, v in row.items() if k not in ("per_sample_errors", "overlap_matrix")}
                         for row in self.per_seed],
            "words": self.words, "overlap_matrix": self.overlap_matrix, "top_samples": self.top_samples,
            "top_sample_snippets": {m: [[self.reps.samples[i].snippet(50) for i in rows] for rows in per_concept]
                                    for m, per_concept in self.top_samples.items()},
            "rules": [r.to_dict() for r in self.rules], "feature_names": self.feature_names,
            "fuzzy_params": self.fuzzy.get_params(), "seconds": self.seconds,
        }


def run_study(backend: Backend, options: FuzzyOptions, on_progress: Progress | None = None,
              store: Any = None) -> FuzzyStudy:
    """The whole run (see the module docstring). `store`: an ActivationStore (default: `options.store` or the
    user cache)."""
    tick = on_progress or (lambda *_: None)
    options.validate(backend.arch().n_layers)
    if store is None:
        store = ActivationStore(options.store) if options.store else ActivationStore()
    started = time.perf_counter()
    reps = harvest(backend, options.representation_source(), options.resolved_layer(backend.arch().n_layers), store=store,
                   batch_size=options.batch_size, on_progress=tick)
    seconds = {"harvest": time.perf_counter() - started}
    splits = split_rows(len(reps.samples), options.dev_fraction, options.eval_fraction, options.seed)
    Z = reps.Z
    check_rules_fit(options.k, int(len(splits["train"]) * options.subsample), Z[splits["train"]])  # before any fit
    Z_train, Z_dev, Z_eval = Z[splits["train"]], Z[splits["dev"]], Z[splits["eval"]]

    started = time.perf_counter()
    tuning = {"fuzzy": tune_fuzzy(Z_train, Z_dev, options, lambda d, t: tick("tune fuzzy (dev)", d, t)),
              "semi-NMF": tune_semi_nmf(Z_train, Z_dev, options, lambda d, t: tick("tune semi-NMF (dev)", d, t))}
    seconds["tune"] = time.perf_counter() - started

    labels = {kind: reps.labels(kind, splits["eval"]) for kind in reps.label_kinds()}
    per_seed, directions, first = [], {m: [] for m in METHODS}, {}
    started = time.perf_counter()
    total = options.seeds * len(METHODS)
    for s in range(options.seeds):
        seed = options.seed + s
        rng = np.random.default_rng(seed)
        n_fit = max(options.k, int(len(splits["train"]) * options.subsample))
        rows = sorted(rng.choice(splits["train"], size=n_fit, replace=False).tolist())
        for j, (method, model) in enumerate(make_models(options, tuning, seed).items()):
            fit_started = time.perf_counter()
            model.fit(Z[rows])
            fit_s = time.perf_counter() - fit_started
            words = ground_words(backend, model.directions_, TOP_K, options.top_words)
            row = {"method": method, "seed": seed, "fit_seconds": fit_s,
                   **evaluate_model(model, Z_eval, words, labels)}
            per_seed.append(row)
            directions[method].append(model.directions_)
            if s == 0:
                first[method] = (model, words, row)
            tick("fit over seeds", s * len(METHODS) + j + 1, total)
    seconds["fit_and_evaluate"] = time.perf_counter() - started
    _add_stability(per_seed, directions)
    summary = {m: {name: dict(zip(("mean", "low", "high"), metrics.seed_interval([r[name] for r in per_seed
                                                                                  if r["method"] == m])))
                   for name in [*METRICS, *(f"ami_{k}" for k in labels)]} for m in METHODS}
    paired = _paired_tests(per_seed, options.seed)

    fuzzy = first["fuzzy"][0]
    feature_words = ground_words(backend, fuzzy.projection_, TOP_K, 3)
    feature_names = [f"f{j + 1} ({w[0]})" if w else f"f{j + 1}" for j, w in enumerate(feature_words)]
    rules = fuzzy.rules(feature_names=feature_names)
    for rule, words in zip(rules, first["fuzzy"][1]):
        rule.words = words
    return FuzzyStudy(
        options=options, reps=reps, splits=splits, tuning=tuning, per_seed=per_seed, summary=summary, paired=paired,
        models={m: first[m][0] for m in METHODS}, words={m: first[m][1] for m in METHODS},
        overlap_matrix={m: first[m][2]["overlap_matrix"] for m in METHODS},
        top_samples={m: top_samples(first[m][0].transform(Z), 5) for m in METHODS},
        rules=rules, feature_names=feature_names, seconds=seconds)


def _add_stability(per_seed: list[dict[str, Any]], directions: dict[str, list[torch.Tensor]]) -> None:
    """Each fit's mean matched concept similarity to the fits of the other seeds (None with one seed)."""
    for method, dirs in directions.items():
        rows = [r for r in per_seed if r["method"] == method]
        for i, row in enumerate(rows):
            others = [metrics.matched_similarity(dirs[i], dirs[j]) for j in range(len(dirs)) if j != i]
            row["stability"] = float(np.mean(others)) if others else None


def _paired_tests(per_seed: list[dict[str, Any]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Fuzzy vs each baseline on the same evaluation samples: per-sample reconstruction errors (mean over
    seeds), Wilcoxon signed-rank and sign tests with a bootstrap interval of the mean difference."""
    def mean_errors(method: str) -> np.ndarray:
        return np.mean([r["per_sample_errors"] for r in per_seed if r["method"] == method], axis=0)

    fuzzy = mean_errors("fuzzy")
    out = {}
    for m in METHODS[1:]:
        base = mean_errors(m)
        what = "per-sample reconstruction error"
        out[m] = {"metric": what, "wilcoxon": wilcoxon_test(fuzzy, base, what=what, seed=seed).to_dict(),
                  "sign": sign_test(fuzzy, base, what=what, seed=seed).to_dict()}
    return out
