"""Fuzzy concepts' benchmark (`thoughtscope bench fuzzy`): fitting time of the fuzzy layer against semi-NMF.

`fuzzy_fit`: one fit of each on the same 10,000 representations of width 576 (the embedded model's
width), K = 20, one run, side by side in one process; `ratio = fuzzy_seconds / semi_nmf_seconds`
(target <= 1: the rules should cost no more than the dictionary they are compared with). The fuzzy
layer runs all of its 400 steps (`tol=0`: no early stop, the worst case of the defaults); the row also
times a fit with the default early stop (`fuzzy_default_seconds`; on these well-separated clusters it
stops after ~25 steps, since the k-means start is already good). Semi-NMF runs at most 200
coordinate-descent iterations (it stops earlier at its own tolerance). CPU seconds of the process are
reported beside wall seconds, since this machine is shared. The rows are
synthetic (seeded: 20 Gaussian clusters on a 32-dimensional subspace plus isotropic noise), since the
timing depends on the shape, not on where the rows came from; the model id is not used.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from analyses.fuzzy_concepts.baselines import SemiNMFConcepts
from analyses.fuzzy_concepts.metrics import reconstruction_error
from analyses.fuzzy_concepts.rules import FuzzyRuleLayer


def synthetic_representations(n: int = 10_000, width: int = 576, clusters: int = 20, rank: int = 32,
                              seed: int = 0) -> torch.Tensor:
    """Rows from `clusters` Gaussian clusters on a random `rank`-dimensional subspace, plus noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(width, rank, generator=g))[0].T  # [rank, width], orthonormal rows
    centres = 3.0 * torch.randn(clusters, rank, generator=g)
    labels = torch.randint(0, clusters, (n,), generator=g)
    low = centres[labels] + torch.randn(n, rank, generator=g)
    return low @ basis + 0.3 * torch.randn(n, width, generator=g)


def bench_fuzzy_fit(n: int = 10_000, width: int = 576, k: int = 20, steps: int = 400,
                    nmf_max_iter: int = 200) -> dict[str, Any]:
    Z = synthetic_representations(n, width)
    started, cpu = time.perf_counter(), time.process_time()
    fuzzy = FuzzyRuleLayer(n_rules=k, n_features=16, steps=steps, tol=0.0, seed=0).fit(Z)
    fuzzy_s, fuzzy_cpu = time.perf_counter() - started, time.process_time() - cpu
    started, cpu = time.perf_counter(), time.process_time()
    nmf = SemiNMFConcepts(k, alpha=0.05, max_iter=nmf_max_iter, seed=0).fit(Z)
    nmf_s, nmf_cpu = time.perf_counter() - started, time.process_time() - cpu
    started = time.perf_counter()
    default = FuzzyRuleLayer(n_rules=k, n_features=16, steps=steps, seed=0).fit(Z)
    default_s = time.perf_counter() - started
    return {"bench": "fuzzy_fit", "ratio": fuzzy_s / nmf_s, "target": 1.0, "n": n, "width": width, "k": k,
            "fuzzy_seconds": fuzzy_s, "fuzzy_steps_run": fuzzy.n_iter_, "semi_nmf_seconds": nmf_s,
            "fuzzy_default_seconds": default_s, "fuzzy_default_steps_run": default.n_iter_,
            "default_ratio": default_s / nmf_s, "cpu_ratio": fuzzy_cpu / nmf_cpu, "fuzzy_cpu_seconds": fuzzy_cpu,
            "semi_nmf_cpu_seconds": nmf_cpu,
            "semi_nmf_iterations_run": int(getattr(nmf.model_, "n_iter_", -1)),
            "semi_nmf_max_iter": nmf_max_iter, "fuzzy_reconstruction_error": reconstruction_error(fuzzy, Z),
            "semi_nmf_reconstruction_error": reconstruction_error(nmf, Z), "torch_threads": torch.get_num_threads()}


def run_fuzzy(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [bench_fuzzy_fit()]


BENCHMARKS = {"fuzzy": run_fuzzy}
