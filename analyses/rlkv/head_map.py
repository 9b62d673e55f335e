"""The RLKV head map (Du et al. 2025): one score per (layer, KV head), learned gates or attention statistics,
binarised by a sparsity into the heads that keep the full cache and those that keep a sink + recent window.

`HeadMap` is what `thoughtscope rlkv map` prints and what the RLKV page draws: both build it here, so the
payload (scores, window, the heads a sparsity keeps, the KV bytes they cost) is made in one place.

    hm = HeadMap.from_gates("runs/rlkv", backend, sink=4, recent=32)     # or HeadMap.from_attention(...)
    hm.full_heads(0.5)          # bool [layers, kv_heads]: the top half by score keep the full cache
    hm.policy(0.5)              # the HeadBudget KV policy a generation runs under
    hm.kv_bytes(0.5, 4096)      # bytes of one sequence's cache at 4,096 tokens (hm.kv_bytes(0.0, n): full)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analyses.rlkv.heads import (LOCAL_HINT, attention_head_scores, full_heads_from_scores, kv_fraction,
                                 problem_texts)
from analyses.rlkv.probe import read_gates
from probes.backend import Backend
from probes.kv_policy import HeadBudget
from thoughtscope import checks

LEARNED, ATTENTION = "learned", "attention"


def bytes_per_entry(backend: Backend) -> int:
    """KV bytes one head stores per token: a key and a value of `head_dim` numbers (2 bytes in a 16-bit dtype,
    else 4)."""
    info = backend.info()
    return 2 * backend.arch().head_dim * (2 if "16" in str(info.get("dtype", "")) else 4)


@dataclass
class HeadMap:
    """Scores [layers, kv_heads] (learned gates, or attention mass outside the window), the local heads' window,
    and where the scores came from. `tiebreak` orders equal scores (the gates' optimiser pressure)."""

    kind: str
    scores: np.ndarray
    sink: int = 4
    recent: int = 32
    bytes_per_entry: int = 4
    tiebreak: np.ndarray | None = None
    log: list[dict[str, Any]] = field(default_factory=list)  # the gates' training log, one row per GRPO step
    gates_file: str | None = None
    trained_on: str | None = None
    n: int | None = None  # traces the attention statistics were read from
    task: str | None = None  # the task those traces solved
    training: dict[str, Any] | None = None  # learned gates: the run's model, fingerprint and settings (its log.json)

    @classmethod
    def from_gates(cls, path: str | Path, backend: Backend, sink: int = 4, recent: int = 32) -> "HeadMap":
        """Learned gates from a `thoughtscope rlkv train` file or folder, checked against the backend's model."""
        sink, recent = checks.window(sink, recent, backend.arch().context_length, hint=LOCAL_HINT)
        found = read_gates(path, backend)
        meta = found["meta"]
        training = {k: meta[k] for k in ("model", "fingerprint", "settings", "task") if k in meta}
        return cls(LEARNED, np.asarray(found["gates"], dtype=np.float32), int(sink), int(recent),
                   bytes_per_entry(backend), found["pressure"], found["log"], found["path"],
                   meta.get("model"), training={**training, "steps": len(found["log"]),
                                                "problems": len(meta.get("problems") or [])})

    @classmethod
    def from_attention(cls, backend: Backend, problems: Sequence[Any], sink: int = 4, recent: int = 32,
                       max_new_tokens: int = 48, progress: Callable[..., None] | None = None,
                       task: str | None = None) -> "HeadMap":
        """Each KV head's attention mass outside its sink + recent window over greedy traces of `problems`
        (of `task`, named in the map; no training). The window is checked before any trace is generated."""
        sink, recent = checks.window(sink, recent, backend.arch().context_length, hint=LOCAL_HINT)
        if progress is not None:
            progress("greedy traces", 0, len(problems))
        texts = problem_texts(backend, problems, max_new_tokens=max_new_tokens)
        scores = attention_head_scores(backend, texts, int(sink), int(recent), progress=progress)
        return cls(ATTENTION, np.asarray(scores, dtype=np.float32), int(sink), int(recent),
                   bytes_per_entry(backend), n=len(problems), task=task)

    def data_name(self) -> str | None:
        """What the scores were read from, for a provenance record: the attention statistics' task, the learned
        gates' training task (named in their log since 2026-12-07), else the count of training problems their
        log lists."""
        if self.task is not None:
            return self.task
        training = self.training or {}
        if training.get("task"):
            return str(training["task"])
        if self.gates_file is not None and training.get("problems"):
            return f"the {training['problems']} training problems listed beside {self.gates_file} (log.json)"
        return None

    def full_heads(self, sparsity: float) -> np.ndarray:
        """bool [layers, kv_heads]: the top (1 - sparsity) fraction by score keeps the full cache."""
        return full_heads_from_scores(self.scores, sparsity, self.tiebreak)

    def policy(self, sparsity: float) -> HeadBudget:
        """The KV policy of this map at `sparsity`: full heads keep everything, the others sink + recent."""
        return HeadBudget(full_heads=self.full_heads(sparsity).tolist(), sink=self.sink, recent=self.recent)

    def kv_fraction(self, sparsity: float, length: int) -> float:
        """KV bytes kept on a sequence of `length` tokens, as a fraction of the full cache."""
        return kv_fraction(self.full_heads(sparsity), length, self.sink, self.recent)

    def kv_bytes(self, sparsity: float, length: int) -> int:
        """KV bytes of one sequence of `length` tokens under this map at `sparsity`."""
        full = self.full_heads(sparsity)
        entries = int(full.sum()) * length + int((~full).sum()) * min(length, self.sink + self.recent)
        return entries * self.bytes_per_entry

    def memory(self, sparsity: float, max_length: int = 4096) -> dict[str, Any]:
        """The data of the page's memory figure (`app.figures.rlkv.memory_figure`)."""
        return {"full_heads": self.full_heads(sparsity).tolist(), "sink": self.sink, "recent": self.recent,
                "bytes_per_entry": self.bytes_per_entry, "max_length": max_length}

    def to_dict(self, sparsity: float | None = None) -> dict[str, Any]:
        """The map as JSON (with the heads `sparsity` keeps full, when given); the training log apart."""
        out: dict[str, Any] = {"kind": self.kind, "scores": self.scores.tolist(), "sink": self.sink,
                               "recent": self.recent, "bytes_per_entry": self.bytes_per_entry}
        for name in ("gates_file", "trained_on", "n", "task"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tiebreak is not None:
            out["tiebreak"] = np.asarray(self.tiebreak).tolist()
        if sparsity is not None:
            out.update(full_heads=self.full_heads(sparsity).tolist(), sparsity=sparsity)
        return out
