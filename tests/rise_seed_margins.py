"""Measure the organism RISE steering test's outcome over several seeds (issue 20, item 8).

`tests/test_rise.py::test_rise_on_the_organism_separates_behaviours_and_steering_moves_the_reflection_rate`
runs `evaluate_rise_organism` on the shipped `toy-reasoner:small` with seed 0 and asserts on the paired
reflection-rate difference between alpha = +0.4 and -0.4. This script runs the same call for seeds 0..N-1
(the seed draws the harvest's sampled traces, the SAEs' init and the steered samples; the organism's
weights are the shipped file, the same on every machine) and writes every outcome, so the test's
thresholds are the measured spread with a margin, not one lucky run:

    OMP_NUM_THREADS=1 .venv/bin/python tests/rise_seed_margins.py --seeds 5   # -> tests/data/rise_seed_margins.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(seed: int) -> dict:
    import torch

    from analyses.evaluation import wilcoxon_test
    from analyses.rise.evaluate import evaluate_rise_organism
    from probes.engine import Engine

    torch.set_num_threads(1)
    organism = Engine.from_id("toy-reasoner:small")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.process_time()
        d = evaluate_rise_organism(organism, n_harvest=300, n_steer=40, alphas=(-0.4, 0.0, 0.4), mode="add",
                                   layer=1, saes=str(Path(tmp) / "saes"), store=str(Path(tmp) / "store"), seed=seed,
                                   control=False).to_dict()
        cpu = time.process_time() - t0
    rows = {r["alpha"]: r for r in d["steering"]["reflection"]["rows"]}
    up = wilcoxon_test([t["reflection"] for t in rows[0.4]["per_trace"]],
                       [t["reflection"] for t in rows[-0.4]["per_trace"]], lower_is_better=False)
    return {"seed": seed, "cpu_seconds": round(cpu, 1), "fingerprint": organism.info()["fingerprint"],
            "label_counts": d["harvest"]["label_counts"],
            "heldout_ev_min": min(r["quality"]["heldout"]["explained_variance"] for r in d["layers"]),
            "probe_auroc_reflection_min": min(r["probe_auroc_kinds"]["reflection"] for r in d["layers"]),
            "latent_auroc_reflection_max": max(r["auroc_kinds"]["reflection"]["heldout_auroc"] for r in d["layers"]),
            "mean_reflection_steps": {str(a): rows[a]["mean_reflection_steps"] for a in sorted(rows)},
            "p_value": up.p_value, "difference": {"estimate": up.difference.estimate, "low": up.difference.low,
                                                  "high": up.difference.high}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data" / "rise_seed_margins.json"))
    args = parser.parse_args()
    out = Path(args.out)
    results = []
    for seed in range(args.seeds):
        results.append(run(seed))
        print(json.dumps(results[-1]), flush=True)
        out.write_text(json.dumps({"command": "OMP_NUM_THREADS=1 .venv/bin/python tests/rise_seed_margins.py "
                                              f"--seeds {args.seeds}", "runs": results}, indent=1))


if __name__ == "__main__":
    main()
