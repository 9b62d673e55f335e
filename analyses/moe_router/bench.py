"""The MoE router method's benchmarks (`thoughtscope bench moe`): ratios measured side by side in one run.

`expert_sample_overhead`: tokens/s of greedy generation / tokens/s of the same generation with Expert-Sample at
every MoE layer (greedy tokens): 16 different problems in one batch, the two sides timed in alternation
(target <= 1.10). Both sides route 16 different token streams, so the ratio is the rule's own cost.

`expert_sample_overhead_same_prompt` (no target): 16 samples of one prompt, as `eval expert-sample` draws them.
Greedy's 16 rows are identical and share one set of experts per layer, while Expert-Sample's rows use
different experts, so the MoE block computes more experts per step: this ratio adds that cost of diversity
to the rule's. `expert_sample_overhead_batch1` (no target): one sequence, where the rule's fixed cost per
layer is the largest share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from probes.bench import sig

TARGET = 1.10


def bench_expert_sample_overhead(backend: Any, *, n_problems: int = 16, n_samples: int = 1, max_new_tokens: int = 32,
                                 rounds: int = 7, setting: Any = None, seed: int = 0,
                                 name: str = "expert_sample_overhead", target: float | None = TARGET) -> dict[str, Any]:
    """Greedy tokens/s over Expert-Sample tokens/s (same prompts, batch of `n_problems` x `n_samples`, same
    length limit); medians over `rounds`."""
    from analyses.moe_router.evaluate import ExpertSetting, require_moe
    from analyses.moe_router.problems import load_items
    from probes.server_bench import alternate

    arch = require_moe(backend)
    k = arch.experts_top_k
    setting = setting or ExpertSetting(max(1, k // 2), min(arch.n_experts - max(1, k // 2), 2 * k), 1.0)
    rule = setting.check(k).rule(seed)
    items = load_items("auto", "development", n_problems, backend=backend)
    tokens: dict[str, int] = {}

    def side(label: str, interventions: list[Any]):
        def run() -> None:
            tokens[label] = sum(1 for _ in backend.generate(prompts=[it.prompt for it in items], chat=items[0].chat,
                                                            n_samples=n_samples,
                                                            max_new_tokens=max_new_tokens, top_k=0, seed=seed,
                                                            stop=[], interventions=interventions))
        return run

    times = alternate({"greedy": side("greedy", []), "expert_sample": side("expert_sample", [rule])}, rounds)
    greedy_tps = tokens["greedy"] / float(np.median(times["greedy"]))
    es_tps = tokens["expert_sample"] / float(np.median(times["expert_sample"]))
    row = {"bench": name, "ratio": round(greedy_tps / es_tps, 3), "greedy_tokens_per_s": sig(greedy_tps),
           "expert_sample_tokens_per_s": sig(es_tps), "n_problems": n_problems, "n_samples": n_samples, "max_new_tokens": max_new_tokens,
           "tokens": dict(tokens), "rounds": rounds, "setting": setting.to_dict(), "model": backend.info()["model_id"]}
    if target is not None:
        row["target"] = target
    return row


def run_moe(model_id: str = "toy-moe") -> list[dict[str, Any]]:
    import torch

    from probes.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a shared machine's other load moves both sides alike
    try:
        engine = Engine.from_id(model_id)
        return [bench_expert_sample_overhead(engine),
                bench_expert_sample_overhead(engine, n_problems=1, n_samples=16, target=None,
                                             name="expert_sample_overhead_same_prompt"),
                bench_expert_sample_overhead(engine, n_problems=1, name="expert_sample_overhead_batch1", target=None)]
    finally:
        torch.set_num_threads(threads)


BENCHMARKS = {"moe": run_moe}
