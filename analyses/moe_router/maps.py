"""Router maps over a generation: which experts every token used at every MoE layer, in N samples, and where
the samples' routing and tokens part.

`generation_map` runs one batched generation through any `Backend` (N samples of one prompt, optionally
under a router rule such as Expert-Sample) and captures, at every step and MoE layer, the router logits
(`router.L`) and the experts and gates the MoE block used (`experts.L`, `expert_gates.L`, read after the
rule). `RouterMap` holds them; `routing_divergence` measures how far the samples' expert sets lie apart
(mean pairwise Jaccard distance per layer and step) and where each sample's tokens fork from sample 0's;
`score_view` is one token's sorted router scores with its head/tail split (the page's k_h slider).
`profile_task` aggregates router statistics (`stats.RouterProfile`) over a task's prompts and greedy answers.

Example:
    >>> from probes import Engine
    >>> from probes.routing import ExpertSample
    >>> engine = Engine.from_id("tiny-random:qwen3_moe")
    >>> rmap = generation_map(engine, "hello", n_samples=3, max_new_tokens=4, rule=ExpertSample(k_h=1, m=4, seed=1))
    >>> rmap.experts.shape  # samples, steps, layers, experts per token
    (3, 4, 2, 2)
    >>> routing_divergence(rmap)["divergence"].shape  # layers, steps
    (2, 4)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from analyses.moe_router.evaluate import arch_of, require_moe
from analyses.moe_router.problems import load_items, resolve_task
from analyses.moe_router.stats import HeadTail, RouterProfile, sorted_probabilities
from probes.arch import ArchInfo
from probes.backend import Backend, require
from thoughtscope import checks
from thoughtscope.errors import BadInputError


@dataclass
class RouterMap:
    """One generation's routing: `logits` [N, steps, layers, E] (NaN once a sample has finished), `experts`
    [N, steps, layers, k'] (-1 once finished) and `gates` [N, steps, layers, k'] (NaN once finished), the
    generated token texts and ids per sample, the MoE `layers`, the model's top-`k`, and the rule described."""

    layers: list[int]
    k: int
    n_experts: int
    tokens: list[list[str]]
    token_ids: list[list[int]]
    logits: np.ndarray
    experts: np.ndarray
    gates: np.ndarray
    rule: str | None = None

    @property
    def n_samples(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.experts.shape[1])

    def texts(self) -> list[str]:
        return ["".join(t) for t in self.tokens]

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "k": self.k, "n_experts": self.n_experts, "tokens": self.tokens,
                "token_ids": self.token_ids, "rule": self.rule,
                "logits": np.where(np.isnan(self.logits), None, self.logits.round(5)).tolist(),
                "experts": self.experts.tolist(),
                "gates": np.where(np.isnan(self.gates), None, self.gates.round(5)).tolist()}


def _moe_layers(arch: ArchInfo) -> list[int]:
    if not arch.n_experts:
        raise BadInputError(f"{arch.model_type} is a dense model: it has no MoE router to map; "
                            "use an MoE model (toy-moe, tiny-random:qwen3_moe, hf: Qwen3-MoE, OLMoE, Mixtral...)")
    return list(arch.moe_layers or range(arch.n_layers))


def generation_map(backend: Backend, prompt: Any, *, n_samples: int = 1, max_new_tokens: int = 32, rule: Any = None,
                   sampling: Any = None, seed: int = 0, chat: bool = False, stop: Sequence[str] = ()) -> RouterMap:
    """Generate `n_samples` continuations of `prompt` (greedy unless `sampling` says otherwise) under `rule`
    (a router rule, or None for the model's own routing), capturing every MoE layer's routing per step."""
    require(backend, "generate", "router")
    arch = backend.arch()
    layers = _moe_layers(arch)
    checks.integer("n_samples", n_samples, low=1)
    if rule is not None:
        rule.validate(arch_of(backend))  # a bad rule is refused before any model work
    sites = [f"{kind}.{layer}" for layer in layers for kind in ("router", "experts", "expert_gates")]
    kwargs: dict[str, Any] = dict(n_samples=n_samples, max_new_tokens=max_new_tokens, seed=seed, capture=sites,
                                  interventions=[rule] if rule is not None else [], top_k=0, chat=chat, stop=list(stop))
    if sampling is not None:
        kwargs["sampling"] = sampling
    per_sample: dict[int, list[Any]] = {b: [] for b in range(n_samples)}
    for rec in backend.generate(prompt, **kwargs):
        per_sample[rec.batch_index].append(rec)
    steps = max(len(v) for v in per_sample.values())
    width = next((int(np.asarray(r.activations[f"experts.{layers[0]}"]).shape[-1])
                  for v in per_sample.values() for r in v), int(arch.experts_top_k))
    E, L = int(arch.n_experts), len(layers)
    logits = np.full((n_samples, steps, L, E), np.nan, dtype=np.float32)
    experts = np.full((n_samples, steps, L, width), -1, dtype=np.int64)
    gates = np.full((n_samples, steps, L, width), np.nan, dtype=np.float32)
    for b, recs in per_sample.items():
        for rec in recs:
            for j, layer in enumerate(layers):
                logits[b, rec.step, j] = np.asarray(rec.activations[f"router.{layer}"], dtype=np.float32).reshape(E)
                experts[b, rec.step, j] = np.asarray(rec.activations[f"experts.{layer}"]).reshape(width)
                gates[b, rec.step, j] = np.asarray(rec.activations[f"expert_gates.{layer}"], dtype=np.float32).reshape(width)
    return RouterMap(layers, int(arch.experts_top_k), E, [[r.text for r in per_sample[b]] for b in range(n_samples)],
                     [[r.token_id for r in per_sample[b]] for b in range(n_samples)], logits, experts, gates,
                     rule.describe() if rule is not None else None)


def jaccard_distance(a: Sequence[int], b: Sequence[int]) -> float:
    """1 - |A & B| / |A | B| of two expert sets (0: the same experts)."""
    sa, sb = set(a), set(b)
    return 1.0 - len(sa & sb) / len(sa | sb) if sa | sb else 0.0


def token_forks(rmap: RouterMap) -> list[int | None]:
    """Per sample: the first step whose token differs from sample 0's (None: never, within the shorter of the two)."""
    base = rmap.token_ids[0]
    out: list[int | None] = []
    for ids in rmap.token_ids:
        fork = next((t for t, (a, b) in enumerate(zip(ids, base)) if a != b), None)
        if fork is None and len(ids) != len(base):
            fork = min(len(ids), len(base))
        out.append(fork)
    return out


def routing_divergence(rmap: RouterMap) -> dict[str, Any]:
    """How the N samples' routing parts: `divergence` [layers, steps] = mean Jaccard distance between the expert
    sets of every pair of samples still generating at that step (NaN with fewer than 2), `same_prefix` [layers,
    steps] = the same over pairs whose tokens so far are identical (routing that differs on the same text: what
    a router rule changes, not what different text causes), `distinct_tokens` [steps] among live samples, and
    `forks` (per sample, the first step its tokens leave sample 0's)."""
    n, steps, n_layers = rmap.n_samples, rmap.n_steps, len(rmap.layers)
    div = np.full((n_layers, steps), np.nan)
    same = np.full((n_layers, steps), np.nan)
    distinct = np.zeros(steps, dtype=int)
    for t in range(steps):
        live = [b for b in range(n) if t < len(rmap.token_ids[b])]
        distinct[t] = len({rmap.token_ids[b][t] for b in live})
        pairs = list(itertools.combinations(live, 2))
        if not pairs:
            continue
        twins = [(a, b) for a, b in pairs if rmap.token_ids[a][:t + 1] == rmap.token_ids[b][:t + 1]]
        for j in range(n_layers):
            dist = {p: jaccard_distance(rmap.experts[p[0], t, j], rmap.experts[p[1], t, j]) for p in pairs}
            div[j, t] = float(np.mean(list(dist.values())))
            if twins:
                same[j, t] = float(np.mean([dist[p] for p in twins]))
    return {"divergence": div, "same_prefix": same, "distinct_tokens": distinct, "forks": token_forks(rmap)}


def divergence_data(rmap: RouterMap) -> dict[str, Any]:
    """The divergence figure's data (plain JSON): per layer and step, the tokens of every sample, the forks."""
    d = routing_divergence(rmap)
    plain = lambda a: np.where(np.isnan(a), None, np.round(a, 4)).tolist()  # noqa: E731
    return {"layers": rmap.layers, "tokens": rmap.tokens, "divergence": plain(d["divergence"]),
            "same_prefix": plain(d["same_prefix"]), "distinct_tokens": d["distinct_tokens"].tolist(),
            "forks": d["forks"], "rule": rmap.rule, "n_samples": rmap.n_samples}


def heatmap_data(rmap: RouterMap, sample: int = 0) -> dict[str, Any]:
    """The router heat map's data for one sample: the experts and gates of every layer at every generated token."""
    if not 0 <= sample < rmap.n_samples:
        raise BadInputError(f"sample {sample} out of range 0..{rmap.n_samples - 1}")
    n = len(rmap.tokens[sample])
    return {"layers": rmap.layers, "tokens": rmap.tokens[sample], "n_experts": rmap.n_experts, "k": rmap.k,
            "experts": rmap.experts[sample, :n].transpose(1, 0, 2).tolist(),
            "gates": np.round(rmap.gates[sample, :n].transpose(1, 0, 2).astype(float), 5).tolist(),
            "sample": sample, "rule": rmap.rule}


def score_view(rmap: RouterMap, sample: int, step: int, layer_index: int, k_h: int, m: int | None = None,
               p: float = 0.5) -> dict[str, Any]:
    """One token's sorted router probabilities with its head/tail split: the top `k_h` (head), the rest of the
    model's k, the tail pool of the next `m`, and the head sizes the cumulative (`p`) and largest-gap rules give."""
    if not 0 <= sample < rmap.n_samples or not 0 <= step < len(rmap.tokens[sample]):
        raise BadInputError(f"no token at sample {sample}, step {step}")
    if not 0 <= layer_index < len(rmap.layers):
        raise BadInputError(f"layer index {layer_index} out of range 0..{len(rmap.layers) - 1}")
    checks.integer("k_h", k_h, low=0, high=rmap.k, why="the model's top-k")
    logits = torch.as_tensor(rmap.logits[sample, step, layer_index])
    order = torch.argsort(logits, descending=True)
    probs = sorted_probabilities(logits)
    m = m if m is not None else 2 * rmap.k
    return {"probs": probs.tolist(), "experts": order.tolist(), "k": rmap.k, "k_h": k_h,
            "m": int(min(m, rmap.n_experts - k_h)), "chosen": [int(e) for e in rmap.experts[sample, step, layer_index]],
            "token": rmap.tokens[sample][step], "step": step, "sample": sample, "layer": rmap.layers[layer_index],
            "cumulative_head": int(HeadTail("cumulative", p=p).head_size(probs, rmap.k)), "p": p,
            "gap_head": int(HeadTail("gap").head_size(probs, rmap.k))}


def profile_task(backend: Backend, task: str = "auto", n: int = 50, *, rules: Sequence[HeadTail] | None = None,
                 max_new_tokens: int = 48, seed: int = 0, batch_rows: int = 64,
                 progress: Callable[[str, int, int], None] | None = None) -> tuple[RouterProfile, str]:
    """Router statistics over `n` development problems of `task`: each prompt and its greedy answer, read
    teacher-forced at every MoE layer. Returns the fitted profile and the task's name."""
    require_moe(backend)
    profile = RouterProfile(rules=tuple(rules)) if rules is not None else RouterProfile()
    for rule in profile.rules:
        rule.check(int(backend.arch().n_experts))
    task = resolve_task(task, backend)
    items = load_items(task, "development", n, seed=seed, backend=backend)
    sequences = []
    for lo in range(0, len(items), batch_rows):
        chunk = items[lo:lo + batch_rows]
        answers: dict[int, list[int]] = {}
        for rec in backend.generate(prompts=[it.prompt for it in chunk], max_new_tokens=max_new_tokens, top_k=0,
                                    chat=chunk[0].chat, seed=seed):
            answers.setdefault(rec.batch_index, []).append(rec.token_id)
        for i, it in enumerate(chunk):
            sequences.append(backend.encode(it.prompt, chat=it.chat) + answers.get(i, []))
        if progress:
            progress("greedy answers", min(len(items), lo + batch_rows), len(items))
    report = (lambda done, total: progress("router statistics", done, total)) if progress else None
    return profile.fit(backend, sequences, on_progress=report), task
