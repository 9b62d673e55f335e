"""Entropy phases of chain of thought, detected online with CUSUM; early exit and weighted voting.

Method: Xu et al., "Unveiling the Entropy Dynamics of Chain-of-Thought Reasoning" (arXiv
2606.02020; no official code). A trace is cut into steps; at the end of each step an
answer-forcing suffix is appended to a fork of the KV state and the intermediate answer A_i is
decoded greedily; H_i is the mean token entropy over A_i. Before a change point the H_i follow an
"uncertainty" density f0, after it a "confidence" density f1; a CUSUM test on
Z_i = log f1(H_i) - log f0(H_i) raises an alarm at the first S_i >= h (h = log gamma), and the
model stops thinking and answers A_i. Sampled trajectories vote with their final CUSUM statistic
as weight.

Our reconstruction, where the paper leaves things open (marked [recon] below):
- steps [recon]: a per-model-family delimiter (regex). Reasoning models keep the paper's
  paragraph boundary; the embedded SmolLM2 writes ~35-token traces without blank lines, so its
  steps end at sentence ends (". ", ".\\n"). A delimiter with look-ahead is only seen one token
  late; the probe still forks at the boundary, and the exit counts the token already generated.
- answer-forcing suffix [recon]: " The answer is " for SmolLM2 / plain instruct models,
  "</think>\\nThe answer is " for thinking models; A_i is decoded until "." or a newline.
- f0/f1 split [recon]: step i of a calibration trace is "confident" when its intermediate answer
  already equals the trace's final answer and stays equal at every later step; histogram
  densities with a Laplace pseudo-count per bin (so every log density is finite); values outside
  the calibration range fall into the edge bins.
- baselines [recon of their papers, same probe as ours]: DEER (Yang et al. 2025) exits when the
  trial answer's geometric-mean token probability exceeds 0.95 at thought-switch points, which
  for us are the step ends; Dynasor-CoT (Fu et al. 2025) probes every k tokens and exits when the
  last m answers agree and none holds a hesitation word; self-consistency is a plain majority vote.
- cost accounting: "generated tokens" are the trace tokens decoded until the exit; a probe costs
  its suffix plus its decoded answer tokens ("tokens with probes" adds them).

Evaluation replays each rule on one probed greedy trace per problem: exiting only truncates a
greedy trace and a fork leaves the state as it was, so the replay takes the same decisions as
`run_with_rule` (a test checks this) while one generation serves every method.

Example:
    >>> detector = CusumDetector(threshold=2.0).fit([CalibrationTrace([1.2, 0.3], ["3", "5"], "5")])
    >>> detector.batch_statistic([1.2, 0.3, 0.3]).round(2).tolist()
    [0.0, 0.69, 1.39]
    >>> detector.alarm_index([1.2, 0.3, 0.3, 0.3])
    3
"""

from __future__ import annotations

import copy
import math
import re
import time
import warnings
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analyses.tasks import Problem, extract_answer, is_correct, load_task, one_shot_messages, split_problems
from thoughtscope.errors import BadInputError

DEFAULT_THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
HESITATION_WORDS = ("wait", "hmm", "but", "however", "alternatively", "maybe", "not sure", "double-check")


# ----------------------------------------------------------------------------- model families


@dataclass(frozen=True)
class CotFamily:
    """How to cut a model family's traces into steps and how to force an answer out of it."""

    name: str
    step_delimiter: str  # regex; a step ends where a match ends
    answer_suffix: str  # appended at a step end to force the intermediate answer
    answer_stop: tuple[str, ...] = (".", "\n")
    answer_max_tokens: int = 8
    probe_every: int = 64  # Dynasor-CoT's probe interval k
    probe_agree: int = 3  # Dynasor-CoT's m consecutive agreeing answers

    def with_delimiter(self, delimiter: str | None) -> "CotFamily":
        if not delimiter:
            return self
        _compile_delimiter(delimiter)
        return CotFamily(**{**self.__dict__, "step_delimiter": delimiter})


COT_FAMILIES = {
    # ~35-token traces without blank lines: sentence ends; probes every 8 tokens, 2 must agree.
    "smollm2": CotFamily("smollm2", r"[.!?](?=\s)", " The answer is ", probe_every=8, probe_agree=2),
    "instruct": CotFamily("instruct", r"\n\n", "The answer is ", probe_every=32, probe_agree=3),
    "thinking": CotFamily("thinking", r"\n\n", "</think>\nThe answer is ", probe_every=64, probe_agree=3),
    # Random-weight test models write words, not sentences: every word end is a step, short probes.
    "tiny": CotFamily("tiny", r"\S(?=\s)", " The answer is ", answer_max_tokens=3, probe_every=4, probe_agree=2),
}
_THINKING_IDS = re.compile(r"r1|qwq|thinking|reason|qwen3(?!.*instruct)", re.IGNORECASE)


def cot_family_for(model: Any) -> CotFamily:
    """The family of a model id (or an engine): SmolLM2, the tiny test models, thinking, plain instruct."""
    model_id = model if isinstance(model, str) else model.handle.model_id
    lowered = model_id.lower()
    if lowered.startswith("tiny-random:"):
        return COT_FAMILIES["tiny"]
    if "smollm" in lowered:
        return COT_FAMILIES["smollm2"]
    if _THINKING_IDS.search(lowered):
        return COT_FAMILIES["thinking"]
    return COT_FAMILIES["instruct"]


def _compile_delimiter(delimiter: str) -> re.Pattern:
    try:
        pattern = re.compile(delimiter)
    except re.error as err:
        raise BadInputError(f"the step delimiter {delimiter!r} is not a valid regular expression: {err}") from err
    if pattern.fullmatch(""):
        raise BadInputError(f"the step delimiter {delimiter!r} matches the empty string; give one that eats text")
    return pattern


# ----------------------------------------------------------------------------- entropy curve


def entropy_per_token(records: Iterable[Any]) -> np.ndarray:
    """The entropy (nats) of each generated token's distribution, from records or their dicts."""
    return np.array([r["entropy"] if isinstance(r, dict) else r.entropy for r in records], dtype=float)


def moving_average(values: Sequence[float], window: int = 5, centered: bool = False) -> np.ndarray:
    """Mean over a window: trailing (what a live view can know) or centered (offline display)."""
    if window < 1:
        raise BadInputError(f"the smoothing window must be >= 1 token, got {window}")
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return x
    csum = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    lo = idx - (window // 2 if centered else window - 1)
    hi = idx + (window - window // 2 if centered else 1)
    lo, hi = np.clip(lo, 0, x.size), np.clip(hi, 0, x.size)
    return (csum[hi] - csum[lo]) / (hi - lo)


def entropy_thirds(values: Sequence[float]) -> list[float]:
    """Mean entropy over the first, middle and last third of a trace (the paper's falling trend)."""
    x = np.asarray(values, dtype=float)
    if x.size < 3:
        return [float("nan")] * 3
    return [float(part.mean()) for part in np.array_split(x, 3)]


# ----------------------------------------------------------------------------- step segmentation


@dataclass(frozen=True)
class StepEnd:
    """A step ends after `boundary` generated tokens; the delimiter was seen after `detected_at`."""

    boundary: int
    detected_at: int


class StepSegmenter:
    """Finds step ends online: `push` one token's text, get the step ends it reveals."""

    def __init__(self, delimiter: str):
        self.pattern = _compile_delimiter(delimiter)
        self.text = ""
        self._token_ends: list[int] = []
        self._search_from = 0
        self.ends: list[StepEnd] = []

    def push(self, piece: str) -> list[int]:
        self.text += piece
        self._token_ends.append(len(self.text))
        new: list[int] = []
        for match in self.pattern.finditer(self.text, self._search_from):
            self._search_from = match.end()
            boundary = bisect_left(self._token_ends, match.end()) + 1  # tokens covering the delimiter
            if (self.ends and boundary <= self.ends[-1].boundary) or boundary in new:
                continue
            new.append(boundary)
            self.ends.append(StepEnd(boundary, len(self._token_ends)))
        return new


def segment_steps(token_texts: Sequence[str], delimiter: str) -> list[StepEnd]:
    """Step ends of a finished trace, exactly as `StepSegmenter` finds them while generating."""
    segmenter = StepSegmenter(delimiter)
    for piece in token_texts:
        segmenter.push(piece)
    return segmenter.ends


# ----------------------------------------------------------------------------- probes


@dataclass
class Probe:
    """An intermediate answer forced at `token_index` generated tokens (a fork; costs only itself)."""

    token_index: int
    answer_text: str
    answer: str | None
    entropies: list[float]  # over the answer tokens (the stop token excluded)
    logprobs: list[float]
    tokens_computed: int  # suffix + decoded answer tokens

    @property
    def mean_entropy(self) -> float:
        return float(np.mean(self.entropies)) if self.entropies else float("nan")

    @property
    def confidence(self) -> float:
        """Geometric-mean token probability of the answer (DEER's trial-answer confidence)."""
        return float(math.exp(np.mean(self.logprobs))) if self.logprobs else 0.0

    @classmethod
    def from_records(cls, records: Sequence[Any], token_index: int, suffix_tokens: int,
                     eos_ids: Iterable[int] = ()) -> "Probe":
        eos = set(eos_ids)
        kept = list(records)
        last = kept[-1] if kept else None
        if last is not None and len(kept) > 1 and (last.token_id in eos or not any(c.isalnum() for c in last.text)):
            kept = kept[:-1]  # the stop token says the answer ended, it is not part of it
        while len(kept) > 1 and not kept[0].text.strip():
            kept = kept[1:]
        text = "".join(r.text for r in records if r.token_id not in eos)
        return cls(token_index, text, extract_answer(text) if text.strip() else None,
                   [float(r.entropy) for r in kept], [float(r.logprob) for r in kept],
                   suffix_tokens + len(records))

    def to_dict(self) -> dict[str, Any]:
        return {"token_index": self.token_index, "answer_text": self.answer_text, "answer": self.answer,
                "mean_entropy": self.mean_entropy, "confidence": self.confidence,
                "entropies": list(self.entropies), "logprobs": list(self.logprobs),
                "tokens_computed": self.tokens_computed}


def probe_answer(engine: Any, state: Any, family: CotFamily, token_index: int) -> Probe:
    """Fork `state`, append the family's answer-forcing suffix, decode the answer greedily."""
    suffix_ids = engine.tok(family.answer_suffix, add_special_tokens=False)["input_ids"]
    records = engine.fork(state, list(suffix_ids), max_new_tokens=family.answer_max_tokens,
                          top_k=0, stop=family.answer_stop)
    return Probe.from_records(records, token_index, len(suffix_ids), engine.eos_ids)


def _supports_crop(cache: Any) -> bool:
    return not any("Sliding" in type(layer).__name__ for layer in getattr(cache, "layers", []))


def probe_positions(engine: Any, prompt_ids: Sequence[int], token_ids: Sequence[int],
                    positions: Iterable[int], family: CotFamily) -> dict[int, Probe]:
    """Probes of a finished trace at each position: one prefill, then forks walking backwards.

    The prefix is run once; each earlier position crops the cache instead of recomputing it.
    """
    from probes.engine import PrefixState, _rollback

    wanted = sorted({int(b) for b in positions if 0 < b <= len(token_ids)}, reverse=True)
    if not wanted:
        return {}
    prompt_ids, token_ids = list(prompt_ids), list(token_ids)
    state = engine.prefill(prompt_ids + token_ids[: wanted[0]])
    probes = {}
    for b in wanted:
        end = len(prompt_ids) + b
        if _supports_crop(state.cache):
            _rollback(state.cache, end)
            at = PrefixState(state.ids[:end], state.cache)
        else:
            at = engine.prefill(prompt_ids + token_ids[:b])
        probes[b] = probe_answer(engine, at, family, b)
    return probes


def _live_state(engine: Any, stream: Any, prompt_len: int, boundary: int) -> Any:
    """The state of a live generation cut at `boundary` generated tokens, without copying the cache."""
    from probes.engine import PrefixState

    ids = stream.step.ids[0]
    end = prompt_len + boundary
    if stream.cache.get_seq_length() <= end:
        return PrefixState(list(ids[:end]), stream.cache)
    return engine.prefill(list(ids[:end]))  # a delimiter that needed more than one token of look-ahead


# ----------------------------------------------------------------------------- CUSUM


def cusum_path(log_ratios: Sequence[float]) -> np.ndarray:
    """S_0 = 0, S_i = max(0, S_{i-1} + Z_i): the CUSUM statistic after each step."""
    out, s = np.empty(len(log_ratios)), 0.0
    for i, z in enumerate(log_ratios):
        s = max(0.0, s + float(z))
        out[i] = s
    return out


def first_alarm(statistic: Sequence[float], threshold: float) -> int | None:
    """Index of the first step whose statistic reaches `threshold`, or None."""
    hits = np.flatnonzero(np.asarray(statistic, dtype=float) >= threshold)
    return int(hits[0]) if hits.size else None


@dataclass
class CalibrationTrace:
    """One calibration trajectory: the probes' mean entropies and answers, and its final answer."""

    entropies: list[float]
    answers: list[str | None]
    final_answer: str | None

    def labels(self) -> list[int]:
        """0 (uncertainty) before the intermediate answer settles on the final one for good, 1 after [recon]."""
        if len(self.answers) != len(self.entropies):
            raise BadInputError("a calibration trace needs one answer per probe entropy")
        settle = len(self.answers)
        if self.final_answer is not None:
            while settle > 0 and self.answers[settle - 1] == self.final_answer:
                settle -= 1
        return [0] * settle + [1] * (len(self.answers) - settle)


def _as_calibration(item: Any) -> CalibrationTrace:
    if isinstance(item, CalibrationTrace):
        return item
    if hasattr(item, "calibration"):
        return item.calibration()
    if isinstance(item, dict):
        return CalibrationTrace(list(item["entropies"]), list(item["answers"]), item.get("final_answer"))
    raise BadInputError(f"cannot calibrate on {type(item).__name__}; pass CalibrationTrace or ProbedTrace objects")


class CusumDetector:
    """CUSUM change-point detector over probe entropies, scikit-learn style.

    `fit` learns histogram densities f0 (uncertainty) and f1 (confidence); `update` is the O(1)
    online step; `threshold` is h = log(gamma). Learned and running state ends in `_`.
    """

    def __init__(self, threshold: float = 2.0, bins: int = 10, smoothing: float = 1.0,
                 value_range: tuple[float, float] | None = None):
        self.threshold = threshold
        self.bins = bins
        self.smoothing = smoothing
        self.value_range = value_range
        self._check_params()

    def _check_params(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold > 0):
            raise BadInputError(f"the CUSUM threshold h must be a positive number, got {self.threshold!r}")
        if not isinstance(self.bins, int) or self.bins < 2:
            raise BadInputError(f"the histograms need at least 2 bins, got {self.bins!r}")
        if not self.smoothing > 0:
            raise BadInputError("smoothing must be > 0 so that every log density is finite")

    def fit(self, calibration_traces: Iterable[Any]) -> "CusumDetector":
        traces = [_as_calibration(t) for t in calibration_traces]
        values = np.array([h for t in traces for h in t.entropies], dtype=float)
        labels = np.array([y for t in traces for y in t.labels()], dtype=int)
        keep = np.isfinite(values)
        values, labels = values[keep], labels[keep]
        if values.size == 0:
            raise BadInputError("the calibration traces hold no probe entropies: give more calibration problems, "
                                "longer generations, or a step delimiter that occurs in this model's traces")
        lo, hi = self.value_range or (min(0.0, float(values.min())), float(values.max()) * 1.05 + 1e-6)
        self.bin_edges_ = np.linspace(lo, hi, self.bins + 1)
        width = np.diff(self.bin_edges_)
        self.counts1_ = np.histogram(np.clip(values[labels == 1], lo, hi), self.bin_edges_)[0]
        self.counts0_ = np.histogram(np.clip(values[labels == 0], lo, hi), self.bin_edges_)[0]
        a = self.smoothing
        self.density0_ = (self.counts0_ + a) / (self.counts0_.sum() + a * self.bins) / width
        self.density1_ = (self.counts1_ + a) / (self.counts1_.sum() + a * self.bins) / width
        self.log_ratio_ = np.log(self.density1_) - np.log(self.density0_)
        self.n_uncertain_, self.n_confident_ = int(self.counts0_.sum()), int(self.counts1_.sum())
        if not self.n_uncertain_ or not self.n_confident_:
            warnings.warn(f"calibration gave {self.n_uncertain_} uncertain and {self.n_confident_} confident "
                          "steps; one density is flat, so the detector carries little information", stacklevel=2)
        self.reset()
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "log_ratio_"):
            raise BadInputError("the CUSUM detector is not fitted: call fit(calibration_traces) first")

    def log_likelihood_ratio(self, entropy: float | Sequence[float]) -> Any:
        """Z = log f1(H) - log f0(H), per value; outside the calibration range the edge bin applies."""
        self._check_fitted()
        h = np.asarray(entropy, dtype=float)
        if np.isnan(h).any():
            raise BadInputError("a probe entropy is NaN; the probe decoded no answer tokens")
        idx = np.clip(np.searchsorted(self.bin_edges_, h, side="right") - 1, 0, self.bins - 1)
        z = self.log_ratio_[idx]
        return float(z) if z.ndim == 0 else z

    def reset(self) -> "CusumDetector":
        self.statistic_, self.n_updates_, self.alarm_step_ = 0.0, 0, None
        return self

    def update(self, entropy: float) -> tuple[float, bool]:
        """One step: S = max(0, S + Z(H)). Returns (S, whether S >= threshold)."""
        self._check_fitted()
        self.statistic_ = max(0.0, self.statistic_ + self.log_likelihood_ratio(entropy))
        alarm = self.statistic_ >= self.threshold
        if alarm and self.alarm_step_ is None:
            self.alarm_step_ = self.n_updates_
        self.n_updates_ += 1
        return self.statistic_, alarm

    def batch_statistic(self, entropies: Sequence[float]) -> np.ndarray:
        """The statistic after each step of a whole sequence (what `update` returns one by one)."""
        return cusum_path(np.atleast_1d(self.log_likelihood_ratio(list(entropies)))) if len(entropies) else np.zeros(0)

    def alarm_index(self, entropies: Sequence[float]) -> int | None:
        return first_alarm(self.batch_statistic(entropies), self.threshold)

    def with_threshold(self, threshold: float) -> "CusumDetector":
        """A copy with another h, sharing the fitted densities, reset."""
        other = copy.copy(self)
        other.threshold = threshold
        other._check_params()
        return other.reset()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"threshold": self.threshold, "bins": self.bins, "smoothing": self.smoothing}
        if hasattr(self, "log_ratio_"):
            out.update(bin_edges=self.bin_edges_.tolist(), density_uncertain=self.density0_.tolist(),
                       density_confident=self.density1_.tolist(), log_ratio=self.log_ratio_.tolist(),
                       counts_uncertain=self.counts0_.tolist(), counts_confident=self.counts1_.tolist(),
                       n_uncertain=self.n_uncertain_, n_confident=self.n_confident_)
        return out


# ----------------------------------------------------------------------------- stopping rules


@dataclass
class StoppingRule:
    """Where a method probes (step ends and/or every k tokens) and whether a probe ends the trace."""

    name: str = "vanilla"
    probe_step_ends: bool = False
    probe_every: int | None = None

    def reset(self) -> None:
        pass

    def points_at(self, n_generated: int, new_step_ends: Sequence[int]) -> list[int]:
        """The positions to probe now that `n_generated` tokens exist and these step ends appeared."""
        points = list(new_step_ends) if self.probe_step_ends else []
        if self.probe_every and n_generated % self.probe_every == 0 and n_generated not in points:
            points.append(n_generated)
        return points

    def observe(self, probe: Probe) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass
class CusumStop(StoppingRule):
    """Exit at the CUSUM alarm on the probes' mean answer entropies (Xu et al.)."""

    detector: CusumDetector | None = None
    name: str = "cusum"
    probe_step_ends: bool = True
    statistic: list[float] = field(default_factory=list)

    def reset(self) -> None:
        if self.detector is None:
            raise BadInputError("CusumStop needs a fitted CusumDetector")
        self.detector.reset()
        self.statistic = []

    def observe(self, probe: Probe) -> bool:
        if not probe.entropies:
            return False
        s, alarm = self.detector.update(probe.mean_entropy)
        self.statistic.append(s)
        return alarm

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "h": self.detector.threshold if self.detector else None}


@dataclass
class DeerStop(StoppingRule):
    """DEER: exit at a thought switch when the trial answer's geometric-mean probability > threshold."""

    threshold: float = 0.95
    name: str = "deer"
    probe_step_ends: bool = True

    def observe(self, probe: Probe) -> bool:
        return probe.answer is not None and probe.confidence > self.threshold

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threshold": self.threshold}


@dataclass
class DynasorStop(StoppingRule):
    """Dynasor-CoT: probe every k tokens; exit when the last m answers agree and none hesitates."""

    probe_every: int | None = 8
    agree: int = 2
    hesitation: tuple[str, ...] = HESITATION_WORDS
    name: str = "dynasor"
    history: list[Probe] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.probe_every or self.probe_every < 1 or self.agree < 1:
            raise BadInputError("Dynasor needs a probe interval k >= 1 and m >= 1 agreeing answers")
        self._hesitant = re.compile(r"\b(" + "|".join(map(re.escape, self.hesitation)) + r")\b", re.IGNORECASE)

    def reset(self) -> None:
        self.history = []

    def observe(self, probe: Probe) -> bool:
        self.history.append(probe)
        last = self.history[-self.agree:]
        return (len(last) == self.agree and last[0].answer is not None
                and all(p.answer == last[0].answer for p in last)
                and not any(self._hesitant.search(p.answer_text) for p in last))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "every": self.probe_every, "agree": self.agree}


# ----------------------------------------------------------------------------- traces and exits


@dataclass
class ExitResult:
    """What one stopping rule did on one problem: its answer and what it cost."""

    method: str
    problem_id: str
    answer: str | None
    target: str | None
    correct: bool | None
    exited: bool  # stopped before the model finished
    generated_tokens: int
    probe_tokens: int
    exit_token: int | None  # the probe position whose answer was emitted
    text: str
    probes: list[Probe] = field(default_factory=list)
    statistic: list[float] = field(default_factory=list)  # CUSUM only

    @property
    def tokens_with_probes(self) -> int:
        return self.generated_tokens + self.probe_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "problem_id": self.problem_id, "answer": self.answer, "target": self.target,
                "correct": self.correct, "exited": self.exited, "generated_tokens": self.generated_tokens,
                "probe_tokens": self.probe_tokens, "tokens_with_probes": self.tokens_with_probes,
                "exit_token": self.exit_token, "text": self.text,
                "probes": [p.to_dict() for p in self.probes], "statistic": list(self.statistic)}


@dataclass
class ProbedTrace:
    """A full greedy (or sampled) trace with probes at every position some rule asked for."""

    problem_id: str
    target: str | None
    token_ids: list[int]
    token_texts: list[str]
    entropies: list[float]
    step_ends: list[StepEnd]
    probes: dict[int, Probe]
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        return "".join(self.token_texts)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def final_answer(self) -> str | None:
        return extract_answer(self.text)

    def step_probes(self) -> list[Probe]:
        """Probes at the step ends seen before the model finished (the ones CUSUM would use)."""
        return [self.probes[e.boundary] for e in self.step_ends
                if e.detected_at < self.n_tokens and e.boundary in self.probes]

    def calibration(self) -> CalibrationTrace:
        probes = [p for p in self.step_probes() if p.entropies]
        return CalibrationTrace([p.mean_entropy for p in probes], [p.answer for p in probes], self.final_answer)

    def to_dict(self) -> dict[str, Any]:
        return {"problem_id": self.problem_id, "target": self.target, "text": self.text,
                "token_ids": list(self.token_ids), "token_texts": list(self.token_texts),
                "entropies": list(self.entropies), "final_answer": self.final_answer,
                "step_ends": [[e.boundary, e.detected_at] for e in self.step_ends],
                "probes": [self.probes[b].to_dict() for b in sorted(self.probes)]}


def _correct(answer: str | None, target: str | None) -> bool | None:
    return None if target is None else is_correct(answer, target)


def plan_probes(step_ends: Sequence[StepEnd], n_tokens: int, rules: Iterable[StoppingRule]) -> set[int]:
    """Every position any of `rules` would probe on a trace of `n_tokens` with these step ends."""
    detected = defaultdict(list)
    for e in step_ends:
        detected[e.detected_at].append(e.boundary)
    positions: set[int] = set()
    for rule in rules:
        for n in range(1, n_tokens):  # the last token ends the generation: nothing left to save
            positions.update(rule.points_at(n, detected.get(n, [])))
    return positions


def replay(trace: ProbedTrace, rule: StoppingRule) -> ExitResult:
    """Run `rule` on a probed trace, taking the decisions it would take while generating."""
    rule.reset()
    detected = defaultdict(list)
    for e in trace.step_ends:
        detected[e.detected_at].append(e.boundary)
    used: list[Probe] = []
    for n in range(1, trace.n_tokens):
        for b in rule.points_at(n, detected.get(n, [])):
            if b not in trace.probes:
                raise BadInputError(f"the trace was not probed at {b} tokens; probe it with this rule in the plan")
            probe = trace.probes[b]
            used.append(probe)
            if rule.observe(probe):
                return _exit(rule, trace.problem_id, trace.target, probe.answer, True, n, used,
                             "".join(trace.token_texts[:n]), b)
    return _exit(rule, trace.problem_id, trace.target, trace.final_answer, False, trace.n_tokens, used,
                 trace.text, None)


def _exit(rule, problem_id, target, answer, exited, generated, used, text, exit_token) -> ExitResult:
    return ExitResult(rule.name, problem_id, answer, target, _correct(answer, target), exited, generated,
                      sum(p.tokens_computed for p in used), exit_token, text, list(used),
                      list(getattr(rule, "statistic", [])))


def _prompt_of(problem: Problem | Any) -> Any:
    return one_shot_messages(problem) if isinstance(problem, Problem) else problem


def run_with_rule(engine: Any, prompt: Any, rule: StoppingRule, *, family: CotFamily | None = None,
                  max_new_tokens: int = 96, sampling: Any = None, seed: int = 0, target: str | None = None,
                  problem_id: str = "", on_event: Callable[[str, Any], None] | None = None) -> ExitResult:
    """Generate while `rule` watches: probes fork the live KV state; stop at the rule's exit.

    `prompt` is a `Problem` (one-shot chat prompt), chat messages or text (rendered as chat).
    `on_event("token", record)` / `on_event("probe", probe)` lets a page draw while it runs.
    """
    family = family or cot_family_for(engine)
    if isinstance(prompt, Problem):
        target, problem_id = target or prompt.answer, problem_id or prompt.id
    rule.reset()
    stream = engine.generate(_prompt_of(prompt), max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                             chat=True, top_k=0)
    segmenter = StepSegmenter(family.step_delimiter)
    texts: list[str] = []
    used: list[Probe] = []
    prompt_len = 0
    try:
        for rec in stream:
            if not texts:
                prompt_len = len(stream.step.ids[0]) - 1
            texts.append(rec.text)
            new_ends = segmenter.push(rec.text)
            if on_event:
                on_event("token", rec)
            if rec.finished:
                break
            for b in rule.points_at(len(texts), new_ends):
                probe = probe_answer(engine, _live_state(engine, stream, prompt_len, b), family, b)
                used.append(probe)
                if on_event:
                    on_event("probe", probe)
                if rule.observe(probe):
                    return _exit(rule, problem_id, target, probe.answer, True, len(texts), used, "".join(texts), b)
    finally:
        stream.close()
    text = "".join(texts)
    return _exit(rule, problem_id, target, extract_answer(text), False, len(texts), used, text, None)


def generate_with_early_exit(engine: Any, problem: Problem | Any, detector: CusumDetector, *,
                             family: CotFamily | None = None, max_new_tokens: int = 96, sampling: Any = None,
                             seed: int = 0, on_event: Callable[[str, Any], None] | None = None) -> ExitResult:
    """Generate with CUSUM watching the step-end probes; at the alarm, stop and emit that probe's answer."""
    return run_with_rule(engine, problem, CusumStop(detector=detector, name=f"cusum h={detector.threshold:g}"),
                         family=family, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         on_event=on_event)


def _trace_from_records(engine, prompt_ids, records, family, rules, problem_id, target) -> ProbedTrace:
    texts = [r.text for r in records]
    ids = [r.token_id for r in records]
    ends = segment_steps(texts, family.step_delimiter)
    probes = probe_positions(engine, prompt_ids, ids, plan_probes(ends, len(ids), rules), family)
    return ProbedTrace(problem_id, target, ids, texts, [float(r.entropy) for r in records], ends, probes,
                       list(prompt_ids))


def probe_traces(engine: Any, problems: Sequence[Problem], family: CotFamily, rules: Sequence[StoppingRule], *,
                 max_new_tokens: int = 96, sampling: Any = None, seed: int = 0, n_samples: int = 1,
                 batch_size: int = 8, progress: bool = True, desc: str = "probing traces") -> list[ProbedTrace]:
    """Generate every problem's trace(s) in batches, then probe each where any of `rules` would.

    Returns `n_samples` traces per problem, problem by problem.
    """
    from tqdm.auto import tqdm

    if not problems:
        raise BadInputError("no problems to run")
    if batch_size < 1:
        raise BadInputError(f"batch_size must be >= 1, got {batch_size}")
    out: list[ProbedTrace] = []
    per_batch = max(1, batch_size // n_samples)
    with tqdm(total=len(problems) * n_samples, desc=desc, disable=not progress, unit="trace") as bar:
        for start in range(0, len(problems), per_batch):
            chunk = list(problems[start:start + per_batch])
            prompts = [one_shot_messages(p) for p in chunk]
            by_index: dict[int, list[Any]] = defaultdict(list)
            stream = engine.generate(prompts=prompts, n_samples=n_samples, max_new_tokens=max_new_tokens,
                                     sampling=sampling, seed=seed + start, chat=True, top_k=0)
            for rec in stream:
                by_index[rec.batch_index].append(rec)
            for i, problem in enumerate(chunk):
                prompt_ids = engine.encode(prompts[i], chat=True)
                for s in range(n_samples):
                    out.append(_trace_from_records(engine, prompt_ids, by_index[i * n_samples + s], family, rules,
                                                   problem.id, problem.answer))
                    bar.update(1)
    return out


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


def analyze_trace(engine: Any, prompt: Problem | Any, detector: CusumDetector, *, family: CotFamily | None = None,
                  max_new_tokens: int = 96, sampling: Any = None, seed: int = 0,
                  smoothing_window: int = 5) -> TraceAnalysis:
    """Generate one trace to its end, probe every step end, and lay out the CUSUM path over it."""
    family = family or cot_family_for(engine)
    target = prompt.answer if isinstance(prompt, Problem) else None
    problem_id = prompt.id if isinstance(prompt, Problem) else ""
    messages = _prompt_of(prompt)
    records = list(engine.generate(messages, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                   chat=True, top_k=0))
    trace = _trace_from_records(engine, engine.encode(messages, chat=True), records, family,
                                [StoppingRule(probe_step_ends=True)], problem_id, target)
    entropies = trace.calibration().entropies
    z = np.atleast_1d(detector.log_likelihood_ratio(entropies)) if entropies else np.zeros(0)
    return TraceAnalysis(trace, detector.threshold, z.tolist(), cusum_path(z).tolist(), smoothing_window)


def analysis_from_run(records: Sequence[Any], probes: Iterable[Probe], detector: CusumDetector,
                      family: CotFamily, *, target: str | None = None, problem_id: str = "",
                      prompt_ids: Sequence[int] = (), smoothing_window: int = 5) -> TraceAnalysis:
    """The `TraceAnalysis` of a trace generated live by `run_with_rule` (a rule that probes every step
    end and never exits): its token records and probes, as `on_event` delivered them. No model call;
    equals what `analyze_trace` computes for the same greedy trace."""
    texts = [r.text for r in records]
    trace = ProbedTrace(problem_id, target, [int(r.token_id) for r in records], texts,
                        [float(r.entropy) for r in records], segment_steps(texts, family.step_delimiter),
                        {p.token_index: p for p in probes}, list(prompt_ids))
    entropies = trace.calibration().entropies
    z = np.atleast_1d(detector.log_likelihood_ratio(entropies)) if entropies else np.zeros(0)
    return TraceAnalysis(trace, detector.threshold, z.tolist(), cusum_path(z).tolist(), smoothing_window)


# ----------------------------------------------------------------------------- evaluation


@dataclass
class MethodSummary:
    """Accuracy and cost of one method over the evaluation problems."""

    name: str
    params: dict[str, Any]
    accuracy: float
    mean_generated_tokens: float
    mean_probe_tokens: float
    exit_rate: float
    n: int
    results: list[ExitResult] = field(default_factory=list, repr=False)

    @property
    def mean_tokens_with_probes(self) -> float:
        return self.mean_generated_tokens + self.mean_probe_tokens

    @classmethod
    def of(cls, rule: StoppingRule, results: Sequence[ExitResult]) -> "MethodSummary":
        return cls(rule.name, rule.describe(), float(np.mean([bool(r.correct) for r in results])),
                   float(np.mean([r.generated_tokens for r in results])),
                   float(np.mean([r.probe_tokens for r in results])),
                   float(np.mean([r.exited for r in results])), len(results), list(results))

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        out = {"name": self.name, "params": self.params, "accuracy": self.accuracy,
               "mean_generated_tokens": self.mean_generated_tokens, "mean_probe_tokens": self.mean_probe_tokens,
               "mean_tokens_with_probes": self.mean_tokens_with_probes, "exit_rate": self.exit_rate, "n": self.n}
        if with_results:
            out["per_problem"] = [{"id": r.problem_id, "answer": r.answer, "correct": r.correct,
                                   "generated": r.generated_tokens, "probe": r.probe_tokens, "exited": r.exited}
                                  for r in self.results]
        return out


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
    on generated tokens and on tokens with probes. Takes `MethodSummary`s or their dicts."""
    rows = [m.to_dict(with_results=False) if hasattr(m, "to_dict") else m for m in methods]
    keys = {"generated": "mean_generated_tokens", "with_probes": "mean_tokens_with_probes"}
    fronts = {"vs_deer_dynasor": [r for r in rows if r["name"] in ("deer", "dynasor")],
              "vs_all_baselines": [r for r in rows if not r["name"].startswith("cusum")]}
    return {r["name"]: {front: {measure: pareto_status((r[key], r["accuracy"]), [(b[key], b["accuracy"]) for b in base])
                                for measure, key in keys.items()}
                        for front, base in fronts.items()}
            for r in rows if r["name"].startswith("cusum")}


@dataclass
class CotExitReport:
    """`thoughtscope eval cot-exit`: every method on the same problems and traces."""

    model: str
    task: str
    n_eval: int
    n_calibration: int
    family: CotFamily
    detector: CusumDetector
    methods: list[MethodSummary]
    entropy_thirds: list[float]
    seconds: dict[str, float]
    settings: dict[str, Any]

    def method(self, name: str) -> MethodSummary:
        return next(m for m in self.methods if m.name == name)

    def pareto(self) -> dict[str, dict[str, dict[str, str]]]:
        return pareto_table(self.methods)

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        return {"command": "eval cot-exit", "model": self.model, "task": self.task, "n_eval": self.n_eval,
                "n_calibration": self.n_calibration, "family": dict(self.family.__dict__),
                "methods": [m.to_dict(with_results) for m in self.methods], "pareto": self.pareto(),
                "detector": self.detector.to_dict(), "entropy_thirds": self.entropy_thirds,
                "seconds": self.seconds, "settings": self.settings}


def fit_detector(engine: Any, problems: Sequence[Problem], family: CotFamily, *, threshold: float = 2.0,
                 bins: int = 10, max_new_tokens: int = 96, seed: int = 0, batch_size: int = 8,
                 progress: bool = True, on_progress: Callable[[int, int], None] | None = None,
                 ) -> tuple[CusumDetector, list[ProbedTrace]]:
    """Greedy calibration traces probed at their step ends, and the detector fitted on them.

    `on_progress(done, total)` is called after each batch (a page's progress bar); without it a
    terminal progress bar is shown when `progress`.
    """
    rule = [StoppingRule(probe_step_ends=True)]
    if on_progress is None:
        traces = probe_traces(engine, problems, family, rule, max_new_tokens=max_new_tokens, seed=seed,
                              batch_size=batch_size, progress=progress, desc="calibration")
    else:
        traces = []
        for start in range(0, len(problems), batch_size):
            traces += probe_traces(engine, problems[start:start + batch_size], family, rule,
                                   max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, progress=False)
            on_progress(len(traces), len(problems))
    return CusumDetector(threshold=threshold, bins=bins).fit(traces), traces


def calibration_summary(traces: Sequence[ProbedTrace]) -> dict[str, Any]:
    """Accuracy of the calibration traces' final answers and how many probed steps the densities saw."""
    return {"accuracy": float(np.mean([is_correct(t.final_answer, t.target) for t in traces])) if traces else 0.0,
            "steps": int(sum(len(t.calibration().entropies) for t in traces))}


def _split(task: str, n: int, n_calibration: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    if n < 1 or n_calibration < 1:
        raise BadInputError(f"need at least one evaluation and one calibration problem, got n={n}, "
                            f"n_calibration={n_calibration}")
    return split_problems(load_task(task, n + n_calibration, seed=seed), n_calibration, seed=seed)


def evaluate_cot_exit(engine: Any, task: str = "arith", n: int = 100, n_calibration: int = 60, *,
                      thresholds: Sequence[float] = DEFAULT_THRESHOLDS, family: CotFamily | None = None,
                      max_new_tokens: int = 96, seed: int = 0, batch_size: int = 8, bins: int = 10,
                      deer_threshold: float = 0.95, dynasor_every: int | None = None,
                      dynasor_agree: int | None = None, progress: bool = True) -> CotExitReport:
    """Vanilla, CUSUM at each h, DEER and Dynasor on the same greedy traces of `n` evaluation
    problems; the detector is fitted on `n_calibration` other problems."""
    if not thresholds:
        raise BadInputError("give at least one CUSUM threshold h")
    family = family or cot_family_for(engine)
    calibration, evaluation = _split(task, n, n_calibration, seed)
    t0 = time.perf_counter()
    detector, cal_traces = fit_detector(engine, calibration, family, threshold=thresholds[0], bins=bins,
                                        max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                                        progress=progress)
    t1 = time.perf_counter()
    rules: list[StoppingRule] = [StoppingRule(name="vanilla")]
    rules += [CusumStop(detector=detector.with_threshold(h), name=f"cusum h={h:g}") for h in thresholds]
    rules += [DeerStop(threshold=deer_threshold),
              DynasorStop(probe_every=dynasor_every or family.probe_every, agree=dynasor_agree or family.probe_agree)]
    traces = probe_traces(engine, evaluation, family, rules, max_new_tokens=max_new_tokens, seed=seed + 10_000,
                          batch_size=batch_size, progress=progress, desc="evaluation")
    t2 = time.perf_counter()
    methods = [MethodSummary.of(rule, [replay(t, rule) for t in traces]) for rule in rules]
    thirds = np.nanmean([entropy_thirds(t.entropies) for t in traces], axis=0).tolist()
    return CotExitReport(
        engine.handle.model_id, task, len(evaluation), len(calibration), family, detector, methods, thirds,
        {"calibration": t1 - t0, "evaluation": t2 - t1, "replay": time.perf_counter() - t2},
        {"max_new_tokens": max_new_tokens, "seed": seed, "thresholds": list(thresholds), "bins": bins,
         "deer_threshold": deer_threshold, "batch_size": batch_size,
         "calibration_steps": {"uncertain": detector.n_uncertain_, "confident": detector.n_confident_},
         "calibration_ids": [p.id for p in calibration],
         "calibration_accuracy": float(np.mean([is_correct(t.final_answer, t.target) for t in cal_traces]))},
    )


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

    def to_dict(self) -> dict[str, Any]:
        return {"command": "eval cot-vote", **{k: v for k, v in self.__dict__.items()}}


def evaluate_cot_vote(engine: Any, task: str = "arith", n: int = 20, n_calibration: int = 20, *,
                      samples: int = 8, temperature: float = 0.7, threshold: float = 2.0,
                      family: CotFamily | None = None, max_new_tokens: int = 96, seed: int = 0,
                      batch_size: int = 16, bins: int = 10, progress: bool = True) -> VoteReport:
    """`samples` sampled trajectories per problem; majority vote vs votes weighted by final CUSUM statistic."""
    from probes.engine import Sampling

    if samples < 1:
        raise BadInputError(f"samples must be >= 1, got {samples}")
    family = family or cot_family_for(engine)
    calibration, evaluation = _split(task, n, n_calibration, seed)
    t0 = time.perf_counter()
    detector, _ = fit_detector(engine, calibration, family, threshold=threshold, bins=bins,
                               max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, progress=progress)
    traces = probe_traces(engine, evaluation, family, [StoppingRule(probe_step_ends=True)],
                          max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temperature),
                          seed=seed + 20_000, n_samples=samples, batch_size=batch_size, progress=progress,
                          desc="sampling")
    rows, majority_hits, weighted_hits, sample_hits = [], 0, 0, []
    for i, problem in enumerate(evaluation):
        group = traces[i * samples:(i + 1) * samples]
        answers = [t.final_answer for t in group]
        stats = [detector.batch_statistic(t.calibration().entropies) for t in group]
        weights = [float(s[-1]) if len(s) else 0.0 for s in stats]
        majority, weighted = majority_vote(answers), cusum_weighted_vote(answers, weights)
        majority_hits += is_correct(majority, problem)
        weighted_hits += is_correct(weighted, problem)
        sample_hits += [is_correct(a, problem) for a in answers]
        rows.append({"id": problem.id, "target": problem.answer, "answers": answers, "weights": weights,
                     "majority": majority, "weighted": weighted})
    k = len(evaluation)
    return VoteReport(engine.handle.model_id, task, k, len(calibration), samples, temperature, threshold,
                      majority_hits / k, weighted_hits / k, float(np.mean(sample_hits)), rows,
                      time.perf_counter() - t0)


# ----------------------------------------------------------------------------- overhead bench


class CotMonitor:
    """The per-token bookkeeping of a live view: entropy curve, trailing smoothing, steps, CUSUM."""

    def __init__(self, detector: CusumDetector, family: CotFamily, window: int = 5):
        self.detector = detector.reset()
        self.segmenter = StepSegmenter(family.step_delimiter)
        self.entropies: list[float] = []
        self.smoothed: list[float] = []
        self._window: deque[float] = deque(maxlen=window)
        self._sum = 0.0

    def push(self, entropy: float, text: str) -> list[int]:
        """Add one token; returns the step ends it revealed."""
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(entropy)
        self._sum += entropy
        self.entropies.append(entropy)
        self.smoothed.append(self._sum / len(self._window))
        return self.segmenter.push(text)

    def observe(self, probe_entropy: float) -> tuple[float, bool]:
        return self.detector.update(probe_entropy)


def bench_cusum_overhead(engine: Any, *, max_new_tokens: int = 48, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """CUSUM + entropy bookkeeping / plain streaming generation, interleaved in one run (probes excluded).

    The detector is updated once per step end with that step's mean token entropy (a stand-in
    for the probe, whose cost is reported separately as tokens computed by one probed pass).
    """
    family = cot_family_for(engine)
    problem = load_task("arith", 1, seed=seed)[0]
    messages = one_shot_messages(problem)
    rng = np.random.default_rng(seed)
    detector = CusumDetector().fit([CalibrationTrace(list(rng.normal(1.0, 0.2, 4).clip(0)) +
                                                     list(rng.normal(0.3, 0.1, 4).clip(0)),
                                                     ["0"] * 4 + ["1"] * 4, "1") for _ in range(8)])

    def plain() -> int:
        return sum(1 for _ in engine.generate(messages, max_new_tokens=max_new_tokens, chat=True, top_k=0))

    def instrumented() -> int:
        monitor, start, n = CotMonitor(detector, family), 0, 0
        for rec in engine.generate(messages, max_new_tokens=max_new_tokens, chat=True, top_k=0):
            n += 1
            for b in monitor.push(rec.entropy, rec.text):
                monitor.observe(float(np.mean(monitor.entropies[start:b])))
                start = b
        return n

    plain()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("instrumented", instrumented)):
            t = time.perf_counter()
            tokens = fn()
            times[name].append((time.perf_counter() - t) / tokens)
    probed = run_with_rule(engine, problem, StoppingRule(probe_step_ends=True), family=family,
                           max_new_tokens=max_new_tokens)
    plain_s, instr_s = float(np.median(times["plain"])), float(np.median(times["instrumented"]))
    return {"bench": "cusum_overhead", "ratio": instr_s / plain_s, "plain_s_per_token": plain_s,
            "instrumented_s_per_token": instr_s, "repeats": repeats, "generated_tokens": probed.generated_tokens,
            "probes": len(probed.probes), "probe_tokens": probed.probe_tokens,
            "probe_tokens_per_generated_token": probed.probe_tokens / max(1, probed.generated_tokens),
            "model": engine.handle.model_id}
