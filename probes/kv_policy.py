"""KV-cache policies: which cache entries each layer and KV head keeps while the model generates.

In the style of NVIDIA's kvpress: one small dataclass per method, inheriting a base that does the
plumbing; a subclass overrides one method. A policy is passed in `interventions=` to
`Engine.generate` and travels over the wire like any registered kind. The cache really shrinks:
entries a policy drops are gone from memory (it is not an attention mask), and every record
reports `kv_bytes`, the bytes of keys and values the cache holds for its sequence.

- `KeepAll`: every entry (equals the plain cache; the control).
- `SinkRecent(sink, recent)`: every KV head keeps the first `sink` and the last `recent` positions
  (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453).
- `HeadBudget(full_heads, sink, recent)`: the heads marked in `full_heads [layers, kv_heads]`
  keep everything, the others sink + recent (the inference side of RLKV, Du et al. 2025,
  arXiv 2510.08525, and of DuoAttention, Xiao et al. 2024).
- `KnormPolicy(budget)`: keep the `budget` entries whose keys have the smallest norm
  (Devoto et al. 2024, arXiv 2406.11430; kvpress `KnormPress`).
- `SnapKVPolicy(budget, window, kernel)`: keep the entries the latest queries attend to most
  (Li et al. 2024, arXiv 2404.14469; kvpress `SnapKVPress`). Our reconstruction applies it after
  every forward (prefill and each decode step) with a fixed budget, so the cache stays bounded
  during long reasoning, where kvpress compresses the prompt once.

The three bases: `KVPolicy` (override `keep`: a bool mask over the entries of a group of heads),
`WindowPolicy` (override `is_local`: which heads see only sink + recent), `ScorerPolicy`
(override `score`: higher is kept, `budget` entries per head).

Semantics, per layer and KV head, at every forward: the new tokens' keys and values are appended;
each new query attends (causally) to the entries present that the policy's `visible` allows; then
`keep` decides which entries stay. A `WindowPolicy` local head therefore gives query position q
exactly the keys at positions p < sink or q - recent < p <= q, in the prompt as well as during
decoding, and the cache holds exactly sink + recent entries between steps: generation equals
full-cache attention with those per-head masks (the test checks this).

Layout (`CompressedCache`): per layer, groups of KV heads that hold the same number of entries,
each group a [batch, heads, entries, head_dim] tensor, so heads with different budgets are never
padded back to full length. Attention runs per group through an attention function registered in
transformers' `AttentionInterface` (`ATTENTION_NAME`), with a mask function registered for the
same name in `AttentionMaskInterface` (without one the causal mask silently disappears).
Supported: full-attention decoders whose attention modules call `cache.update` then the attention
interface (Llama/SmolLM2, Mistral without sliding window, Qwen2/2-MoE, Qwen3/3-MoE, OLMoE, Mixtral).

Example:
    >>> from probes import Engine
    >>> from probes.kv_policy import SinkRecent
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> recs = list(engine.generate("one two three four five six", max_new_tokens=4,
    ...                             interventions=[SinkRecent(sink=2, recent=3)]))
    >>> recs[-1].kv_bytes == 2 * 2 * (2 + 3) * 2 * 16 * 4   # layers, kv heads, entries, k+v, head_dim, fp32
    True
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
import torch.nn.functional as F

from probes.interventions import Registered
from thoughtscope.errors import BadInputError

ATTENTION_NAME = "thoughtscope_kv_policy"
# Model types whose attention modules follow the functional pattern this cache relies on
# (cache.update -> registered attention function), checked on tiny random models of each.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmoe", "mixtral")


@dataclass
class CacheView:
    """What a policy sees of one group of KV heads in one layer, after this forward's entries were added.

    `positions` are token positions (0 = a sequence's first real token, whatever its padding);
    `valid` is False for padding and for filler that aligns a batch; `queries` are this forward's
    queries (after RoPE) of the query heads that read these KV heads; `query_positions` their positions.
    """

    layer: int
    heads: torch.Tensor  # [h] KV-head indices
    keys: torch.Tensor  # [batch, h, n, head_dim], after RoPE
    values: torch.Tensor  # [batch, h, n, head_dim]
    positions: torch.Tensor  # [batch, h, n]
    valid: torch.Tensor  # [batch, h, n] bool
    queries: torch.Tensor  # [batch, h, group_size, q, head_dim]
    query_positions: torch.Tensor  # [batch, q]
    scaling: float

    @property
    def newest(self) -> torch.Tensor:
        """[batch] position of the newest token."""
        return self.query_positions[:, -1]


class KVPolicy(Registered):
    """Base of KV-cache policies. Subclasses override `keep` (or use one of the bases below).

    `keep(view) -> bool [batch, heads, entries]`: which entries of `view` stay in the cache after
    this forward. `visible(view) -> bool [batch, heads, queries, entries] | None`: which entries
    each new query may read (None: all present, causally); override it only when a policy must
    also restrict the prompt's own attention (a sliding window), so that dropping never changes
    what a later query would have read.
    """

    def validate(self, arch: Any) -> None:
        self._check(arch)

    def _check(self, arch: Any) -> None:
        """Subclasses check their parameters here (before any model work)."""

    def keep(self, view: CacheView) -> torch.Tensor:
        return torch.ones_like(view.valid)

    def visible(self, view: CacheView) -> torch.Tensor | None:
        return None

    def max_entries(self) -> int | None:
        """The most entries a compressed head keeps (None: unbounded); a generation shorter than this drops nothing."""
        return None

    def describe(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.parameters() if n not in self.tensor_fields)
        return f"KV policy {type(self).__name__}({args})"


@dataclass
class KeepAll(KVPolicy):
    """Keep every entry: the compressed cache's plumbing with nothing dropped (equals the plain cache)."""

    kind: ClassVar[str] = "kv_keep_all"


class WindowPolicy(KVPolicy):
    """Base of positional policies: a local head keeps (and reads) the first `sink` and last `recent`
    positions; other heads keep everything. Subclasses override `is_local` and define `sink`, `recent`."""

    sink: int
    recent: int

    def is_local(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        """bool [len(heads)]: which of these KV heads of `layer` keep only sink + recent entries."""
        raise NotImplementedError

    def _check(self, arch: Any) -> None:
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInputError(f"{type(self).__name__}.{name} must be a non-negative integer, got {value!r}")
        if self.recent < 1:
            raise BadInputError(f"{type(self).__name__}.recent must be >= 1 (a token must see itself)")
        if self.sink + self.recent >= arch.context_length:
            raise BadInputError(f"sink + recent = {self.sink + self.recent} reaches this model's context "
                                f"({arch.context_length}): nothing would ever be dropped; use KeepAll or a smaller window")

    def _window(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        return (key_pos < self.sink) | (key_pos > query_pos - self.recent)

    def keep(self, view: CacheView) -> torch.Tensor:
        local = self.is_local(view.layer, view.heads).to(view.keys.device).view(1, -1, 1)
        return ~local | self._window(view.positions, view.newest.view(-1, 1, 1))

    def visible(self, view: CacheView) -> torch.Tensor:
        local = self.is_local(view.layer, view.heads).to(view.keys.device).view(1, -1, 1, 1)
        return ~local | self._window(view.positions[:, :, None, :], view.query_positions[:, None, :, None])

    def max_entries(self) -> int:
        return self.sink + self.recent


@dataclass
class SinkRecent(WindowPolicy):
    """StreamingLLM (Xiao et al. 2023): every KV head keeps the first `sink` tokens (attention sinks)
    and the last `recent`; the uniform local-window baseline of RLKV."""

    kind: ClassVar[str] = "kv_sink_recent"
    sink: int = 16
    recent: int = 64

    def is_local(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(heads), dtype=torch.bool)


@dataclass
class HeadBudget(WindowPolicy):
    """RLKV / DuoAttention inference (Du et al. 2025; Xiao et al. 2024): heads marked in
    `full_heads [layers, kv_heads]` (the reasoning or retrieval heads) keep the whole cache, the
    others keep only the first `sink` and last `recent` positions."""

    kind: ClassVar[str] = "kv_head_budget"
    tensor_fields: ClassVar[tuple[str, ...]] = ("full_heads",)
    full_heads: Any = None
    sink: int = 16
    recent: int = 64

    def _check(self, arch: Any) -> None:
        super()._check(arch)
        try:
            full = torch.as_tensor(self.full_heads)
        except (TypeError, ValueError, RuntimeError) as err:
            raise BadInputError(f"full_heads must be a bool array [layers, kv_heads]: {err}") from err
        want = (arch.n_layers, arch.n_kv_heads)
        if tuple(full.shape) != want:
            raise BadInputError(f"full_heads has shape {tuple(full.shape)}; this model needs {want} "
                                "(layers x KV heads: query heads of a GQA group share their KV head)")
        if full.dtype != torch.bool:
            if not torch.isin(full.float(), torch.tensor([0.0, 1.0])).all():
                raise BadInputError("full_heads must hold booleans (or 0/1)")
            full = full.float() > 0.5
        self.full_heads = full

    def is_local(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        return ~self.full_heads[layer, heads.cpu()]

    def describe(self) -> str:
        full = torch.as_tensor(self.full_heads).bool()
        return (f"KV policy HeadBudget({int(full.sum())}/{full.numel()} heads full, "
                f"others sink={self.sink} + recent={self.recent})")


class ScorerPolicy(KVPolicy):
    """Base of token-dropping policies (kvpress `ScorerPress`): after every forward each KV head keeps
    its `budget` highest-scoring entries. Subclasses override `score` and define `budget`."""

    budget: int

    def score(self, view: CacheView) -> torch.Tensor:
        """float [batch, heads, entries]: higher is kept."""
        raise NotImplementedError

    def _check(self, arch: Any) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise BadInputError(f"{type(self).__name__}.budget must be a positive integer, got {self.budget!r}")
        if self.budget >= arch.context_length:
            raise BadInputError(f"budget {self.budget} reaches this model's context ({arch.context_length}); "
                                "nothing would ever be dropped: use KeepAll")

    def max_entries(self) -> int:
        return self.budget

    def keep(self, view: CacheView) -> torch.Tensor:
        n = view.keys.shape[2]
        if n <= self.budget:
            return torch.ones_like(view.valid)
        scores = self.score(view).float().masked_fill(~view.valid, -math.inf)
        top = scores.topk(self.budget, dim=-1).indices
        return torch.zeros_like(view.valid).scatter(-1, top, True)


@dataclass
class KnormPolicy(ScorerPolicy):
    """Knorm (Devoto et al. 2024): keys with a low L2 norm draw high attention, so keep the `budget`
    entries with the smallest key norms."""

    kind: ClassVar[str] = "kv_knorm"
    budget: int = 128

    def score(self, view: CacheView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)


@dataclass
class SnapKVPolicy(ScorerPolicy):
    """SnapKV (Li et al. 2024): the attention the last `window` queries pay to each entry, averaged
    over the query heads of the group and smoothed by a `kernel`-wide pooling, says what to keep;
    entries inside the observation window are always kept. At a decode step the window is the new token."""

    kind: ClassVar[str] = "kv_snapkv"
    budget: int = 128
    window: int = 8
    kernel: int = 5

    def _check(self, arch: Any) -> None:
        super()._check(arch)
        for name in ("window", "kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInputError(f"SnapKVPolicy.{name} must be a positive integer, got {value!r}")
        if self.kernel % 2 == 0:
            raise BadInputError("SnapKVPolicy.kernel must be odd (a centred pooling window)")

    def score(self, view: CacheView) -> torch.Tensor:
        q = view.queries[:, :, :, -self.window:].float()  # [B, h, r, w, D]
        logits = torch.einsum("bhrwd,bhnd->bhrwn", q, view.keys.float()) * view.scaling
        qpos = view.query_positions[:, -self.window:]
        seen = view.valid[:, :, None, None, :] & (view.positions[:, :, None, None, :] <= qpos[:, None, None, :, None])
        attn = logits.masked_fill(~seen, -math.inf).softmax(-1).nan_to_num(0.0)
        scores = attn.mean(dim=(2, 3))  # [B, h, n]
        b, h, n = scores.shape
        scores = F.avg_pool1d(scores.view(b * h, 1, n), self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False).view(b, h, n)
        in_window = view.positions >= qpos[:, :1, None]
        return scores.masked_fill(in_window, math.inf)


# ----- the compressed cache -----


@dataclass
class _Group:
    """KV heads of one layer that hold the same number of entries."""

    heads: torch.Tensor  # [h] long
    keys: torch.Tensor  # [B, h, n, D]
    values: torch.Tensor
    cols: torch.Tensor  # [B, h, n] long: column of each entry in the padded batch; -1 = filler
    positions: torch.Tensor  # [B, h, n] long


@dataclass
class _Pending:
    """What `CompressedLayer.update` hands the attention function: the groups with this forward's entries added."""

    layer: "CompressedLayer"
    groups: list[_Group]
    query_cols: torch.Tensor  # [q]
    query_positions: torch.Tensor  # [B, q]


def _cache_layer_base() -> type:
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


class CompressedLayer(_cache_layer_base()):
    """One layer of a `CompressedCache`: groups of heads with equal entry counts."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, n_kv_heads: int, policy: KVPolicy, owner: "CompressedCache"):
        super().__init__()
        self.layer_idx, self.n_kv_heads, self.policy, self.owner = layer_idx, n_kv_heads, policy, owner
        self.groups: list[_Group] = []
        self.seen = 0  # columns fed so far (padding included), what transformers sizes its masks by

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               kwargs: dict[str, Any] | None = None, **extra: Any) -> tuple[_Pending, _Pending]:
        if not self.owner.active:
            raise BadInputError("this KV cache was compressed by a KV policy and has dropped entries: it cannot be "
                                "forked or reused; fork from a generation without a KV policy")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, t, _ = key_states.shape
        dev = key_states.device
        cols = torch.arange(self.seen, self.seen + t, device=dev)
        pos = (kwargs or {}).get("position_ids")
        pos = cols.view(1, -1).expand(batch, -1) if pos is None else pos.to(dev).expand(batch, -1)
        groups = self.groups or [_Group(torch.arange(self.n_kv_heads, device=dev),
                                        key_states[:, :, :0], value_states[:, :, :0],
                                        torch.zeros(batch, self.n_kv_heads, 0, dtype=torch.long, device=dev),
                                        torch.zeros(batch, self.n_kv_heads, 0, dtype=torch.long, device=dev))]
        grown = []
        for g in groups:
            h = len(g.heads)
            grown.append(_Group(
                g.heads,
                torch.cat([g.keys, key_states[:, g.heads]], dim=2),
                torch.cat([g.values, value_states[:, g.heads]], dim=2),
                torch.cat([g.cols, cols.view(1, 1, -1).expand(batch, h, -1)], dim=2),
                torch.cat([g.positions, pos.view(batch, 1, -1).expand(batch, h, -1)], dim=2),
            ))
        self.seen += t
        pending = _Pending(self, grown, cols, pos)
        return pending, pending

    def attend(self, module: Any, query: torch.Tensor, pending: _Pending, mask: torch.Tensor | None,
               scaling: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of this forward's queries over each group, then the policy's pruning."""
        batch, n_q_heads, t, dim = query.shape
        rep = n_q_heads // self.n_kv_heads
        scale = scaling if scaling is not None else dim ** -0.5
        allowed_cols = _bool_mask(mask, batch, pending.query_cols, self.seen)  # [B, t, seen]
        last_row = allowed_cols[:, -1]  # what the newest query may read: padding and masked columns are out
        out = query.new_zeros(batch, n_q_heads, t, dim)
        weights = query.new_zeros(batch, n_q_heads, t, self.seen) if self.owner.want_weights else None
        kept: list[_Group] = []
        for g in pending.groups:
            h, n = g.cols.shape[1], g.cols.shape[2]
            qidx = (g.heads.view(-1, 1) * rep + torch.arange(rep, device=query.device)).flatten()
            q = query[:, qidx]
            safe = g.cols.clamp(min=0)
            real = g.cols >= 0
            allowed = allowed_cols.gather(2, safe.view(batch, 1, h * n).expand(batch, t, h * n))
            allowed = allowed.view(batch, t, h, n).permute(0, 2, 1, 3) & real[:, :, None, :]
            valid = last_row.gather(1, safe.view(batch, h * n)).view(batch, h, n) & real
            view = CacheView(self.layer_idx, g.heads, g.keys, g.values, g.positions, valid,
                             q.view(batch, h, rep, t, dim), pending.query_positions, scale)
            visible = self.policy.visible(view)
            if visible is not None:
                allowed = allowed & visible
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # a padding query reads something finite
            # GQA without copying keys: the `rep` query heads of a KV head become rows of one [rep * t] block.
            grouped_q = q.reshape(batch, h, rep * t, dim)
            grouped_mask = allowed[:, :, None].expand(batch, h, rep, t, n).reshape(batch, h, rep * t, n)
            bias = torch.zeros(grouped_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~grouped_mask, torch.finfo(q.dtype).min)
            if weights is None:
                # an additive mask keeps CPU sdpa on its math kernel, much faster than the flash one at these sizes
                o = F.scaled_dot_product_attention(grouped_q, g.keys, g.values, attn_mask=bias, scale=scale)
            else:
                w = (grouped_q @ g.keys.transpose(-1, -2) * scale + bias).softmax(-1, dtype=torch.float32).to(q.dtype)
                o = w @ g.values
                w = (w * real[:, :, None, :]).view(batch, h * rep, t, n)
                idx = safe.repeat_interleave(rep, dim=1)[:, :, None, :].expand(-1, -1, t, -1)
                weights[:, qidx] = torch.zeros_like(weights[:, qidx]).scatter_add_(3, idx, w)
            o = o.view(batch, h * rep, t, dim)
            out[:, qidx] = o
            kept.extend(_regroup(g, self.policy.keep(view) & valid))
        self.groups = _merge(kept)
        return out.transpose(1, 2).contiguous(), weights

    def entries(self) -> torch.Tensor:
        """[batch, kv_heads] entries each head holds for each sequence (filler not counted)."""
        if not self.groups:
            return torch.zeros(0, self.n_kv_heads, dtype=torch.long)
        batch = self.groups[0].cols.shape[0]
        out = torch.zeros(batch, self.n_kv_heads, dtype=torch.long)
        for g in self.groups:
            out[:, g.heads.cpu()] = (g.cols >= 0).sum(-1).cpu()
        return out

    def head_positions(self, batch_index: int, head: int) -> list[int]:
        """Token positions a head holds for one sequence, in cache order (what a test inspects)."""
        for g in self.groups:
            hit = (g.heads == head).nonzero()
            if len(hit):
                i = int(hit[0, 0])
                real = g.cols[batch_index, i] >= 0
                return g.positions[batch_index, i][real].tolist()
        return []

    def stored_bytes(self) -> int:
        return sum(2 * g.keys.numel() * g.keys.element_size() for g in self.groups)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise BadInputError("a KV-policy cache has dropped entries and cannot be rolled back")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.groups = [_Group(g.heads, g.keys[indices], g.values[indices], g.cols[indices], g.positions[indices])
                       for g in self.groups]

    def reset(self) -> None:
        self.groups, self.seen = [], 0


def _cache_base() -> type:
    from transformers.cache_utils import Cache

    return Cache


class CompressedCache(_cache_base()):
    """A transformers `Cache` whose layers hold only what a `KVPolicy` keeps (see the module docstring)."""

    def __init__(self, policy: KVPolicy, n_layers: int, n_kv_heads: int):
        self.active = False  # set while `compressed_attention` has the model's attention switched
        self.want_weights = False  # attention weights for `attn_pattern.L` captures
        super().__init__(layers=[CompressedLayer(i, n_kv_heads, policy, self) for i in range(n_layers)])
        self.policy = policy

    def entries(self) -> torch.Tensor:
        """[layers, batch, kv_heads] entries held per head and sequence."""
        return torch.stack([layer.entries() for layer in self.layers])

    def kv_bytes(self) -> list[int]:
        """Bytes of keys and values held for each sequence of the batch (alignment filler excluded)."""
        per_entry = 0
        for layer in self.layers:
            if layer.groups:
                g = layer.groups[0]
                per_entry = 2 * g.keys.shape[-1] * g.keys.element_size()
                break
        return [int(n) * per_entry for n in self.entries().sum(dim=(0, 2)).tolist()]


def _bool_mask(mask: torch.Tensor | None, batch: int, query_cols: torch.Tensor, width: int) -> torch.Tensor:
    """The 4D mask transformers built (bool or additive float, [B, 1, q, width]) -> bool [B, q, width]."""
    if mask is None:
        keys = torch.arange(width, device=query_cols.device)
        return (keys.view(1, 1, -1) <= query_cols.view(1, -1, 1)).expand(batch, -1, -1)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0, :, -width:].expand(batch, -1, -1)


def _regroup(g: _Group, keep: torch.Tensor) -> list[_Group]:
    """Gather the kept entries of a group; heads whose longest row keeps the same count stay together.
    Rows of a batch that keep fewer entries than their head's longest row are filled with marked filler."""
    if bool(keep.all()):
        return [g]
    counts = keep.sum(-1)  # [B, h]
    lengths = counts.max(0).values  # [h]
    out = []
    for length in lengths.unique().tolist():
        sel = (lengths == length).nonzero().view(-1)
        sub = keep[:, sel]
        # kept entries first, in cache order (argsort of 0/1 flags is stable)
        order = (~sub).to(torch.int8).argsort(dim=-1, stable=True)[..., :length]
        flag = sub.gather(2, order)
        d = g.keys.shape[-1]
        gather_kv = order.unsqueeze(-1).expand(-1, -1, -1, d)
        out.append(_Group(
            g.heads[sel],
            g.keys[:, sel].gather(2, gather_kv),
            g.values[:, sel].gather(2, gather_kv),
            g.cols[:, sel].gather(2, order).masked_fill(~flag, -1),
            g.positions[:, sel].gather(2, order),
        ))
    return out


def _merge(groups: list[_Group]) -> list[_Group]:
    """One group per entry count (heads concatenated), ordered by the first head they hold."""
    by_len: dict[int, list[_Group]] = {}
    for g in groups:
        by_len.setdefault(g.keys.shape[2], []).append(g)
    merged = []
    for same in by_len.values():
        if len(same) == 1:
            merged.append(same[0])
            continue
        merged.append(_Group(*(torch.cat([getattr(g, f) for g in same], dim=0 if f == "heads" else 1)
                               for f in ("heads", "keys", "values", "cols", "positions"))))
    return sorted(merged, key=lambda g: int(g.heads.min()))


# ----- the attention function and its mask function, registered with transformers -----


def _policy_attention(module: Any, query: torch.Tensor, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    if not isinstance(key, _Pending):
        # Another cache (a trace run while a compressed generation holds the model): plain attention.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise BadInputError("KV policies do not support attention soft-capping or learned sinks")
    return key.layer.attend(module, query, key, attention_mask, scaling)


def _materialised_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa mask, always built as a tensor: the compressed attention reads it by column."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register the compressed attention and its mask function under `ATTENTION_NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _policy_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _materialised_mask)


def check_model(handle: Any) -> None:
    """A `BadInputError` (before any model work) when this model cannot run a KV policy."""
    if getattr(handle, "remote", False):
        raise BadInputError("KV policies need the weights in this process; ndif: models cannot run them")
    arch = handle.arch
    if arch.model_type not in SUPPORTED_MODEL_TYPES:
        raise BadInputError(f"KV policies support {', '.join(SUPPORTED_MODEL_TYPES)}; this model is "
                            f"{arch.model_type!r}")
    cfg = getattr(handle.model.config, "text_config", None) or handle.model.config
    layer_types = getattr(cfg, "layer_types", None)
    sliding = (any("sliding" in str(t) for t in layer_types) if layer_types is not None
               else bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True))
    if sliding:
        raise BadInputError("KV policies support full-attention models; this one uses sliding-window attention")


def new_cache(handle: Any, policy: KVPolicy) -> CompressedCache:
    return CompressedCache(policy, handle.arch.n_layers, handle.arch.n_kv_heads)


@contextlib.contextmanager
def compressed_attention(model: Any, cache: CompressedCache, want_weights: bool = False) -> Iterator[None]:
    """Switch the model's attention to the compressed one for the duration (the engine lock is held)."""
    register_attention()
    saved = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    cache.active, cache.want_weights = True, want_weights
    try:
        yield
    finally:
        cache.active = False
        model.set_attn_implementation(saved)


def kv_bytes_per_sequence(cache: Any, pad_counts: list[int]) -> list[int]:
    """Bytes of keys and values a cache holds for each sequence of a left-padded batch.

    A `CompressedCache` counts what it kept; a plain transformers cache counts every position it
    stores minus the sequence's own padding (a sliding-window layer may have dropped some of it).
    """
    if isinstance(cache, CompressedCache):
        return cache.kv_bytes()
    totals = [0] * len(pad_counts)
    for layer in getattr(cache, "layers", []):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.ndim != 4:
            continue
        stored = keys.shape[-2]
        seen = int(getattr(layer, "cumulative_length", stored) or stored)
        per_pos = keys.shape[1] * keys.shape[-1] * keys.element_size() + values.shape[1] * values.shape[-1] * values.element_size()
        for b, pads in enumerate(pad_counts):
            pads_stored = max(0, pads - (seen - stored))
            totals[b] += (stored - pads_stored) * per_pos
    return totals
