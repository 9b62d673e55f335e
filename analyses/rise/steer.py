"""RISE steering with behaviour vectors: h' = h - alpha w (w.h) at every generated token, or h + alpha w."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from analyses.evaluation import bootstrap_interval
from analyses.families import family_for
from analyses.organism import behaviour_counts
from analyses.rise.harvest import HarvestSettings, TraceRecord, generate_traces, resolve_delimiter
from analyses.rise.labels import count_behaviours
from analyses.tasks import Problem
from probes.backend import Backend
from probes.interventions import AddVector, ProjectionRescale
from thoughtscope import checks
from thoughtscope.errors import BadInputError

def steering_intervention(site: str, vector: torch.Tensor, alpha: float | list[float],
                          mode: str = "projection") -> Any:
    """ProjectionRescale (h - alpha w (w.h)) or AddVector (h + alpha w) at every generated token; `alpha` may
    be one value per batch row (the alpha grid of one batched generation)."""
    if mode == "projection":
        return ProjectionRescale(site, vector, alpha=alpha, where="generated")
    if mode == "add":
        return AddVector(site, vector, scale=alpha, where="generated")
    raise BadInputError(f"steering mode {mode!r}; use projection or add")


STEER_MODES = ("projection", "add")


def check_steering(alphas: Sequence[float], mode: str) -> list[float]:
    """The alphas (each a finite number) and the mode, checked before any harvest or generation: a NaN alpha
    or an unknown mode once surfaced only after the harvest and the SAEs' training."""
    checks.choice("steering mode", mode, STEER_MODES)
    if not alphas:
        raise BadInputError("give at least one alpha to steer with (0 is the unsteered model)")
    return [float(checks.number("alpha", a, low=-1e6, high=1e6)) for a in alphas]


def behaviour_counter(labeller: str, delimiter: str, model_id: str = "") -> Callable[[str], dict[str, int]]:
    """Steps of each behaviour in one trace, as the family's labeller reads them: RISE's keyword list, or
    the organism's own labeller (its backtrack steps counted as `backtracking`)."""
    if labeller == "auto":
        labeller = family_for(model_id).labeller
    if labeller == "toy-reasoner":
        def organism(text: str) -> dict[str, int]:
            c = behaviour_counts(text)
            return {"reflection": c["reflection"], "backtracking": c["backtrack"], "other": c["compute"] +
                    c["redundant"] + c["other"]}
        return organism
    return lambda text: count_behaviours(text, delimiter)


@dataclass
class SteeringRow:
    """One alpha: behaviour steps per trace (means and 95% bootstrap intervals over problems), length,
    accuracy. `per_trace` keeps each problem's counts so alphas can be compared problem by problem."""

    alpha: float
    n: int
    mean_reflection_steps: float
    mean_backtracking_steps: float
    mean_steps: float
    mean_tokens: float
    accuracy: float
    examples: list[str] = field(default_factory=list)
    generation_seconds: float = 0.0
    intervals: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_trace: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SteeringResult:
    behaviour: str
    site: str
    mode: str
    rows: list[SteeringRow]
    problem_ids: list[str]
    traces: dict[float, list[TraceRecord]] = field(default_factory=dict, repr=False)  # vanilla vs steered
    temperature: float = 0.0
    split: str = ""

    def monotone(self, key: str = "mean_reflection_steps") -> str:
        """Whether `key` rises, falls or neither as alpha grows (strictly, from row to row)."""
        rows = sorted(self.rows, key=lambda r: r.alpha)
        diffs = np.diff([getattr(r, key) for r in rows])
        if len(diffs) and (diffs > 0).all():
            return "increasing"
        if len(diffs) and (diffs < 0).all():
            return "decreasing"
        return "not monotone"

    def to_dict(self) -> dict[str, Any]:
        return {"behaviour": self.behaviour, "site": self.site, "mode": self.mode, "temperature": self.temperature,
                "split": self.split, "rows": [r.to_dict() for r in self.rows], "problem_ids": self.problem_ids,
                "monotone": {k: self.monotone(k) for k in ("mean_reflection_steps", "mean_backtracking_steps")}}


def steer(backend: Backend, problems: Sequence[Problem], vector: torch.Tensor, site: str,
          alphas: Sequence[float] = (-1.5, -1.0, 0.0, 1.0, 1.5), mode: str = "projection",
          settings: HarvestSettings | None = None, behaviour: str = "reflection", seed: int = 0,
          split: str = "", on_progress: Callable[[int, int], None] | None = None,
          batch_alphas: bool = False) -> SteeringResult:
    """Generate on `problems` at each alpha (0 = vanilla) and count behaviours, length, accuracy.

    Traces are greedy, or sampled at `settings.temperature`; sampled alphas share their seeds
    batch by batch, so differences between alphas are not differences of random draws alone.
    Behaviours are counted by the family's labeller (`settings.labeller`).

    `batch_alphas` (greedy traces only): every alpha of a problem in one batched generation, one row per
    alpha (the intervention takes one alpha per row; alpha 0 edits nothing), so the whole sweep costs about
    one generation of a batch rather than one generation per alpha: what lets the RISE page's alpha slider
    answer by a lookup. The rows equal the per-alpha generations (tested on a tiny model). Sampled traces
    ignore it: a row's random draws depend on its place in the batch.

    A job's Stop ends the sweep within one model call (`probes.cancel`: the engine checks before each forward;
    a batched grid reports progress only once its one generation ends).

    Example:
        >>> result = steer(engine, problems[:1], vector, "resid_post.2", alphas=[-1, 0, 1],
        ...                batch_alphas=True)  # doctest: +SKIP
        >>> result.traces[1.0][0].text  # the steered trace at alpha 1  # doctest: +SKIP
    """
    alphas = check_steering(alphas, mode)
    model_id = backend.info()["model_id"]
    settings = (settings or HarvestSettings()).resolved(model_id)
    if not problems:
        raise BadInputError("no held-out problems to steer on; ask for n >= 1")
    delimiter = resolve_delimiter(settings.delimiter, model_id)
    counter = behaviour_counter(settings.labeller, delimiter, model_id)
    rows, by_alpha = [], {}
    grid, grid_seconds = {}, 0.0
    if batch_alphas and settings.temperature == 0 and len(alphas) > 1:
        started = time.perf_counter()
        grid = _alpha_grid(backend, problems, vector, site, [float(a) for a in alphas], mode, settings, delimiter,
                           seed, on_progress)
        grid_seconds = (time.perf_counter() - started) / len(alphas)
    for done, alpha in enumerate(alphas):
        ivs = [] if float(alpha) == 0.0 else [steering_intervention(site, vector, float(alpha), mode)]
        traces: list[TraceRecord] = []
        started = time.perf_counter()
        if grid:
            traces = grid[float(alpha)]
        else:
            for lo in range(0, len(problems), settings.batch_size):
                traces += generate_traces(backend, problems[lo:lo + settings.batch_size], settings, delimiter, ivs,
                                          seed=seed + lo)
        by_alpha[float(alpha)] = traces
        counts = [counter(t.text) for t in traces]
        per_trace = [{"problem_id": t.problem.id, "reflection": c["reflection"], "backtracking": c["backtracking"],
                      "steps": len(t.steps), "tokens": t.n_tokens, "correct": bool(t.correct)}
                     for t, c in zip(traces, counts)]
        intervals = {key: bootstrap_interval([float(r[key]) for r in per_trace], seed=seed).to_dict()
                     for key in ("reflection", "backtracking", "steps", "tokens", "correct")}
        rows.append(SteeringRow(
            alpha=float(alpha), n=len(traces),
            mean_reflection_steps=float(np.mean([c["reflection"] for c in counts])),
            mean_backtracking_steps=float(np.mean([c["backtracking"] for c in counts])),
            mean_steps=float(np.mean([len(t.steps) for t in traces])),
            mean_tokens=float(np.mean([t.n_tokens for t in traces])),
            accuracy=float(np.mean([t.correct for t in traces])),
            examples=[t.text for t in traces[:2]],
            generation_seconds=grid_seconds if grid else time.perf_counter() - started,
            intervals=intervals, per_trace=per_trace,
        ))
        if on_progress and not grid:
            on_progress(done + 1, len(alphas))
    return SteeringResult(behaviour, site, mode, rows, [p.id for p in problems], by_alpha, settings.temperature, split)


def _alpha_grid(backend: Backend, problems: Sequence[Problem], vector: torch.Tensor, site: str, alphas: list[float],
                mode: str, settings: HarvestSettings, delimiter: str, seed: int,
                on_progress: Callable[[int, int], None] | None) -> dict[float, list[TraceRecord]]:
    """Greedy traces of every (alpha, problem) pair, one row each, `settings.batch_size` problems times all
    alphas per batched generation; alpha 0 rows edit nothing, so they are the vanilla traces."""
    grid: dict[float, list[TraceRecord]] = {a: [] for a in alphas}
    step = max(1, settings.batch_size // len(alphas))
    chunks = range(0, len(problems), step)
    for done, lo in enumerate(chunks):
        chunk = list(problems[lo:lo + step])
        row_alphas = [a for a in alphas for _ in chunk]
        iv = steering_intervention(site, vector, row_alphas, mode)
        traces = generate_traces(backend, [p for _ in alphas for p in chunk], settings, delimiter, [iv], seed=seed + lo)
        for i, a in enumerate(alphas):
            grid[a] += traces[i * len(chunk):(i + 1) * len(chunk)]
        if on_progress:
            on_progress(done + 1, len(chunks))
    return grid
