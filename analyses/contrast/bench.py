"""Benchmark of the contrast (`thoughtscope bench contrast`), issue 25.

- `contrast_cost`: a contrast over 1,000 stored steps at 3 sites (the difference of means at
  resid_post.1, the head norms of layer 1, a 512-latent SAE at resid_post.0; 1,000 bootstrap
  resamples of the top 20) / the harvest of those steps (greedy generation of toy-reasoner traces,
  cut and read at the 3 sites). Target <= 1.2. Runs on `toy-reasoner:small` (the organism: its
  steps carry kinds) whatever model is asked for.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from analyses.contrast.core import ContrastSettings, ContrastSite, contrast
from analyses.contrast.steps import select, traces_steps
from analyses.organism import organism_problems, rise_label
from analyses.rise.harvest import HarvestSettings, generate_traces
from probes.engine import Engine
from saes.train import SAETrainSettings, make_training_sae

N_STEPS = 1_000


def bench_contrast(n_steps: int = N_STEPS, seed: int = 0) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    engine = Engine.from_id("toy-reasoner:small")
    sites = ["resid_post.0", "resid_post.1", "z.1"]
    settings = HarvestSettings(layers=(1,), prompt="question", labeller="toy-reasoner", max_new_tokens=64,
                               batch_size=64)
    problems = organism_problems(int(n_steps / 3.5), split="dev", size="small", seed=seed)
    started = time.perf_counter()
    traces = []
    for lo in range(0, len(problems), settings.batch_size):
        traces += generate_traces(engine, problems[lo:lo + settings.batch_size], settings, ";")
    for trace in traces:
        for step in trace.steps:
            step.label = rise_label(step.text)
    steps = traces_steps(engine, traces, sites, "toy-reasoner:small dev", batch_size=64)
    harvest_s = time.perf_counter() - started
    sae = make_training_sae(64, SAETrainSettings(d_sae=512, progress=False)).eval()
    in_a, in_b, rule = select(steps, "kind:reflection")
    started = time.perf_counter()
    result = contrast(steps.acts, steps.trace, in_a, in_b,
                      [ContrastSite("direction", "resid_post.1"), ContrastSite("heads", "z.1"),
                       ContrastSite("sae", "resid_post.0", sae)], ContrastSettings(seed=seed), rule=rule)
    contrast_s = time.perf_counter() - started
    return [{"bench": "contrast_cost", "ratio": round(contrast_s / harvest_s, 3), "target": 1.2,
             "contrast_s": round(contrast_s, 3), "harvest_s": round(harvest_s, 3), "steps": len(steps),
             "traces": len(traces), "sites": result.sites, "set_a": int(in_a.sum()), "set_b": int(in_b.sum()),
             "n_significant": result.n_significant, "model": "toy-reasoner:small"}]


def run_contrast_bench(model_id: str = "toy-reasoner:small") -> list[dict[str, Any]]:
    return bench_contrast()


BENCHMARKS = {"contrast": run_contrast_bench}
