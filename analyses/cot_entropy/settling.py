"""The CUSUM alarm against a known settling step, on the `toy-reasoner` organism (issue 11).

The organism's generator plants a settling step in every trace: the step that fixes the final
value (the last computation, or the correction of a wrong one); what follows is redundant. So the
uncertainty-to-confidence change point of Xu et al. is known, and the detector can be scored:

- delay: alarm step minus settling step (0 = the alarm at the settling step's end, as early as
  the answer is known; > 0 late; < 0 a false alarm, raised before the answer exists);
- false-alarm rate (alarms before settling), miss rate (no alarm), and the share of traces whose
  alarm lands within `bound` steps after settling.

The traces are the generator's planted ones, teacher-forced: the model reads each planted trace and
is probed at every step end, so the ground truth holds exactly. The detector never sees it: f0/f1
are fitted with the usual unsupervised split (a step is confident once its probe answer settles on
the trace's final answer); the settling step only scores the alarm. Calibration, development and
evaluation traces come from the generator's disjoint splits; h is chosen on development (the share
within the bound, then fewer false alarms) and reported once on evaluation, with every h of the
grid beside it for reference.

Example (hand-made probes; no model):
    >>> from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector
    >>> det = CusumDetector(threshold=1.0, density="histogram", bins=2, value_range=(0, 2)).fit(
    ...     [CalibrationTrace([1.5, 1.5, 0.5, 0.5], ["1", "2", "9", "9"], "9")] * 3)
    >>> row = settling_row("p", [1.5, 1.5, 0.5, 0.5, 0.5], settle_step=2, detector=det)
    >>> row.alarm_step, row.delay  # Z = log 7 at 0.5 nats: the alarm at the settling step itself
    (2, 0)
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector, check_h_grid
from analyses.cot_entropy.evaluate import DEFAULT_H_GRID, choose_density
from analyses.cot_entropy.probing import probe_positions
from analyses.cot_entropy.rules import ProbedTrace, _prompt_of
from analyses.evaluation import Choice, bootstrap_interval, choose_on_dev
from analyses.families import ModelFamily, default_task, family_for
from analyses.organism import is_organism
from analyses.steps import step_ends
from analyses.tasks import Problem, load_splits
from probes.backend import Backend
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance

Progress = Callable[[str, int, int], None]


@dataclass
class SettlingRow:
    """One trace: where it settles, where the alarm went off (step indices), and the delay."""

    problem_id: str
    settle_step: int
    n_steps: int
    alarm_step: int | None
    statistic: list[float]

    @property
    def delay(self) -> int | None:
        return None if self.alarm_step is None else self.alarm_step - self.settle_step

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "delay": self.delay}


def settling_row(problem_id: str, entropies: Sequence[float], settle_step: int, detector: CusumDetector,
                 threshold: float | None = None) -> SettlingRow:
    """CUSUM over one trace's step probes (one entropy per step, NaN where a probe read nothing: the
    statistic stays put) and its first alarm at h = `threshold` (default: the detector's)."""
    h = detector.threshold if threshold is None else threshold
    s, path, alarm = 0.0, [], None
    for i, e in enumerate(entropies):
        if e is not None and math.isfinite(e):
            s = max(0.0, s + float(detector.log_likelihood_ratio(e)))
        path.append(s)
        if alarm is None and s >= h:
            alarm = i
    return SettlingRow(problem_id, int(settle_step), len(entropies), alarm, path)


def summarise_delays(rows: Sequence[SettlingRow], bound: int = 2, seed: int = 0) -> dict[str, Any]:
    """Delay distribution, false alarms, misses and the share within `bound` steps, with 95% intervals."""
    if not rows:
        raise BadInputError("no traces to score")
    delays = [r.delay for r in rows]
    false_alarm = np.array([d is not None and d < 0 for d in delays], dtype=float)
    missed = np.array([d is None for d in delays], dtype=float)
    within = np.array([d is not None and 0 <= d <= bound for d in delays], dtype=float)
    hit = [d for d in delays if d is not None and d >= 0]
    out = {"n": len(rows), "bound": bound,
           "within_bound": bootstrap_interval(within, seed=seed).to_dict(),
           "false_alarm_rate": bootstrap_interval(false_alarm, seed=seed).to_dict(),
           "miss_rate": bootstrap_interval(missed, seed=seed).to_dict(),
           "delay_counts": {str(k): v for k, v in sorted(Counter(d for d in delays if d is not None).items())},
           "no_alarm": int(missed.sum())}
    out["mean_delay_when_not_early"] = bootstrap_interval(hit, seed=seed).to_dict() if hit else None
    return out


@dataclass
class SettlingReport:
    """`thoughtscope eval cot-settling`: the alarm against the known settling step."""

    model: str
    task: str
    threshold: float
    bound: int
    rows: list[SettlingRow]  # evaluation split, at the chosen h
    summary: dict[str, Any]
    choices: dict[str, Choice]
    by_threshold: list[dict[str, Any]]  # evaluation split, every h of the grid (reference only)
    detector: CusumDetector
    splits: dict[str, Any]
    seconds: float
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, with_rows: bool = True) -> dict[str, Any]:
        out = {"command": "eval cot-settling", "model": self.model, "task": self.task, "split": "evaluation",
               "threshold": self.threshold, "bound": self.bound, "summary": self.summary,
               "choices": {k: c.to_dict() for k, c in self.choices.items()}, "by_threshold": self.by_threshold,
               "detector": self.detector.to_dict(), "splits": self.splits, "seconds": self.seconds,
               "provenance": self.provenance}
        if with_rows:
            out["rows"] = [r.to_dict() for r in self.rows]
        return out


def planted_traces(backend: Backend, problems: Sequence[Problem], family: ModelFamily,
                   on_progress: Callable[[int, int], None] | None = None) -> list[ProbedTrace]:
    """Each problem's planted trace (`meta["trace"]`), teacher-forced and probed at every step end."""
    out = []
    for i, problem in enumerate(problems):
        if "trace" not in problem.meta:
            raise BadInputError(f"problem {problem.id} carries no planted trace; use the toy-reasoner task")
        messages, chat = _prompt_of(problem, family)
        prompt_ids = backend.encode(messages, chat=chat)
        ids = backend.encode(problem.meta["trace"], add_special_tokens=False)
        texts = backend.token_texts(ids)
        ends = step_ends(texts, family.step_delimiter)
        probes = probe_positions(backend, prompt_ids, ids, [e.boundary for e in ends], family)
        out.append(ProbedTrace(problem.id, problem.answer, list(ids), list(texts), [], ends, probes, list(prompt_ids)))
        if on_progress:
            on_progress(i + 1, len(problems))
    return out


def _step_entropies(trace: ProbedTrace) -> list[float]:
    return [trace.probes[e.boundary].mean_entropy for e in trace.step_ends if e.boundary in trace.probes]


def _calibration_of(trace: ProbedTrace) -> CalibrationTrace:
    """The planted trace ends with the right answer: a step is confident once its probe answer equals
    it for good (the usual unsupervised split; the planted settling step is not used)."""
    answers = [trace.probes[e.boundary].answer for e in trace.step_ends if e.boundary in trace.probes]
    return CalibrationTrace(_step_entropies(trace), answers, trace.target)


def _rows(traces: Sequence[ProbedTrace], problems: Sequence[Problem], detector: CusumDetector,
          threshold: float) -> list[SettlingRow]:
    rows = []
    for trace, problem in zip(traces, problems):
        entropies = _step_entropies(trace)
        if len(entropies) != len(problem.meta["kinds"]):
            raise BadInputError(f"{problem.id}: {len(entropies)} step ends found but {len(problem.meta['kinds'])} "
                                "planted; the step delimiter does not match the organism's")
        rows.append(settling_row(problem.id, entropies, problem.meta["settle_step"], detector, threshold))
    return rows


def evaluate_settling(backend: Backend, task: str | None = None, n: int = 100, n_calibration: int = 60, n_dev: int = 60,
                      *, h_grid: Sequence[float] = DEFAULT_H_GRID, bound: int = 2, density: str = "kde",
                      bandwidths: Sequence[float] | None = None, bins: int = 10, seed: int = 0,
                      family: ModelFamily | None = None, progress: Progress | None = None) -> SettlingReport:
    """Detection delay of the CUSUM alarm relative to the organism's planted settling step (module docstring)."""
    task = task or default_task(backend)
    if not is_organism(task):
        raise BadInputError(f"task {task!r} has no known settling step; use toy-reasoner or toy-reasoner:small")
    checks.integer("the delay bound (steps)", bound, low=0)
    h_grid = check_h_grid(h_grid)  # before any trace is read
    family = family or family_for(backend)
    t0 = time.perf_counter()
    splits = load_splits(task, n_calibration, n_dev, n, seed=seed)
    traces = {name: planted_traces(backend, part, family,
                                   None if progress is None else (lambda d, t, s=name: progress(s, d, t)))
              for name, part in zip(("calibration", "development", "evaluation"), splits)}
    cal = [_calibration_of(t) for t in traces["calibration"]]
    density_choice = choose_density(cal, [_calibration_of(t) for t in traces["development"]], density=density,
                                    bandwidths=bandwidths, bins=bins)
    detector = CusumDetector(threshold=float(h_grid[0]), density=density,
                             bins=int(density_choice.chosen) if density == "histogram" else bins,
                             bandwidth=float(density_choice.chosen) if density == "kde" else None).fit(cal)

    def on_dev(h: float) -> dict[str, Any]:
        s = summarise_delays(_rows(traces["development"], splits.development, detector, float(h)), bound, seed)
        return {"within_bound": s["within_bound"]["estimate"], "false_alarm_rate": s["false_alarm_rate"]["estimate"],
                "miss_rate": s["miss_rate"]["estimate"]}

    choice = choose_on_dev(list(h_grid), on_dev, lambda r: (r["within_bound"], -r["false_alarm_rate"]), name="h",
                           objective_name=f"max share of alarms 0..{bound} steps after settling, then fewest false "
                                          "alarms")
    h = float(choice.chosen)
    rows = _rows(traces["evaluation"], splits.evaluation, detector, h)
    by_h = []
    for other in h_grid:
        s = summarise_delays(_rows(traces["evaluation"], splits.evaluation, detector, float(other)), bound, seed)
        by_h.append({"h": float(other), "within_bound": s["within_bound"]["estimate"],
                     "false_alarm_rate": s["false_alarm_rate"]["estimate"], "miss_rate": s["miss_rate"]["estimate"]})
    info = backend.info()
    record = provenance(info, data=task, split="evaluation (h and bandwidth chosen on development)", seed=seed,
                        command="eval cot-settling", settings={"h_grid": list(h_grid), "bound": bound,
                                                              "density": density, "bins": bins,
                                                              "family": family.to_dict()}, splits=splits.sizes())
    return SettlingReport(info["model_id"], task, h, bound, rows, summarise_delays(rows, bound, seed),
                          {"density": density_choice, "cusum": choice}, by_h, detector.with_threshold(h),
                          splits.to_dict(), time.perf_counter() - t0, record)
