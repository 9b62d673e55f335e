"""Evaluation sweeps beyond one process: the same batches, with the same seeds, on Ray model replicas.

`RayRunner` (analyses.distributed.runner) is what `thoughtscope eval cot-exit|expert-sample --ray`
hands to the evaluation harness; `bench.py` holds the `ray` benchmark group (`ray_eval_speedup`).
"""

from analyses.distributed.runner import RayRunner

__all__ = ["RayRunner"]
