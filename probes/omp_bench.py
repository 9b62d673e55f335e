"""`thoughtscope bench omp`: model work on a worker thread, with OpenMP's default wait and with the
spin `thoughtscope.omp` sets, side by side (see that module for why the default is slow there).

libgomp reads its variables once, when torch loads it, so each side is a child process that loads the
model on its main thread (as the server and the app do) and then, on each "go", runs one batched
greedy generation in a fresh thread (the server starts a thread per request) or, on "main", on its
main thread. The parent alternates the two children round by round and compares medians, so a slow
moment of the machine hits both. Torch keeps its default thread count: the setting only matters with
more than one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from probes.server_bench import server_log
from thoughtscope.omp import SPIN

CHILD = r"""
import json, sys, threading, time
import torch
from probes.engine import Engine
engine = Engine.from_id(sys.argv[1])
prompts = ["The dragon counted to ten, then to twenty, and then"] * int(sys.argv[2])
def run():
    return sum(1 for _ in engine.generate(prompts=prompts, max_new_tokens=int(sys.argv[3]), top_k=0, seed=0, stop=[]))
print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
for line in sys.stdin:
    out = {}
    def timed():
        t0 = time.perf_counter(); out["tokens"] = run(); out["s"] = time.perf_counter() - t0
    if line.strip() == "main":
        timed()
    else:
        worker = threading.Thread(target=timed); worker.start(); worker.join()
    print(json.dumps(out), flush=True)
"""


def _child(model_id: str, spin: bool, rows: int, new_tokens: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in SPIN}
    env["HF_HUB_OFFLINE"] = "1"
    if spin:
        env.update(SPIN)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, model_id, str(rows), str(new_tokens)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _died(proc: subprocess.Popen, what: str) -> RuntimeError:
    return RuntimeError(f"the benchmark child exited with code {proc.wait()} {what}: {server_log(proc)[-1500:]}")


def _ask(proc: subprocess.Popen, what: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise _died(proc, f"on {what!r}")
    return json.loads(line)


def bench_omp_worker(model_id: str, rows: int = 8, new_tokens: int = 24, rounds: int = 7) -> dict[str, Any]:
    """Worker-thread seconds per generation with libgomp's default wait / with `SPIN` (the speed-up the
    setting buys), and both sides' main-thread seconds beside them."""
    sides = {"default": _child(model_id, False, rows, new_tokens), "spin": _child(model_id, True, rows, new_tokens)}
    try:
        threads = {}
        for name, proc in sides.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise _died(proc, f"({name}) before it was ready")
            threads[name] = json.loads(line)["threads"]
        times: dict[str, list[float]] = {f"{n}_{where}": [] for n in sides for where in ("worker", "main")}
        for name, proc in sides.items():  # warm-up
            _ask(proc, "worker"), _ask(proc, "main")
        for _ in range(rounds):
            for where in ("worker", "main"):
                for name, proc in sides.items():
                    times[f"{name}_{where}"].append(_ask(proc, where)["s"])
    finally:
        for proc in sides.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.log.close()  # type: ignore[attr-defined]
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"bench": "omp_worker_speedup", "ratio": round(med["default_worker"] / med["spin_worker"], 3),
            **{f"{k}_s": round(v, 4) for k, v in med.items()},
            "default_worker_over_main": round(med["default_worker"] / med["default_main"], 3),
            "spin_worker_over_main": round(med["spin_worker"] / med["spin_main"], 3),
            "model": model_id, "rows": rows, "new_tokens": new_tokens, "rounds": rounds,
            "torch_threads": threads["default"], "setting": SPIN, "cores": os.cpu_count(),
            "note": "ratio: default worker-thread seconds / spin worker-thread seconds (> 1: the setting helps)"}


def run_omp(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [bench_omp_worker(m) for m in dict.fromkeys([model_id, "toy-moe"])]


BENCHMARKS = {"omp": run_omp}
