"""The calibration a CoT entropy page opens on: f0/f1 fitted on calibration traces, h chosen on development.

`calibrate` runs what the page's Calibrate does (greedy traces of the first `n_calibration`
problems of the task, probed at every step end, densities fitted by `CusumDetector`), then probes
`n_development` other problems (after the page's held-out problems, so a trace the page shows was
used by neither) and chooses CUSUM's h on them with the evaluation harness' objective
(`evaluate.choose_threshold`: the fewest generated tokens within `tolerance` of vanilla's
development accuracy). The result is plain data: `to_json()` is what `thoughtscope ship
cot-calibration` stores, and `PageCalibration.from_json` refits the detector from the stored
calibration steps (the fit is deterministic, so the densities equal the stored ones).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector
from analyses.cot_entropy.evaluate import DEFAULT_H_GRID, calibration_summary, choose_threshold, summarise
from analyses.cot_entropy.rules import StoppingRule, probe_traces, replay
from analyses.evaluation import Choice
from analyses.families import ModelFamily
from analyses.organism import is_organism
from analyses.tasks import Problem, load_task
from probes.backend import Backend
from thoughtscope.errors import BadInputError

HELD_OUT = 8  # problems after the calibration ones that the page offers as traces (never calibrated or developed on)
PAGE_H_GRID = (0.25,) + tuple(DEFAULT_H_GRID)  # 0.25 .. 8: SmolLM2's traces hold only a few probes each


def calibration_problems(task: str, n: int, seed: int) -> list[Problem]:
    return load_task(task, n, seed=seed, split="calibration")


def held_out_problems(task: str, n_cal: int, seed: int, k: int = HELD_OUT) -> list[Problem]:
    """`k` problems the calibration (the first `n_cal` of this seed) did not use (the organism's: its eval split)."""
    if is_organism(task):
        return load_task(task, k, seed=seed, split="eval")
    calibration = load_task(task, n_cal, seed=seed)
    used = {p.id for p in calibration} | {p.question for p in calibration}
    return [p for p in load_task(task, n_cal + k, seed=seed) if p.id not in used and p.question not in used][:k]


def development_problems(task: str, n_cal: int, n_dev: int, seed: int) -> list[Problem]:
    """`n_dev` problems after the calibration and the held-out ones (the organism's: its dev split)."""
    if is_organism(task):
        return load_task(task, n_dev, seed=seed, split="dev")
    return load_task(task, n_cal + HELD_OUT + n_dev, seed=seed)[n_cal + HELD_OUT:]


@dataclass
class PageCalibration:
    """A fitted detector (threshold: the h chosen on development), its calibration steps and the choice."""

    detector: CusumDetector
    settings: dict[str, Any]
    traces: list[dict[str, Any]]  # per calibration trace: id, target, probe entropies/answers, final answer
    summary: dict[str, Any]
    h_choice: dict[str, Any]  # Choice.to_dict() of h on development
    dev_vanilla: dict[str, float]
    development: list[dict[str, Any]] = field(default_factory=list)  # per development trace: tokens, probes

    @property
    def h(self) -> float:
        return float(self.h_choice["chosen"])

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings, "traces": self.traces, "summary": self.summary, "h_choice": self.h_choice,
                "dev_vanilla": self.dev_vanilla, "development": self.development, "detector": self.detector.to_dict()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PageCalibration":
        s = data["settings"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the stored summary carries the fit's warnings
            detector = CusumDetector(threshold=float(data["h_choice"]["chosen"]), density=s["density"],
                                     bins=int(s["bins"])).fit(
                [CalibrationTrace(t["entropies"], t["answers"], t["final_answer"]) for t in data["traces"]])
        return cls(detector, s, data["traces"], data["summary"], data["h_choice"], data["dev_vanilla"],
                   data.get("development", []))


def _trace_row(t: Any) -> dict[str, Any]:
    cal = t.calibration()
    return {"problem_id": t.problem_id, "target": t.target, "n_tokens": t.n_tokens,
            "step_ends": [[int(e.boundary), int(e.detected_at)] for e in t.step_ends], "entropies": [float(h) for h in cal.entropies],
            "answers": list(cal.answers), "final_answer": cal.final_answer}


def calibrate(backend: Backend, task: str, family: ModelFamily, *, n_calibration: int = 12, n_development: int = 12,
              max_new_tokens: int = 48, seed: int = 0, density: str = "kde", bins: int = 10,
              h_grid: Sequence[float] = PAGE_H_GRID, tolerance: float = 0.02, batch_size: int = 4,
              on_progress: Callable[[str, int, int], None] | None = None) -> PageCalibration:
    """Fit f0/f1 on `n_calibration` problems, then choose h on `n_development` others (module docstring).
    `on_progress(stage, done, total)` after every trace, and between model calls (it may raise to stop)."""
    if n_calibration < 1 or n_development < 1:
        raise BadInputError(f"calibrate on at least one problem and choose h on at least one, got "
                            f"{n_calibration} and {n_development}")

    def stage(name: str) -> Callable[[int, int], None] | None:
        return None if on_progress is None else (lambda done, total: on_progress(name, done, total))

    rule = [StoppingRule(probe_step_ends=True)]
    common = dict(max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = probe_traces(backend, calibration_problems(task, n_calibration, seed), family, rule,
                           on_progress=stage("calibration"), **common)
        detector = CusumDetector(density=density, bins=bins).fit(cal)
    dev = probe_traces(backend, development_problems(task, n_calibration, n_development, seed), family, rule,
                       on_progress=stage("development"), **common)
    choice: Choice = choose_threshold(detector, dev, h_grid, tolerance=tolerance, cost="generated")
    detector = detector.with_threshold(float(choice.chosen))
    settings = {"task": task, "n_calibration": n_calibration, "n_development": n_development,
                "max_new_tokens": max_new_tokens, "seed": seed, "density": density, "bins": bins,
                "delimiter": family.step_delimiter, "answer_suffix": family.answer_suffix, "h_grid": list(h_grid),
                "tolerance": tolerance, "cost": "generated", "batch_size": batch_size}
    summary = {**calibration_summary(cal), "warnings": [str(w.message) for w in caught]}
    development = [{"problem_id": t.problem_id, "n_tokens": t.n_tokens, "probes": len(t.calibration().entropies),
                    "alarm_step": detector.alarm_index(t.calibration().entropies) if t.calibration().entropies
                    else None} for t in dev]
    return PageCalibration(detector, settings, [_trace_row(t) for t in cal], summary, choice.to_dict(),
                           summarise([replay(t, StoppingRule(name="vanilla")) for t in dev]), development)
