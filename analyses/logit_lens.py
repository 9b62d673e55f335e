"""Read-outs of one teacher-forced trace: the logit lens, residual-stream norms, attention patterns.

Logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"): decode every layer's
residual stream with the model's own final norm and unembedding, as if the model stopped at that
layer; the top token and its probability per (layer, position) show where a prediction forms.
At the last layer the lens is the model's actual next-token distribution. Besides the top token,
the lens reports the probability and rank of the token that actually comes next at each position
(the view the LLM Transparency Tool and the tuned-lens paper plot).

No tuned lens here: a tuned lens (Belrose et al. 2023) needs one trained affine translator per
layer, and this project trains none, so every read-out below is the plain logit lens. Its known
bias (early layers read out poorly because their basis differs from the last layer's) applies.

Every function is pure over a `Trace`; the lens decodes through the backend's `readout` (the
model's own final norm and unembedding, wherever the model lives), so the app, the CLI and tests
share them, in-process and through the model server.

`trace_completion` makes the one trace every view of a finished generation needs: the residual
stream at every layer and, when they fit a memory budget, the attention patterns of every layer,
in a single teacher-forced pass. Views then slice it (a lens window, one layer's heads) without
running the model again; a layer whose pattern did not fit is traced alone on first use.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> done = trace_completion(engine, "2 + 2 =", [16, 17])
    >>> lens = logit_lens(done.trace, engine, start=2)
    >>> lens.top_probs.shape, lens.next_ranks.shape  # [layers, positions 2..]
    ((2, 5), (2, 5))
    >>> attention_pattern(done.trace, layer=1, prompt_len=done.prompt_len).weights.shape  # every head
    (4, 7, 7)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probes.backend import Backend
from probes.records import Trace
from probes.sites import parse_site
from thoughtscope.errors import BadInputError

# Attention patterns of every layer are kept from the one trace only while they take less than
# this (seq^2 x heads x layers x 4 bytes); longer traces read one layer at a time, on demand.
ATTENTION_BUDGET_BYTES = 256 * 2**20


def resid_sites(n_layers: int) -> list[str]:
    """`resid_post.L` for every layer: what the logit lens and the residual norms read."""
    return [f"resid_post.{layer}" for layer in range(n_layers)]


def attention_sites(n_layers: int) -> list[str]:
    return [f"attn_pattern.{layer}" for layer in range(n_layers)]


def _resid_layers(trace: Trace) -> list[int]:
    layers = sorted(s.layer for s in map(parse_site, trace.activations) if s.kind == "resid_post")
    if not layers:
        raise BadInputError("the trace holds no resid_post.L captures; trace with capture=resid_sites(n_layers)")
    return layers


def _window(n: int, start: int, stop: int | None) -> tuple[int, int]:
    stop = n if stop is None else min(n, int(stop))
    start = max(0, int(start))
    if start >= stop:
        raise BadInputError(f"empty position window [{start}, {stop}); the trace has {n} positions")
    return start, stop


# ----------------------------------------------------------------- the one trace of a finished generation

@dataclass
class CompletionTrace:
    """The trace of prompt + generated tokens that every view of a generation reads.

    `trace.activations` holds `resid_post.L` for every layer and `attn_pattern.L` for the layers
    whose patterns fit the budget (`attention_layers`); `pattern_of` fetches any other layer once.
    """

    trace: Trace
    prompt_len: int
    n_layers: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def attention_layers(self) -> list[int]:
        return sorted(s.layer for s in map(parse_site, self.trace.activations) if s.kind == "attn_pattern")

    def pattern_of(self, backend: Backend, layer: int) -> Trace:
        """The trace, with `attn_pattern.<layer>` in it (traced alone, once, if the first pass left it out)."""
        if not 0 <= int(layer) < self.n_layers:
            raise BadInputError(f"layer {layer} out of range; this model has layers 0..{self.n_layers - 1}")
        site = f"attn_pattern.{int(layer)}"
        with self._lock:
            if site not in self.trace.activations:
                acts = backend.capture(list(self.trace.token_ids), [site])
                self.trace.activations[site] = acts[site]
        return self.trace

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.trace.activations.values())


def attention_bytes(n_layers: int, n_heads: int, seq: int) -> int:
    return n_layers * n_heads * seq * seq * 4


def trace_completion(backend: Backend, prompt: Any, generated_ids: Sequence[int], chat: bool = False,
                     attention_budget: int = ATTENTION_BUDGET_BYTES, attention: bool = True) -> CompletionTrace:
    """One teacher-forced pass over prompt + generated tokens capturing what every view needs."""
    arch = backend.arch()
    prompt_ids = backend.encode(prompt, chat=chat)
    ids = list(prompt_ids) + [int(i) for i in generated_ids]
    sites = resid_sites(arch.n_layers)
    caps = backend.capabilities()
    if attention and caps.get("attention", True) and \
            attention_bytes(arch.n_layers, arch.n_heads, len(ids)) <= attention_budget:
        sites += attention_sites(arch.n_layers)
    trace = backend.trace(ids, capture=sites)
    return CompletionTrace(trace, len(prompt_ids), arch.n_layers)


# ----------------------------------------------------------------- the logit lens

@dataclass
class LogitLensResult:
    """Top token and its probability per (layer, position) of a trace, and the next token's p and rank."""

    tokens: list[str]  # the input token at each position
    layers: list[int]
    top_ids: np.ndarray  # [layers, positions]
    top_tokens: list[list[str]]  # [layers][positions]
    top_probs: np.ndarray  # [layers, positions]
    next_probs: np.ndarray | None = None  # [layers, positions]: p(the token that comes next); NaN at the end
    next_ranks: np.ndarray | None = None  # [layers, positions]: its rank (0 = top); -1 at the end
    start: int = 0  # index of the first position shown (see `window`)
    next_tokens: list[str] | None = None  # the token that comes next at each position ("" at the end)
    prompt_len: int | None = None  # tokens of the prompt (the rest was generated)

    def window(self, start: int, stop: int) -> "LogitLensResult":
        """The same lens over positions [start, stop) of this result only."""
        start, stop = _window(len(self.tokens), start, stop)
        cut = (lambda a: None if a is None else a[:, start:stop])
        return LogitLensResult(self.tokens[start:stop], list(self.layers), self.top_ids[:, start:stop],
                               [row[start:stop] for row in self.top_tokens], self.top_probs[:, start:stop],
                               cut(self.next_probs), cut(self.next_ranks), self.start + start,
                               None if self.next_tokens is None else self.next_tokens[start:stop], self.prompt_len)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "tokens": list(self.tokens),
            "layers": list(self.layers),
            "positions": list(range(self.start, self.start + len(self.tokens))),
            "top_ids": self.top_ids.tolist(),
            "top_tokens": [list(r) for r in self.top_tokens],
            "top_probs": self.top_probs.tolist(),
            "prompt_len": self.prompt_len,
        }
        if self.next_probs is not None:
            out |= {"next_tokens": list(self.next_tokens or []), "next_probs": self.next_probs.tolist(),
                    "next_ranks": self.next_ranks.tolist()}
        return out


def logit_lens(trace: Trace, backend: Backend, start: int = 0, stop: int | None = None,
               prompt_len: int | None = None) -> LogitLensResult:
    """softmax(unembed @ final_norm(resid_post.L)) at every layer and at positions [start, stop), through
    `backend.readout`: the top token and its probability, and the probability and rank of the next
    input token. Only the window is decoded (each row costs a d_model x vocab product)."""
    layers = _resid_layers(trace)
    n_all = len(trace.token_ids)
    start, stop = _window(n_all, start, stop)
    n = stop - start
    vectors = torch.cat([trace.activations[f"resid_post.{layer}"][start:stop].float().cpu() for layer in layers])
    ids = list(trace.token_ids)
    following = [ids[p + 1] if p + 1 < n_all else ids[p] for p in range(start, stop)]  # the last has no next
    read = backend.readout(vectors, norm=True, top_k=1, token_ids=following * len(layers))
    top_ids = read.top_ids[:, 0].reshape(len(layers), n).numpy()
    next_probs = read.token_probs.reshape(len(layers), n).numpy().astype(float)
    next_ranks = read.token_ranks.reshape(len(layers), n).numpy().astype(int)
    if stop == n_all:
        next_probs[:, -1], next_ranks[:, -1] = np.nan, -1
    names = {int(i): backend.decode([int(i)]) for i in np.unique(top_ids)}
    next_tokens = [trace.tokens[p + 1] if p + 1 < n_all else "" for p in range(start, stop)]
    return LogitLensResult(
        tokens=list(trace.tokens[start:stop]), layers=layers, top_ids=top_ids,
        top_tokens=[[names[int(t)] for t in row] for row in top_ids],
        top_probs=read.top_probs[:, 0].reshape(len(layers), n).numpy().astype(float), next_probs=next_probs,
        next_ranks=next_ranks, start=start, next_tokens=next_tokens, prompt_len=prompt_len,
    )


# ----------------------------------------------------------------- residual norms

@dataclass
class ResidualNorms:
    """L2 norm of the residual stream leaving each layer, at every position."""

    tokens: list[str]
    layers: list[int]
    norms: np.ndarray  # [layers, positions]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "layers": list(self.layers), "norms": self.norms.tolist()}


def residual_norms(trace: Trace) -> ResidualNorms:
    layers = _resid_layers(trace)
    norms = torch.stack([trace.activations[f"resid_post.{layer}"].float().norm(dim=-1).cpu() for layer in layers])
    return ResidualNorms(list(trace.tokens), layers, norms.numpy())


# ----------------------------------------------------------------- attention

@dataclass
class AttentionPattern:
    """Attention weights of one head ([queries, keys]) or of every head ([heads, queries, keys]) of a layer,
    over the positions [start, start + len(tokens)); `earlier` is the weight each query puts on keys
    before the window (so no attention mass goes missing from the view)."""

    tokens: list[str]
    layer: int
    head: int | None  # None: every head
    weights: np.ndarray
    start: int = 0
    prompt_len: int | None = None
    earlier: np.ndarray | None = None  # [queries] or [heads, queries]

    @property
    def heads(self) -> list[int]:
        return list(range(self.weights.shape[0])) if self.head is None else [self.head]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "positions": list(range(self.start, self.start + len(self.tokens))),
                "layer": self.layer, "head": self.head, "heads": self.heads, "prompt_len": self.prompt_len,
                "weights": self.weights.tolist(),
                "earlier": None if self.earlier is None else self.earlier.tolist()}


def attention_pattern(trace: Trace, layer: int, head: int | None = None, start: int = 0, stop: int | None = None,
                      prompt_len: int | None = None) -> AttentionPattern:
    """One head's pattern (or every head's, `head=None`) over positions [start, stop), from a trace that
    captured `attn_pattern.<layer>` ([seq, heads, kv])."""
    site = f"attn_pattern.{layer}"
    if site not in trace.activations:
        raise BadInputError(f"the trace holds no {site}; trace with capture=['{site}']")
    pattern = trace.activations[site]
    if head is not None and not 0 <= head < pattern.shape[1]:
        raise BadInputError(f"head {head} out of range; layer {layer} has heads 0..{pattern.shape[1] - 1}")
    start, stop = _window(pattern.shape[0], start, stop)
    rows = pattern[start:stop].float().cpu()  # [q, heads, kv]
    rows = rows.permute(1, 0, 2)  # [heads, q, kv]
    if head is not None:
        rows = rows[head:head + 1]
    weights = rows[:, :, start:stop]
    earlier = rows[:, :, :start].sum(-1) if start > 0 else None
    if head is not None:
        weights, earlier = weights[0], None if earlier is None else earlier[0]
    return AttentionPattern(list(trace.tokens[start:stop]), layer, head, weights.numpy(), start, prompt_len,
                            None if earlier is None else earlier.numpy())
