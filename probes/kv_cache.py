"""The compressed KV cache: a transformers `Cache` whose layers hold only what a KV policy keeps.

The policies themselves (what to keep) are in `probes.kv_policies`; this module is the plumbing
they share: the cache layers, the attention function that reads them, and the switch of the
model's attention for the duration of one generation. Nothing is stamped on the model: the
count of generations that have the attention switched (they may overlap in one thread, a stream
left unfinished being closed by the garbage collector in the middle of the next) is kept here,
per model, in a weak map.

Layouts (`CompressedCache` picks one per layer). Positional policies (`KeepAll`, `WindowPolicy`:
`policy.local_heads` says which heads are local) use `WindowLayer`: full heads hold one growing
tensor like a plain cache, local heads a fixed ring of sink + recent slots written in place, with
positions and masks computed once per forward for all layers; generation runs at 0.97-1.02x the
plain cache's tokens/s on SmolLM2-135M (docs/rlkv.md). Entry-by-entry policies (`ScorerPolicy`:
SnapKV, Knorm) use the general `CompressedLayer`: groups of KV heads that hold the same number of
entries, each group a [batch, heads, entries, head_dim] tensor, so heads with different budgets are
never padded back to full length; it re-gathers and regroups every step (0.71-0.83x of plain, same
page). Attention runs per group through an attention function registered in
transformers' `AttentionInterface` (`ATTENTION_NAME`), with a mask function registered for the
same name in `AttentionMaskInterface` (without one the causal mask silently disappears).
Supported: full-attention decoders whose attention modules call `cache.update` then the attention
interface (Llama/SmolLM2, Mistral without sliding window, Qwen2/2-MoE, Qwen3/3-MoE, OLMoE, Mixtral).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from thoughtscope.errors import BadInputError

# A `probes.kv_policies.KVPolicy` (keep / visible / local_heads / max_entries); not imported: the policies
# build on this module, not the other way round.
KVPolicy = Any

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


class _PolicyLayer(_cache_layer_base()):
    """What both layouts of a policy layer answer alike: `seen` columns so far (the mask covers them all,
    dropped ones included: attention reads only what is kept), no maximum, no rollback."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    seen: int = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise BadInputError("a KV-policy cache has dropped entries and cannot be rolled back")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def _begin_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """What every `update` checks first: the cache still belongs to a live generation; the layer is set up."""
        if not self.owner.active:
            raise BadInputError("this KV cache was compressed by a KV policy and has dropped entries: it cannot be "
                                "forked or reused; fork from a generation without a KV policy")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)


class CompressedLayer(_PolicyLayer):
    """One layer of a `CompressedCache`: groups of heads with equal entry counts."""

    def __init__(self, layer_idx: int, n_kv_heads: int, policy: KVPolicy, owner: "CompressedCache"):
        super().__init__()
        self.layer_idx, self.n_kv_heads, self.policy, self.owner = layer_idx, n_kv_heads, policy, owner
        self.groups: list[_Group] = []
        self.seen = 0  # columns fed so far (padding included), what transformers sizes its masks by

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               kwargs: dict[str, Any] | None = None, **extra: Any) -> tuple[_Pending, _Pending]:
        self._begin_update(key_states, value_states)
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

    def entry_counts(self) -> list[int]:
        """Entries held per sequence over all heads of this layer."""
        return self.entries().sum(-1).tolist()

    def entry_bytes(self) -> int:
        return 2 * self.groups[0].keys.shape[-1] * self.groups[0].keys.element_size() if self.groups else 0

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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.groups = [_Group(g.heads, g.keys[indices], g.values[indices], g.cols[indices], g.positions[indices])
                       for g in self.groups]

    def reset(self) -> None:
        self.groups, self.seen = [], 0


@dataclass
class _WindowPending:
    """This forward's keys and values, handed from `WindowLayer.update` to its `attend`."""

    layer: "WindowLayer"
    keys: torch.Tensor  # [B, H, t, D]
    values: torch.Tensor
    query_cols: torch.Tensor  # [t]
    query_positions: torch.Tensor  # [B, t]


@dataclass
class _Plan:
    """What every window layer of one forward shares (they all see the same tokens at the same positions):
    computed by the first layer of the forward, reused by the others."""

    seen: int  # columns after this forward: the key that tells forwards apart
    allowed: torch.Tensor  # [B, t, seen] bool: what transformers' mask lets each query read
    full_visible: torch.Tensor | None  # the mask of the full heads (None: everything present)
    # local heads, decode (one new token): the slot each sequence writes, which rows write, what the ring shows
    rows: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    write: torch.Tensor | None = None  # [B] bool: the new column is real (not masked)
    ring_visible: torch.Tensor | None = None  # [B, 1, S] or None
    # local heads, several new tokens: the window mask over ring + new entries and how to refill the ring
    window_visible: torch.Tensor | None = None  # [B, t, S + t]
    take: torch.Tensor | None = None  # [B, S] index into ring + new entries
    entry_cols: torch.Tensor | None = None  # [B, S + t] column of each entry (-1: none)


class WindowState:
    """Positions and columns the window layers of a `CompressedCache` share: every full head holds the
    same columns and every local head the same ring slots, so this is kept once, not per layer."""

    def __init__(self, sink: int, recent: int):
        self.sink, self.recent, self.slots = sink, recent, sink + recent
        self.count: list[int] = []  # real tokens seen per sequence
        self.full_pos: torch.Tensor | None = None  # [B, seen] position of each column, -1 = padding or masked
        self.ring_pos: torch.Tensor | None = None  # [B, S] position held by each slot, -1 = empty
        self.ring_col: torch.Tensor | None = None  # [B, S] its column
        self.plan: _Plan | None = None

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Position p lives in slot p below `sink`, else in slot sink + (p - sink) mod recent."""
        if not self.recent:
            return pos
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.recent)

    def plan_for(self, seen: int, mask: torch.Tensor | None, pending: "_WindowPending") -> _Plan:
        if self.plan is not None and self.plan.seen == seen:
            return self.plan
        batch, t = pending.query_positions.shape
        allowed = _bool_mask(mask, batch, pending.query_cols, seen)  # causal, padding, MaskAttention
        new_real = allowed[:, -1, -t:]  # the newest query reads every real new column: padding is out
        new_pos = pending.query_positions.masked_fill(~new_real, -1)
        self.count = [c + n for c, n in zip(self.count or [0] * batch, new_real.sum(-1).tolist())]
        self.full_pos = new_pos if self.full_pos is None else torch.cat([self.full_pos, new_pos], dim=1)
        plan = _Plan(seen, allowed, None if bool(allowed.all()) else allowed)
        if self.recent and t == 1 and self.ring_pos is not None:
            plan.rows = torch.arange(batch, device=allowed.device)
            plan.write = new_pos[:, 0] >= 0
            plan.slot = self.slot_of(new_pos[:, 0].clamp(min=0))
            kept_pos, kept_col = self.ring_pos[plan.rows, plan.slot], self.ring_col[plan.rows, plan.slot]
            self.ring_pos[plan.rows, plan.slot] = torch.where(plan.write, new_pos[:, 0], kept_pos)
            self.ring_col[plan.rows, plan.slot] = torch.where(plan.write, pending.query_cols[0], kept_col)
            visible = (self.ring_pos >= 0) & allowed[:, -1].gather(1, self.ring_col.clamp(min=0))
            plan.ring_visible = None if bool(visible.all()) else visible[:, None, :]
        elif self.recent:
            new_cols = pending.query_cols.view(1, -1).expand(batch, -1)
            pos = new_pos if self.ring_pos is None else torch.cat([self.ring_pos, new_pos], dim=1)
            cols = new_cols if self.ring_col is None else torch.cat([self.ring_col, new_cols], dim=1)
            cols = cols.masked_fill(pos < 0, -1)
            qpos, kpos = pending.query_positions[:, :, None], pos[:, None, :]
            visible = ((kpos >= 0) & (kpos <= qpos) & ((kpos < self.sink) | (kpos > qpos - self.recent))
                       & allowed.gather(2, cols.clamp(min=0)[:, None, :].expand(-1, t, -1)))
            plan.window_visible = visible | ~visible.any(-1, keepdim=True)  # a padding query reads something finite
            # slot s keeps the newest position p <= last with slot(p) = s, when that position is present
            last = pos.max(dim=1).values.view(-1, 1)
            s = torch.arange(self.slots, device=pos.device).view(1, -1)
            wanted = torch.where(s < self.sink, s, last - (last - s) % self.recent)
            wanted = wanted.masked_fill((wanted > last) | ((s >= self.sink) & (wanted < self.sink)), -1)
            match = (pos[:, None, :] == wanted[:, :, None]) & (wanted[:, :, None] >= 0)  # [B, S, n]
            found = match.any(-1)
            plan.take = match.to(torch.int8).argmax(-1)
            plan.entry_cols = cols
            self.ring_pos = torch.where(found, wanted, -1)
            self.ring_col = torch.where(found, cols.gather(1, plan.take), -1)
        self.plan = plan
        return plan

    def select(self, indices: torch.Tensor) -> None:
        for name in ("full_pos", "ring_pos", "ring_col"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[indices])
        self.count = [self.count[i] for i in torch.as_tensor(indices).tolist()]
        self.plan = None


class WindowLayer(_PolicyLayer):
    """One layer of a `CompressedCache` under a positional policy (`WindowPolicy`, `KeepAll`): the fast layout.

    Full heads hold every column, as a plain cache does (one [B, heads, columns, D] tensor grown by
    concatenation; the batch's left padding is stored and masked, but not counted). Local heads hold a
    fixed ring of `sink + recent` slots per sequence: position p lives in slot p below `sink`, else in
    slot sink + (p - sink) mod recent, so writing the newest token overwrites exactly the entry that
    has just left the window. A decode step is then one indexed write and one attention call per head
    group, with no mask once the ring is full and the batch has no padding; a layer whose heads are all
    full or all local runs one attention call on the query as it comes. Positions, columns and masks are
    the same in every layer, so they are computed once per forward (`WindowState`).
    """

    def __init__(self, layer_idx: int, n_kv_heads: int, policy: KVPolicy, owner: "CompressedCache",
                 local: torch.Tensor):
        super().__init__()
        self.layer_idx, self.n_kv_heads, self.policy, self.owner = layer_idx, n_kv_heads, policy, owner
        local = torch.as_tensor(local, dtype=torch.bool).view(-1)
        self.local_idx = local.nonzero().view(-1)
        self.full_idx = (~local).nonzero().view(-1)
        self.n_local, self.n_full = len(self.local_idx), len(self.full_idx)
        self.seen = 0
        self._qidx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.full_keys = self.full_values = None  # [B, h_full, seen, D]
        self.ring_keys = self.ring_values = None  # [B, h_local, sink + recent, D]

    @property
    def state(self) -> WindowState:
        return self.owner.window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               kwargs: dict[str, Any] | None = None, **extra: Any) -> tuple[_WindowPending, _WindowPending]:
        self._begin_update(key_states, value_states)
        batch, _, t, _ = key_states.shape
        cols = torch.arange(self.seen, self.seen + t, device=key_states.device)
        pos = (kwargs or {}).get("position_ids")
        pos = cols.view(1, -1).expand(batch, -1) if pos is None else pos.to(key_states.device).expand(batch, -1)
        self.seen += t
        pending = _WindowPending(self, key_states, value_states, cols, pos)
        return pending, pending

    def _query_index(self, rep: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Query heads reading the full and the local KV heads (query head i reads KV head i // rep)."""
        if rep not in self._qidx:
            spread = torch.arange(rep)
            self._qidx[rep] = tuple((idx.view(-1, 1) * rep + spread).flatten().to(device)
                                    for idx in (self.full_idx, self.local_idx))
        return self._qidx[rep]

    def _heads(self, x: torch.Tensor, which: torch.Tensor, alone: bool) -> torch.Tensor:
        return x if alone else x.index_select(1, which.to(x.device))

    def attend(self, module: Any, query: torch.Tensor, pending: _WindowPending, mask: torch.Tensor | None,
               scaling: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, n_q_heads, t, dim = query.shape
        rep = n_q_heads // self.n_kv_heads
        scale = scaling if scaling is not None else dim ** -0.5
        plan = self.state.plan_for(self.seen, mask, pending)
        want = self.owner.want_weights
        weights = query.new_zeros(batch, n_q_heads, t, self.seen) if want else None
        q_full, q_local = self._query_index(rep, query.device)
        outs = []
        if self.n_full:
            only = not self.n_local
            k_new, v_new = self._heads(pending.keys, self.full_idx, only), self._heads(pending.values, self.full_idx, only)
            if self.full_keys is None:
                self.full_keys, self.full_values = k_new, v_new
            else:
                self.full_keys = torch.cat([self.full_keys, k_new], dim=2)
                self.full_values = torch.cat([self.full_values, v_new], dim=2)
            o, w = _grouped_attention(self._heads(query, q_full, only), self.full_keys, self.full_values,
                                      plan.full_visible, scale, rep, want)
            outs.append((q_full, o))
            if want:
                weights[:, q_full] = w
        if self.n_local:
            only = not self.n_full
            k_new, v_new = self._heads(pending.keys, self.local_idx, only), self._heads(pending.values, self.local_idx, only)
            q = self._heads(query, q_local, only)
            if plan.slot is not None:  # decode: write the new token over the entry leaving the window, then attend
                if not bool(plan.write.all()):  # a masked new column is not written
                    keep = plan.write.view(-1, 1, 1)
                    k_new = torch.where(keep, k_new[:, :, 0], self.ring_keys[plan.rows, :, plan.slot]).unsqueeze(2)
                    v_new = torch.where(keep, v_new[:, :, 0], self.ring_values[plan.rows, :, plan.slot]).unsqueeze(2)
                self.ring_keys[plan.rows, :, plan.slot] = k_new[:, :, 0]
                self.ring_values[plan.rows, :, plan.slot] = v_new[:, :, 0]
                o, w = _grouped_attention(q, self.ring_keys, self.ring_values, plan.ring_visible, scale, rep, want)
                cols = self.state.ring_col.masked_fill(self.state.ring_pos < 0, -1)
            else:  # several new tokens: attend over ring + new entries under the window mask, then refill the ring
                keys = k_new if self.ring_keys is None else torch.cat([self.ring_keys, k_new], dim=2)
                values = v_new if self.ring_values is None else torch.cat([self.ring_values, v_new], dim=2)
                o, w = _grouped_attention(q, keys, values, plan.window_visible, scale, rep, want)
                take = plan.take[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                self.ring_keys, self.ring_values = keys.gather(2, take), values.gather(2, take)
                cols = plan.entry_cols
            outs.append((q_local, o))
            if want:
                idx = cols.clamp(min=0)[:, None, None, :].expand(-1, w.shape[1], t, -1)
                weights[:, q_local] = torch.zeros_like(weights[:, q_local]).scatter_add_(
                    3, idx, w * (cols >= 0)[:, None, None, :])
        if len(outs) == 1:
            out = outs[0][1]
        else:
            out = query.new_empty(batch, n_q_heads, t, dim)
            for idx, o in outs:
                out.index_copy_(1, idx, o)
        return out.transpose(1, 2).contiguous(), weights

    # ----- what the cache holds -----

    @property
    def groups(self) -> list[_Group]:
        """The stored tensors as head groups (full heads, local ring), for inspection."""
        out, st = [], self.state
        if self.full_keys is not None:
            h = self.n_full
            out.append(_Group(self.full_idx, self.full_keys, self.full_values,
                              _cols_of(st.full_pos, h), st.full_pos[:, None, :].expand(-1, h, -1)))
        if self.ring_keys is not None:
            h = self.n_local
            cols = st.ring_col.masked_fill(st.ring_pos < 0, -1)
            out.append(_Group(self.local_idx, self.ring_keys, self.ring_values, cols[:, None, :].expand(-1, h, -1),
                              st.ring_pos[:, None, :].expand(-1, h, -1)))
        return sorted(out, key=lambda g: int(g.heads.min()))

    def entries(self) -> torch.Tensor:
        """[batch, kv_heads] entries each head holds for each sequence (padding and empty slots not counted)."""
        st = self.state
        out = torch.zeros(len(st.count), self.n_kv_heads, dtype=torch.long)
        counts = torch.tensor(st.count, dtype=torch.long).view(-1, 1)
        if self.n_full:
            out[:, self.full_idx] = counts
        if self.n_local:
            out[:, self.local_idx] = counts.clamp(max=st.slots)
        return out

    def entry_counts(self) -> list[int]:
        """Entries held per sequence over all heads of this layer (plain integers: cheap at every step)."""
        st = self.state
        return [self.n_full * c + self.n_local * min(c, st.slots) for c in st.count]

    def entry_bytes(self) -> int:
        t = self.full_keys if self.full_keys is not None else self.ring_keys
        return 0 if t is None else 2 * t.shape[-1] * t.element_size()

    def head_positions(self, batch_index: int, head: int) -> list[int]:
        """Token positions a head holds for one sequence, ascending (what a test inspects)."""
        st = self.state
        pos = (st.full_pos if head in self.full_idx.tolist() else st.ring_pos)[batch_index]
        return sorted(pos[pos >= 0].tolist())

    def stored_bytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in (self.full_keys, self.ring_keys) if t is not None)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in ("full_keys", "full_values", "ring_keys", "ring_values"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[indices])
        if self.layer_idx == 0:
            self.state.select(indices)

    def reset(self) -> None:
        self.full_keys = self.full_values = self.ring_keys = self.ring_values = None
        self.seen = 0
        if self.layer_idx == 0:
            self.owner.window = WindowState(self.state.sink, self.state.recent)


def _cols_of(pos: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, heads, seen]: each column's index, -1 where it holds padding."""
    cols = torch.arange(pos.shape[1], device=pos.device).view(1, -1).expand(pos.shape[0], -1)
    return cols.masked_fill(pos < 0, -1)[:, None, :].expand(-1, heads, -1)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                       scale: float, rep: int, want_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of query heads [B, h * rep, t, D] over their KV heads [B, h, n, D] without copying keys:
    the `rep` query heads of a KV head are rows of one [rep * t] block. `visible`: bool [B, t, n] (or
    [B, 1, n]) shared by the heads, None for all. Returns ([B, h * rep, t, D], weights [B, h * rep, t, n] or None)."""
    batch, n_q, t, dim = q.shape
    h, n = keys.shape[1], keys.shape[2]
    grouped = q.reshape(batch, h, rep * t, dim)
    mask = None
    if visible is not None:
        rows = visible.shape[1]
        mask = visible[:, None, None].expand(batch, 1, rep, rows, n).reshape(batch, 1, rep * rows, n) \
            if rows == t else visible[:, None].expand(batch, 1, rep * t, n)
    if not want_weights:
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return o.view(batch, n_q, t, dim), None
    logits = grouped @ keys.transpose(-1, -2) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    w = logits.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (w @ values).view(batch, n_q, t, dim), w.view(batch, n_q, t, n)


def _cache_base() -> type:
    from transformers.cache_utils import Cache

    return Cache


class CompressedCache(_cache_base()):
    """A transformers `Cache` whose layers hold only what a `KVPolicy` keeps (see the module docstring).

    It has dropped entries, so a prefix state holding it cannot be forked (`forkable`)."""

    forkable = False

    def __init__(self, policy: KVPolicy, n_layers: int, n_kv_heads: int):
        self.active = False  # set while `compressed_attention` has the model's attention switched
        self.want_weights = False  # attention weights for `attn_pattern.L` captures
        self.window = WindowState(int(getattr(policy, "sink", 0)), int(getattr(policy, "recent", 0)))
        layers = []
        for i in range(n_layers):
            local = policy.local_heads(i, n_kv_heads)
            layers.append(CompressedLayer(i, n_kv_heads, policy, self) if local is None
                          else WindowLayer(i, n_kv_heads, policy, self, local))
        super().__init__(layers=layers)
        self.policy = policy

    def entries(self) -> torch.Tensor:
        """[layers, batch, kv_heads] entries held per head and sequence."""
        return torch.stack([layer.entries() for layer in self.layers])

    def kv_bytes(self) -> list[int]:
        """Bytes of keys and values held for each sequence of the batch (alignment filler excluded)."""
        totals: list[int] = []
        for layer in self.layers:
            per_entry = layer.entry_bytes()
            counts = layer.entry_counts()
            totals = [a + per_entry * b for a, b in zip(totals or [0] * len(counts), counts)]
        return totals


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
    if not isinstance(key, (_Pending, _WindowPending)):
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


class _Switch:
    """A model's attention while compressed generations run: how many, and the implementation to restore."""

    def __init__(self, saved: str):
        self.saved, self.depth = saved, 0


_SWITCHED: "weakref.WeakKeyDictionary[Any, _Switch]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def compressed_attention(model: Any, cache: CompressedCache, want_weights: bool = False) -> Iterator[None]:
    """Switch the model's attention to the compressed one for the duration (the engine lock is held).

    Generations may overlap in one thread (a stream left unfinished is closed later by the garbage
    collector, in the middle of the next one), so the switch is counted per model (in `_SWITCHED`,
    not on the model) and the saved implementation comes back only when the last one ends."""
    register_attention()
    switch = _SWITCHED.get(model)
    if switch is None:
        switch = _SWITCHED[model] = _Switch(model.config._attn_implementation)
        model.set_attn_implementation(ATTENTION_NAME)
    switch.depth += 1
    cache.active, cache.want_weights = True, want_weights
    try:
        yield
    finally:
        cache.active = False
        switch.depth -= 1
        if switch.depth == 0:
            del _SWITCHED[model]
            model.set_attn_implementation(switch.saved)


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
