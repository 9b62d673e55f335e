"""Decoding settings (`Sampling`): a leaf of `probes`, so the engine and its checker (`probes.validate`)
both use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from thoughtscope import checks
from thoughtscope.errors import BadInputError

# below this a temperature only approaches greedy decoding, and logits / T overflow float32 (|logit| ~ 1e2 / 1e-37)
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. temperature 0 is greedy; otherwise top-k then top-p filtering."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        checks.number("temperature", self.temperature, low=0, why="0 is greedy")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise BadInputError(f"temperature {self.temperature:g} is above 0 but below {MIN_TEMPERATURE:g}: the "
                                "logits divided by it overflow float32; use 0 for greedy decoding")
        checks.number("top_p", self.top_p, low=0, high=1, low_open=True)
        checks.integer("top_k", self.top_k, low=0, why="0 keeps every token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        return "greedy" if self.greedy else f"T={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k}"
