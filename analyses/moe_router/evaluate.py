"""Expert-Sample against temperature sampling: pass@n and best-of-n under the shared evaluation protocol.

Chen et al., "Certain Head, Uncertain Tail: Expert-Sample for Test-Time Scaling in Fine-Grained MoE"
(arXiv 2602.02443) sample N answers by perturbing the router's tail instead of the tokens. Only the
abstract is public; the evaluation here is our reconstruction (METHODS.md section 6):

1. Expert-Sample's k_h, m, T_e and tail-gate weighting are chosen on the development split from a
   small grid (`default_grid`), by dev pass@N (ties: dev pass@1); Expert-Sample combined with token
   temperature takes that setting and chooses its temperature on development too. Every setting and
   score of the grid is in the report (`analyses.evaluation.choose_on_dev`).
2. Then each method runs once on the evaluation split: greedy; token temperature sampling at each T
   of `TEMPERATURES`; Expert-Sample at the chosen setting (greedy tokens); Expert-Sample + temperature.
3. Per method: pass@k for k = 1..N (the unbiased estimator of Chen et al. 2021,
   `analyses.evaluation.pass_at_k`) and best-of-n (the sample the model itself scores highest, mean token
   log-prob, checked by the task's verifier) and majority@n, each with a 95% bootstrap interval over
   problems. With the verifier itself as the selector best-of-n is pass@n ("oracle").
4. Paired tests on the same problems: pass@1 per problem (Wilcoxon signed-rank, with the paired
   bootstrap interval of the difference) and "any of N correct" (exact McNemar) for Expert-Sample
   and Expert-Sample + T against greedy and against every temperature.

`evaluate_active_experts` is the other measurement of the method: greedy accuracy as the number
of active experts shrinks (each layer's own top-k replaced by top-k' with k' < k, gates
renormalised as the family does).

Sampling seeds: every batch of problems gets its own seed (`seed` and the batch index), used by both
the token sampler and Expert-Sample's noise; results depend on `batch_rows` too, which is recorded.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from analyses.evaluation import (Choice, bootstrap_interval, choose_on_dev, mcnemar_exact, mean_pass_at_k,
                                 paired_difference_interval, pass_at_k_interval, wilcoxon_test)
from analyses.moe_router.problems import Item, load_items, resolve_task
from probes.arch import ArchInfo
from probes.backend import Backend, require
from probes.engine import Sampling
from probes.routing import EVERY_LAYER, ExpertSample, TopK
from thoughtscope import checks
from thoughtscope.errors import BadInputError

TEMPERATURES = (0.3, 0.6, 1.0)
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ExpertSetting:
    """One Expert-Sample setting (see `probes.routing.ExpertSample`): keep the top `k_h` experts, draw the
    other k - k_h from the next `m` at temperature `t_e`; `tail_gates` weights the drawn experts."""

    k_h: int
    m: int
    t_e: float
    tail_gates: str = "router"
    where: str = "all"

    def check(self, k: int) -> "ExpertSetting":
        """Refuse a setting that is not Expert-Sample at a model with top-`k` routing: the head must leave at
        least one expert to sample (k_h < k; k_h = k is the model's own routing, run it as greedy). The rule's
        own checks (m >= k - k_h, T_e finite and > 0, k_h + m <= experts) follow in `check_methods`."""
        checks.integer("Expert-Sample's k_h", self.k_h, low=0, high=k - 1,
                       why=f"k_h < k = {k}, the model's top-k: the head keeps k_h experts and the other k - k_h "
                           "are sampled")
        return self

    def check_for(self, arch: Any) -> "ExpertSetting":
        """`check` and then the rule's own checks against the model's `ArchInfo` (m >= k - k_h, k_h + m <= the
        experts, T_e finite and > 0): what a page says next to its widgets before any job starts."""
        self.check(int(arch.experts_top_k)).rule().validate(arch)
        return self

    def rule(self, seed: int = 0) -> Any:
        return ExpertSample(EVERY_LAYER, k_h=self.k_h, m=self.m, t_e=self.t_e, tail_gates=self.tail_gates,
                            seed=seed, where=self.where)

    @property
    def label(self) -> str:
        gates = "" if self.tail_gates == "router" else f", {self.tail_gates} gates"
        return f"k_h={self.k_h}, m={self.m}, T_e={self.t_e:g}{gates}"

    def to_dict(self) -> dict[str, Any]:
        return {"k_h": self.k_h, "m": self.m, "t_e": self.t_e, "tail_gates": self.tail_gates, "where": self.where}

    @classmethod
    def parse(cls, text: str) -> "ExpertSetting":
        """`"4:12:1.0"` or `"4:12:1.0:displaced"` -> k_h=4, m=12, T_e=1.0 (tail gates)."""
        parts = str(text).strip().split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            return cls(int(parts[0]), int(parts[1]), float(parts[2]), *(parts[3:]))
        except ValueError as err:
            raise BadInputError(f"an Expert-Sample setting reads k_h:m:T_e[:tail_gates], e.g. 4:12:1 or "
                                f"2:16:2:displaced; got {text!r}") from err


def default_grid(k: int, n_experts: int) -> list[ExpertSetting]:
    """The development grid for a model with top-`k` of `n_experts`: a head of about k/2 or k/4 experts, a
    pool of 1.5k or 3k, T_e 1 or 2, with the family's gates or the displaced ones (16 settings at k = 8).

    >>> [s.label for s in default_grid(8, 64)][:2]
    ['k_h=4, m=12, T_e=1', 'k_h=4, m=12, T_e=2']
    """
    heads = sorted({max(1, k // 2), max(1, k // 4)}, reverse=True)
    grid = []
    for gates, k_h in itertools.product(("router", "displaced"), heads):
        for m in sorted({max(k - k_h, round(1.5 * k)), max(k - k_h, 3 * k)}):
            if k_h + m > n_experts:
                m = n_experts - k_h
            for t_e in (1.0, 2.0):
                setting = ExpertSetting(k_h, m, t_e, gates)
                if setting not in grid and k_h < k and m >= k - k_h:
                    grid.append(setting)
    return grid


@dataclass(frozen=True)
class Method:
    """One way of drawing N answers: token `temperature` (0: greedy), an `expert` setting, or greedy with
    `active_experts` experts per token."""

    name: str
    temperature: float = 0.0
    expert: ExpertSetting | None = None
    active_experts: int | None = None

    def interventions(self, seed: int) -> list[Any]:
        out = []
        if self.expert is not None:
            out.append(self.expert.rule(seed))
        if self.active_experts is not None:
            out.append(TopK(EVERY_LAYER, k=self.active_experts))
        return out

    def sampling(self) -> Any:
        return Sampling(temperature=float(self.temperature))

    @property
    def stochastic(self) -> bool:
        return self.temperature > 0 or self.expert is not None

    def setting(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "expert_sample": self.expert.to_dict() if self.expert else None,
                "active_experts": self.active_experts}


def arch_of(backend: Backend) -> ArchInfo:
    """The backend's `ArchInfo` (what router rules validate against)."""
    return backend.arch()


def require_moe(backend: Backend) -> Any:
    """The backend's ArchInfo, or a clear error for a dense model (before any model work)."""
    arch = arch_of(backend)
    if not arch.is_moe:
        raise BadInputError(f"{backend.info().get('model_id')} is a dense model ({arch.model_type}): it has no MoE "
                            "router to read or sample. Use an MoE model: toy-moe, or hf: Qwen3-MoE, OLMoE, Mixtral...")
    require(backend, "generate", "router")
    return arch


def check_methods(methods: Sequence[Method], arch: Any) -> None:
    """Every rule of every method validated against the model before any model work."""
    for method in methods:
        method.sampling()
        if method.expert is not None:
            method.expert.check(arch.experts_top_k)
        for rule in method.interventions(0):
            rule.validate(arch)


# ----------------------------------------------------------------------------- drawing samples


@dataclass
class Samples:
    """N answers per problem from one method: `correct` [P, N] (bool), `mean_logprob` and `tokens` [P, N],
    the parsed `answers`, and the texts when kept."""

    method: Method
    items: list[Item]
    correct: np.ndarray
    mean_logprob: np.ndarray
    tokens: np.ndarray
    answers: list[list[str | None]]
    seconds: float
    texts: list[list[str]] | None = None

    @property
    def n_samples(self) -> int:
        return int(self.correct.shape[1])

    def counts(self) -> list[tuple[int, int]]:
        return [(self.n_samples, int(c)) for c in self.correct.sum(1)]

    def pass_at(self, k: int, seed: int = 0, n_resamples: int = 2000) -> Any:
        return pass_at_k_interval(self.counts(), k, seed=seed, n_resamples=n_resamples)

    def best_of(self, n: int) -> np.ndarray:
        """Per problem: is the sample of the first `n` the model scores highest (mean token log-prob) correct?"""
        pick = self.mean_logprob[:, :n].argmax(1)
        return self.correct[np.arange(len(pick)), pick].astype(float)

    def majority_at(self, n: int) -> np.ndarray:
        """Per problem: is the most frequent parsed answer of the first `n` samples right (ties: first seen)?"""
        out = []
        for item, answers in zip(self.items, self.answers):
            votes = Counter(a for a in answers[:n] if a is not None)
            out.append(float(bool(votes) and votes.most_common(1)[0][0] == item.answer))
        return np.array(out)

    def summary(self, seed: int = 0, n_resamples: int = 2000) -> dict[str, Any]:
        n = self.n_samples
        ns = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n] + ([n] if n not in (1, 2, 4, 8, 16, 32, 64) else [])
        kw = dict(seed=seed, n_resamples=n_resamples)
        distinct = [len({a for a in answers}) for answers in self.answers]
        return {
            "name": self.method.name, "setting": self.method.setting(), "n_problems": len(self.items), "n_samples": n,
            "pass_at": {str(k): self.pass_at(k, **kw).to_dict() for k in range(1, n + 1)},
            "best_of": {str(k): bootstrap_interval(self.best_of(k), **kw).to_dict() for k in ns},
            "majority_at": {str(k): bootstrap_interval(self.majority_at(k), **kw).to_dict() for k in ns},
            "mean_tokens": float(self.tokens.mean()), "distinct_answers": float(np.mean(distinct)),
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(float(self.tokens.sum()) / max(self.seconds, 1e-9), 1),
        }

    def per_problem(self) -> list[dict[str, Any]]:
        return [{"id": it.id, "answer": it.answer, "correct": int(c.sum()), "n": self.n_samples,
                 "answers": list(a)} for it, c, a in zip(self.items, self.correct, self.answers)]


def batch_seed(seed: int, batch: int) -> int:
    """The seed of one batch of problems: distinct per batch, the same for every method (common random numbers)."""
    return int(seed) * 100_003 + int(batch)


def generate_batch(backend: Backend, batch: tuple[list[Any], bool, int], *, method: Method, n: int,
                   max_new_tokens: int) -> tuple[dict[int, list[str]], dict[int, float], dict[int, int]]:
    """One batch of `draw_samples`: (prompts, chat, seed) -> per row its token texts, summed log-prob and token
    count; a Ray replica (`analyses.distributed`) runs the same call."""
    prompts, chat, s = batch
    pieces: dict[int, list[str]] = {}
    lp_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    for rec in backend.generate(prompts=prompts, n_samples=n, max_new_tokens=max_new_tokens,
                                sampling=method.sampling(), seed=s, interventions=method.interventions(s),
                                top_k=0, chat=chat):
        pieces.setdefault(rec.batch_index, []).append(rec.text)
        lp_sum[rec.batch_index] = lp_sum.get(rec.batch_index, 0.0) + rec.logprob
        count[rec.batch_index] = count.get(rec.batch_index, 0) + 1
    return pieces, lp_sum, count


def draw_samples(backend: Backend, items: Sequence[Item], method: Method, n_samples: int, *, max_new_tokens: int = 48,
                 seed: int = 0, batch_rows: int = 128, keep_texts: bool = False, progress: Progress | None = None,
                 stage: str | None = None, runner: Any = None) -> Samples:
    """Draw `n_samples` answers per problem with `method` (one per problem when the method is deterministic),
    `batch_rows` sequences per generate call (whole problems of N samples each). With a `runner`
    (`analyses.distributed.RayRunner`) the same batches, with the same seeds, run on its model replicas."""
    items = list(items)
    if not items:
        raise BadInputError("no problems to sample")
    n = n_samples if method.stochastic else 1
    per_batch = max(1, batch_rows // n)
    P = len(items)
    correct, mean_lp, tokens = np.zeros((P, n), bool), np.zeros((P, n)), np.zeros((P, n), int)
    answers: list[list[str | None]] = [[] for _ in items]
    texts: list[list[str]] = [[] for _ in items]
    stage = stage or method.name
    t0 = time.perf_counter()
    starts = list(range(0, P, per_batch))
    batches = [([it.prompt for it in items[lo:lo + per_batch]], items[lo].chat, batch_seed(seed, b))
               for b, lo in enumerate(starts)]
    one_batch = partial(generate_batch, method=method, n=n, max_new_tokens=max_new_tokens)
    done = None if runner is None else runner.map(
        one_batch, batches, weights=[len(prompts) for prompts, _, _ in batches],
        on_progress=(lambda finished, total: progress(stage, finished, total)) if progress else None)
    for b, lo in enumerate(starts):
        chunk = items[lo:lo + per_batch]
        pieces, lp_sum, count = done[b] if done is not None else one_batch(backend, batches[b])
        for row in range(len(chunk) * n):
            p, j = lo + row // n, row % n
            text = "".join(pieces.get(row, []))
            correct[p, j] = items[p].verify(text)
            tokens[p, j] = count.get(row, 0)
            mean_lp[p, j] = lp_sum.get(row, 0.0) / max(1, count.get(row, 0))
            answers[p].append(items[p].parse(text))
            texts[p].append(text)
        if progress:
            progress(stage, min(P, lo + per_batch), P)
    return Samples(method, items, correct, mean_lp, tokens, answers, time.perf_counter() - t0,
                   texts if keep_texts else None)


# ----------------------------------------------------------------------------- paired tests


def paired_tests(method: Samples, baseline: Samples, seed: int = 0, n_resamples: int = 2000) -> dict[str, Any]:
    """`method` against `baseline` on the same problems: pass@1 per problem (Wilcoxon; bootstrap interval
    of the mean difference) and any-of-N correct (exact McNemar)."""
    if [it.id for it in method.items] != [it.id for it in baseline.items]:
        raise BadInputError("paired tests need the same problems on both sides")
    kw = dict(seed=seed, n_resamples=n_resamples)
    a, b = method.correct.mean(1), baseline.correct.mean(1)
    return {
        "method": method.method.name, "baseline": baseline.method.name,
        "pass@1": {**wilcoxon_test(a, b, lower_is_better=False, what="pass@1", **kw).to_dict(),
                   "difference": paired_difference_interval(a, b, **kw).to_dict()},
        f"any of {method.n_samples} vs any of {baseline.n_samples}":
            mcnemar_exact(method.correct.any(1), baseline.correct.any(1), **kw).to_dict(),
    }


# ----------------------------------------------------------------------------- choosing on development


def _dev_row(samples: Samples) -> dict[str, Any]:
    n = samples.n_samples
    counts = samples.counts()
    return {"pass@1": mean_pass_at_k(counts, 1), f"pass@{max(1, n // 4)}": mean_pass_at_k(counts, max(1, n // 4)),
            f"pass@{n}": mean_pass_at_k(counts, n), "mean_tokens": float(samples.tokens.mean()),
            "distinct_answers": float(np.mean([len(set(a)) for a in samples.answers])),
            "seconds": round(samples.seconds, 2)}


def choose_expert_setting(backend: Backend, dev: Sequence[Item], grid: Sequence[ExpertSetting], n_samples: int, *,
                          temperature: float = 0.0, progress: Progress | None = None, **kw: Any) -> Choice:
    """The Expert-Sample setting with the highest dev pass@N (ties: dev pass@1), every setting measured."""
    grid = list(grid)
    done = [0]

    def measure(setting: ExpertSetting) -> dict[str, Any]:
        method = Method(f"dev {setting.label}", temperature=temperature, expert=setting)
        row = _dev_row(draw_samples(backend, dev, method, n_samples, **kw))
        done[0] += 1
        if progress:
            progress("choosing Expert-Sample on development", done[0], len(grid))
        return row

    key = f"pass@{n_samples}"
    objective = lambda row: (round(row[key], 6), round(row["pass@1"], 6))  # noqa: E731
    return choose_on_dev(grid, measure, objective, name="expert_sample",
                         objective_name=f"max dev {key}, ties: max dev pass@1")


def choose_temperature(backend: Backend, dev: Sequence[Item], temperatures: Sequence[float], n_samples: int, *,
                       expert: ExpertSetting | None = None, name: str = "temperature",
                       progress: Progress | None = None, **kw: Any) -> Choice:
    """The token temperature (with `expert` routing, if given) with the highest dev pass@N (ties: pass@1)."""
    temperatures = list(temperatures)
    done = [0]

    def measure(t: float) -> dict[str, Any]:
        row = _dev_row(draw_samples(backend, dev, Method(f"dev T={t:g}", temperature=t, expert=expert), n_samples, **kw))
        done[0] += 1
        if progress:
            progress(f"choosing {name} on development", done[0], len(temperatures))
        return row

    key = f"pass@{n_samples}"
    return choose_on_dev(temperatures, measure, lambda row: (round(row[key], 6), round(row["pass@1"], 6)), name=name,
                         objective_name=f"max dev {key}, ties: max dev pass@1")


# ----------------------------------------------------------------------------- the evaluation


@dataclass
class ExpertSampleReport:
    """Choices on development, then every method once on evaluation, with intervals and paired tests."""

    model: str
    task: str
    n_dev: int
    n_eval: int
    n_samples: int
    choices: dict[str, Choice]
    samples: dict[str, Samples]
    tests: list[dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    n_resamples: int = 2000

    def to_dict(self, per_problem: bool = False) -> dict[str, Any]:
        methods = []
        for name, s in self.samples.items():
            row = s.summary(self.seed, self.n_resamples)
            if per_problem:
                row["per_problem"] = s.per_problem()
            methods.append(row)
        return {"model": self.model, "task": self.task, "n_dev": self.n_dev, "n_eval": self.n_eval,
                "n_samples": self.n_samples, "choices": {k: c.to_dict() for k, c in self.choices.items()},
                "methods": methods, "tests": self.tests, "settings": self.settings,
                "notes": self.notes()}

    def notes(self) -> list[str]:
        out = [f"Settings chosen on {self.n_dev} development problems; every method then ran once on "
               f"{self.n_eval} evaluation problems ({self.n_samples} samples each, greedy once).",
               "best_of: the sample with the highest mean token log-prob of the first n, checked by the verifier; "
               "with the verifier as the selector best-of-n equals pass@n.",
               "95% intervals: percentile bootstrap over problems. Paired tests: Wilcoxon on per-problem pass@1, "
               "exact McNemar on 'any of N correct'."]
        for t in self.tests:
            key = next(k for k in t if k.startswith("any of"))
            out.append(f"{t['method']} vs {t['baseline']}: pass@1 {t['pass@1']['verdict']}; {key}: {t[key]['verdict']}")
        return out


def evaluate_expert_sample(backend: Backend, task: str = "auto", n: int = 100, n_dev: int = 40, n_samples: int = 16, *,
                           grid: Sequence[ExpertSetting] | None = None, temperatures: Sequence[float] = TEMPERATURES,
                           combined_temperatures: Sequence[float] | None = None, max_new_tokens: int = 48,
                           seed: int = 0, batch_rows: int = 128, n_resamples: int = 2000,
                           progress: Progress | None = None, runner: Any = None) -> ExpertSampleReport:
    """Choose Expert-Sample (and its temperature when combined) on development, then run greedy, every
    temperature, Expert-Sample and Expert-Sample + temperature once on evaluation. All inputs are checked
    before any model work."""
    arch = require_moe(backend)
    for name, value in (("n", n), ("n_dev", n_dev), ("n_samples", n_samples)):
        checks.integer(name, value, low=1)
    checks.integer("seed", seed, low=0, high=checks.SEED_MAX)  # before the batches' seeds are derived from it
    temperatures = list(temperatures)
    combined = list(combined_temperatures if combined_temperatures is not None else temperatures)
    if not temperatures or not combined:
        raise BadInputError("give at least one temperature > 0 (greedy runs anyway)")
    temperatures = [float(checks.number("a temperature", t, low=0, low_open=True, why="greedy runs anyway"))
                    for t in temperatures]
    combined = [float(checks.number("a combined temperature", t, low=0, low_open=True)) for t in combined]
    grid = list(grid) if grid is not None else default_grid(arch.experts_top_k, arch.n_experts)
    if not grid:
        raise BadInputError("the Expert-Sample grid is empty")
    check_methods([Method("grid", expert=s) for s in grid] + [Method(f"T={t:g}", temperature=t) for t in temperatures],
                  arch)
    task = resolve_task(task, backend)
    dev = load_items(task, "development", n_dev, seed=seed, backend=backend)
    ev = load_items(task, "evaluation", n, seed=seed, backend=backend)
    kw = dict(max_new_tokens=max_new_tokens, seed=seed, batch_rows=batch_rows, runner=runner)

    choices = {"expert_sample": choose_expert_setting(backend, dev, grid, n_samples, progress=progress, **kw)}
    chosen: ExpertSetting = choices["expert_sample"].chosen
    choices["expert_sample+temperature"] = choose_temperature(backend, dev, combined, n_samples, expert=chosen,
                                                              name="Expert-Sample's token temperature",
                                                              progress=progress, **kw)
    t_combined = choices["expert_sample+temperature"].chosen
    methods = [Method("greedy"), *[Method(f"temperature {t:g}", temperature=t) for t in temperatures],
               Method("Expert-Sample", expert=chosen),
               Method(f"Expert-Sample + temperature {t_combined:g}", temperature=t_combined, expert=chosen)]
    samples = {}
    for i, method in enumerate(methods):
        samples[method.name] = draw_samples(backend, ev, method, n_samples, progress=progress,
                                            stage=f"evaluation {i + 1}/{len(methods)}: {method.name}", **kw)
    tests = []
    baselines = [methods[0], *methods[1:1 + len(temperatures)]]
    for m in methods[-2:]:
        for base in baselines:
            tests.append(paired_tests(samples[m.name], samples[base.name], seed=seed, n_resamples=n_resamples))
    return ExpertSampleReport(
        model=backend.info()["model_id"], task=task, n_dev=len(dev), n_eval=len(ev), n_samples=n_samples,
        choices=choices, samples=samples, tests=tests, seed=seed, n_resamples=n_resamples,
        settings={"grid": [s.to_dict() for s in grid], "temperatures": temperatures, "combined_temperatures": combined,
                  "max_new_tokens": max_new_tokens, "batch_rows": batch_rows, "seed": seed,
                  "k": arch.experts_top_k, "n_experts": arch.n_experts})


# ----------------------------------------------------------------------------- active experts


@dataclass
class ActiveExpertsReport:
    """Greedy accuracy on evaluation problems with k' experts per token, k' = the model's k down to 1."""

    model: str
    task: str
    k: int
    rows: list[dict[str, Any]]
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "k": self.k, "rows": self.rows, "settings": self.settings}


def evaluate_active_experts(backend: Backend, task: str = "auto", n: int = 100, ks: Sequence[int] | None = None, *,
                            max_new_tokens: int = 48, seed: int = 0, batch_rows: int = 128, n_resamples: int = 2000,
                            progress: Progress | None = None) -> ActiveExpertsReport:
    """Greedy accuracy with `TopK(k')` at every MoE layer for each k' in `ks` (default: k down to 1), each
    with a bootstrap interval and an exact McNemar test against the model's own k on the same problems."""
    arch = require_moe(backend)
    k = arch.experts_top_k
    ks = sorted({int(x) for x in (ks if ks is not None else range(1, k + 1))}, reverse=True)
    checks.integer("n", n, low=1)
    methods = [Method(f"top-{x}", active_experts=x) for x in ks]
    check_methods(methods, arch)
    if k not in ks:
        methods.insert(0, Method(f"top-{k}", active_experts=k))
    task = resolve_task(task, backend)
    items = load_items(task, "evaluation", n, seed=seed, backend=backend)
    runs = {}
    for i, method in enumerate(methods):
        runs[method.active_experts] = draw_samples(backend, items, method, 1, max_new_tokens=max_new_tokens, seed=seed,
                                                   batch_rows=batch_rows)
        if progress:
            progress("greedy accuracy vs active experts", i + 1, len(methods))
    base = runs[k].correct[:, 0]
    rows = []
    for x in ks:
        c = runs[x].correct[:, 0]
        rows.append({"active_experts": x, "accuracy": bootstrap_interval(c.astype(float), seed=seed,
                                                                         n_resamples=n_resamples).to_dict(),
                     "mean_tokens": float(runs[x].tokens.mean()),
                     "vs_model_k": None if x == k else mcnemar_exact(c, base, seed=seed, n_resamples=n_resamples).to_dict()})
    return ActiveExpertsReport(backend.info()["model_id"], task, k, rows,
                               {"n": len(items), "split": "evaluation", "max_new_tokens": max_new_tokens, "seed": seed,
                                "ks": ks, "batch_rows": batch_rows})
