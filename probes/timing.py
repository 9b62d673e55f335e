"""What the benchmark modules share: timing two or more sides in alternation, and printed figures.

A leaf of `probes` (standard library only): `probes.bench`, `probes.server_bench`,
`probes.validate_bench` and the method packages' `bench.py` all import it, so none of them imports
another benchmark module for a helper (the circle `probes.bench` <-> `probes.server_bench`).

These machines are noisy: each pair is timed A, B, A, B, ... after one warm-up each and compared
by medians, so a slow moment hits both sides.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

STORY = "Write a long, detailed story about a dragon who learns to count. Begin with the dragon's childhood."


def sig(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits: a millisecond forward on a fast machine keeps its precision,
    so a ratio recomputed from the printed times matches the printed ratio (fixed decimals would not)."""
    return float(f"{x:.{digits}g}")


def synchronize() -> None:
    """Wait for queued GPU work, so a clock read after a CUDA forward counts its kernels, not their launch
    (benchmarks.gpu); nothing on a CPU (torch is looked up, not imported: this module stays a leaf)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def clock() -> float:
    synchronize()
    return time.perf_counter()


def alternate_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
    """Time a and b in alternation after one warm-up each; return both lists of seconds."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        t0 = clock()
        a()
        ta.append(clock() - t0)
        t0 = clock()
        b()
        tb.append(clock() - t0)
    return ta, tb


def alternate(sides: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each side per round, run in alternation in a worker thread (as the server runs them)."""
    times: dict[str, list[float]] = {name: [] for name in sides}

    def run() -> None:
        for fn in sides.values():  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in sides.items():
                start = clock()
                fn()
                times[name].append(clock() - start)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()
    return times
