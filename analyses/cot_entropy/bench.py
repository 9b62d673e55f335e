"""CoT entropy's benchmarks (`thoughtscope bench cot`): ratios measured side by side in one run."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from analyses.cot_entropy.detector import CalibrationTrace, CotMonitor, CusumDetector
from analyses.cot_entropy.evaluate import evaluate_cot_exit
from analyses.cot_entropy.rules import StoppingRule, run_with_rule
from analyses.families import family_for, task_prompt
from analyses.tasks import load_task
from probes.backend import Backend
from probes.engine import Engine
from probes.server_bench import alternate, served

def bench_cusum_overhead(backend: Backend, *, max_new_tokens: int = 48, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """CUSUM + entropy bookkeeping / plain streaming generation, interleaved in one run (probes excluded).

    The detector is updated once per step end with that step's mean token entropy (a stand-in
    for the probe, whose cost is reported separately as tokens computed by one probed pass).
    """
    family = family_for(backend)
    problem = load_task("arith", 1, seed=seed)[0]
    messages, chat = task_prompt(problem, family)
    rng = np.random.default_rng(seed)
    detector = CusumDetector().fit([CalibrationTrace(list(rng.normal(1.0, 0.2, 4).clip(0)) +
                                                     list(rng.normal(0.3, 0.1, 4).clip(0)),
                                                     ["0"] * 4 + ["1"] * 4, "1") for _ in range(8)])

    def plain() -> int:
        return sum(1 for _ in backend.generate(messages, max_new_tokens=max_new_tokens, chat=chat, top_k=0))

    def instrumented() -> int:
        monitor, start, n = CotMonitor(detector, family), 0, 0
        for rec in backend.generate(messages, max_new_tokens=max_new_tokens, chat=chat, top_k=0):
            n += 1
            for b in monitor.push(rec.entropy, rec.text):
                monitor.observe(float(np.mean(monitor.entropies[start:b])))
                start = b
        return n

    plain()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("instrumented", instrumented)):
            t = time.perf_counter()
            tokens = fn()
            times[name].append((time.perf_counter() - t) / tokens)
    probed = run_with_rule(backend, problem, StoppingRule(probe_step_ends=True), family=family,
                           max_new_tokens=max_new_tokens)
    plain_s, instr_s = float(np.median(times["plain"])), float(np.median(times["instrumented"]))
    return {"bench": "cusum_overhead", "ratio": instr_s / plain_s, "plain_s_per_token": plain_s,
            "instrumented_s_per_token": instr_s, "repeats": repeats, "generated_tokens": probed.generated_tokens,
            "probes": len(probed.probes), "probe_tokens": probed.probe_tokens,
            "probe_tokens_per_generated_token": probed.probe_tokens / max(1, probed.generated_tokens),
            "model": backend.info()["model_id"]}


def bench_server_cot_eval(model_id: str = "smollm2-135m", n: int = 4, n_calibration: int = 4,
                          rounds: int = 2) -> dict[str, Any]:
    """`eval cot-exit` at small n through the model server / in-process, same problems (target <= 1.2)."""
    reports: dict[str, Any] = {}

    def run(name: str, backend: Backend) -> None:
        reports[name] = evaluate_cot_exit(backend, "arith", n, n_calibration, n_calibration, max_new_tokens=48,
                                          batch_size=4, n_resamples=200)

    with served(model_id) as (engine, remote):
        times = alternate({"inproc": lambda: run("inproc", engine), "server": lambda: run("server", remote)}, rounds)
    inproc, server = float(np.median(times["inproc"])), float(np.median(times["server"]))
    same = [m.to_dict(with_results=True)["per_problem"] for m in reports["inproc"].methods] == \
        [m.to_dict(with_results=True)["per_problem"] for m in reports["server"].methods]
    return {"bench": "server_cot_eval", "ratio": round(server / inproc, 3), "target": 1.2, "model": model_id,
            "n": n, "n_calibration": n_calibration, "inproc_s": round(inproc, 3), "server_s": round(server, 3),
            "same_results": same, "rounds": rounds}


def run_cot(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [bench_cusum_overhead(Engine.from_id(model_id)), bench_server_cot_eval(model_id)]


BENCHMARKS = {"cot": run_cot}
