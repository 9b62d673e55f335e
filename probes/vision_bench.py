"""Vision-language benchmarks (`thoughtscope bench vision --json`), ratios measured side by side:

- `vlm_stream_generate`: a tiny Qwen2.5-VL's streaming generation with an image (entropy, top-5 and one
  captured site per token) / Hugging Face `generate` on the same image and prompt, per-token times
  (target <= 1.10). Both sides decode greedily for the same number of tokens; the engine feeds the
  model's own 3-D rotary positions (probes.vision.mrope_positions), HF computes them itself.

Each pair is timed in alternation (A, B, A, B, ...) and compared by medians (probes.timing).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from probes.engine import Engine
from probes.timing import STORY, alternate_pair, sig

VLM_BENCH_MODEL = "tiny-random:qwen2_5_vl"


def bench_vlm_stream_generate(engine: Engine, tokens: int = 64, repeats: int = 5) -> dict[str, Any]:
    """Engine streaming (one captured site) / HF `generate`, both with one image, seconds per token."""
    image = (np.random.default_rng(0).random((48, 64, 3)) * 255).astype(np.uint8)
    prompt = "<image> " + STORY
    (ids,), kw = engine._vision_inputs([engine.encode(prompt)], [[image]])
    x = torch.tensor([ids], device=engine.handle.device)
    site = f"resid_post.{engine.handle.arch.n_layers // 2}"
    counts: dict[str, list[int]] = {"hf": [], "engine": []}

    @torch.no_grad()
    def hf() -> None:
        out = engine.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw, max_new_tokens=tokens,
                                    min_new_tokens=tokens, do_sample=False, pad_token_id=engine.tok.pad_token_id)
        counts["hf"].append(out.shape[1] - len(ids))

    def ours() -> None:
        stream = engine.generate(ids, images=[image], max_new_tokens=tokens, capture=[site], top_k=5)
        counts["engine"].append(sum(1 for _ in stream))

    th, te = alternate_pair(hf, ours, repeats)
    hf_s = statistics.median([t / c for c, t in zip(counts["hf"][1:], th)])
    en_s = statistics.median([t / c for c, t in zip(counts["engine"][1:], te)])
    return {"bench": "vlm_stream_generate", "ratio": round(en_s / hf_s, 3), "target": 1.10,
            "model": engine.handle.model_id, "prompt_tokens": len(ids), "image_tokens": engine.handle.vision.n_tokens,
            "hf_s_per_token": sig(hf_s), "engine_s_per_token": sig(en_s), "engine_tokens": counts["engine"][-1],
            "extras": f"entropy, top-5, 1 captured site ({site}), 3-D rotary positions"}


def run_vision(model_id: str = VLM_BENCH_MODEL) -> list[dict[str, Any]]:
    """The group on a VLM: `--model` names one; the CLI's text default stands for the tiny Qwen2.5-VL."""
    from probes.zoo import DEFAULT_MODEL
    from thoughtscope.errors import BadInputError

    engine = Engine.from_id(VLM_BENCH_MODEL if model_id == DEFAULT_MODEL else model_id)
    if engine.handle.vision is None:
        raise BadInputError(f"{model_id} is a text-only model; the vision benchmarks need a VLM "
                            f"(default {VLM_BENCH_MODEL})")
    torch.manual_seed(0)
    return [bench_vlm_stream_generate(engine)]


# A group for `thoughtscope bench vision` (the entry point discovers it through probes.bench's BENCHMARKS).
BENCHMARKS = {"vision": run_vision}
