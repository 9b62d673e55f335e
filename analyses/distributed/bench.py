"""`thoughtscope bench ray`: `ray_eval_speedup`, serial / 2 Ray replicas for `eval cot-exit` at small n.

Both sides run one torch thread (the replicas: one each), on the same problems, batches and seeds,
so they compute the same report (`same_results`); the replicas are started and warmed before the
clock starts (their start-up is reported apart, `start_s`). The machine's load average is recorded:
on a shared machine two replica processes also win a larger share of the CPUs than one process.
"""

from __future__ import annotations

import os
import time
from typing import Any

from analyses.cot_entropy import evaluate_cot_exit
from analyses.distributed.runner import RayRunner
from probes.backend import Backend, open_backend


def warm(backend: Backend, _: Any) -> int:
    """One short generation on a replica, so neither side's clock holds first-call set-up."""
    return sum(1 for _ in backend.generate("1 + 1 =", max_new_tokens=2))


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in ("seconds", "created")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def bench_ray_eval_speedup(model_id: str = "smollm2-135m", n: int = 8, n_calibration: int = 4, n_dev: int = 4,
                           max_new_tokens: int = 48, batch_size: int = 2, replicas: int = 2) -> dict[str, Any]:
    """Wall time of `evaluate_cot_exit` in this process (one thread) / on `replicas` Ray actors (one thread each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, n_resamples=500)
    load_before = os.getloadavg()
    try:
        engine = open_backend(model_id)
        warm(engine, None)
        t0 = time.perf_counter()
        serial = evaluate_cot_exit(engine, "arith", n, n_calibration, n_dev, **kw)
        serial_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with RayRunner(model_id, replicas=replicas, threads=1) as runner:
            runner.map(warm, [None] * replicas)
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            sharded = evaluate_cot_exit(engine, "arith", n, n_calibration, n_dev, runner=runner, **kw)
            ray_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    same = without_timings(serial.to_dict()) == without_timings(sharded.to_dict())
    return {"bench": "ray_eval_speedup", "ratio": round(serial_s / ray_s, 3), "target": 1.5, "higher_is_better": True,
            "model": model_id, "n": n, "n_calibration": n_calibration, "n_dev": n_dev,
            "max_new_tokens": max_new_tokens, "batch_size": batch_size, "replicas": replicas,
            "threads_per_replica": 1, "serial_s": round(serial_s, 2), "ray_s": round(ray_s, 2),
            "start_s": round(start_s, 2), "same_results": same, "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def run_ray(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [bench_ray_eval_speedup(model_id)]


BENCHMARKS = {"ray": run_ray}
