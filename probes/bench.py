"""Performance harness: ratios measured side by side in one process (these machines are noisy).

`thoughtscope bench hooks --json` prints one JSON object per line, each with the `ratio` it exists for:
- `capture_forward`: a forward capturing 3 sites / a plain forward (target <= 1.05)
- `stream_generate`: HF `generate` tokens/s / engine streaming tokens/s with entropy, top-5 and one
  captured site (target <= 1.10)
- `steer_generate`: the same with one additive intervention (target <= 1.10)
- `fork_probe`: a 16-token probe forked from a 512-token prefix / a 16-token forward from scratch (target <= 2)
- `ndif_local_overhead`: a 3-site capture through nnsight `remote="local"` (the NDIF path) / the engine's
  (reported, no target; probes.ndif_bench)

`thoughtscope bench validation`: `validate_s` and `badge_overhead` (probes.validate_bench).

`thoughtscope bench vision`: `vlm_stream_generate`, a tiny Qwen2.5-VL streaming with an image / HF
`generate` (target <= 1.10; probes.vision_bench).

Each pair is timed in alternation (A, B, A, B, ...) and compared by medians, so a slow moment of
the machine hits both sides.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import torch

from probes.engine import Engine
from probes.interventions import AddVector
from probes.server_bench import bench_server, bench_server_fork_probe
from probes.timing import STORY, alternate_pair, sig
from probes.validate_bench import run_validation as run_validation_group
from probes.vision_bench import run_vision


def bench_capture_forward(engine: Any, repeats: int = 15, tokens: int = 128) -> dict[str, Any]:
    ids = (engine.encode(STORY) * 20)[:tokens]
    x = torch.tensor([ids], device=engine.handle.device)
    n = engine.handle.arch.n_layers
    sites = [f"resid_post.{n // 2}", f"mlp_out.{n // 2}", f"attn_out.{n - 1}"]

    @torch.no_grad()
    def plain() -> None:
        engine.model(input_ids=x, use_cache=False)

    def captured() -> None:
        engine.capture(ids, sites)

    tp, tc = alternate_pair(plain, captured, repeats)
    ratio = statistics.median(tc) / statistics.median(tp)
    return {"bench": "capture_forward", "ratio": round(ratio, 3), "target": 1.05, "sites": sites,
            "tokens": tokens, "plain_s": sig(statistics.median(tp)), "capture_s": sig(statistics.median(tc))}


def _hf_generate(engine: Any, ids: list[int], new: int) -> int:
    x = torch.tensor([ids], device=engine.handle.device)
    out = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=engine.tok.pad_token_id)
    return out.shape[1] - len(ids)


def _engine_generate(engine: Any, ids: list[int], new: int, interventions: list[Any]) -> int:
    site = f"resid_post.{engine.handle.arch.n_layers // 2}"
    stream = engine.generate(ids, max_new_tokens=new, capture=[site], top_k=5, interventions=interventions)
    return sum(1 for _ in stream)


def bench_generate(engine: Any, steer: bool = False, tokens: int = 128, repeats: int = 3) -> dict[str, Any]:
    """HF generate vs the engine's stream, tokens/s each (the engine may stop at EOS: per-token rates)."""
    ids = engine.encode(STORY, chat=engine.handle.has_chat_template)
    interventions = []
    if steer:
        vec = torch.randn(engine.handle.arch.d_model, generator=torch.Generator().manual_seed(0))
        interventions = [AddVector(f"resid_post.{engine.handle.arch.n_layers // 2}", vec, scale=0.5)]
    counts = {"hf": [], "engine": []}

    def hf() -> None:
        counts["hf"].append(_hf_generate(engine, ids, tokens))

    def ours() -> None:
        counts["engine"].append(_engine_generate(engine, ids, tokens, interventions))

    th, te = alternate_pair(hf, ours, repeats)
    hf_tps = statistics.median([c / t for c, t in zip(counts["hf"][1:], th)])
    en_tps = statistics.median([c / t for c, t in zip(counts["engine"][1:], te)])
    return {"bench": "steer_generate" if steer else "stream_generate", "ratio": round(hf_tps / en_tps, 3),
            "target": 1.10, "hf_tokens_per_s": sig(hf_tps), "engine_tokens_per_s": sig(en_tps),
            "engine_tokens": counts["engine"][-1], "extras": "entropy, top-5, 1 captured site"
            + (", 1 AddVector" if steer else "")}


def bench_fork_probe(engine: Any, prefix_tokens: int = 512, probe_tokens: int = 16, repeats: int = 15) -> dict[str, Any]:
    base = engine.encode(STORY)
    prefix = (base * (prefix_tokens // len(base) + 1))[:prefix_tokens]
    probe = (base * 2)[:probe_tokens]
    state = engine.prefill(prefix)
    x = torch.tensor([probe], device=engine.handle.device)

    def forked() -> None:
        engine.fork(state, probe, max_new_tokens=1)

    @torch.no_grad()
    def scratch() -> None:
        engine.model(input_ids=x, use_cache=False)

    tf, ts = alternate_pair(forked, scratch, repeats)
    ratio = statistics.median(tf) / statistics.median(ts)
    return {"bench": "fork_probe", "ratio": round(ratio, 3), "target": 2.0, "prefix_tokens": prefix_tokens,
            "probe_tokens": probe_tokens, "fork_s": sig(statistics.median(tf)),
            "scratch_s": sig(statistics.median(ts)),
            "full_recompute_would_cost_tokens": prefix_tokens + probe_tokens}


def run_hooks(model_id: str = "smollm2-135m") -> Iterator[dict[str, Any]]:
    """Each row as soon as it is measured (`thoughtscope bench` prints it then)."""
    engine = Engine.from_id(model_id)
    torch.manual_seed(0)
    from probes.ndif_bench import bench_ndif_local_overhead

    yield bench_capture_forward(engine)
    yield bench_generate(engine, steer=False)
    yield bench_generate(engine, steer=True)
    yield bench_fork_probe(engine)
    yield bench_ndif_local_overhead(engine)


def run_server(model_id: str = "smollm2-135m") -> Iterator[dict[str, Any]]:
    yield bench_server(model_id)
    yield bench_server_fork_probe(model_id)


def run_validation(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return run_validation_group(model_id)


# Groups for `thoughtscope bench GROUP` (discovered by the entry point, as each method's bench.py is).
BENCHMARKS = {"hooks": run_hooks, "server": run_server, "validation": run_validation,
              "vision": run_vision}  # probes.vision_bench: vlm_stream_generate
