"""One trace for the page: a full trace probed at every step end, its CUSUM path, and the exit at any h."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analyses.cot_entropy.detector import CusumDetector, cusum_path, first_alarm, moving_average
from analyses.cot_entropy.probing import Probe
from analyses.cot_entropy.rules import ProbedTrace, StoppingRule, _correct, _prompt_of, _trace_from_records
from analyses.families import ModelFamily, family_for
from analyses.steps import step_ends
from analyses.tasks import Problem
from probes.backend import Backend

# ----------------------------------------------------------------------------- one trace, for the page


@dataclass
class TraceAnalysis:
    """One full trace with probes at every step end and its CUSUM path; `alarm_at(h)` moves the exit."""

    trace: ProbedTrace
    threshold: float
    log_ratios: list[float]
    statistic: list[float]
    smoothing_window: int = 5

    @property
    def step_probes(self) -> list[Probe]:
        return [p for p in self.trace.step_probes() if p.entropies]

    def alarm_at(self, threshold: float | None = None) -> int | None:
        """Index (among step probes) of the first alarm at h = `threshold` (default: the fitted h)."""
        return first_alarm(self.statistic, self.threshold if threshold is None else threshold)

    def exit_token_at(self, threshold: float | None = None) -> int | None:
        """Generated tokens when the alarm would stop the trace (the delimiter's detection point)."""
        i = self.alarm_at(threshold)
        if i is None:
            return None
        boundary = self.step_probes[i].token_index
        return next(e.detected_at for e in self.trace.step_ends if e.boundary == boundary)

    def redundant_tail(self, threshold: float | None = None) -> int:
        """Tokens the model generated after the alarm (0 without an alarm)."""
        at = self.exit_token_at(threshold)
        return 0 if at is None else self.trace.n_tokens - at

    def to_dict(self) -> dict[str, Any]:
        probes = self.step_probes
        i = self.alarm_at()
        return {
            **self.trace.to_dict(),
            "smoothed_entropies": moving_average(self.trace.entropies, self.smoothing_window).tolist(),
            "smoothing_window": self.smoothing_window,
            "step_probe_tokens": [p.token_index for p in probes],
            "step_probe_entropies": [p.mean_entropy for p in probes],
            "step_probe_answers": [p.answer for p in probes],
            "step_probe_correct": [_correct(p.answer, self.trace.target) for p in probes],
            "log_ratios": list(self.log_ratios), "statistic": list(self.statistic), "threshold": self.threshold,
            "alarm_step": i, "exit_token": self.exit_token_at(),
            "exit_answer": probes[i].answer if i is not None else None,
            "redundant_tail": self.redundant_tail(),
        }


def analyze_trace(backend: Backend, prompt: Problem | Any, detector: CusumDetector, *, family: ModelFamily | None = None,
                  max_new_tokens: int = 96, sampling: Any = None, seed: int = 0,
                  smoothing_window: int = 5) -> TraceAnalysis:
    """Generate one trace to its end, probe every step end, and lay out the CUSUM path over it."""
    family = family or family_for(backend)
    target = prompt.answer if isinstance(prompt, Problem) else None
    problem_id = prompt.id if isinstance(prompt, Problem) else ""
    messages, chat = _prompt_of(prompt, family)
    records = list(backend.generate(messages, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                    chat=chat, top_k=0))
    trace = _trace_from_records(backend, backend.encode(messages, chat=chat), records, family,
                                [StoppingRule(probe_step_ends=True)], problem_id, target)
    entropies = trace.calibration().entropies
    z = np.atleast_1d(detector.log_likelihood_ratio(entropies)) if entropies else np.zeros(0)
    return TraceAnalysis(trace, detector.threshold, z.tolist(), cusum_path(z).tolist(), smoothing_window)


def analysis_from_run(records: Sequence[Any], probes: Iterable[Probe], detector: CusumDetector,
                      family: ModelFamily, *, target: str | None = None, problem_id: str = "",
                      prompt_ids: Sequence[int] = (), smoothing_window: int = 5) -> TraceAnalysis:
    """The `TraceAnalysis` of a trace generated live by `run_with_rule` (a rule that probes every step
    end and never exits): its token records and probes, as `on_event` delivered them. No model call;
    equals what `analyze_trace` computes for the same greedy trace."""
    texts = [r.text for r in records]
    trace = ProbedTrace(problem_id, target, [int(r.token_id) for r in records], texts,
                        [float(r.entropy) for r in records], step_ends(texts, family.step_delimiter),
                        {p.token_index: p for p in probes}, list(prompt_ids))
    entropies = trace.calibration().entropies
    z = np.atleast_1d(detector.log_likelihood_ratio(entropies)) if entropies else np.zeros(0)
    return TraceAnalysis(trace, detector.threshold, z.tolist(), cusum_path(z).tolist(), smoothing_window)
