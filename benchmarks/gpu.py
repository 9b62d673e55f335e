"""`python -m benchmarks.gpu`: the prepared GPU run (issue 26, item 5), one JSON object on stdout.

On one CUDA GPU, in bfloat16, for the embedded model and the shipped toys, it runs the `hooks` group
(`capture_forward`, `stream_generate`, `steer_generate`, `fork_probe`, `ndif_local_overhead`), the
`server` group (`server_stream`, `server_fork_probe`) and the validator (`validate_s`), with the
absolute times each row already carries (seconds, tokens/s) beside its ratio; with two or more GPUs
also `sharded_2gpu_exact`, a 2-way layer split checked against the one-device model. Each row is
timed with the GPU synchronised at every clock read (probes.timing.clock). A row that fails is kept
as `{"bench": ..., "error": ...}` and the run goes on; rows that would start past `--budget-s` are
listed as skipped, so the run ends within about 10 minutes. Without CUDA it refuses (exit status 2,
one line on stderr) before loading anything.

    python -m benchmarks.gpu                       # every model, every group
    python -m benchmarks.gpu --models smollm2-135m --groups hooks --budget-s 120

Written on a CPU-only machine: this run has not been executed on a GPU yet (README says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

MODELS = ("smollm2-135m", "toy-reasoner:small", "toy-moe", "toy-vlm")
GROUPS = ("hooks", "server", "validation")
DTYPE = "bfloat16"
BUDGET_S = 540.0  # the whole run: 9 minutes of benchmarks, a minute of loading and slack
TOKENS = 64  # generated per timed generation (the CPU groups use 128)


def refuse_without_cuda() -> str | None:
    """The refusal message when no CUDA GPU is visible, else None."""
    import torch

    if torch.cuda.is_available():
        return None
    return ("benchmarks.gpu needs a CUDA GPU and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): run it on a GPU box with a "
            "CUDA build of torch (make setup TORCH=...), or `python -m benchmarks` for the CPU ratios")


def hooks_rows(model_id: str) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The `hooks` group on `model_id` loaded once on cuda:0 in bfloat16 (probes.bench's functions)."""
    from probes import bench as B
    from probes.engine import Engine

    engine: list[Any] = []

    def load() -> Any:
        if not engine:
            engine.append(Engine.from_id(model_id, device="cuda", dtype=DTYPE))
        return engine[0]

    def ndif() -> dict[str, Any]:
        from probes.ndif_bench import bench_ndif_local_overhead

        return bench_ndif_local_overhead(load())

    return [("capture_forward", lambda: B.bench_capture_forward(load())),
            ("stream_generate", lambda: B.bench_generate(load(), steer=False, tokens=TOKENS)),
            ("steer_generate", lambda: B.bench_generate(load(), steer=True, tokens=TOKENS)),
            ("fork_probe", lambda: B.bench_fork_probe(load())),
            ("ndif_local_overhead", ndif),
            ("validate_s", lambda: _validate(load()))]


def _validate(engine: Any) -> dict[str, Any]:
    from probes.validate_bench import bench_validate_s

    return bench_validate_s(engine)


def server_rows(model_id: str) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The `server` group: a server subprocess and this process, both on cuda (bfloat16, the CUDA default)."""
    from probes.server_bench import bench_server, bench_server_fork_probe

    return [("server_stream", lambda: bench_server(model_id, tokens=TOKENS, device="cuda", torch_threads=None)),
            ("server_fork_probe", lambda: bench_server_fork_probe(model_id, device="cuda"))]


def sharded_rows(model_id: str) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """With two GPUs: the model split layer-wise over cuda:0 and cuda:1 against the one-device model."""
    import torch

    if torch.cuda.device_count() < 2:
        return []
    from probes.sharding_bench import check_split

    return [("sharded_2gpu_exact", lambda: check_split(model_id, ["cuda:0", "cuda:1"], dtype=DTYPE))]


def plan(models: Sequence[str], groups: Sequence[str]) -> list[tuple[str, str, str, Callable[[], dict[str, Any]]]]:
    """(group, model, bench, run) in the order they run: per model, hooks (and the validator on the same
    loaded engine) first, then the server pair, then the 2-GPU split."""
    out = []
    for model_id in models:
        if "hooks" in groups or "validation" in groups:
            for name, run in hooks_rows(model_id):
                group = "validation" if name == "validate_s" else "hooks"
                if group in groups:
                    out.append((group, model_id, name, run))
        if "server" in groups:
            out.extend(("server", model_id, name, run) for name, run in server_rows(model_id))
    if models:
        out.extend(("sharded", models[0], name, run) for name, run in sharded_rows(models[0]))
    return out


def run(models: Sequence[str], groups: Sequence[str], budget_s: float = BUDGET_S) -> dict[str, Any]:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    rows, skipped = [], []
    for group, model_id, name, fn in plan(models, groups):
        elapsed = time.perf_counter() - t0
        if elapsed > budget_s:
            skipped.append({"group": group, "model": model_id, "bench": name})
            continue
        print(f"benchmarks.gpu: {group} {name} on {model_id} ({elapsed:.0f} s in)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as err:  # one failing row must not lose the others of a 10-minute run
            row = {"bench": name, "error": f"{type(err).__name__}: {err}",
                   "where": traceback.format_exc(limit=-3).strip().splitlines()[-3:]}
        row.update(group=group, model=model_id, wall_s=round(time.perf_counter() - start, 2))
        row.setdefault("device", "cuda")
        rows.append(row)
    torch.cuda.synchronize()
    return {"bench": "gpu", "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": DTYPE, "models": list(models),
            "groups": list(groups), "rows": rows, "skipped": skipped, "budget_s": budget_s,
            "seconds": round(time.perf_counter() - t0, 1),
            "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model ids")
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated: hooks, server, validation")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no row after this many seconds")
    args = parser.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        print(f"benchmarks.gpu: unknown group(s) {', '.join(unknown)}; groups: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    refusal = refuse_without_cuda()
    if refusal:
        print(f"benchmarks.gpu: {refusal}", file=sys.stderr)
        return 2
    print(json.dumps(run([m for m in args.models.split(",") if m], groups, args.budget_s)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
