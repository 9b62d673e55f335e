"""The evaluation harness of CoT entropy phases: early exit against the baselines, and weighted voting.

`evaluate_cot_exit` follows the shared protocol (analyses.evaluation, issue 11):

1. three disjoint splits of the task (`analyses.tasks.load_splits`): calibration, development,
   evaluation;
2. calibration: greedy traces probed at every step end; f0/f1 fitted on them;
3. development: greedy traces probed wherever any candidate setting would probe; the KDE
   bandwidth is chosen by the held-out log-likelihood of the development steps, then CUSUM's h,
   DEER's threshold and Dynasor's (k, m) are each chosen from a small grid by one objective (the
   fewest tokens whose development accuracy stays within `tolerance` of vanilla's); every grid row
   and the choice are in the report;
4. evaluation: each method runs once at its chosen setting; accuracy and token counts get 95%
   bootstrap intervals, and each method is tested against vanilla on the same problems (exact
   McNemar on correctness, sign and Wilcoxon tests on tokens), with the verdict in words.

The replay design is kept: one probed greedy trace per problem serves every method on a split
(exiting only truncates a greedy trace), so the methods differ only in where they stop.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analyses.cot_entropy.detector import CusumDetector, check_h_grid, entropy_thirds, silverman_bandwidth
from analyses.cot_entropy.rules import (CusumStop, DeerStop, DynasorStop, ExitResult, ProbedTrace, StoppingRule,
                                        probe_traces, replay)
from analyses.evaluation import (Choice, Comparison, bootstrap_interval, choose_on_dev, compare,
                                 detectable_statement, fewest_cost_within, mcnemar_exact)
from analyses.families import ModelFamily, family_for
from analyses.tasks import Problem, is_correct, load_splits
from probes.backend import Backend
from probes.sampling import Sampling  # a plain dataclass (the backend may live elsewhere)
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance

DEFAULT_H_GRID = (0.5, 1.0, 2.0, 4.0, 8.0)
DEFAULT_THRESHOLDS = DEFAULT_H_GRID  # the page's h choices
DEFAULT_DEER_GRID = (0.8, 0.9, 0.95, 0.99)
BANDWIDTH_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # times Silverman's bandwidth of the pooled calibration steps
COSTS = {"generated": "mean_generated_tokens", "with_probes": "mean_tokens_with_probes"}


def default_dynasor_grid(family: ModelFamily) -> list[tuple[int, int]]:
    """(k, m) candidates around the family's defaults: probe every k/2, k, 2k tokens; m = 2 or 3 agreeing."""
    k = family.probe_every
    return [(every, agree) for every in sorted({max(1, k // 2), k, 2 * k}) for agree in (2, 3)]


# ----------------------------------------------------------------------------- one method, one split


def summarise(results: Sequence[ExitResult]) -> dict[str, float]:
    """Accuracy and mean costs of one rule's exits (a development-grid row)."""
    return {"accuracy": float(np.mean([bool(r.correct) for r in results])),
            "mean_generated_tokens": float(np.mean([r.generated_tokens for r in results])),
            "mean_probe_tokens": float(np.mean([r.probe_tokens for r in results])),
            "mean_tokens_with_probes": float(np.mean([r.tokens_with_probes for r in results])),
            "exit_rate": float(np.mean([r.exited for r in results])), "n": len(results)}


@dataclass
class MethodSummary:
    """Accuracy and cost of one method over one split's problems; on the evaluation split also the
    bootstrap intervals and the paired tests against vanilla (`comparison`)."""

    name: str
    params: dict[str, Any]
    accuracy: float
    mean_generated_tokens: float
    mean_probe_tokens: float
    exit_rate: float
    n: int
    results: list[ExitResult] = field(default_factory=list, repr=False)
    comparison: Comparison | None = None
    split: str = "evaluation"

    @property
    def mean_tokens_with_probes(self) -> float:
        return self.mean_generated_tokens + self.mean_probe_tokens

    @classmethod
    def of(cls, rule: StoppingRule, results: Sequence[ExitResult], baseline: Sequence[ExitResult] | None = None,
           seed: int = 0, split: str = "evaluation", n_resamples: int = 2000) -> "MethodSummary":
        row = summarise(results)
        comparison = compare(
            rule.name, rule.describe(), [bool(r.correct) for r in results], _costs(results),
            [bool(r.correct) for r in baseline] if baseline is not None else None,
            _costs(baseline) if baseline is not None else None, seed=seed, n_resamples=n_resamples,
            cost_names={"generated": "generated tokens", "with_probes": "tokens incl. probes"})
        return cls(rule.name, rule.describe(), row["accuracy"], row["mean_generated_tokens"], row["mean_probe_tokens"],
                   row["exit_rate"], len(results), list(results), comparison, split)

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        out = {"name": self.name, "params": self.params, "split": self.split, "accuracy": self.accuracy,
               "mean_generated_tokens": self.mean_generated_tokens, "mean_probe_tokens": self.mean_probe_tokens,
               "mean_tokens_with_probes": self.mean_tokens_with_probes, "exit_rate": self.exit_rate, "n": self.n}
        if self.comparison is not None:
            c = self.comparison.to_dict()
            out.update(accuracy_ci=c["accuracy"], generated_tokens_ci=c["costs"]["generated"],
                       tokens_with_probes_ci=c["costs"]["with_probes"], vs_vanilla=(
                           {"accuracy": c["accuracy_test"], "tokens": c["cost_tests"]}
                           if c["accuracy_test"] is not None else None))
        if with_results:
            out["per_problem"] = [{"id": r.problem_id, "answer": r.answer, "correct": r.correct,
                                   "generated": r.generated_tokens, "probe": r.probe_tokens, "exited": r.exited}
                                  for r in self.results]
        return out


def _costs(results: Sequence[ExitResult]) -> dict[str, list[float]]:
    return {"generated": [float(r.generated_tokens) for r in results],
            "with_probes": [float(r.tokens_with_probes) for r in results]}


def pareto_status(point: tuple[float, float], front: Sequence[tuple[float, float]]) -> str:
    """Where a (tokens, accuracy) point stands against baseline points (fewer tokens, higher accuracy win).

    "behind": some baseline is at least as good on both and better on one; "beyond": the point
    dominates some baseline and none dominates it; "on": a trade-off no baseline beats.
    """
    def dominates(a, b):
        return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])

    if any(dominates(q, point) for q in front):
        return "behind"
    return "beyond" if any(dominates(point, q) for q in front) else "on"


def pareto_table(methods: Sequence[Any]) -> dict[str, dict[str, dict[str, str]]]:
    """Each CUSUM method's place against the DEER/Dynasor points and against all baselines (vanilla too),
    on generated tokens and on tokens with probes (point estimates: see the tests for what n can tell).
    Takes `MethodSummary`s or their dicts."""
    rows = [m.to_dict(with_results=False) if hasattr(m, "to_dict") else m for m in methods]
    keys = {"generated": "mean_generated_tokens", "with_probes": "mean_tokens_with_probes"}
    fronts = {"vs_deer_dynasor": [r for r in rows if r["name"] in ("deer", "dynasor")],
              "vs_all_baselines": [r for r in rows if not r["name"].startswith("cusum")]}
    return {r["name"]: {front: {measure: pareto_status((r[key], r["accuracy"]), [(b[key], b["accuracy"]) for b in base])
                                for measure, key in keys.items()}
                        for front, base in fronts.items()}
            for r in rows if r["name"].startswith("cusum")}


# ----------------------------------------------------------------------------- the report


@dataclass
class CotExitReport:
    """`thoughtscope eval cot-exit`: settings chosen on development, every method once on evaluation."""

    model: str
    task: str
    family: ModelFamily
    detector: CusumDetector
    methods: list[MethodSummary]  # on the evaluation split, vanilla first
    choices: dict[str, Choice]  # density, cusum, deer, dynasor: grid, dev rows, choice
    splits: dict[str, Any]
    dev_vanilla: dict[str, float]
    entropy_thirds: list[float]
    seconds: dict[str, float]
    settings: dict[str, Any]
    power: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def n_eval(self) -> int:
        return self.splits["sizes"]["evaluation"]

    @property
    def n_calibration(self) -> int:
        return self.splits["sizes"]["calibration"]

    @property
    def n_dev(self) -> int:
        return self.splits["sizes"]["development"]

    def method(self, name: str) -> MethodSummary:
        return next(m for m in self.methods if m.name == name)

    def pareto(self) -> dict[str, dict[str, dict[str, str]]]:
        return pareto_table(self.methods)

    def table(self) -> list[dict[str, Any]]:
        """One row per method on the evaluation split: setting, accuracy and tokens with intervals, verdicts."""
        rows = []
        for m in self.methods:
            c = m.comparison
            rows.append({
                "method": m.name, "setting": {k: v for k, v in m.params.items() if k != "name"},
                "accuracy": c.accuracy.format(percent=True), "generated tokens": c.costs["generated"].format(".1f"),
                "tokens incl. probes": c.costs["with_probes"].format(".1f"), "exit rate": m.exit_rate,
                "accuracy vs vanilla": c.accuracy_test.verdict if c.accuracy_test else "",
                "tokens vs vanilla": c.cost_tests["generated"][0].verdict if c.cost_tests else ""})
        return rows

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        return {"command": "eval cot-exit", "model": self.model, "task": self.task, "n_eval": self.n_eval,
                "n_calibration": self.n_calibration, "n_dev": self.n_dev, "family": self.family.to_dict(),
                "split": "evaluation", "methods": [m.to_dict(with_results) for m in self.methods],
                "choices": {k: c.to_dict() for k, c in self.choices.items()}, "dev_vanilla": self.dev_vanilla,
                "splits": self.splits, "pareto": self.pareto(), "power": self.power,
                "detector": self.detector.to_dict(), "entropy_thirds": self.entropy_thirds,
                "seconds": self.seconds, "settings": self.settings, "provenance": self.provenance}


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def fit_detector(backend: Backend, problems: Sequence[Problem], family: ModelFamily, *, threshold: float = 2.0,
                 density: str = "kde", bandwidth: float | None = None, bins: int = 10, max_new_tokens: int = 96,
                 seed: int = 0, batch_size: int = 8,
                 on_progress: Callable[[int, int], None] | None = None) -> tuple[CusumDetector, list[ProbedTrace]]:
    """Greedy calibration traces probed at their step ends, and the detector fitted on them.

    `on_progress(done, total)` is called after each trace (a page's or a terminal's progress bar).
    """
    traces = probe_traces(backend, problems, family, [StoppingRule(probe_step_ends=True)],
                          max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, on_progress=on_progress)
    detector = CusumDetector(threshold=threshold, density=density, bandwidth=bandwidth, bins=bins).fit(traces)
    return detector, traces


def calibration_summary(traces: Sequence[ProbedTrace]) -> dict[str, Any]:
    """Accuracy of the calibration traces' final answers and how many probed steps the densities saw."""
    return {"accuracy": float(np.mean([is_correct(t.final_answer, t.target) for t in traces])) if traces else 0.0,
            "steps": int(sum(len(t.calibration().entropies) for t in traces))}


def choose_density(calibration: Sequence[ProbedTrace], development: Sequence[ProbedTrace], *, density: str = "kde",
                   bandwidths: Sequence[float] | None = None, bins: int = 10) -> Choice:
    """The density of f0/f1 chosen on development: for a KDE, the bandwidth (default grid: 1/4 to 4 times
    Silverman's bandwidth of the pooled calibration steps) with the highest mean log-likelihood of the
    development steps under their own class's density; a histogram keeps its `bins`."""
    values, _ = CusumDetector.labelled_steps(calibration)
    if values.size == 0:
        raise BadInputError("the calibration traces hold no probe entropies: give more calibration problems, "
                            "longer generations, or a step delimiter that occurs in this model's traces")
    dev_values, _ = CusumDetector.labelled_steps(development)
    if density == "histogram":
        grid: list[Any] = [bins]
        make = lambda b: CusumDetector(density="histogram", bins=b)  # noqa: E731
    else:
        base = silverman_bandwidth(values)
        grid = sorted({float(f"{base * f:.3g}") for f in BANDWIDTH_FACTORS}) if bandwidths is None else list(bandwidths)
        make = lambda bw: CusumDetector(density="kde", bandwidth=bw)  # noqa: E731

    def dev_loglik(setting: Any) -> dict[str, float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a flat class is reported once, by the final fit
            fitted = make(setting).fit(calibration)
        return {"dev_log_likelihood": fitted.score(development) if dev_values.size else float("nan"),
                "dev_steps": int(dev_values.size)}

    return choose_on_dev(grid, dev_loglik, "dev_log_likelihood", name="bins" if density == "histogram" else "bandwidth",
                         objective_name="max mean log-likelihood of the development steps")


def choose_threshold(detector: CusumDetector, development: Sequence[ProbedTrace], h_grid: Sequence[float],
                     objective: Callable[[dict[str, Any]], Any] | None = None, *, tolerance: float = 0.02,
                     cost: str = "generated") -> Choice:
    """CUSUM's h chosen on development traces: each h of `h_grid` replays every trace with the fitted
    `detector`; `objective` (default: the fewest `cost` tokens whose development accuracy stays within
    `tolerance` of vanilla's on the same traces) picks one. Ties go to the earlier h of the grid."""
    if not h_grid:
        raise BadInputError("give at least one CUSUM threshold h to choose from")
    if not development:
        raise BadInputError("no development traces to choose h on")
    if objective is None:
        checks.choice("cost", cost, COSTS)
        vanilla = summarise([replay(t, StoppingRule(name="vanilla")) for t in development])
        objective = fewest_cost_within(vanilla["accuracy"], tolerance, cost_key=COSTS[cost])
    return choose_on_dev([float(h) for h in h_grid],
                         lambda h: summarise([replay(t, CusumStop(detector=detector.with_threshold(float(h))))
                                              for t in development]),
                         objective, name="h", objective_name=objective.__doc__)


def _stage(progress: Progress | None, stage: str) -> Callable[[int, int], None] | None:
    return None if progress is None else (lambda done, total: progress(stage, done, total))


def evaluate_cot_exit(backend: Backend, task: str = "arith", n: int = 100, n_calibration: int = 60, n_dev: int = 60, *,
                      h_grid: Sequence[float] = DEFAULT_H_GRID, deer_grid: Sequence[float] = DEFAULT_DEER_GRID,
                      dynasor_grid: Sequence[tuple[int, int]] | None = None, density: str = "kde",
                      bandwidths: Sequence[float] | None = None, bins: int = 10, tolerance: float = 0.02,
                      cost: str = "generated", family: ModelFamily | None = None, max_new_tokens: int = 96,
                      seed: int = 0, batch_size: int = 8, n_resamples: int = 2000,
                      progress: Progress | None = None, runner: Any = None) -> CotExitReport:
    """Vanilla, CUSUM, DEER and Dynasor-CoT under the evaluation protocol (module docstring).

    `n`, `n_calibration`, `n_dev`: problems of the evaluation, calibration and development splits.
    `h_grid`, `deer_grid`, `dynasor_grid` ((k, m) pairs): the candidates chosen from on development;
    `tolerance`: how much development accuracy below vanilla a setting may lose; `cost`: which token
    count it minimises (`generated`, or `with_probes`). `runner` (`analyses.distributed.RayRunner`): the
    traces are generated on its model replicas, batch by batch with the serial run's seeds (the same report).
    """
    if not h_grid or not deer_grid:
        raise BadInputError("give at least one CUSUM threshold h and one DEER threshold to choose from")
    h_grid = check_h_grid(h_grid)  # every candidate checked before any trace is generated
    deer_grid = [DeerStop(threshold=t).threshold for t in deer_grid]
    checks.choice("cost", cost, COSTS)
    if n < 1 or n_calibration < 1 or n_dev < 1:
        raise BadInputError(f"every split needs at least one problem, got n={n}, n_calibration={n_calibration}, "
                            f"n_dev={n_dev}")
    family = family or family_for(backend)
    dynasor_grid = [tuple(map(int, km)) for km in (dynasor_grid or default_dynasor_grid(family))]
    splits = load_splits(task, n_calibration, n_dev, n, seed=seed)
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, runner=runner)
    t0 = time.perf_counter()
    cal_traces = probe_traces(backend, splits.calibration, family, [StoppingRule(probe_step_ends=True)], seed=seed,
                              on_progress=_stage(progress, "calibration"), **common)
    t1 = time.perf_counter()
    vanilla = StoppingRule(name="vanilla")
    candidates = [StoppingRule(probe_step_ends=True)] + [DynasorStop(probe_every=k, agree=m) for k, m in dynasor_grid]
    dev_traces = probe_traces(backend, splits.development, family, candidates, seed=seed + 5_000,
                              on_progress=_stage(progress, "development"), **common)
    t2 = time.perf_counter()

    density_choice = choose_density(cal_traces, dev_traces, density=density, bandwidths=bandwidths, bins=bins)
    detector = CusumDetector(threshold=float(h_grid[0]), density=density, bins=int(density_choice.chosen)
                             if density == "histogram" else bins,
                             bandwidth=float(density_choice.chosen) if density == "kde" else None).fit(cal_traces)
    dev_vanilla = summarise([replay(t, vanilla) for t in dev_traces])
    objective = fewest_cost_within(dev_vanilla["accuracy"], tolerance, cost_key=COSTS[cost])

    def on_dev(rule: StoppingRule) -> dict[str, float]:
        return summarise([replay(t, rule) for t in dev_traces])

    choices = {
        "density": density_choice,
        "cusum": choose_threshold(detector, dev_traces, h_grid, objective),
        "deer": choose_on_dev(list(deer_grid), lambda th: on_dev(DeerStop(threshold=float(th))), objective,
                              name="threshold", objective_name=objective.__doc__),
        "dynasor": choose_on_dev(dynasor_grid, lambda km: on_dev(DynasorStop(probe_every=km[0], agree=km[1])),
                                 objective, name="(k, m)", objective_name=objective.__doc__),
    }
    k, m = choices["dynasor"].chosen
    rules: list[StoppingRule] = [vanilla, CusumStop(detector=detector.with_threshold(float(choices["cusum"].chosen))),
                                 DeerStop(threshold=float(choices["deer"].chosen)), DynasorStop(probe_every=k, agree=m)]
    t3 = time.perf_counter()
    traces = probe_traces(backend, splits.evaluation, family, rules, seed=seed + 10_000,
                          on_progress=_stage(progress, "evaluation"), **common)
    t4 = time.perf_counter()
    exits = {rule.name: [replay(t, rule) for t in traces] for rule in rules}
    methods = [MethodSummary.of(rule, exits[rule.name], None if rule is vanilla else exits["vanilla"], seed=seed,
                                n_resamples=n_resamples) for rule in rules]
    thirds = np.nanmean([entropy_thirds(t.entropies) for t in traces], axis=0).tolist()
    info = backend.info()
    settings = {"max_new_tokens": max_new_tokens, "seed": seed, "h_grid": list(h_grid), "deer_grid": list(deer_grid),
                "dynasor_grid": [list(km) for km in dynasor_grid], "density": density, "bins": bins,
                "bandwidths": list(bandwidths) if bandwidths else None, "tolerance": tolerance, "cost": cost,
                "batch_size": batch_size, "n_resamples": n_resamples,
                "calibration_steps": {"uncertain": detector.n_uncertain_, "confident": detector.n_confident_},
                "calibration_accuracy": calibration_summary(cal_traces)["accuracy"]}
    record = provenance(info, data=task, split="evaluation (settings chosen on development)", seed=seed,
                        settings={**settings, "family": family.to_dict()}, command="eval cot-exit",
                        splits=splits.sizes())
    cusum_correct = [bool(r.correct) for r in exits[rules[1].name]]
    return CotExitReport(
        info["model_id"], task, family, detector, methods, choices, splits.to_dict(), dev_vanilla, thirds,
        {"calibration": t1 - t0, "development": t2 - t1, "choice": t3 - t2, "evaluation": t4 - t3,
         "replay": time.perf_counter() - t4},
        settings, detectable_statement(cusum_correct, [bool(r.correct) for r in exits["vanilla"]]), record)


def _split(task: str, n: int, n_calibration: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(calibration, evaluation) problems for voting: the first and last parts of the task's splits."""
    if n < 1 or n_calibration < 1:
        raise BadInputError(f"need at least one evaluation and one calibration problem, got n={n}, "
                            f"n_calibration={n_calibration}")
    splits = load_splits(task, n_calibration, 0, n, seed=seed)
    return splits.calibration, splits.evaluation


# ----------------------------------------------------------------------------- voting


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-empty answer (ties: the one seen first)."""
    counts = Counter(a for a in answers if a is not None)
    return counts.most_common(1)[0][0] if counts else None


def cusum_weighted_vote(answers: Sequence[str | None], weights: Sequence[float]) -> str | None:
    """The answer with the largest total final-CUSUM weight; all weights zero falls back to the majority."""
    if len(answers) != len(weights):
        raise BadInputError("one weight per answer")
    totals: dict[str, float] = {}
    for a, w in zip(answers, weights):
        if a is not None:
            totals[a] = totals.get(a, 0.0) + max(0.0, float(w))
    if not totals or max(totals.values()) <= 0:
        return majority_vote(answers)
    return max(totals, key=lambda a: totals[a])  # first seen wins a tie: dicts keep insertion order


@dataclass
class VoteReport:
    """`thoughtscope eval cot-vote`: self-consistency vs CUSUM-weighted voting over the same samples."""

    model: str
    task: str
    n_eval: int
    n_calibration: int
    samples: int
    temperature: float
    threshold: float
    majority_accuracy: float
    weighted_accuracy: float
    sample_accuracy: float  # mean accuracy of single samples
    per_problem: list[dict[str, Any]]
    seconds: float
    intervals: dict[str, Any] = field(default_factory=dict)  # 95% bootstrap over problems, per vote
    weighted_vs_majority: dict[str, Any] = field(default_factory=dict)  # exact McNemar on the same problems
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"command": "eval cot-vote", "split": "evaluation", **{k: v for k, v in self.__dict__.items()}}


def evaluate_cot_vote(backend: Backend, task: str = "arith", n: int = 20, n_calibration: int = 20, *,
                      samples: int = 8, temperature: float = 0.7, threshold: float = 2.0,
                      family: ModelFamily | None = None, max_new_tokens: int = 96, seed: int = 0,
                      batch_size: int = 16, density: str = "kde", bins: int = 10,
                      progress: Progress | None = None) -> VoteReport:
    """`samples` sampled trajectories per problem; majority vote vs votes weighted by final CUSUM statistic."""
    checks.integer("samples", samples, low=1)
    family = family or family_for(backend)
    calibration, evaluation = _split(task, n, n_calibration, seed)
    t0 = time.perf_counter()
    detector, _ = fit_detector(backend, calibration, family, threshold=threshold, density=density, bins=bins,
                               max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                               on_progress=_stage(progress, "calibration"))
    traces = probe_traces(backend, evaluation, family, [StoppingRule(probe_step_ends=True)],
                          max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temperature),
                          seed=seed + 20_000, n_samples=samples, batch_size=batch_size,
                          on_progress=_stage(progress, "sampling"))
    rows, majority_hits, weighted_hits, sample_hits = [], [], [], []
    for i, problem in enumerate(evaluation):
        group = traces[i * samples:(i + 1) * samples]
        answers = [t.final_answer for t in group]
        stats = [detector.batch_statistic(t.calibration().entropies) for t in group]
        weights = [float(s[-1]) if len(s) else 0.0 for s in stats]
        majority, weighted = majority_vote(answers), cusum_weighted_vote(answers, weights)
        majority_hits.append(is_correct(majority, problem))
        weighted_hits.append(is_correct(weighted, problem))
        sample_hits.append(float(np.mean([is_correct(a, problem) for a in answers])))
        rows.append({"id": problem.id, "target": problem.answer, "answers": answers, "weights": weights,
                     "majority": majority, "weighted": weighted})
    info = backend.info()
    intervals = {name: bootstrap_interval(np.asarray(hits, dtype=float), seed=seed).to_dict()
                 for name, hits in (("single", sample_hits), ("majority", majority_hits),
                                    ("weighted", weighted_hits))}
    test = mcnemar_exact(weighted_hits, majority_hits, seed=seed).to_dict()
    record = provenance(info, data=task, split="evaluation", seed=seed, command="eval cot-vote",
                        settings={"samples": samples, "temperature": temperature, "threshold": threshold,
                                  "density": density, "bins": bins, "max_new_tokens": max_new_tokens,
                                  "n": len(evaluation), "n_calibration": len(calibration)})
    return VoteReport(info["model_id"], task, len(evaluation), len(calibration), samples, temperature, threshold,
                      float(np.mean(majority_hits)), float(np.mean(weighted_hits)), float(np.mean(sample_hits)), rows,
                      time.perf_counter() - t0, intervals, test, record)
