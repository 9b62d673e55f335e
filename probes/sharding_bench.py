"""`sharded_2gpu_exact` (benchmarks.gpu): a model split layer-wise over two GPUs against the model on one.

Apart from probes.sharding because it drives the engine (probes.sharding is imported by the zoo, which
the engine imports).
"""

from __future__ import annotations

from typing import Any

import torch

from probes.engine import Engine
from probes.interventions import AddVector
from probes.sharding import check_device
from probes.timing import STORY



def check_split(model_id: str, devices: list[str], dtype: str = "bfloat16", tokens: int = 8) -> dict[str, Any]:
    """`model_id` split layer-wise over `devices` against the same model on `devices[0]`: captures of three
    sites, and a steered greedy generation, compared exactly (benchmarks.gpu's `sharded_2gpu_exact`)."""
    whole = Engine.from_id(model_id, device=devices[0], dtype=dtype)
    n = whole.handle.arch.n_layers
    split = Engine.from_id(model_id, dtype=dtype, device_map=split_map(whole.handle.model, devices))
    ids = (whole.encode(STORY) * 4)[:64]
    sites = [f"resid_post.{n // 2}", f"mlp_out.{n - 1}", f"attn_out.{n // 2}"]
    a, b = whole.capture(ids, sites), split.capture(ids, sites)
    same_captures = {s: bool(torch.equal(a[s].cpu(), b[s].cpu())) for s in sites}
    vec = torch.randn(whole.handle.arch.d_model, generator=torch.Generator().manual_seed(0))
    steer = [AddVector(f"resid_post.{n // 2}", vec, scale=0.5)]
    ga = [(r.token_id, r.entropy) for r in whole.generate(ids, max_new_tokens=tokens, interventions=steer)]
    gb = [(r.token_id, r.entropy) for r in split.generate(ids, max_new_tokens=tokens, interventions=steer)]
    return {"bench": "sharded_2gpu_exact", "ratio": float(all(same_captures.values()) and ga == gb), "target": 1.0,
            "devices": devices, "captures_equal": same_captures, "steered_generation_equal": ga == gb,
            "device_map": {k: str(v) for k, v in split.handle.model.hf_device_map.items()}}


def split_map(model: torch.nn.Module, devices: list[str]) -> dict[str, Any]:
    """Decoder layers split into len(devices) contiguous runs; embeddings on the first device, norm and head
    on the last (a LLaMA-style `model.layers` stack)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    prefix = next(n for n, m in model.named_modules() if m is base)
    layers = [n for n, _ in base.named_children()]
    n_layers = len(getattr(base, "layers"))
    out: dict[str, Any] = {}
    for child in layers:
        if child != "layers":
            out[f"{prefix}.{child}"] = devices[0] if child in ("embed_tokens", "rotary_emb") else devices[-1]
    for i in range(n_layers):
        out[f"{prefix}.layers.{i}"] = devices[i * len(devices) // n_layers]
    for name, _ in model.named_children():
        if name != prefix.split(".")[0]:
            out[name] = devices[-1]
    return {k: check_device(v, k) for k, v in out.items()}
