"""The CUSUM change-point detector over probe-answer entropies, and the per-token entropy curve.

Xu et al., "Unveiling the Entropy Dynamics of Chain-of-Thought Reasoning" (arXiv 2606.02020): before
the change point the probe entropies H_i follow an "uncertainty" density f0, after it a "confidence"
density f1; Z_i = log f1(H_i) - log f0(H_i); S_i = max(0, S_{i-1} + Z_i); alarm at S_i >= h.
The f0/f1 split of calibration steps is our reconstruction [recon]: a step is confident once its
intermediate answer equals the trace's final answer and stays equal. The paper fits histograms; our
default is a kernel density estimate whose bandwidth the development split chooses (issue 11: a
10-bin histogram quantised log f1/f0 so coarsely that h = 1 and h = 2 gave the same alarms) [recon].

Example:
    >>> cal = [CalibrationTrace([1.2, 0.3], ["3", "5"], "5")]
    >>> detector = CusumDetector(threshold=2.0, density="histogram").fit(cal)
    >>> detector.batch_statistic([1.2, 0.3, 0.3]).round(2).tolist()
    [0.0, 0.69, 1.39]
    >>> detector.alarm_index([1.2, 0.3, 0.3, 0.3])
    3
    >>> kde = CusumDetector(threshold=2.0, bandwidth=0.2).fit(cal)
    >>> z = kde.log_likelihood_ratio([0.3, 0.6, 1.2])
    >>> bool(z[0] > z[1] > 0 > z[2])  # smooth in H: halfway between the two classes Z is smaller
    True
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analyses.families import ModelFamily
from analyses.steps import StepSegmenter
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

# ----------------------------------------------------------------------------- entropy curve


def entropy_per_token(records: Iterable[Any]) -> np.ndarray:
    """The entropy (nats) of each generated token's distribution, from records or their dicts."""
    return np.array([r["entropy"] if isinstance(r, dict) else r.entropy for r in records], dtype=float)


def moving_average(values: Sequence[float], window: int = 5, centered: bool = False) -> np.ndarray:
    """Mean over a window: trailing (what a live view can know) or centered (offline display)."""
    checks.integer("the smoothing window (tokens)", window, low=1)
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


DENSITIES = ("kde", "histogram")


def silverman_bandwidth(values: Sequence[float], minimum: float = 0.02) -> float:
    """Silverman's rule of thumb, 0.9 min(sd, IQR / 1.34) n^(-1/5), never below `minimum` nats
    (a class whose probes all read the same entropy would otherwise get a zero-width kernel)."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return max(minimum, 0.1)
    q75, q25 = np.percentile(x, [75, 25])
    spread = min(float(x.std(ddof=1)), float(q75 - q25) / 1.34) or float(x.std(ddof=1))
    return max(minimum, 0.9 * spread * x.size ** -0.2)


class _Density:
    """One class's density of probe entropies: a Gaussian KDE (scikit-learn) or a smoothed histogram,
    mixed with a little uniform mass over the calibration range so every log density stays finite."""

    def __init__(self, values: np.ndarray, kind: str, lo: float, hi: float, *, bandwidth: float | None, bins: int,
                 smoothing: float, floor: float):
        self.kind, self.lo, self.hi, self.floor, self.n = kind, lo, hi, floor, int(values.size)
        self.edges = np.linspace(lo, hi, bins + 1)
        self.counts = np.histogram(np.clip(values, lo, hi), self.edges)[0]
        if kind == "histogram":
            width = np.diff(self.edges)
            self.hist = (self.counts + smoothing) / (self.counts.sum() + smoothing * bins) / width
            self.bandwidth = None
        else:
            with importing("sklearn.neighbors"):  # lazy: scikit-learn takes seconds to import
                from sklearn.neighbors import KernelDensity

            self.bandwidth = float(bandwidth if bandwidth is not None else silverman_bandwidth(values))
            self.kde = KernelDensity(kernel="gaussian", bandwidth=self.bandwidth).fit(values[:, None]) \
                if values.size else None

    def log_pdf(self, h: np.ndarray) -> np.ndarray:
        uniform = 1.0 / (self.hi - self.lo)
        if self.kind == "histogram":
            idx = np.clip(np.searchsorted(self.edges, h, side="right") - 1, 0, len(self.edges) - 2)
            return np.log(self.hist[idx])
        if self.kde is None:  # no calibration step of this class: flat
            return np.full(h.shape, np.log(uniform))
        return np.logaddexp(np.log1p(-self.floor) + self.kde.score_samples(h.reshape(-1, 1)),
                            np.log(self.floor * uniform))


def check_h_grid(h_grid: Sequence[float]) -> list[float]:
    """The CUSUM thresholds to choose from, each a finite number > 0 (checked before any model work: a NaN
    once surfaced only after the calibration and development traces had been generated)."""
    if not h_grid:
        raise BadInputError("give at least one CUSUM threshold h to choose from")
    return [float(checks.number("the CUSUM threshold h", h, low=0, low_open=True)) for h in h_grid]


class CusumDetector:
    """CUSUM change-point detector over probe entropies, scikit-learn style.

    `fit` learns the densities f0 (uncertainty) and f1 (confidence) of the probes' mean answer
    entropy: by default Gaussian kernel density estimates (scikit-learn `KernelDensity`; the
    bandwidth given, or Silverman's rule per class), so log f1/f0 varies smoothly with the entropy
    and every h gives its own alarm; `density="histogram"` keeps the paper's histogram (`bins`,
    with `smoothing` pseudo-counts), whose piecewise-constant ratio quantises the alarm. Both are
    mixed with a fraction `floor` of uniform mass over the calibration range, so a value far from
    every calibration step gets a bounded Z. `update` is the O(1) online step; `threshold` is
    h = log(gamma). Learned and running state ends in `_`.
    """

    def __init__(self, threshold: float = 2.0, density: str = "kde", bandwidth: float | None = None, bins: int = 10,
                 smoothing: float = 1.0, value_range: tuple[float, float] | None = None, floor: float = 0.01):
        self.threshold = threshold
        self.density = density
        self.bandwidth = bandwidth
        self.bins = bins
        self.smoothing = smoothing
        self.value_range = value_range
        self.floor = floor
        self._check_params()

    def _check_params(self) -> None:
        checks.number("the CUSUM threshold h", self.threshold, low=0, low_open=True)
        checks.choice("density", self.density, DENSITIES)
        checks.number("the KDE bandwidth (nats)", self.bandwidth, low=0, low_open=True, none_ok=True)
        checks.integer("bins", self.bins, low=2, why="a histogram needs at least 2 bins")
        checks.number("smoothing", self.smoothing, low=0, low_open=True, why="so that every log density is finite")
        checks.number("floor (the uniform share of each density)", self.floor, low=0, high=1, low_open=True,
                      high_open=True)

    @staticmethod
    def labelled_steps(calibration_traces: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(probe entropies, 0/1 labels) of every finite calibration step."""
        traces = [_as_calibration(t) for t in calibration_traces]
        values = np.array([h for t in traces for h in t.entropies], dtype=float)
        labels = np.array([y for t in traces for y in t.labels()], dtype=int)
        keep = np.isfinite(values)
        return values[keep], labels[keep]

    def fit(self, calibration_traces: Iterable[Any]) -> "CusumDetector":
        values, labels = self.labelled_steps(calibration_traces)
        if values.size == 0:
            raise BadInputError("the calibration traces hold no probe entropies: give more calibration problems, "
                                "longer generations, or a step delimiter that occurs in this model's traces")
        lo, hi = self.value_range or (min(0.0, float(values.min())), float(values.max()) * 1.05 + 1e-6)
        common = dict(bandwidth=self.bandwidth, bins=self.bins, smoothing=self.smoothing, floor=self.floor)
        self.f0_ = _Density(values[labels == 0], self.density, lo, hi, **common)
        self.f1_ = _Density(values[labels == 1], self.density, lo, hi, **common)
        self.value_range_ = (lo, hi)
        self.bin_edges_ = self.f0_.edges
        self.counts0_, self.counts1_ = self.f0_.counts, self.f1_.counts
        self.n_uncertain_, self.n_confident_ = self.f0_.n, self.f1_.n
        self.bandwidths_ = (self.f0_.bandwidth, self.f1_.bandwidth)
        if self.density == "histogram":
            self.density0_, self.density1_ = self.f0_.hist, self.f1_.hist
            self.log_ratio_ = np.log(self.density1_) - np.log(self.density0_)
        if not self.n_uncertain_ or not self.n_confident_:
            warnings.warn(f"calibration gave {self.n_uncertain_} uncertain and {self.n_confident_} confident "
                          "steps; one density is flat, so the detector carries little information", stacklevel=2)
        self.reset()
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "f0_"):
            raise BadInputError("the CUSUM detector is not fitted: call fit(calibration_traces) first")

    def log_likelihood_ratio(self, entropy: float | Sequence[float]) -> Any:
        """Z = log f1(H) - log f0(H), per value (a histogram applies its edge bin outside the range)."""
        self._check_fitted()
        h = np.asarray(entropy, dtype=float)
        if np.isnan(h).any():
            raise BadInputError("a probe entropy is NaN; the probe decoded no answer tokens")
        flat = np.atleast_1d(h)
        z = self.f1_.log_pdf(flat) - self.f0_.log_pdf(flat)
        return float(z[0]) if h.ndim == 0 else z.reshape(h.shape)

    def score(self, calibration_traces: Iterable[Any]) -> float:
        """Mean log density of held-out labelled steps under their own class's density (higher is better):
        what the development split chooses the bandwidth by."""
        self._check_fitted()
        values, labels = self.labelled_steps(calibration_traces)
        if values.size == 0:
            raise BadInputError("no probe entropies to score the densities on")
        logp = np.where(labels == 1, self.f1_.log_pdf(values), self.f0_.log_pdf(values))
        return float(logp.mean())

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

    def curve(self, points: int = 200) -> dict[str, list[float]]:
        """f0, f1 and log f1/f0 on a grid over the calibration range (what the page draws)."""
        self._check_fitted()
        lo, hi = self.value_range_
        x = np.linspace(lo, hi, points)
        l0, l1 = self.f0_.log_pdf(x), self.f1_.log_pdf(x)
        return {"x": x.tolist(), "density_uncertain": np.exp(l0).tolist(), "density_confident": np.exp(l1).tolist(),
                "log_ratio": (l1 - l0).tolist()}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"threshold": self.threshold, "density": self.density, "bandwidth": self.bandwidth,
                               "bins": self.bins, "smoothing": self.smoothing, "floor": self.floor}
        if hasattr(self, "f0_"):
            width = np.diff(self.bin_edges_)
            out.update(bin_edges=self.bin_edges_.tolist(), counts_uncertain=self.counts0_.tolist(),
                       counts_confident=self.counts1_.tolist(), n_uncertain=self.n_uncertain_,
                       n_confident=self.n_confident_, bandwidths=list(self.bandwidths_),
                       value_range=list(self.value_range_), curve=self.curve(),
                       # the calibration steps as normalised histograms (what the densities were fitted to)
                       empirical_uncertain=(self.counts0_ / max(1, self.n_uncertain_) / width).tolist(),
                       empirical_confident=(self.counts1_ / max(1, self.n_confident_) / width).tolist())
            if self.density == "histogram":
                out.update(density_uncertain=self.density0_.tolist(), density_confident=self.density1_.tolist(),
                           log_ratio=self.log_ratio_.tolist())
        return out


class CotMonitor:
    """The per-token bookkeeping of a live view: entropy curve, trailing smoothing, steps, CUSUM."""

    def __init__(self, detector: CusumDetector, family: ModelFamily, window: int = 5):
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
