"""Steering benchmarks (issue 23): ratios measured side by side in one process run.

`thoughtscope bench steering --json` prints:
- `steer_stack_generate`: streaming with a 4-term stack (additive, norm-scaled, project-out, projection
  cap at two sites, chat tokens skipped) / plain streaming, per-token rates (target <= 1.10);
- `steer_frozen_attention`: the same stack with frozen attention (a shadow unsteered forward per step,
  eager attention) / plain streaming (target <= 2.2).

Both sides stream the same chat prompt with entropy, top-5 and one captured site, timed in alternation.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from probes.edits import Additive, NormScaled, ProjectionCap, ProjectOut
from probes.engine import Engine
from probes.frozen_attention import FrozenAttention
from probes.timing import STORY, alternate_pair, sig


def four_term_stack(engine: Any) -> list[Any]:
    arch = engine.handle.arch
    g = torch.Generator().manual_seed(0)
    d, mid, late = arch.d_model, arch.n_layers // 2, max(arch.n_layers - 2, 0)
    vec = lambda: torch.randn(d, generator=g)  # noqa: E731
    return [Additive(f"resid_post.{mid}", vec(), strength=0.5, term="add"),
            NormScaled(f"resid_post.{mid}", vec(), strength=0.05, term="norm"),
            ProjectOut(f"resid_post.{late}", vec(), term="ablate"),
            ProjectionCap(f"resid_post.{late}", vec(), high=1.0, term="cap")]


def _stream(engine: Any, ids: list[int], new: int, interventions: list[Any], counts: list[int]) -> None:
    site = f"resid_post.{engine.handle.arch.n_layers // 2}"
    counts.append(sum(1 for _ in engine.generate(ids, max_new_tokens=new, capture=[site], top_k=5,
                                                interventions=interventions)))


def bench_stack(engine: Any, frozen: bool = False, tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    """Plain streaming vs streaming under the 4-term stack (with frozen attention when `frozen`)."""
    ids = engine.encode(STORY, chat=engine.handle.has_chat_template)
    stack = four_term_stack(engine) + ([FrozenAttention()] if frozen else [])
    counts: dict[str, list[int]] = {"plain": [], "steered": []}
    tp, ts = alternate_pair(lambda: _stream(engine, ids, tokens, [], counts["plain"]),
                            lambda: _stream(engine, ids, tokens, stack, counts["steered"]), repeats)
    plain_tps = statistics.median([c / t for c, t in zip(counts["plain"][1:], tp)])
    steered_tps = statistics.median([c / t for c, t in zip(counts["steered"][1:], ts)])
    return {"bench": "steer_frozen_attention" if frozen else "steer_stack_generate",
            "ratio": round(plain_tps / steered_tps, 3), "target": 2.2 if frozen else 1.10,
            "plain_tokens_per_s": sig(plain_tps), "steered_tokens_per_s": sig(steered_tps),
            "steered_tokens": counts["steered"][-1], "terms": [t.describe() for t in stack],
            "extras": "entropy, top-5, 1 captured site, chat prompt"}


def run_steering(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    engine = Engine.from_id(model_id)
    torch.manual_seed(0)
    return [bench_stack(engine), bench_stack(engine, frozen=True)]


# A group for `thoughtscope bench steering` (the entry point discovers it: thoughtscope.cli CORE_BENCHMARKS).
BENCHMARKS = {"steering": run_steering}
