"""RISE's benchmarks (`thoughtscope bench rise`): harvest cost against generation cost, SAE throughput."""

from __future__ import annotations

import time
from typing import Any

from analyses.rise.harvest import HarvestSettings, generate_traces, resolve_delimiter, step_residuals
from analyses.rise.pipeline import default_layers
from analyses.tasks import load_task
from probes.backend import Backend
from probes.engine import Engine
from saes.train import sae_throughput


def bench_harvest(backend: Backend, n: int = 16, layers: tuple[int, ...] | None = None, batch_size: int = 16,
                  max_new_tokens: int = 64) -> dict[str, Any]:
    """Reading the step vectors vs generating the traces, same traces, one process (target <= 0.25)."""
    info = backend.info()
    layers = layers or default_layers(backend.arch().n_layers)
    settings = HarvestSettings(layers=layers, batch_size=batch_size, max_new_tokens=max_new_tokens)
    delimiter = resolve_delimiter("auto", info["model_id"])
    problems = load_task("arith", n, seed=12345)
    started = time.perf_counter()
    traces = []
    for lo in range(0, n, batch_size):
        traces += generate_traces(backend, problems[lo:lo + batch_size], settings, delimiter)
    generation = time.perf_counter() - started
    started = time.perf_counter()
    step_residuals(backend, [t.prompt_ids + t.gen_ids for t in traces],
                   [[len(t.prompt_ids) + s.token for s in t.steps] for t in traces], layers, batch_size=batch_size)
    reading = time.perf_counter() - started
    return {"bench": "rise_harvest", "ratio": reading / generation, "target": 0.25, "model": info["model_id"],
            "n_traces": n, "layers": list(layers), "batch_size": batch_size,
            "n_steps": sum(len(t.steps) for t in traces), "generated_tokens": sum(t.n_tokens for t in traces),
            "generation_s": generation, "harvest_s": reading}


def bench_sae_throughput(d_in: int = 576, n: int = 8192, steps: int = 100, device: str = "cpu") -> dict[str, Any]:
    """SAELens training loop throughput (activations/s) at the embedded model's width."""
    row = sae_throughput(d_in=d_in, n=n, steps=steps, device=device)
    return {"bench": "rise_sae_throughput", **row}


def run_rise(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [bench_harvest(Engine.from_id(model_id), 16), bench_sae_throughput()]


BENCHMARKS = {"rise": run_rise}
