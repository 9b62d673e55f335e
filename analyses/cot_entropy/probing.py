"""Intermediate-answer probes: fork a prefix state, append the family's answer-forcing suffix, decode.

A probe at step i costs only its suffix and its answer tokens: the prefix is a state the backend
holds (in this process or on the model server), and a fork never changes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analyses.families import ModelFamily
from analyses.tasks import extract_answer
from probes.backend import Backend

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


def probe_answer(backend: Backend, state: Any, family: ModelFamily, token_index: int, at: int | None = None) -> Probe:
    """Fork `state` (or its first `at` tokens), append the family's answer-forcing suffix, decode greedily."""
    suffix_ids = backend.encode(family.answer_suffix, add_special_tokens=False)
    records = backend.fork(state, list(suffix_ids), max_new_tokens=family.answer_max_tokens,
                           top_k=0, stop=family.answer_stop, at=at)
    return Probe.from_records(records, token_index, len(suffix_ids), backend.eos_ids())


def probe_positions(backend: Backend, prompt_ids: Sequence[int], token_ids: Sequence[int],
                    positions: Iterable[int], family: ModelFamily,
                    between: Callable[[], None] | None = None) -> dict[int, Probe]:
    """Probes of a finished trace at each position: one prefill of the longest prefix, then one fork
    per position from its first `prompt + position` tokens (the prefix is never recomputed).
    `between()` runs before each model call (a job's Stop check: it may raise to end the work there)."""
    wanted = sorted({int(b) for b in positions if 0 < b <= len(token_ids)})
    if not wanted:
        return {}
    prompt_ids, token_ids = list(prompt_ids), list(token_ids)
    if between:
        between()
    state = backend.prefill(prompt_ids + token_ids[: wanted[-1]])
    try:
        out = {}
        for b in wanted:
            if between:
                between()
            out[b] = probe_answer(backend, state, family, b, at=len(prompt_ids) + b)
        return out
    finally:
        backend.free(state)


class LivePrefix:
    """The prefix state of a trace being generated, extended step by step (only new tokens computed)."""

    def __init__(self, backend: Backend, prompt_ids: Sequence[int]):
        self.backend, self.prompt_ids, self.state = backend, list(prompt_ids), None

    def at(self, token_ids: Sequence[int]) -> Any:
        """The state of the prompt followed by `token_ids` (the generated tokens up to a step end)."""
        old = self.state
        self.state = self.backend.prefill(self.prompt_ids + list(token_ids), base=old)
        if old is not None:
            self.backend.free(old)
        return self.state

    def close(self) -> None:
        if self.state is not None:
            self.backend.free(self.state)
            self.state = None
