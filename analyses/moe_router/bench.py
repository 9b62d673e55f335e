"""The MoE router method's benchmarks (`thoughtscope bench moe`): ratios measured side by side in one run.

`expert_sample_overhead`: tokens/s of greedy generation / tokens/s of the same generation with Expert-Sample at
every MoE layer (greedy tokens): 16 different problems in one batch, the two sides timed in alternation
(target <= 1.10). Both sides route 16 different token streams, so the ratio is the rule's own cost.

`expert_sample_overhead_same_prompt` (no target): 16 samples of one prompt, as `eval expert-sample` draws them.
Greedy's 16 rows are identical and share one set of experts per layer, while Expert-Sample's rows use
different experts, so the MoE block computes more experts per step: this ratio adds that cost of diversity
to the rule's. `expert_sample_overhead_batch1` (no target): one sequence, where the rule's fixed cost per
layer is the largest share.

Where the time goes, in two more figures: `router_rule_overhead` (no target) times the identity rule
(`TopK()` with the model's own k, through the same replaced router forward) against greedy: the price of
routing by a rule at all. And each Expert-Sample row reports `distinct_experts_per_step` for both sides
(experts the MoE block computes per layer and decode step, over the batch): sampled tails spread the batch
over more experts, and the grouped expert kernels pay per expert group, which is the cost of diversity
itself rather than of the rule. `expert_sample_cold_overhead` (no target) runs the whole Expert-Sample code
path at T_e = 1e-4, where the drawn tail is the model's own next ranks (so, up to near-ties, the same experts
as greedy): the rule's operations without the cost of diversity.

`ratio` is wall-clock tokens/s (medians over the alternated rounds); `cpu_ratio` is the same quotient of the
worker thread's own CPU time (medians, warm-up run left out), which a loaded shared machine moves less;
`load_1min` is the load average before and after the rounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from analyses.moe_router.evaluate import ExpertSetting, require_moe
from analyses.moe_router.problems import load_items
from probes.backend import Backend
from probes.bench import sig
from probes.engine import Engine
from probes.routing import TopK
from probes.server_bench import alternate

TARGET = 1.10


def bench_expert_sample_overhead(backend: Backend, *, n_problems: int = 16, n_samples: int = 1, max_new_tokens: int = 32,
                                 rounds: int = 25, setting: Any = None, seed: int = 0,
                                 name: str = "expert_sample_overhead", target: float | None = TARGET,
                                 identity: bool = False) -> dict[str, Any]:
    """Greedy tokens/s over Expert-Sample tokens/s (same prompts, batch of `n_problems` x `n_samples`, same
    length limit); medians over `rounds`. `identity` times the identity rule (`TopK()`) instead."""
    arch = require_moe(backend)
    k = arch.experts_top_k
    setting = setting or ExpertSetting(max(1, k // 2), min(arch.n_experts - max(1, k // 2), 2 * k), 1.0)
    rule = setting.check(k).rule(seed)
    items = load_items("auto", "development", n_problems, backend=backend)
    tokens: dict[str, int] = {}
    cpu: dict[str, list[float]] = {}  # the worker thread's CPU seconds per run: what other load moves least

    def side(label: str, interventions: list[Any]):
        def run() -> None:
            start = time.thread_time()
            tokens[label] = sum(1 for _ in backend.generate(prompts=[it.prompt for it in items], chat=items[0].chat,
                                                            n_samples=n_samples,
                                                            max_new_tokens=max_new_tokens, top_k=0, seed=seed,
                                                            stop=[], interventions=interventions))
            cpu.setdefault(label, []).append(time.thread_time() - start)
        return run

    def distinct_experts(interventions: list[Any]) -> float:
        """Mean number of distinct experts per MoE layer and decode step over the batch (one untimed run)."""
        layers = getattr(arch, "moe_layers", None) or range(arch.n_layers)
        used: dict[tuple[int, int], set[int]] = {}
        for rec in backend.generate(prompts=[it.prompt for it in items], chat=items[0].chat, n_samples=n_samples,
                                    max_new_tokens=max_new_tokens, top_k=0, seed=seed, stop=[],
                                    capture=[f"experts.{layer}" for layer in layers], interventions=interventions):
            for layer in layers:
                used.setdefault((rec.step, layer), set()).update(rec.activations[f"experts.{layer}"].tolist())
        return round(float(np.mean([len(v) for v in used.values()])), 2)

    sides = {"greedy": side("greedy", [])}
    if identity:
        sides["identity"] = side("identity", [TopK()])
    else:
        sides["expert_sample"] = side("expert_sample", [rule])
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    times = alternate(sides, rounds)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    other = "identity" if identity else "expert_sample"
    greedy_tps = tokens["greedy"] / float(np.median(times["greedy"]))
    other_tps = tokens[other] / float(np.median(times[other]))
    cpu_ratio = (float(np.median(cpu[other][1:])) / tokens[other]) / (float(np.median(cpu["greedy"][1:])) / tokens["greedy"])
    row = {"bench": name, "ratio": round(greedy_tps / other_tps, 3), "greedy_tokens_per_s": sig(greedy_tps),
           f"{other}_tokens_per_s": sig(other_tps), "cpu_ratio": round(cpu_ratio, 3),
           "n_problems": n_problems, "n_samples": n_samples,
           "max_new_tokens": max_new_tokens, "tokens": dict(tokens), "rounds": rounds, "model": backend.info()["model_id"],
           "load_1min": [None if v is None else round(v, 1) for v in (load_before, load_after)]}
    if not identity:
        row["setting"] = setting.to_dict()
        row["distinct_experts_per_step"] = {"greedy": distinct_experts([]), "expert_sample": distinct_experts([rule]),
                                            "experts": arch.n_experts, "top_k": k}
    if target is not None:
        row["target"] = target
    return row


def run_moe(model_id: str = "toy-moe") -> Iterator[dict[str, Any]]:
    """Each row as soon as it is measured (`thoughtscope bench` prints it then)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a shared machine's other load moves both sides alike
    try:
        engine = Engine.from_id(model_id)
        arch = engine.arch()
        k = arch.experts_top_k
        k_h = max(1, k // 2)
        cold = ExpertSetting(k_h, min(arch.n_experts - k_h, 2 * k), 1e-4)
        yield bench_expert_sample_overhead(engine)
        yield bench_expert_sample_overhead(engine, identity=True, target=None, name="router_rule_overhead")
        yield bench_expert_sample_overhead(engine, setting=cold, target=None, name="expert_sample_cold_overhead")
        yield bench_expert_sample_overhead(engine, n_problems=1, n_samples=16, target=None,
                                           name="expert_sample_overhead_same_prompt")
        yield bench_expert_sample_overhead(engine, n_problems=1, name="expert_sample_overhead_batch1", target=None)
    finally:
        torch.set_num_threads(threads)


BENCHMARKS = {"moe": run_moe}
