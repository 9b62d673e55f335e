"""Head maps without training and the KV budgets RLKV's baselines are held to.

- `attention_head_scores`: a head score from attention statistics, computed through the Backend from
  `attn_pattern` captures of full-cache traces: the attention mass each KV head's queries put on keys
  outside their sink + recent window (averaged over the query heads of the GQA group and over every
  query that has such keys). A head that reads far back is a retrieval/reasoning head that needs the
  full cache; one that reads only its sink and neighbours loses nothing when made local. [recon]
  This is a training-free stand-in for DuoAttention's retrieval-head identification (Xiao et al.
  2024, arXiv 2410.10819, which optimises gates on a passkey task) and for the retrieval score of Wu
  et al. 2024 (arXiv 2404.15574); it asks what the local window would lose, on the task's own traces.
- `random_full_heads`: the random-heads baseline, seeded.
- `matched_entries`: the entries per head a uniform window or a token-dropping policy may keep so its
  KV bytes match head-level compression at sparsity s on sequences of a reference length.
- `kv_fraction`: KV bytes kept / full cache for a head choice on a sequence of a given length.

Example:
    >>> matched_entries(150, 0.5, sink=4, recent=32)  # half the heads full (150), half local (36)
    93
    >>> round(kv_fraction(random_full_heads((30, 3), 0.5, seed=0), 400, sink=4, recent=32), 3)
    0.545
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from analyses.families import family_for, task_prompt
from probes.backend import Backend, require
from probes.gates import binarised
from thoughtscope import checks
from thoughtscope.errors import BadInputError

LOCAL_HINT = "a local head would read everything; choose a smaller window"  # a too-wide sink + recent window


def random_full_heads(shape: tuple[int, int], sparsity: float, seed: int = 0) -> np.ndarray:
    """bool [layers, kv_heads]: a random (1 - sparsity) fraction of heads keeps the full cache."""
    scores = torch.rand(tuple(shape), generator=torch.Generator().manual_seed(int(seed)))
    return binarised(scores, sparsity).numpy()


def full_heads_from_scores(scores: Any, sparsity: float, tiebreak: Any = None) -> np.ndarray:
    """bool [layers, kv_heads]: the top (1 - sparsity) fraction of heads by score keeps the full cache
    (equal scores ordered by `tiebreak`, higher first)."""
    second = None if tiebreak is None else torch.as_tensor(np.asarray(tiebreak, dtype=np.float32))
    return binarised(torch.as_tensor(np.asarray(scores, dtype=np.float32)), sparsity, second).numpy()


def matched_entries(reference_length: float, sparsity: float, sink: int, recent: int) -> int:
    """Entries per head that give every head the KV bytes head-level compression gives on average:
    (1 - s) * L + s * min(L, sink + recent) for sequences of length L."""
    checks.number("sparsity", sparsity, low=0, high=1, high_open=True)
    length = float(reference_length)
    return max(sink + 1, int(round((1 - sparsity) * length + sparsity * min(length, sink + recent))))


def kv_fraction(full_heads: Any, length: int, sink: int, recent: int) -> float:
    """KV bytes a head choice keeps on a sequence of `length` tokens, as a fraction of the full cache."""
    full = np.asarray(full_heads, dtype=bool)
    kept = full.sum() * length + (~full).sum() * min(length, sink + recent)
    return float(kept / (full.size * length))


def problem_texts(backend: Backend, problems: Sequence[Any], max_new_tokens: int = 48,
                  batch_size: int = 16) -> list[list[int]]:
    """Token ids of prompt + greedy full-cache completion for each problem (the traces statistics are read from)."""
    family = family_for(backend)
    prompts = [backend.encode(*task_prompt(p, family)[:1], chat=task_prompt(p, family)[1]) for p in problems]
    out = [list(p) for p in prompts]
    for lo in range(0, len(prompts), batch_size):
        for rec in backend.generate(prompts=prompts[lo:lo + batch_size], max_new_tokens=max_new_tokens, top_k=0):
            out[lo + rec.batch_index].append(rec.token_id)
    return out


def long_range_mass(pattern: torch.Tensor, sink: int, recent: int) -> tuple[torch.Tensor, int]:
    """(attention mass outside the sink + recent window, summed over queries [heads]; number of queries).

    `pattern` [seq, heads, seq] (query, head, key), each row a distribution over keys <= query.
    Only queries that have keys outside their window (q >= sink + recent) count."""
    seq = pattern.shape[0]
    q = torch.arange(seq).view(-1, 1)
    p = torch.arange(seq).view(1, -1)
    outside = (p >= sink) & (p <= q - recent)  # [q, k]: causal keys the window leaves out
    rows = outside.any(-1)
    if not bool(rows.any()):
        return torch.zeros(pattern.shape[1]), 0
    mass = (pattern.float() * outside[:, None, :]).sum(-1)  # [q, heads]
    return mass[rows].sum(0), int(rows.sum())


def attention_head_scores(backend: Backend, sequences: Sequence[Sequence[int]], sink: int, recent: int,
                          progress: Callable[[str, int, int], None] | None = None) -> np.ndarray:
    """[layers, kv_heads]: mean attention mass outside the sink + recent window (see the module docstring)."""
    require(backend, "attention")
    arch = backend.arch()
    layers, heads, kv_heads = arch.n_layers, arch.n_heads, arch.n_kv_heads
    if not sequences:
        raise BadInputError("attention statistics need at least one trace")
    sites = [f"attn_pattern.{layer}" for layer in range(layers)]
    totals = torch.zeros(layers, heads)
    count = 0
    for i, seq in enumerate(sequences):
        acts = backend.capture(list(seq), sites)
        for layer, site in enumerate(sites):
            mass, n = long_range_mass(acts[site], sink, recent)
            totals[layer] += mass
        count += n
        if progress is not None:
            progress("attention statistics", i + 1, len(sequences))
    if count == 0:
        raise BadInputError(f"no trace is longer than sink + recent = {sink + recent} tokens: every key is in every "
                            "window; use longer traces or a smaller window")
    per_query_head = totals / count
    return per_query_head.view(layers, kv_heads, heads // kv_heads).mean(-1).numpy()
