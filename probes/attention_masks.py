"""Masked attention for chosen (query, key) pairs in chosen layers: how `MaskAttention` reaches a model.

A forward pre-hook on each chosen layer's attention module edits the 4D attention mask that
transformers built for that layer (a bool mask for sdpa, an additive float mask for eager, our
own bool mask for the KV-policy attention); where sdpa was given no mask (plain causal, no
padding) the hook builds the causal one first. Columns are absolute token positions: the hook
reads the cache's length to place a decode step's queries. This is what the exhaustive effects
of amortized visual attribution need (Kang et al. 2026, vSTREAM, arXiv 2604.16587): the log-prob
of a reasoning span with its attention to one region's visual tokens removed in every layer.

Example:
    >>> from probes import Engine, MaskAttention
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> tr = engine.trace("one two three four", capture=["attn_pattern.0"],
    ...                   interventions=[MaskAttention([1], queries=[2, 3])])
    >>> float(tr.activations["attn_pattern.0"][2:, :, 1].abs().max())   # [query, head, key]
    0.0

`RowMask` is a `MaskAttention` for chosen batch rows only: a teacher-forced `trace` given row masks
runs the same sequence once per row in one batched forward (row r with the masks naming r, rows
no mask names run unmasked), which is how visual attribution masks K regions in one pass:

    >>> tr = engine.trace("one two three four", interventions=[RowMask([1], rows=[1])])
    >>> tr.logprobs.shape   # [rows, seq]: row 0 unmasked, row 1 with key 1 hidden
    torch.Size([2, 4])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from probes.registered import Part, Registered
from probes.sites import FAMILIES, get_module
from thoughtscope import checks
from thoughtscope.errors import BadInputError

# Implementations whose masks are 4D tensors a hook can edit (flash kernels take 2D padding masks only).
MASKABLE_IMPLEMENTATIONS = ("eager", "sdpa", "thoughtscope_kv_policy")


@dataclass
class MaskAttention(Registered):
    """Queries may not attend to the key `positions`, in every layer or in the chosen `layers`.

    In `generate`, the queries are the generated tokens (and the last prompt token, which predicts
    the first of them) and `positions` index the prompt; without `layers` this goes through the
    2D attention mask, so it works with any attention implementation. In a teacher-forced
    `trace`/`capture`/`capture_batch`, `queries` names the query positions (default: every
    position that is not itself masked), and a pre-hook on each chosen layer's attention edits the
    4D mask (eager or sdpa attention; see `AttentionMasker`). Positions are token indices
    of the whole sequence. The masks of one call share one `AttentionMasks` part (joint checks: no
    query left with nothing to read).
    """

    kind: ClassVar[str] = "mask_attention"
    positions: list[int]
    queries: list[int] | None = None
    layers: list[int] | None = None
    site: ClassVar[str] = "attention_mask"
    where: ClassVar[str] = "generated"
    per_row: ClassVar[bool] = False  # True for masks of chosen batch rows (RowMask)

    def _check(self, arch: Any) -> None:
        # token indices of the whole sequence; on this per-call copy they become plain lists of ints
        self.positions = checks.int_list("MaskAttention.positions", self.positions, low=0)
        if self.queries is not None:
            self.queries = checks.int_list("MaskAttention.queries", self.queries, low=0)
        if self.layers is not None:
            self.layers = checks.int_list("MaskAttention.layers", self.layers, low=0, high=arch.n_layers - 1)

    def bind(self, call: Any) -> "MaskAttention":
        bound = self.validate(call.arch)
        call.part(AttentionMasks, lambda: AttentionMasks(call)).masks.append(bound)
        return bound

    def install(self, call: Any) -> Any:
        return call.parts[AttentionMasks]

    def describe(self) -> str:
        def show(xs: list[int]) -> str:
            return str(xs) if len(xs) <= 8 else f"{xs[:8]}..."

        text = f"mask attention to {len(self.positions)} positions {show(self.positions)}"
        if self.queries is not None:
            text += f" from {len(self.queries)} queries {show(self.queries)}"
        if self.layers is not None:
            text += f" in layers {show(self.layers)}"
        return text


@dataclass
class RowMask(MaskAttention):
    """`MaskAttention` in the batch `rows` named only (teacher-forced passes): K masked variants of one
    sequence in one forward. In `trace`/`capture` the sequence runs once per row (max(rows) + 1 rows;
    row r gets the masks naming it plus every plain MaskAttention) and the Trace's log-probs,
    entropies and activations gain a leading row axis; in `capture_batch` rows index the sequences.
    Generation refuses it."""

    kind: ClassVar[str] = "mask_attention_rows"
    modes: ClassVar[tuple[str, ...]] = ("trace", "capture", "capture_batch", "gradient")
    elsewhere: ClassVar[str] = ("RowMask masks batch rows of a teacher-forced pass (trace, capture, capture_batch); "
                                "in generate use MaskAttention")
    rows: list[int] = field(default_factory=list)
    per_row: ClassVar[bool] = True

    def _check(self, arch: Any) -> None:
        super()._check(arch)
        self.batch_rows()

    def batch_rows(self) -> int:
        return max(checks.int_list("RowMask.rows", self.rows, low=0)) + 1

    def describe(self) -> str:
        return f"{super().describe()} in rows {self.rows[:8]}{'...' if len(self.rows) > 8 else ''}"


class AttentionMasks(Part):
    """The attention masks of one engine call: their joint checks, the call's mask settings, one masker.

    In a generation, masks without `layers` hide prompt columns through the 2D mask (`call.hidden_columns`,
    with the last prompt token fed alone so that it sees them too) and masks with `layers` hook those
    layers from the last prompt token on; in a teacher-forced pass every mask goes through the masker."""

    def __init__(self, call: Any):
        super().__init__()
        self.call = call
        self.masks: list[MaskAttention] = []
        self._masker: AttentionMasker | None = None

    def checked(self, call: Any) -> None:
        hooked = self.masks if call.teacher_forced else [m for m in self.masks if m.layers is not None]
        replacing = [b for b in call.bound if getattr(b, "replaces_attention", False)]
        if hooked and replacing:  # the masker edits 4D masks, which a replaced attention function never reads
            where = "in a teacher-forced pass" if call.teacher_forced else "in chosen layers"
            raise BadInputError(f"MaskAttention {where} cannot be combined with {replacing[0].describe()}, which "
                                "replaces the attention function; drop one of them (a generation may mask prompt "
                                "positions in every layer, without `layers`)")
        if not call.teacher_forced:
            check_generation_masks(self.masks, call.lengths)
            call.hidden_columns = sorted({p for m in self.masks if m.layers is None for p in m.positions})
            call.feed_last_alone = True
            return
        impl = call.handle.model.config._attn_implementation
        if impl not in MASKABLE_IMPLEMENTATIONS:
            raise BadInputError(f"MaskAttention in a teacher-forced pass edits 4D attention masks, which {impl!r} "
                                "attention does not take; load the model with attn_implementation 'sdpa' or 'eager'")
        n_rows = call.batch_rows if call.batch_rows is not None else call.rows
        # a position past a shorter sequence's end reads padding: the longest one bounds them
        check_rows(self.masks, max(call.lengths), call.arch.n_layers, n_rows)

    def open(self) -> None:
        generation = not self.call.teacher_forced
        masks = [m for m in self.masks if m.layers is not None] if generation else self.masks
        self._masker = AttentionMasker(self.call.handle, masks,
                                       first_query=self.call.first_query if generation else None).__enter__()

    def close(self) -> None:
        if self._masker is not None:
            self._masker.__exit__(None, None, None)
            self._masker = None


def rows_needed(interventions: Sequence[Any]) -> int:
    """Batch rows a teacher-forced pass needs for these interventions: max row + 1 with row masks, else 1."""
    return max((iv.batch_rows() for iv in interventions), default=1)


def check_generation_masks(masks: Sequence[Any], lengths: Sequence[int]) -> None:
    """MaskAttention in `generate`, checked when the call is made (before a stream starts, so a server answers
    a 4xx): no `queries=` (the queries are the generated tokens), positions inside every prompt of the batch
    (`lengths`), prompts of one length."""
    if not masks:
        return
    if any(m.queries is not None for m in masks):
        raise BadInputError("in generate() MaskAttention masks the generated tokens; queries= applies to "
                            "teacher-forced trace/capture")
    bad = sorted({p for m in masks for p in m.positions if p >= min(lengths)})
    if bad:
        raise BadInputError(f"MaskAttention positions {bad[:5]} are beyond a prompt of {min(lengths)} tokens "
                            f"(positions 0..{min(lengths) - 1})")
    if len(set(lengths)) != 1:
        raise BadInputError("MaskAttention needs prompts of equal length in a batch")


def _applies(m: Any, row: int | None) -> bool:
    """Whether mask `m` acts on batch `row` (None: the whole batch, no row masks given)."""
    return row is None or not m.per_row or row in m.rows


def check_rows(masks: Sequence[Any], length: int, n_layers: int, n_rows: int | None = None) -> None:
    """Every position must keep at least one key it may read; positions and queries must lie in the text;
    row masks must name rows of the batch (`n_rows`)."""
    for m in masks:
        bad = [p for p in [*m.positions, *(m.queries or [])] if p >= length]
        if bad:
            raise BadInputError(f"MaskAttention positions {bad[:5]} are beyond the text's {length} tokens "
                                f"(positions 0..{length - 1})")
    row_masks = [m for m in masks if m.per_row]
    if not row_masks:
        _check_keys_left(masks, n_layers)
        return
    if n_rows is not None:
        bad = sorted({r for m in row_masks for r in m.rows if r >= n_rows})
        if bad:
            raise BadInputError(f"RowMask rows {bad[:5]} are beyond the batch's {n_rows} rows")
    _check_keys_left([m for m in masks if not m.per_row], n_layers)  # rows no row mask names
    for row in sorted({r for m in row_masks for r in m.rows}):
        _check_keys_left([m for m in masks if _applies(m, row)], n_layers)


def _check_keys_left(masks: Sequence[Any], n_layers: int) -> None:
    # A row can lose its own key only when it is named explicitly as a query of a mask that hides it;
    # default queries never include their own mask's positions.
    def reads(m: Any, q: int) -> bool:
        return q in m.queries if m.queries is not None else q not in m.positions

    layer_sets = {tuple(i for i, m in enumerate(masks) if m.layers is None or layer in m.layers)
                  for layer in range(n_layers)}
    for covering in layer_sets:
        chosen = [masks[i] for i in covering]
        for q in sorted({q for m in chosen if m.queries is not None for q in m.queries}):
            hidden = set().union(*(set(m.positions) for m in chosen if reads(m, q)))
            if all(k in hidden for k in range(q + 1)):
                raise BadInputError(f"MaskAttention leaves query position {q} nothing to attend to "
                                    f"(keys 0..{q} are all masked); unmask one of them or drop that query")


class AttentionMasker:
    """Context manager: pre-hooks on the chosen layers' attention that remove masked (query, key) pairs.

    `first_query` (generation): queries default to columns >= first_query (the last prompt token
    and every generated one); None (teacher-forced): to every column that is not itself masked.
    """

    def __init__(self, handle: Any, masks: Sequence[Any], first_query: int | None = None):
        self.handle, self.masks, self.first_query = handle, list(masks), first_query
        self._removers: list[Any] = []

    def __enter__(self) -> "AttentionMasker":
        if not self.masks:
            return self
        impl = self.handle.model.config._attn_implementation
        if impl not in MASKABLE_IMPLEMENTATIONS:
            raise BadInputError(f"MaskAttention in chosen layers or a teacher-forced pass edits 4D attention masks, "
                                f"which {impl!r} attention does not take; load the model with attn_implementation "
                                "'sdpa' or 'eager'")
        n_layers = self.handle.arch.n_layers
        paths = FAMILIES[self.handle.family]
        layers = sorted({layer for m in self.masks for layer in (m.layers if m.layers is not None else range(n_layers))})
        for layer in layers:
            module = get_module(self.handle.model, f"{paths['layers']}.{layer}.{paths['attn']}")
            self._removers.append(module.register_forward_pre_hook(self._hook(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for remover in self._removers:
            remover.remove()
        self._removers.clear()
        self._last_row_pairs = None  # [rows, queries, keys] bools: not kept past the forward

    def pairs(self, layer: int, query_cols: torch.Tensor, width: int, row: int | None = None) -> torch.Tensor:
        """bool [queries, width]: the (query, key) pairs masked in `layer` (in batch `row`, with row masks)."""
        cols = torch.arange(width, device=query_cols.device)
        out = torch.zeros(len(query_cols), width, dtype=torch.bool, device=query_cols.device)
        for m in self.masks:
            if (m.layers is None or layer in m.layers) and _applies(m, row):
                out |= self._mask_pairs(m, query_cols, cols)
        return out

    def row_pairs(self, layer: int, query_cols: torch.Tensor, width: int, n_rows: int) -> torch.Tensor:
        """bool [n_rows, queries, width]: `pairs` of every batch row, each mask's pairs built once and set in the
        rows it acts on. Layers whose masks are the same share one tensor within a forward (the last one is
        kept), so K row masks over R rows and L layers cost K pair builds, not R x K x L (the K + 1 rows of an
        exhaustive ablation: tests/test_mask_attention.py counts them)."""
        chosen = tuple(i for i, m in enumerate(self.masks) if m.layers is None or layer in m.layers)
        key = (chosen, int(query_cols[0]) if len(query_cols) else 0, len(query_cols), width, n_rows,
               str(query_cols.device))
        last = getattr(self, "_last_row_pairs", None)
        if last is not None and last[0] == key:
            return last[1]
        cols = torch.arange(width, device=query_cols.device)
        out = torch.zeros(n_rows, len(query_cols), width, dtype=torch.bool, device=query_cols.device)
        for i in chosen:
            m = self.masks[i]
            rows = [r for r in m.rows if 0 <= r < n_rows] if m.per_row else list(range(n_rows))
            if rows:
                out[rows] |= self._mask_pairs(m, query_cols, cols)
        self._last_row_pairs = (key, out)
        return out

    def _mask_pairs(self, m: Any, query_cols: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """bool [queries, width]: the pairs one mask removes."""
        dev = query_cols.device
        keys = torch.isin(cols, torch.tensor(m.positions, device=dev))
        if m.queries is not None:
            rows = torch.isin(query_cols, torch.tensor(m.queries, device=dev))
        elif self.first_query is not None:
            rows = query_cols >= self.first_query
        else:
            rows = ~torch.isin(query_cols, torch.tensor(m.positions, device=dev))
        return rows.view(-1, 1) & keys.view(1, -1)

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            n_q = hidden.shape[1]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            offset = cache.get_seq_length(layer) if cache is not None else 0
            width = offset + n_q
            mask = kwargs.get("attention_mask")
            if mask is not None and (mask.ndim != 4 or mask.shape[-1] != width):
                raise BadInputError(f"MaskAttention expected a 4D attention mask over {width} keys in layer {layer}, "
                                    f"got shape {tuple(mask.shape)} (sliding-window caches are not supported)")
            query_cols = torch.arange(offset, width, device=hidden.device)
            if any(m.per_row for m in self.masks):  # one mask per batch row: [batch, 1, q, k]
                pairs = self.row_pairs(layer, query_cols, width, hidden.shape[0]).unsqueeze(1)
            else:
                pairs = self.pairs(layer, query_cols, width)
            if not bool(pairs.any()):
                return None
            if mask is None:  # sdpa's plain causal case: build the mask it would have used
                keys = torch.arange(width, device=hidden.device)
                mask = (keys.view(1, -1) <= query_cols.view(-1, 1)).view(1, 1, n_q, width)
            if mask.dtype == torch.bool:
                mask = mask & ~pairs
            else:  # where, not masked_fill: per-row pairs may widen a mask shared by the batch
                mask = torch.where(pairs, torch.finfo(mask.dtype).min, mask)
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook
