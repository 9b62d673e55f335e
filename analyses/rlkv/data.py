"""The problems RLKV trains and evaluates on: a task of `analyses.tasks`, optionally one operator only.

The embedded SmolLM2-135M solves additions with a worked example far more often than subtractions
(docs/rlkv.md has the measured figures), so an RL probe with a 0/1 reward learns more per step on
additions (`ops="+"`): more groups of samples then hold both right and wrong answers. Training and evaluation problems come from different
seeds, and evaluation drops every problem whose question the gates were trained on (`exclude`), so
the two never share a problem whatever the seeds.

Example:
    >>> [p.meta["ops"] for p in task_problems("arith", 3, seed=0, ops="+")]
    [['+'], ['+'], ['+']]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from analyses.tasks import arithmetic_problems, load_task
from thoughtscope.errors import BadInputError

OPS_TASKS = ("arith", "arith2")


def parse_ops(ops: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """`"+"`, `"+-"`, `"+,-"` or None (every operator the task has) -> a tuple of operators."""
    if ops is None or ops == "":
        return None
    chars = [c for c in (ops if isinstance(ops, str) else "".join(ops)) if c not in ", "]
    if not chars or any(c not in "+-" for c in chars):
        raise BadInputError(f"ops takes + and/or -, got {ops!r}")
    return tuple(dict.fromkeys(chars))


def training_task(task: str, ops: str | None) -> str:
    """The training data's name in a gates log and a head map's provenance: the task, with its operators."""
    return f"{task} ops={ops}" if ops else task


def task_problems(task: str, n: int, seed: int = 0, ops: str | Iterable[str] | None = None,
                  exclude: Iterable[str] = ()) -> list[Any]:
    """`n` problems of `task` (seeded), restricted to `ops` for the arithmetic tasks, none of whose
    questions is in `exclude`."""
    chosen = parse_ops(ops)
    if chosen is not None and task not in OPS_TASKS:
        raise BadInputError(f"--ops applies to {', '.join(OPS_TASKS)}; task {task!r} has its own problems")
    skip = set(exclude)
    want = n + len(skip)

    def draw(k: int) -> list[Any]:
        if chosen is not None:
            return arithmetic_problems(k, steps=1 if task == "arith" else 2, seed=seed, ops=chosen)
        return load_task(task, k, seed=seed)

    found = [p for p in draw(want) if p.question not in skip][:n]
    if len(found) < n:
        raise BadInputError(f"only {len(found)} {task} problems are left after excluding the training problems; "
                            "ask for fewer")
    return found
