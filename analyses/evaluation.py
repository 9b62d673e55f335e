"""The evaluation protocol every method shares (DESIGN.md, Conventions; issue 11).

One protocol, so that no method's number is chosen on the problems it is reported on:

1. **Splits** (`split_three`): disjoint calibration / development / evaluation parts of a problem
   pool, seeded. Calibration fits what a method learns (densities, SAEs, probes); development
   chooses every tunable setting; evaluation is touched once, at the chosen settings.
2. **Choice on development** (`choose_on_dev`): a small grid, one measurement per setting, an
   objective; the grid, every score and the choice are recorded (`Choice.to_dict`) so a reader
   sees what was tried. `fewest_cost_within` is the objective of an early-exit method: the
   cheapest setting whose accuracy stays within a tolerance of the baseline's.
3. **Intervals** (`bootstrap_interval`, `pass_at_k_interval`): 95% percentile bootstrap over
   problems, seeded, for accuracies, token counts and pass@k.
4. **Paired tests against the baseline on the same problems**: exact McNemar for 0/1 outcomes
   (`mcnemar_exact`), the sign test and the Wilcoxon signed-rank test for paired counts such as
   tokens (`sign_test`, `wilcoxon_test`). Each carries a verdict in words, including "n = 100
   cannot tell these apart" when it cannot.
5. **Power** (`mcnemar_sample_size`, `paired_mean_sample_size`): how many problems a given
   difference would need, so a report can say what its n could and could not have found.

Pure functions over arrays (numpy and scipy); no model, no I/O.

Example:
    >>> ci = bootstrap_interval([1, 0, 1, 1, 0, 1, 0, 1], seed=0)
    >>> round(ci.estimate, 3), ci.low <= ci.estimate <= ci.high
    (0.625, True)
    >>> test = mcnemar_exact([1, 1, 1, 0, 0, 1], [1, 0, 0, 0, 1, 1])  # method vs baseline, same problems
    >>> test.gains, test.losses, round(test.p_value, 3)
    (2, 1, 1.0)
    >>> test.verdict
    'n = 6 cannot tell these apart (exact McNemar p = 1.00; 2 gained, 1 lost)'
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

CONFIDENCE = 0.95
N_RESAMPLES = 2000
ALPHA = 0.05

# ----------------------------------------------------------------------------- splits

SPLIT_NAMES = ("calibration", "development", "evaluation")


@dataclass
class Splits:
    """Disjoint calibration / development / evaluation lists, each in the pool's order."""

    calibration: list[Any]
    development: list[Any]
    evaluation: list[Any]
    seed: int = 0

    def __iter__(self):
        return iter((self.calibration, self.development, self.evaluation))

    def sizes(self) -> dict[str, int]:
        return {name: len(part) for name, part in zip(SPLIT_NAMES, self)}

    def to_dict(self, key: Callable[[Any], Hashable] | None = None) -> dict[str, Any]:
        key = key or _default_key
        return {"seed": self.seed, "sizes": self.sizes(),
                "ids": {name: [key(x) for x in part] for name, part in zip(SPLIT_NAMES, self)}}


def _default_key(item: Any) -> Hashable:
    return getattr(item, "id", item)


def split_three(items: Sequence[Any], n_calibration: int, n_development: int, n_evaluation: int | None = None, *,
                seed: int = 0, key: Callable[[Any], Hashable] | None = None) -> Splits:
    """Cut `items` into disjoint calibration, development and evaluation parts, chosen by `seed`.

    `n_evaluation=None` gives the evaluation part everything left. Items are told apart by `key`
    (default: their `id`, else the item); duplicates are refused, because a duplicate could sit on
    both sides of a split.

    >>> s = split_three(list(range(10)), 2, 3, seed=1)
    >>> s.sizes(), sorted(s.calibration + s.development + s.evaluation) == list(range(10))
    ({'calibration': 2, 'development': 3, 'evaluation': 5}, True)
    """
    items = list(items)
    key = key or _default_key
    keys = [key(x) for x in items]
    if len(set(keys)) != len(keys):
        raise BadInputError("the problems to split hold duplicates; remove them so no problem sits in two splits")
    n_calibration = checks.integer("n_calibration", n_calibration, low=0)
    n_development = checks.integer("n_development", n_development, low=0)
    rest = len(items) - n_calibration - n_development
    if n_evaluation is None:
        n_evaluation = rest
    if not isinstance(n_evaluation, int) or n_evaluation < 1 or n_evaluation > rest:
        raise BadInputError(f"{len(items)} problems cannot give {n_calibration} calibration, {n_development} "
                            f"development and {n_evaluation} evaluation problems; ask for fewer or load more")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    cut1, cut2 = n_calibration, n_calibration + n_development
    parts = (set(order[:cut1]), set(order[cut1:cut2]), set(order[cut2:cut2 + n_evaluation]))
    cal, dev, ev = ([x for i, x in enumerate(items) if i in part] for part in parts)
    return Splits(cal, dev, ev, seed)


# ----------------------------------------------------------------------------- choice on development


@dataclass
class Choice:
    """What `choose_on_dev` tried and what it chose: one row per grid setting, in grid order."""

    name: str
    grid: list[Any]
    rows: list[dict[str, Any]]  # the measurement of each setting on the development split
    scores: list[Any]
    index: int
    objective: str
    split: str = "development"

    @property
    def chosen(self) -> Any:
        return self.grid[self.index]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "objective": self.objective, "chosen": _plain(self.chosen),
                "chosen_index": self.index,
                "grid": [{"setting": _plain(g), "score": _plain(s), **_plain(r)}
                         for g, r, s in zip(self.grid, self.rows, self.scores)]}


def choose_on_dev(grid: Sequence[Any], evaluate_fn: Callable[[Any], Any], objective: Callable[[Any], Any] | str, *,
                  name: str = "setting", objective_name: str | None = None) -> Choice:
    """Measure every setting of `grid` on the development split and keep the best by `objective`.

    `evaluate_fn(setting)` returns the measurement (a dict, or a number); `objective` maps a
    measurement to a score to maximise (a number or a tuple: tuples compare element by element),
    or names a key of the measurement dict. Ties go to the earlier setting, so put the cheaper or
    more conservative settings first.

    >>> c = choose_on_dev([1, 2, 3], lambda h: {"acc": [0.5, 0.7, 0.7][h - 1]}, "acc", name="h")
    >>> c.chosen, c.scores
    (2, [0.5, 0.7, 0.7])
    """
    grid = list(grid)
    if not grid:
        raise BadInputError(f"the {name} grid is empty; give at least one setting to choose from")
    if isinstance(objective, str):
        key = objective
        objective_name = objective_name or f"max {key}"
        objective = lambda row: row[key]  # noqa: E731
    rows, scores = [], []
    for setting in grid:
        row = evaluate_fn(setting)
        row = dict(row) if isinstance(row, dict) else {"value": row}
        rows.append(row)
        scores.append(objective(row))
    best = 0
    for i, score in enumerate(scores):
        if _greater(score, scores[best]):
            best = i
    return Choice(name, grid, rows, scores, best, objective_name or getattr(objective, "__doc__", None) or "max")


def _greater(a: Any, b: Any) -> bool:
    def clean(x):
        if isinstance(x, tuple):
            return tuple(-math.inf if (isinstance(v, float) and math.isnan(v)) else v for v in x)
        return -math.inf if isinstance(x, float) and math.isnan(x) else x
    return clean(a) > clean(b)


def fewest_cost_within(baseline_accuracy: float, tolerance: float = 0.02, accuracy_key: str = "accuracy",
                       cost_key: str = "mean_tokens") -> Callable[[dict[str, Any]], tuple]:
    """The early-exit objective: among settings whose development accuracy is at least the baseline's
    minus `tolerance`, the fewest mean tokens; when none qualifies, the most accurate (then cheapest).

    >>> f = fewest_cost_within(0.5, 0.05)
    >>> max([{"accuracy": 0.46, "mean_tokens": 20}, {"accuracy": 0.40, "mean_tokens": 10}], key=f)["mean_tokens"]
    20
    """
    floor = baseline_accuracy - tolerance - 1e-12

    def score(row: dict[str, Any]) -> tuple:
        ok = row[accuracy_key] >= floor
        return (1 if ok else 0, -row[cost_key] if ok else row[accuracy_key], -row[cost_key])

    score.__doc__ = (f"fewest {cost_key} with {accuracy_key} >= baseline {baseline_accuracy:.3f} - {tolerance:g} "
                     f"(else the most accurate)")
    return score


# ----------------------------------------------------------------------------- bootstrap intervals


@dataclass
class Interval:
    """An estimate over n problems and its percentile-bootstrap interval."""

    estimate: float
    low: float
    high: float
    n: int
    confidence: float = CONFIDENCE
    n_resamples: int = N_RESAMPLES
    seed: int = 0
    method: str = "percentile bootstrap over problems"

    def format(self, spec: str = ".3g", percent: bool = False) -> str:
        f = (lambda v: f"{100 * v:.1f}%") if percent else (lambda v: format(v, spec))  # noqa: E731
        return f"{f(self.estimate)} [{f(self.low)}, {f(self.high)}]"

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n,
                "confidence": self.confidence, "n_resamples": self.n_resamples, "seed": self.seed,
                "method": self.method}


def _statistic(statistic: str | Callable[[np.ndarray], Any]) -> Callable[[np.ndarray], np.ndarray]:
    """A statistic over the last axis of an array of resamples."""
    if statistic == "mean":
        return lambda x: x.mean(axis=-1)
    if statistic == "median":
        return lambda x: np.median(x, axis=-1)
    if callable(statistic):
        return lambda x: np.apply_along_axis(statistic, -1, x) if x.ndim > 1 else np.asarray(statistic(x))
    raise BadInputError(f"statistic {statistic!r}: use 'mean', 'median' or a function of a 1-d array")


def resample_indices(n: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """[n_resamples, n] indices drawn with replacement (the problems of each bootstrap resample)."""
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def bootstrap_interval(values: Sequence[float], statistic: str | Callable[[np.ndarray], Any] = "mean", *,
                       confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0) -> Interval:
    """The `statistic` of `values` (one per problem) with its percentile-bootstrap interval.

    Problems are resampled with replacement `n_resamples` times (numpy's default_rng(seed)); the
    interval is the (1 - confidence)/2 and (1 + confidence)/2 percentiles of the resampled statistic.
    For 0/1 values this is the accuracy's interval.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise BadInputError("the bootstrap needs a non-empty list with one value per problem")
    checks.number("confidence", confidence, low=0, high=1, low_open=True, high_open=True)
    stat = _statistic(statistic)
    draws = stat(x[resample_indices(x.size, n_resamples, seed)])
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Interval(float(stat(x[None, :])[0]), float(low), float(high), int(x.size), confidence, n_resamples, seed)


def paired_difference_interval(method: Sequence[float], baseline: Sequence[float], **kwargs: Any) -> Interval:
    """Mean of method - baseline over the same problems, with its bootstrap interval (pairs resampled together)."""
    a, b = _paired(method, baseline)
    return bootstrap_interval(a - b, **kwargs)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct (Chen et al. 2021).

    Equals 1 - C(n-c, k) / C(n, k), computed as a product so large `n` does not overflow.

    >>> round(pass_at_k(5, 2, 1), 12), round(pass_at_k(5, 2, 2), 12), pass_at_k(5, 4, 2)
    (0.4, 0.7, 1.0)
    """
    n, c, k = (checks.integer(f"pass@k's {label}", value) for label, value in (("n", n), ("c", c), ("k", k)))
    if not 0 <= c <= n:
        raise BadInputError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}.")
    if not 1 <= k <= n:
        raise BadInputError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}; draw more samples.")
    if n - c < k:
        # Every k-subset of the samples holds at least one correct one.
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1)))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems, each given as (samples drawn, samples correct).

    >>> round(mean_pass_at_k([(5, 2), (5, 0)], k=1), 12)
    0.2
    """
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise BadInputError("mean_pass_at_k needs at least one (n, c) pair.")
    return sum(values) / len(values)


def pass_at_k_interval(counts: Sequence[tuple[int, int]], k: int, *, confidence: float = CONFIDENCE,
                       n_resamples: int = N_RESAMPLES, seed: int = 0) -> Interval:
    """Mean unbiased pass@k over problems, each given as (samples drawn, samples correct), with its
    bootstrap interval over problems."""
    per_problem = [pass_at_k(int(n), int(c), k) for n, c in counts]
    return bootstrap_interval(per_problem, confidence=confidence, n_resamples=n_resamples, seed=seed)


# ----------------------------------------------------------------------------- paired tests


@dataclass
class PairedTest:
    """A paired test of a method against the baseline on the same problems, and its verdict in words."""

    test: str
    n: int
    p_value: float
    gains: int  # problems (or pairs) where the method is better: right where the baseline is wrong / fewer tokens
    losses: int
    ties: int
    difference: Interval | None  # mean of method - baseline with its bootstrap interval
    verdict: str
    alpha: float = ALPHA
    statistic: float | None = None

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test, "n": self.n, "p_value": self.p_value, "gains": self.gains, "losses": self.losses,
                "ties": self.ties, "statistic": self.statistic, "alpha": self.alpha, "significant": self.significant,
                "difference": self.difference.to_dict() if self.difference else None, "verdict": self.verdict}


def _paired(method: Sequence[float], baseline: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(method, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise BadInputError(f"a paired test needs one value per problem for both sides, got {a.shape} and {b.shape}")
    return a, b


def _binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial p-value of k successes in n at p = 1/2 (0 successes in 0 trials: 1)."""
    if n == 0:
        return 1.0
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import binomtest

    return float(binomtest(k, n, 0.5, alternative="two-sided").pvalue)


def verdict(n: int, p_value: float, better: bool, *, test: str, detail: str = "", alpha: float = ALPHA,
            what: str = "") -> str:
    """A sentence: which side wins at level alpha, or that n cannot tell them apart."""
    tail = f" ({test} p = {p_value:.2g}{'; ' + detail if detail else ''})" if p_value < 0.01 else \
        f" ({test} p = {p_value:.2f}{'; ' + detail if detail else ''})"
    if p_value < alpha:
        side = "better" if better else "worse"
        return f"the method is {side}{' on ' + what if what else ''} than the baseline" + tail
    return f"n = {n} cannot tell these apart{' on ' + what if what else ''}" + tail


def mcnemar_exact(method_correct: Sequence[bool | int], baseline_correct: Sequence[bool | int], *,
                  alpha: float = ALPHA, seed: int = 0, n_resamples: int = N_RESAMPLES) -> PairedTest:
    """Exact McNemar test of two 0/1 outcomes on the same problems.

    Only discordant problems carry information: `gains` (the method right, the baseline wrong) and
    `losses` (the reverse). Under the null each discordant problem is a fair coin, so the p-value
    is the two-sided binomial test of `gains` out of `gains + losses` at 1/2.
    """
    a, b = _paired(method_correct, baseline_correct)
    if not np.isin(a, (0, 1)).all() or not np.isin(b, (0, 1)).all():
        raise BadInputError("McNemar's test takes 0/1 outcomes (correct or not) per problem")
    gains, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    p = _binomial_two_sided(gains, gains + losses)
    diff = bootstrap_interval(a - b, seed=seed, n_resamples=n_resamples)
    detail = f"{gains} gained, {losses} lost"
    return PairedTest("exact McNemar", int(a.size), p, gains, losses, int(a.size) - gains - losses, diff,
                      verdict(int(a.size), p, gains > losses, test="exact McNemar", detail=detail, alpha=alpha),
                      alpha, float(min(gains, losses)))


def sign_test(method: Sequence[float], baseline: Sequence[float], *, lower_is_better: bool = True,
              alpha: float = ALPHA, seed: int = 0, n_resamples: int = N_RESAMPLES, what: str = "") -> PairedTest:
    """Sign test of paired values (e.g. tokens per problem): ties dropped, the number of problems where
    the method is lower against a fair coin. `gains` counts the problems where the method is better."""
    a, b = _paired(method, baseline)
    d = a - b
    lower, higher = int((d < 0).sum()), int((d > 0).sum())
    gains, losses = (lower, higher) if lower_is_better else (higher, lower)
    p = _binomial_two_sided(gains, gains + losses)
    diff = bootstrap_interval(d, seed=seed, n_resamples=n_resamples)
    detail = f"better on {gains}, worse on {losses}, {int(a.size) - gains - losses} ties"
    return PairedTest("sign test", int(a.size), p, gains, losses, int(a.size) - gains - losses, diff,
                      verdict(int(a.size), p, gains > losses, test="sign test", detail=detail, alpha=alpha, what=what),
                      alpha, float(gains))


def wilcoxon_test(method: Sequence[float], baseline: Sequence[float], *, lower_is_better: bool = True,
                  alpha: float = ALPHA, seed: int = 0, n_resamples: int = N_RESAMPLES, what: str = "") -> PairedTest:
    """Wilcoxon signed-rank test of paired values (zero differences dropped; scipy's exact or normal p)."""
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import wilcoxon

    a, b = _paired(method, baseline)
    d = a - b
    lower, higher = int((d < 0).sum()), int((d > 0).sum())
    gains, losses = (lower, higher) if lower_is_better else (higher, lower)
    if gains + losses == 0:
        p, stat = 1.0, None
    else:
        res = wilcoxon(a, b, zero_method="wilcox", alternative="two-sided")
        p, stat = float(res.pvalue), float(res.statistic)
    diff = bootstrap_interval(d, seed=seed, n_resamples=n_resamples)
    better = (diff.estimate < 0) == lower_is_better if diff.estimate != 0 else gains > losses
    return PairedTest("Wilcoxon signed-rank", int(a.size), p, gains, losses, int(a.size) - gains - losses, diff,
                      verdict(int(a.size), p, better, test="Wilcoxon", alpha=alpha, what=what), alpha, stat)


# ----------------------------------------------------------------------------- power


def _z(q: float) -> float:
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import norm

    return float(norm.ppf(q))


def mcnemar_sample_size(discordant: float, difference: float, *, alpha: float = ALPHA, power: float = 0.8) -> int:
    """Problems a paired comparison of accuracies needs to detect `difference` (p10 - p01) with
    probability `power` at two-sided level `alpha`, when a fraction `discordant` (p10 + p01) of the
    problems come out differently (Connor 1987's normal approximation to McNemar's test).

    >>> mcnemar_sample_size(0.2, 0.1)
    155
    """
    psi, delta = float(discordant), abs(float(difference))
    if not 0 < delta <= psi <= 1:
        raise BadInputError("need 0 < |difference| <= discordant <= 1 (the difference is a share of the discordant "
                            "problems)")
    n = (_z(1 - alpha / 2) * math.sqrt(psi) + _z(power) * math.sqrt(psi - delta ** 2)) ** 2 / delta ** 2
    return int(math.ceil(n - 1e-9))


def paired_mean_sample_size(sd: float, difference: float, *, alpha: float = ALPHA, power: float = 0.8) -> int:
    """Pairs needed to detect a mean paired difference `difference` whose per-pair standard deviation
    is `sd` (normal approximation: ((z_{1-alpha/2} + z_power) sd / difference)^2).

    >>> paired_mean_sample_size(10.0, 2.0)
    197
    """
    if sd <= 0 or difference == 0:
        raise BadInputError("need sd > 0 and a non-zero difference")
    return int(math.ceil(((_z(1 - alpha / 2) + _z(power)) * sd / abs(difference)) ** 2 - 1e-9))


def detectable_statement(method_correct: Sequence[bool | int], baseline_correct: Sequence[bool | int],
                         differences: Iterable[float] = (0.05, 0.10), **kwargs: Any) -> str:
    """What n would be needed for accuracy differences of this size, at the discordance seen here."""
    a, b = _paired(method_correct, baseline_correct)
    psi = float((a != b).mean())
    parts = []
    for delta in differences:
        if psi >= delta > 0:
            parts.append(f"{100 * delta:.0f} points: about {mcnemar_sample_size(psi, delta, **kwargs)} problems")
        else:
            parts.append(f"{100 * delta:.0f} points: more discordant problems than the {100 * psi:.0f}% seen")
    return (f"with {100 * psi:.0f}% of problems discordant, detecting an accuracy difference of "
            + "; ".join(parts) + " (80% power, two-sided 5%)")


# ----------------------------------------------------------------------------- one method against a baseline


@dataclass
class Comparison:
    """One method run once on the evaluation split, against the baseline on the same problems."""

    name: str
    setting: dict[str, Any]
    accuracy: Interval
    costs: dict[str, Interval]  # e.g. generated tokens, tokens with probes
    accuracy_test: PairedTest | None = None
    cost_tests: dict[str, list[PairedTest]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "setting": _plain(self.setting), "accuracy": self.accuracy.to_dict(),
                "costs": {k: v.to_dict() for k, v in self.costs.items()},
                "accuracy_test": self.accuracy_test.to_dict() if self.accuracy_test else None,
                "cost_tests": {k: [t.to_dict() for t in v] for k, v in self.cost_tests.items()}}


def compare(name: str, setting: dict[str, Any], correct: Sequence[bool | int], costs: dict[str, Sequence[float]],
            baseline_correct: Sequence[bool | int] | None = None,
            baseline_costs: dict[str, Sequence[float]] | None = None, *, seed: int = 0,
            n_resamples: int = N_RESAMPLES, cost_names: dict[str, str] | None = None) -> Comparison:
    """Intervals on accuracy and every cost, and (given a baseline) McNemar on accuracy and the sign
    and Wilcoxon tests on each cost, all over the same problems. `cost_names` words the verdicts
    ("generated tokens"; default: the cost's key)."""
    kw = dict(seed=seed, n_resamples=n_resamples)
    acc = bootstrap_interval(np.asarray(correct, dtype=float), **kw)
    cost_ci = {k: bootstrap_interval(v, **kw) for k, v in costs.items()}
    out = Comparison(name, setting, acc, cost_ci)
    if baseline_correct is not None:
        out.accuracy_test = mcnemar_exact(correct, baseline_correct, **kw)
        for k, v in (baseline_costs or {}).items():
            if k in costs:
                what = (cost_names or {}).get(k, k)
                out.cost_tests[k] = [sign_test(costs[k], v, what=what, **kw),
                                     wilcoxon_test(costs[k], v, what=what, **kw)]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value
