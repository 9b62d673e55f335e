"""The `toy-reasoner` model organism seen from the methods: its problems as a task, its labeller as
RISE's judge, and the settling step of a trace (issue 11).

`probes.toys.reasoner` trains the organism and owns its generator and labeller; this module is the
thin adapter the analyses use, so they never parse the trace format themselves:

- `organism_problems(n, split, seed, size)`: generator examples as `analyses.tasks.Problem`s whose
  `meta` keeps the ground truth (the planted trace, each step's kind, the settling step);
- `step_kinds(text)`: the generator's own labeller on any continuation (compute / reflection /
  backtrack / redundant / other); `rise_label(step_text)`: the same as a RISE judge
  (reflection / backtracking / other);
- `settling_index(kinds)`: the step after which the answer is fixed (the last compute or
  backtrack step), for generated traces whose planted truth is unknown;
- `behaviour_counts(text)`: steps of each kind in one trace (what steering moves).

Example:
    >>> p = organism_problems(1, split="eval", size="small")[0]
    >>> p.meta["kinds"] == step_kinds(p.meta["trace"]) and p.meta["settle_step"] == settling_index(p.meta["kinds"])
    True
    >>> rise_label("Wait , let me check : 3 + 4 = 7 ;"), rise_label("No , that is wrong . 3 + 4 = 7 ;")
    ('reflection', 'backtracking')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from analyses.problem import Problem
from thoughtscope.errors import BadInputError

NAME = "toy-reasoner"
SIZES = ("full", "small")
SPLITS = {"calibration": "calibration", "development": "dev", "evaluation": "eval", "dev": "dev", "eval": "eval",
          "train": "train"}
KIND_TO_RISE = {"reflection": "reflection", "backtrack": "backtracking"}


def _reasoner():
    from probes.toys import reasoner  # torch: drawn only when organism problems are, so analyses.tasks stays torch-free

    return reasoner


def size_of(model_or_task: str) -> str:
    """`toy-reasoner` -> full, `toy-reasoner:small` -> small (a model id or a task name)."""
    name, _, size = str(model_or_task).partition(":")
    if name != NAME:
        raise BadInputError(f"{model_or_task!r} is not the {NAME} organism")
    size = size or "full"
    if size not in SIZES:
        raise BadInputError(f"{NAME} comes in sizes {', '.join(SIZES)}, not {size!r}")
    return size


def is_organism(model_or_task: Any) -> bool:
    text = model_or_task if isinstance(model_or_task, str) else model_or_task.info()["model_id"]
    return str(text).split(":", 1)[0] == NAME


def step_kinds(text: str) -> list[str]:
    """The kind of every step of a continuation, by the generator's labeller (`reasoner.label_steps`)."""
    return [kind for _, kind in _reasoner().label_steps(text)]


def rise_label(step_text: str) -> str:
    """RISE's label of one step read by the organism's labeller: reflection, backtracking or other."""
    return KIND_TO_RISE.get(_reasoner().step_kind(step_text), "other")


def settling_index(kinds: Sequence[str]) -> int | None:
    """Index of the step that fixes the answer: the last compute or backtrack step (None if none)."""
    hits = [i for i, k in enumerate(kinds) if k in ("compute", "backtrack")]
    return hits[-1] if hits else None


def behaviour_counts(text: str) -> dict[str, int]:
    """Steps of each kind in one continuation (reflection, backtrack, compute, redundant, other)."""
    counts = Counter(step_kinds(text))
    return {k: counts.get(k, 0) for k in (*_reasoner().KINDS, _reasoner().OTHER)}


def check_split(split: str) -> None:
    """One of the generator's own splits, or a clear error (before any model work)."""
    if split not in SPLITS:
        raise BadInputError(f"split {split!r}; use one of calibration, dev, eval")


def organism_problems(n: int, split: str = "eval", seed: int = 0, size: str = "full") -> list[Problem]:
    """`n` problems of one of the generator's own splits (train, calibration, dev, eval: disjoint by
    construction), each with its planted trace and ground truth in `meta`."""
    r = _reasoner()
    check_split(split)
    gen_split = SPLITS[split]
    if size not in SIZES:
        raise BadInputError(f"{NAME} comes in sizes {', '.join(SIZES)}, not {size!r}")
    out = []
    for i, ex in enumerate(r.examples(n, seed=seed, split=gen_split, config=r.task_config(size))):
        kinds = [s.kind for s in ex.steps]
        out.append(Problem(
            id=f"{NAME}-{gen_split}-s{seed}-{i:04d}", question=ex.problem.question, answer=str(ex.answer),
            source=NAME if size == "full" else f"{NAME}:{size}", steps=len(ex.problem.ops),
            meta={"split": gen_split, "trace": ex.trace, "kinds": kinds, "settle_step": ex.settle_step,
                  "hard_steps": ex.hard_steps, "size": size}))
    return out
