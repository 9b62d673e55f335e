"""The `Problem` type: one question with a checkable answer, shared by the task sources.

A leaf module (the standard library only), so that `analyses.tasks`, which loads every task,
and `analyses.organism`, which makes the organism's problems, both use it without importing
each other in a circle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One question with a single canonical numeric answer.

    `answer` is already normalised (``"18"``, not ``"18.0"`` or ``"$18"``), so two problems
    compare by string. `meta` holds what made the problem (operands and operators for the
    generated ones) so tests and analyses can recompute the answer; it is left out of the hash
    because a dict cannot be hashed.
    """

    id: str
    question: str
    answer: str
    source: str
    steps: int
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        return cls(**data)
