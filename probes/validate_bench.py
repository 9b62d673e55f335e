"""Benchmarks of the validator (`thoughtscope bench validation`), one JSON row each:

- `validate_s`: the whole validation of a model (every site, three readers, logits vs float32, streamed
  generation), in seconds (target <= 60 s for SmolLM2-135M on a CPU); `ratio` is seconds / 60.
- `badge_overhead`: a trace plus what the app does for its badge (`info()["validation"]`, then
  `probes.validate.badge`, which starts the validation in a thread when none is cached) / the trace alone.
  `first`: the first trace of a model without a cached badge (target <= 1.10); `cached`: once it is cached
  (target 1.00, medians of alternating runs). `concurrent_trace_ratio` says what the background
  validation costs a trace that runs while it does (the CPU is shared; the lock is held one reader pass at a time).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from probes import validate as V
from probes.engine import Engine
from probes.timing import STORY, alternate_pair, sig


def bench_validate_s(engine: Any) -> dict[str, Any]:
    start = time.perf_counter()
    report = V.validate(engine, save=False)
    seconds = time.perf_counter() - start
    return {"bench": "validate_s", "ratio": round(seconds / 60.0, 3), "target": 1.0, "validate_s": sig(seconds),
            "target_s": 60, "sites": len(report.site_verdicts()), "checks": len(report.checks),
            "readers": sorted({c.reader for c in report.checks}), "verdict": report.verdict}


def bench_badge_overhead(engine: Any, repeats: int = 15, first_repeats: int = 3) -> dict[str, Any]:
    ids = (engine.encode(STORY) * 4)[:96]
    n = engine.handle.arch.n_layers
    sites = [f"resid_post.{layer}" for layer in range(n)]

    def trace() -> None:
        engine.trace(ids, capture=sites)

    def with_badge() -> None:
        engine.trace(ids, capture=sites)
        if engine.info()["validation"] is None:
            V.badge(engine, background=True)

    own_dir = V.validation_dir
    plain, firsts, during, background, tmps = [], [], [], [], []
    try:
        for _ in range(first_repeats):  # each time an empty cache: the first trace finds no badge
            tmp = tempfile.mkdtemp(prefix="thoughtscope-badge-bench-")
            tmps.append(tmp)
            V.validation_dir = lambda tmp=tmp: Path(tmp)
            for _ in range(3):
                t0 = time.perf_counter()
                trace()
                plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with_badge()  # the first trace: the badge's validation starts in the background here
            firsts.append(time.perf_counter() - t0)
            started = t0 + firsts[-1]
            while V.badge_running(engine):
                t0 = time.perf_counter()
                trace()
                during.append(time.perf_counter() - t0)
            background.append(time.perf_counter() - started)  # until the badge is cached
        tb, tc = alternate_pair(trace, with_badge, repeats)  # the last cache holds the badge now
    finally:
        V.validation_dir = own_dir
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    first = statistics.median(firsts)
    background_s = statistics.median(background)
    base = statistics.median(plain)
    return {"bench": "badge_overhead", "ratio": round(first / base, 3), "target": 1.10,
            "first_ratio": round(first / base, 3), "cached_ratio": round(statistics.median(tc) / statistics.median(tb), 3),
            "cached_target": 1.00, "trace_s": sig(base), "first_trace_with_badge_s": sig(first),
            "concurrent_trace_ratio": round(statistics.median(during) / base, 3) if during else None,
            "first_repeats": first_repeats, "traces_during_background_validation": len(during),
            "background_validation_s": sig(background_s)}


def run_validation(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    engine = Engine.from_id(model_id)
    torch.manual_seed(0)
    return [bench_validate_s(engine), bench_badge_overhead(engine)]
