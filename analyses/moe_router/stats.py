"""Router statistics: how confident a mixture-of-experts router is, token by token and layer by layer.

At every MoE layer a token's router gives each of the E experts a score; sorted, the probabilities
p_(1) >= p_(2) >= ... >= p_(E) show how the mass splits between a few confident "head" experts and an
uncertain "tail" (Chen et al., "Certain Head, Uncertain Tail", arXiv 2602.02443; only the abstract is
public, so the statistics and the head/tail rules here are our reconstruction, METHODS.md section 6):

- `sorted_probabilities`: softmax of the router logits, sorted per token (for every family: the
  family's own score for softmax routers; for DeepSeek-V3's sigmoid router a normalised view with the
  same ranking, its load-balancing bias not included);
- `HeadTail`: where the head ends, by a fixed k_h, by cumulative probability (the fewest experts
  holding at least p of the mass) or at the largest gap between neighbouring ranks;
- `token_statistics`: entropy, the gap at the routed set's edge (p_(k) - p_(k+1)), top-k mass, head
  size and head mass per token;
- `RouterProfile`: the same aggregated over a data set (mean probability at each rank, means of the
  statistics and the head-size distribution of each rule, per layer), fitted through any `Backend`.

Example:
    >>> import torch
    >>> probs = sorted_probabilities(torch.log(torch.tensor([[0.1, 0.6, 0.3]])))
    >>> [round(x, 3) for x in probs[0].tolist()]
    [0.6, 0.3, 0.1]
    >>> HeadTail("cumulative", p=0.8).head_size(probs, k=2).tolist()
    [2]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probes.backend import Backend, require
from thoughtscope import checks
from thoughtscope.errors import BadInputError

RULES = ("fixed", "cumulative", "gap")


def sorted_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities sorted in descending order along the last axis (softmax of the logits, float32)."""
    logits = torch.as_tensor(logits)
    if logits.ndim < 1 or logits.shape[-1] < 2:
        raise BadInputError(f"router logits need an expert axis of at least 2 experts, got shape {tuple(logits.shape)}")
    if not torch.isfinite(logits).all():
        raise BadInputError("router logits hold NaN or infinite values")
    return torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values


@dataclass(frozen=True)
class HeadTail:
    """Where a token's confident head ends among its sorted router probabilities.

    `rule`: `fixed` (the top `k_h`), `cumulative` (the fewest experts whose probabilities sum to at
    least `p`) or `gap` (the head ends at the largest drop p_(i) - p_(i+1), i = 1..limit). The head size
    is at least 1 and at most `max_head` (None: the model's top-k, so the head stays inside the routed set).
    """

    rule: str = "fixed"
    k_h: int = 4
    p: float = 0.5
    max_head: int | None = None

    def check(self, n_experts: int | None = None) -> "HeadTail":
        if self.rule not in RULES:
            raise BadInputError(f"head/tail rule {self.rule!r}; use one of {', '.join(RULES)}")
        if self.rule == "fixed":
            checks.integer("k_h", self.k_h, low=1)
        if self.rule == "cumulative":
            checks.number("the cumulative rule's p", self.p, low=0, high=1, low_open=True)
        checks.integer("max_head", self.max_head, low=1, none_ok=True)
        if n_experts is not None and self.rule == "fixed" and self.k_h > n_experts:
            raise BadInputError(f"k_h={self.k_h} but the router has {n_experts} experts")
        return self

    def limit(self, k: int, n_experts: int) -> int:
        return max(1, min(self.max_head or k, n_experts - 1 if self.rule == "gap" else n_experts))

    def head_size(self, probs: torch.Tensor, k: int) -> torch.Tensor:
        """Head sizes [...] (long) for sorted probabilities [..., E]; `k` is the model's top-k."""
        self.check(probs.shape[-1])
        limit = self.limit(k, probs.shape[-1])
        if self.rule == "fixed":
            return torch.full(probs.shape[:-1], min(self.k_h, self.max_head or self.k_h), dtype=torch.long)
        if self.rule == "cumulative":
            # the first rank whose running sum reaches p (a float tolerance so 0.5 + 0.3 "reaches" 0.8)
            reached = probs.cumsum(-1) >= float(self.p) - 1e-6
            size = reached.float().argmax(-1) + 1
            return size.clamp(1, limit)
        gaps = probs[..., :limit] - probs[..., 1:limit + 1]
        return gaps.argmax(-1) + 1  # the first of equal largest gaps: the smaller head

    def describe(self) -> str:
        cap = f", at most {self.max_head}" if self.max_head else ""
        return {"fixed": f"fixed k_h={self.k_h}", "cumulative": f"cumulative p={self.p:g}{cap}",
                "gap": f"largest gap{cap}"}[self.rule]

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "k_h": self.k_h, "p": self.p, "max_head": self.max_head, "name": self.describe()}


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats along the last axis (0 log 0 = 0)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def token_statistics(logits: torch.Tensor, k: int, rule: HeadTail = HeadTail()) -> dict[str, torch.Tensor]:
    """Per-token router statistics for logits [..., E] at a model with top-`k` routing:
    sorted probabilities, entropy (nats), gap at the routed set's edge p_(k) - p_(k+1), top-1 and top-k
    mass, and the head size and head mass under `rule`."""
    probs = sorted_probabilities(logits)
    n_experts = probs.shape[-1]
    checks.integer("k", k, low=1, high=n_experts)
    head = rule.head_size(probs, k)
    cum = probs.cumsum(-1)
    return {
        "sorted_probs": probs,
        "entropy": entropy(probs),
        "gap_k": probs[..., k - 1] - (probs[..., k] if k < n_experts else 0.0),
        "top1": probs[..., 0],
        "topk_mass": cum[..., k - 1],
        "head_size": head,
        "head_mass": cum.gather(-1, (head - 1).unsqueeze(-1)).squeeze(-1),
    }


@dataclass
class RouterProfile:
    """Router statistics aggregated over a data set, per MoE layer (an estimator: `fit`, then the `_` fields).

    `rules` are the head/tail rules whose head-size distributions are recorded; `layers` None means
    every MoE layer. After `fit`: `layers_`, `k_`, `n_experts_`, `n_tokens_`, `mean_sorted_probs_`
    [layers, E] (mass at each rank), `entropy_`, `gap_k_`, `top1_`, `topk_mass_` (means [layers]),
    `head_sizes_` {rule name: [layers, max head + 1] counts} and `head_mass_` {rule name: [layers]}.

    >>> from probes import Engine
    >>> profile = RouterProfile().fit(Engine.from_id("tiny-random:qwen3_moe"), ["a b c", "d e"])
    >>> profile.n_tokens_, profile.mean_sorted_probs_.shape
    (5, (2, 8))
    """

    rules: Sequence[HeadTail] = field(default_factory=lambda: (HeadTail("fixed", k_h=2), HeadTail("cumulative", p=0.5),
                                                               HeadTail("gap")))
    layers: Sequence[int] | None = None

    def fit(self, backend: Backend, texts: Sequence[Any], chat: bool = False,
            on_progress: Callable[[int, int], None] | None = None) -> "RouterProfile":
        """Capture the router logits at every position of `texts` (teacher-forced) and aggregate them."""
        require(backend, "trace", "router")
        if not texts:
            raise BadInputError("the router profile needs at least one text")
        arch = backend.arch()
        layers = list(self.layers) if self.layers is not None else list(arch.moe_layers or range(arch.n_layers))
        k, n_experts = int(arch.experts_top_k), int(arch.n_experts)
        for rule in self.rules:
            rule.check(n_experts)
        sites = [f"router.{layer}" for layer in layers]
        per_layer: list[list[torch.Tensor]] = [[] for _ in layers]
        for i, text in enumerate(texts):
            acts = backend.capture(text, capture=sites, chat=chat)
            for j, site in enumerate(sites):
                per_layer[j].append(torch.as_tensor(acts[site]).float())
            if on_progress:
                on_progress(i + 1, len(texts))
        return self.fit_logits([torch.cat(rows) for rows in per_layer], k, layers)

    def fit_logits(self, logits: Sequence[torch.Tensor], k: int, layers: Sequence[int] | None = None) -> "RouterProfile":
        """Aggregate captured router logits: one [tokens, E] tensor per layer."""
        if not logits:
            raise BadInputError("no router logits to aggregate")
        self.layers_ = list(layers) if layers is not None else list(range(len(logits)))
        self.k_ = int(k)
        self.n_experts_ = int(logits[0].shape[-1])
        self.n_tokens_ = int(logits[0].shape[0])
        stats = [[token_statistics(x, self.k_, rule) for rule in self.rules] for x in logits]
        first = [s[0] for s in stats]
        self.mean_sorted_probs_ = np.stack([s["sorted_probs"].mean(0).numpy() for s in first])
        self.entropy_, self.gap_k_, self.top1_, self.topk_mass_ = (
            np.array([float(s[name].mean()) for s in first]) for name in ("entropy", "gap_k", "top1", "topk_mass"))
        self.head_sizes_, self.head_mass_ = {}, {}
        for r, rule in enumerate(self.rules):
            width = max(rule.limit(self.k_, self.n_experts_), *(int(s[r]["head_size"].max()) for s in stats)) + 1
            self.head_sizes_[rule.describe()] = np.stack(
                [np.bincount(s[r]["head_size"].numpy(), minlength=width)[:width] for s in stats])
            self.head_mass_[rule.describe()] = np.array([float(s[r]["head_mass"].mean()) for s in stats])
        return self

    def to_dict(self) -> dict[str, Any]:
        if not hasattr(self, "mean_sorted_probs_"):
            raise BadInputError("fit the router profile first")
        return {
            "layers": self.layers_, "k": self.k_, "n_experts": self.n_experts_, "n_tokens": self.n_tokens_,
            "rules": [r.to_dict() for r in self.rules],
            "mean_sorted_probs": self.mean_sorted_probs_.tolist(),
            "entropy": self.entropy_.tolist(), "max_entropy": math.log(self.n_experts_),
            "gap_k": self.gap_k_.tolist(), "top1": self.top1_.tolist(), "topk_mass": self.topk_mass_.tolist(),
            "head_sizes": {name: v.tolist() for name, v in self.head_sizes_.items()},
            "head_mass": {name: v.tolist() for name, v in self.head_mass_.items()},
        }
