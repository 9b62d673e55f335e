"""Shipped results of CoT entropy phases: the calibration the page opens on (`thoughtscope ship cot-calibration`).

The page's default calibration (the task's first 12 calibration problems, greedy, 48 tokens, KDE
densities) with CUSUM's h chosen on 12 development problems (`analyses.cot_entropy.calibration`),
made seeded and on one thread so the same command gives the same file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from analyses.cot_entropy.calibration import PAGE_H_GRID, PageCalibration, calibrate
from analyses.families import default_task, family_for
from probes.backend import Backend
from probes.engine import Engine
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "cot-calibration"
FILE = "calibration.json"
# the page's defaults (app/views/cot_entropy.py and the sidebar's 48 tokens, seed 0)
DEFAULTS = {"n_calibration": 12, "n_development": 12, "max_new_tokens": 48, "seed": 0, "density": "kde", "bins": 10,
            "h_grid": list(PAGE_H_GRID), "tolerance": 0.02, "batch_size": 4}


def _terminal_progress(stage: str, done: int, total: int, _last: dict[str, Any] = {}) -> None:  # noqa: B006
    if _last.get("at") != (stage, done):
        _last["at"] = (stage, done)
        print(f"\r{stage}: {done}/{total} traces", end="\n" if done == total else "", file=sys.stderr, flush=True)


def build_calibration(backend: Backend, on_progress=None, **overrides: Any) -> tuple[PageCalibration, dict[str, Any]]:
    """The page's default calibration on `backend` (plus its provenance record)."""
    settings = {**DEFAULTS, **overrides}
    info = backend.info()
    task = default_task(info["model_id"])
    result = calibrate(backend, task, family_for(info["model_id"]), on_progress=on_progress, **settings)
    record = provenance(info, data=task, split="calibration (h chosen on development)", seed=settings["seed"],
                        settings=result.settings, command="ship cot-calibration")
    return result, record


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None) -> Path:
    torch.manual_seed(0)
    engine = Engine.from_id(model_id)
    started = time.perf_counter()
    result, record = build_calibration(engine, on_progress=_terminal_progress)
    seconds = time.perf_counter() - started
    return shipped.write(NAME, model_id, engine.info()["fingerprint"], {FILE: result.to_json()}, command=command,
                         provenance=record, root=root, build_seconds=round(seconds, 1))


SHIPPED = {NAME: ("smollm2-135m", build)}
