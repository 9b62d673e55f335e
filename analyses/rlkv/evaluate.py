"""RLKV's evaluation harness: full cache, RLKV and every baseline on the same KV budget, in one run.

The protocol (`analyses.evaluation`): three disjoint problem sets drawn from one seeded pool, none of
them a problem the gates were trained on (their questions are read from the gates' log and dropped):

- calibration: full-cache greedy traces whose attention statistics give the training-free head score
  (`heads.attention_head_scores`);
- development: the full cache's sequence lengths there fix the reference length the byte budgets of
  the uniform-window and token-dropping baselines are matched to, and SnapKV's observation window is
  chosen there (most accurate at the middle sparsity; ties to the smaller window); both are recorded;
- evaluation: every method runs once, greedy, on the same problems.

Methods at each sparsity s (the fraction of KV heads made local; `probes.kv_policy` policies, all
through the Backend, so a model server works too):

- `rlkv`: the top (1 - s) heads by learned gate keep the full cache, the others sink + recent (HeadBudget);
- `attention`: the same with the attention-statistics score (no training);
- `random`: the same with random heads (several seeds, and their mean);
- `streaming`: StreamingLLM, every head keeps sink + (E - sink) recent entries, E the matched budget;
- `rlkv-inverse` (a control, only when named): the heads with the lowest gates keep the full cache and
  the highest-gate heads are made local; if the gates carry information it should do worse than rlkv;
- `snapkv`, `knorm`: token dropping in the kvpress style, E entries per head (kvpress itself needs
  transformers < 5.3 and cannot be installed beside ours, so these are our `KVPolicy` versions).

Per method: accuracy with a 95% bootstrap interval, exact McNemar against the full cache on the same
problems, KV bytes held at the last token (mean, and as a fraction of the full cache's on the same
problem), generated tokens, tokens/s of the batched run (wall clock, on a shared machine: read the
ratio, not the absolute), and error modes: correct, repetition (a 4-token n-gram three times or more),
over-length (hit the token limit without an answer), wrong answer.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table

from analyses.evaluation import (Splits, bootstrap_interval, choose_on_dev, compare, detectable_statement,
                                 mcnemar_exact, paired_difference_interval, split_three)
from analyses.families import family_for, task_prompt
from analyses.rlkv.data import task_problems
from analyses.rlkv.heads import (LOCAL_HINT, attention_head_scores, full_heads_from_scores, matched_entries,
                                 problem_texts, random_full_heads)
from analyses.rlkv.probe import read_gates
from analyses.tasks import is_correct
from probes.backend import Backend, require
from probes.kv_policy import HeadBudget, KnormPolicy, SinkRecent, SnapKVPolicy
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance

METHODS = ("rlkv", "attention", "random", "streaming", "snapkv", "knorm")
# Controls run only when asked for by name: `rlkv-inverse` makes the heads with the HIGHEST gates local
# (the lowest keep the full cache), so if the gates carry information it should do worse than rlkv.
CONTROLS = ("rlkv-inverse",)
ERROR_MODES = ("correct", "repetition", "over-length", "wrong answer")


def is_repetitive(token_ids: Sequence[int], n: int = 4, times: int = 3) -> bool:
    """Some n-gram of tokens occurs `times` times or more (a generation caught in a loop).

    >>> is_repetitive([1, 2, 3, 4] * 3), is_repetitive([1, 2, 3, 4, 5, 6, 7, 8])
    (True, False)
    """
    counts = Counter(tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1))
    return bool(counts) and max(counts.values()) >= times


def error_mode(token_ids: Sequence[int], correct: bool, hit_limit: bool) -> str:
    """correct | repetition | over-length (token limit reached) | wrong answer, in that order of precedence."""
    if correct:
        return "correct"
    if is_repetitive(token_ids):
        return "repetition"
    if hit_limit:
        return "over-length"
    return "wrong answer"


@dataclass
class Run:
    """One method at one sparsity on one problem set: per-problem outcomes and the run's wall clock."""

    method: str
    sparsity: float | None
    setting: dict[str, Any]
    policy: str
    correct: list[int]
    modes: list[str]
    kv_bytes: list[int]  # bytes held when the last token was generated
    lengths: list[int]  # prompt + generated tokens
    tokens: list[int]  # generated tokens
    seconds: float
    texts: list[str] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    def mode_counts(self) -> dict[str, int]:
        c = Counter(self.modes)
        return {m: int(c.get(m, 0)) for m in ERROR_MODES}


def generate_run(backend: Backend, method: str, sparsity: float | None, setting: dict[str, Any], policy: Any,
                 prompts: list[list[int]], problems: Sequence[Any], *, max_new_tokens: int, batch_size: int,
                 progress: Callable[[str, int, int], None] | None = None, stage: str = "") -> Run:
    """Greedy generations of every prompt under `policy` (None: the full cache), scored."""
    interventions = [policy] if policy is not None else []
    eos = set(backend.eos_ids())
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts, kv = [""] * n, [0] * n
    start = time.perf_counter()
    for lo in range(0, n, batch_size):
        for rec in backend.generate(prompts=prompts[lo:lo + batch_size], max_new_tokens=max_new_tokens, top_k=0,
                                    interventions=interventions):
            b = lo + rec.batch_index
            tokens[b].append(rec.token_id)
            texts[b] += rec.text
            kv[b] = rec.kv_bytes
        if progress is not None:
            progress(stage or method, min(lo + batch_size, n), n)
    seconds = time.perf_counter() - start
    correct = [int(is_correct(t, p)) for t, p in zip(texts, problems)]
    modes = [error_mode(ids, bool(c), hit_limit=len(ids) >= max_new_tokens and ids[-1] not in eos)
             for ids, c in zip(tokens, correct)]
    return Run(method, sparsity, setting, policy.describe() if policy is not None else "full cache", correct, modes,
               kv, [len(p) + len(t) for p, t in zip(prompts, tokens)], [len(t) for t in tokens], seconds, texts)


@dataclass
class RLKVReport:
    """Everything `thoughtscope eval rlkv` reports (see the module docstring)."""

    model: str
    task: str
    sparsities: list[float]
    sink: int
    recent: int
    full: Run
    runs: list[Run]
    splits: dict[str, Any]
    choices: dict[str, Any]
    head_maps: dict[str, Any]
    settings: dict[str, Any]
    provenance: dict[str, Any]
    seed: int = 0

    def rows(self) -> list[dict[str, Any]]:
        """One row per method and sparsity (random seeds pooled into `random-mean` besides their own rows)."""
        out = [self._row(self.full, None)]
        for run in self.runs:
            out.append(self._row(run, compare(run.method, run.setting, run.correct,
                                              {"kv_bytes": run.kv_bytes, "tokens": run.tokens},
                                              self.full.correct, {"kv_bytes": self.full.kv_bytes, "tokens": self.full.tokens},
                                              seed=self.seed)))
        return out

    def _row(self, run: Run, comparison: Any) -> dict[str, Any]:
        frac = [k / f if f else float("nan") for k, f in zip(run.kv_bytes, self.full.kv_bytes)]
        acc = bootstrap_interval(run.correct, seed=self.seed) if comparison is None else comparison.accuracy
        row = {"method": run.method, "sparsity": run.sparsity, "setting": run.setting, "policy": run.policy,
               "accuracy": acc.to_dict(), "kv_bytes_mean": float(np.mean(run.kv_bytes)),
               "kv_fraction": float(np.nanmean(frac)), "tokens_mean": float(np.mean(run.tokens)),
               "tokens_per_s": run.tokens_per_s, "tps_ratio": run.tokens_per_s / self.full.tokens_per_s,
               "seconds": run.seconds, "error_modes": run.mode_counts()}
        if comparison is not None:
            row["vs_full"] = comparison.accuracy_test.to_dict()
        return row

    def curves(self) -> dict[str, list[dict[str, Any]]]:
        """Accuracy vs sparsity per method (random pooled over seeds), for the figure."""
        curves: dict[str, list[dict[str, Any]]] = {}
        by = {}
        for run in self.runs:
            by.setdefault((run.method, run.sparsity), []).append(run)
        for (method, s), runs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            per_problem = np.mean([r.correct for r in runs], axis=0)
            ci = bootstrap_interval(per_problem, seed=self.seed)
            frac = np.nanmean([[k / f for k, f in zip(r.kv_bytes, self.full.kv_bytes) if f] for r in runs])
            curves.setdefault(method, []).append({"sparsity": s, "accuracy": ci.estimate, "low": ci.low,
                                                  "high": ci.high, "kv_fraction": float(frac), "runs": len(runs)})
        full = bootstrap_interval(self.full.correct, seed=self.seed)
        curves["full cache"] = [{"sparsity": 0.0, "accuracy": full.estimate, "low": full.low, "high": full.high,
                                 "kv_fraction": 1.0, "runs": 1}]
        return curves

    def rlkv_vs_baselines(self) -> list[dict[str, Any]]:
        """RLKV against every other method at each sparsity, on the same problems: the mean paired
        difference in accuracy with its bootstrap interval (a random baseline: the mean over its seeds
        per problem) and exact McNemar (against each random seed on its own; `seeds` lists them)."""
        out = []
        for s in self.sparsities:
            here = [r for r in self.runs if r.sparsity == s]
            rlkv = next((r for r in here if r.method == "rlkv"), None)
            if rlkv is None:
                continue
            by: dict[str, list[Run]] = {}
            for run in here:
                if run.method != "rlkv":
                    by.setdefault(run.method, []).append(run)
            for method, runs in by.items():
                diff = paired_difference_interval(rlkv.correct, np.mean([r.correct for r in runs], axis=0), seed=self.seed)
                tests = [mcnemar_exact(rlkv.correct, r.correct, seed=self.seed) for r in runs]
                out.append({"sparsity": s, "baseline": method, "difference": diff.to_dict(),
                            "mcnemar": [{"seed": r.setting.get("seed"), "p_value": t.p_value, "gains": t.gains,
                                         "losses": t.losses} for r, t in zip(runs, tests)]})
        return out

    def notes(self) -> list[str]:
        """What n can tell apart, in words."""
        n = len(self.full.correct)
        lines = [f"{n} evaluation problems: a 95% interval on an accuracy near "
                 f"{np.mean(self.full.correct):.0%} is about ±{1.96 * math.sqrt(max(np.mean(self.full.correct) * (1 - np.mean(self.full.correct)), 0.01) / n):.0%} wide."]
        rlkv = [r for r in self.runs if r.method == "rlkv"]
        if rlkv:
            lines.append("RLKV vs full cache at the middle sparsity: "
                         + detectable_statement(rlkv[len(rlkv) // 2].correct, self.full.correct))
        lines.append("tokens/s are wall-clock figures of batched runs on a shared CPU: compare ratios, and expect noise.")
        return lines

    def to_dict(self, per_problem: bool = False) -> dict[str, Any]:
        out = {"model": self.model, "task": self.task, "sparsities": self.sparsities, "sink": self.sink,
               "recent": self.recent, "rows": self.rows(), "curves": self.curves(), "splits": self.splits,
               "rlkv_vs_baselines": self.rlkv_vs_baselines(),
               "choices": self.choices, "head_maps": self.head_maps, "settings": self.settings,
               "notes": self.notes(), "provenance": self.provenance}
        if per_problem:
            out["per_problem"] = [{"method": r.method, "sparsity": r.sparsity, "setting": r.setting,
                                   "correct": r.correct, "modes": r.modes, "kv_bytes": r.kv_bytes,
                                   "tokens": r.tokens, "texts": r.texts} for r in [self.full, *self.runs]]
        return out


def _methods(methods: str | Sequence[str], have_gates: bool, random_seeds: int) -> list[str]:
    chosen = list(METHODS) if methods in ("all", ["all"], ("all",)) else \
        [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not chosen:  # "," or " ": the evaluation would print the full-cache row only
        raise BadInputError(f"--methods names no method; choose from {', '.join(METHODS + CONTROLS)} (or all)")
    bad = [m for m in chosen if m not in METHODS + CONTROLS]
    if bad:
        raise BadInputError(f"unknown method(s) {bad}; choose from {', '.join(METHODS + CONTROLS)} (or all)")
    if "rlkv-inverse" in chosen and not have_gates:
        raise BadInputError("the rlkv-inverse control needs learned gates: pass --gates")
    if "rlkv" in chosen and not have_gates:
        if methods == "all":
            chosen.remove("rlkv")
        else:
            raise BadInputError("method rlkv needs learned gates: pass --gates (train them with `thoughtscope rlkv train`)")
    if "random" in chosen and random_seeds == 0:  # zero random head choices: the method would run nothing
        if methods == "all":
            chosen.remove("random")
        else:
            raise BadInputError("method random needs at least one random head choice: --random-seeds 1 or more")
    return chosen


def evaluate_rlkv(backend: Backend, task: str, sparsities: Sequence[float], *, gates: str | Path | None = None,
                  ops: str | None = None, n: int = 60, n_dev: int = 16, n_calibration: int = 8, seed: int = 1,
                  sink: int = 4, recent: int = 32, random_seeds: int = 3, snapkv_windows: Sequence[int] = (4, 16),
                  snapkv_kernel: int = 5, max_new_tokens: int = 64, batch_size: int = 16, methods: Any = "all",
                  progress: Callable[[str, int, int], None] | None = None) -> RLKVReport:
    """Run the comparison (see the module docstring). Every check runs before any model work."""
    info = backend.info()
    arch = backend.arch()
    shape = (arch.n_layers, arch.n_kv_heads)
    levels = sorted(dict.fromkeys(float(s) for s in sparsities))
    if not levels or any(not (0 <= s < 1) for s in levels):
        raise BadInputError(f"sparsities must lie in [0, 1) (the fraction of heads made local), got {list(sparsities)}")
    checks.window(sink, recent, arch.context_length, hint=LOCAL_HINT)
    for name, value, low in (("n", n, 1), ("n_dev", n_dev, 1), ("n_calibration", n_calibration, 1),
                             ("random_seeds", random_seeds, 0), ("max_new_tokens", max_new_tokens, 1),
                             ("batch_size", batch_size, 1)):
        checks.integer(name, value, low=low)
    windows = sorted(dict.fromkeys(int(w) for w in snapkv_windows))
    if not windows or min(windows) < 1:
        raise BadInputError("give at least one SnapKV window >= 1")
    chosen = _methods(methods, gates is not None, random_seeds)
    learned, pressure, trained_on = None, None, []
    if gates is not None:
        found = read_gates(gates, backend)  # a file for another model is refused here
        learned, pressure = found["gates"], found["pressure"]
        trained_on = [p.get("question", "") for p in found["meta"].get("problems", [])]
    require(backend, "generate", "kv_policy", *(["attention"] if "attention" in chosen else []))
    pool = task_problems(task, n_calibration + n_dev + n, seed=seed, ops=ops, exclude=trained_on)
    splits = split_three(pool, n_calibration, n_dev, n, seed=seed, key=lambda p: p.question)
    family = family_for(backend)

    def encode(problems):
        return [backend.encode(*task_prompt(p, family)[:1], chat=task_prompt(p, family)[1]) for p in problems]

    kw = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress)
    dev_prompts, eval_prompts = encode(splits.development), encode(splits.evaluation)

    # development: reference length of the byte budgets, SnapKV's window
    dev_full = generate_run(backend, "full cache", None, {}, None, dev_prompts, splits.development,
                            stage="development: full cache", **kw)
    reference = float(np.median(dev_full.lengths))
    middle = min(levels, key=lambda s: abs(s - 0.5))
    choices: dict[str, Any] = {"reference_length": {"split": "development", "value": reference,
                                                    "rule": "median prompt + generated tokens of the full cache"}}
    snap_window = windows[0]
    if "snapkv" in chosen and len(windows) > 1:
        budget = matched_entries(reference, middle, sink, recent)
        choice = choose_on_dev(windows, lambda w: {"accuracy": float(np.mean(generate_run(
            backend, "snapkv", middle, {"window": w}, SnapKVPolicy(budget=budget, window=w, kernel=snapkv_kernel),
            dev_prompts, splits.development, stage=f"development: SnapKV window {w}", **kw).correct))},
            "accuracy", name="snapkv_window")
        snap_window = choice.chosen
        choices["snapkv_window"] = {**choice.to_dict(), "at_sparsity": middle}

    # calibration: the attention-statistics head score
    head_maps: dict[str, Any] = {}
    if learned is not None:
        head_maps["rlkv"] = learned.tolist()
    if "attention" in chosen:
        traces = problem_texts(backend, splits.calibration, max_new_tokens=max_new_tokens, batch_size=batch_size)
        head_maps["attention"] = attention_head_scores(backend, traces, sink, recent, progress=progress).tolist()

    # evaluation: every method once
    full = generate_run(backend, "full cache", None, {}, None, eval_prompts, splits.evaluation,
                        stage="evaluation: full cache", **kw)
    runs: list[Run] = []
    for s in levels:
        budget = matched_entries(reference, s, sink, recent)
        plans: list[tuple[str, dict[str, Any], Any]] = []
        if "rlkv" in chosen:
            plans.append(("rlkv", {}, HeadBudget(full_heads=torch.as_tensor(full_heads_from_scores(learned, s, pressure)),
                                                 sink=sink, recent=recent)))
        if "rlkv-inverse" in chosen:
            inverse = full_heads_from_scores(-learned, s, None if pressure is None else -pressure)
            plans.append(("rlkv-inverse", {}, HeadBudget(full_heads=torch.as_tensor(inverse), sink=sink, recent=recent)))
        if "attention" in chosen:
            plans.append(("attention", {}, HeadBudget(
                full_heads=torch.as_tensor(full_heads_from_scores(head_maps["attention"], s)), sink=sink, recent=recent)))
        if "random" in chosen:
            for r in range(random_seeds):
                plans.append(("random", {"seed": r}, HeadBudget(
                    full_heads=torch.as_tensor(random_full_heads(shape, s, seed=r)), sink=sink, recent=recent)))
        if "streaming" in chosen:
            plans.append(("streaming", {"entries": budget}, SinkRecent(sink=sink, recent=budget - sink)))
        if "snapkv" in chosen:
            plans.append(("snapkv", {"entries": budget, "window": snap_window},
                          SnapKVPolicy(budget=budget, window=snap_window, kernel=snapkv_kernel)))
        if "knorm" in chosen:
            plans.append(("knorm", {"entries": budget}, KnormPolicy(budget=budget)))
        for method, setting, policy in plans:
            label = f"s={s:g}: {method}" + (f" seed {setting['seed']}" if "seed" in setting else "")
            runs.append(generate_run(backend, method, s, setting, policy, eval_prompts, splits.evaluation,
                                     stage=label, **kw))
    settings = {"sparsities": levels, "sink": sink, "recent": recent, "n": n, "n_dev": n_dev,
                "n_calibration": n_calibration, "random_seeds": random_seeds, "snapkv_windows": windows,
                "snapkv_kernel": snapkv_kernel, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "methods": chosen, "ops": ops, "gates": str(gates) if gates is not None else None,
                "excluded_training_problems": len(trained_on)}
    record = provenance(info, data=f"{task}{' ops=' + ops if ops else ''}", split="evaluation", seed=seed,
                        settings=settings, command="thoughtscope eval rlkv")
    return RLKVReport(info["model_id"], task, levels, sink, recent, full, runs,
                      Splits.to_dict(splits, key=lambda p: p.id), choices, head_maps, settings, record, seed)


def report_table(report: RLKVReport) -> Any:
    """A rich table of the report's rows."""
    table = Table("sparsity", "method", "accuracy [95% CI]", "McNemar p (+/-)", "KV / full", "tokens/s ratio",
                  "repetition / over-length / wrong",
                  title=f"{report.model} on {report.task}: {len(report.full.correct)} evaluation problems, "
                        f"local heads keep {report.sink} + {report.recent}")
    for row in report.rows():
        acc = row["accuracy"]
        vs = row.get("vs_full")
        m = row["error_modes"]
        table.add_row("-" if row["sparsity"] is None else f"{row['sparsity']:g}",
                      row["method"] + (f" {row['setting'].get('seed')}" if "seed" in row["setting"] else ""),
                      f"{acc['estimate']:.1%} [{acc['low']:.1%}, {acc['high']:.1%}]",
                      "" if vs is None else f"{vs['p_value']:.2g} (+{vs['gains']}/-{vs['losses']})",
                      f"{row['kv_fraction']:.2f}", f"{row['tps_ratio']:.2f}",
                      f"{m['repetition']} / {m['over-length']} / {m['wrong answer']}")
    return table


def compressed_generation(backend: Backend, prompt: Any, policy: Any, *, max_new_tokens: int = 64, chat: bool = False,
                          sampling: Any = None, seed: int = 0, answer: str | None = None) -> dict[str, Any]:
    """One prompt with the full cache and under `policy`: both texts, KV bytes per token, and the compressed
    generation's error mode (with a known `answer`; without one, correct/wrong cannot be told apart and a
    generation that is neither repetitive nor over-length is tagged 'finished')."""
    eos = set(backend.eos_ids())
    out: dict[str, Any] = {"policy": policy.describe(), "answer": answer}
    for key, interventions in (("full", []), ("compressed", [policy])):
        recs = list(backend.generate(prompt, max_new_tokens=max_new_tokens, chat=chat, sampling=sampling, seed=seed,
                                     top_k=0, interventions=interventions))
        ids = [r.token_id for r in recs]
        text = "".join(r.text for r in recs)
        hit_limit = len(ids) >= max_new_tokens and ids[-1] not in eos
        correct = answer is not None and is_correct(text, answer)
        mode = error_mode(ids, correct, hit_limit)
        if answer is None and mode == "wrong answer":
            mode = "finished"
        prefix = "" if key == "compressed" else "full_"
        out.update({f"{prefix}text": text, f"{prefix}kv_bytes": [r.kv_bytes for r in recs], f"{prefix}mode": mode})
    return out
