"""RLKV gate training as the page runs it: `HeadGateProbe.fit` (what `thoughtscope rlkv train` runs) with one
settings dict, checkpointed in one user-cache folder per model weights and settings, so a stopped run
resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from analyses.rlkv.data import task_problems, training_task
from analyses.rlkv.probe import HeadGateProbe
from probes.backend import Backend
from probes.zoo import user_cache_dir

# `thoughtscope rlkv train` as docs/rlkv.md ran it for the shipped SmolLM2 gates (sink 4, recent 32): the page's
# defaults
SHIPPED_RUN = {"task": "arith", "ops": "+", "n_train": 96, "seed": 0, "steps": 24, "prompts_per_step": 8,
               "group_size": 4, "max_new_tokens": 40, "temperature": 0.4}


def training_folder(fingerprint: str, settings: dict[str, Any]) -> Path:
    """Where a training run with `settings` on the weights `fingerprint` checkpoints (in the user cache)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return user_cache_dir() / "rlkv_runs" / f"{fingerprint}-{digest}"


def train_gates(backend: Backend, settings: dict[str, Any], folder: Path,
                on_progress: Callable[..., None] | None = None) -> Path:
    """Fit the gates with `settings` (task, ops, n_train, seed, steps, prompts_per_step, group_size,
    max_new_tokens, temperature, sink, recent), checkpointing in `folder`; `on_progress("GRPO steps", done,
    total)` after each step. Returns the folder."""
    s = settings
    probe = HeadGateProbe(sink=s["sink"], recent=s["recent"], group_size=s["group_size"], steps=s["steps"],
                          prompts_per_step=s["prompts_per_step"], max_new_tokens=s["max_new_tokens"],
                          temperature=s["temperature"], seed=s["seed"])
    report = on_progress or (lambda *args: None)
    report("GRPO steps", 0, s["steps"])
    probe.fit(backend, task_problems(s["task"], s["n_train"], seed=s["seed"], ops=s["ops"]),
              on_step=lambda done, total, row: report("GRPO steps", done, total), checkpoint_dir=folder,
              task=training_task(s["task"], s["ops"]))
    return folder
