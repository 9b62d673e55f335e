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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from probes.sites import FAMILIES, get_module
from thoughtscope.errors import BadInputError

# Implementations whose masks are 4D tensors a hook can edit (flash kernels take 2D padding masks only).
MASKABLE_IMPLEMENTATIONS = ("eager", "sdpa", "thoughtscope_kv_policy")


def check_rows(masks: Sequence[Any], length: int, n_layers: int) -> None:
    """Every position must keep at least one key it may read; positions and queries must lie in the text."""
    for m in masks:
        bad = [p for p in [*m.positions, *(m.queries or [])] if p >= length]
        if bad:
            raise BadInputError(f"MaskAttention positions {bad[:5]} are beyond the text's {length} tokens "
                                f"(positions 0..{length - 1})")
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

    def pairs(self, layer: int, query_cols: torch.Tensor, width: int) -> torch.Tensor:
        """bool [queries, width]: the (query, key) pairs masked in `layer`."""
        dev = query_cols.device
        cols = torch.arange(width, device=dev)
        out = torch.zeros(len(query_cols), width, dtype=torch.bool, device=dev)
        for m in self.masks:
            if m.layers is not None and layer not in m.layers:
                continue
            keys = torch.isin(cols, torch.tensor(m.positions, device=dev))
            if m.queries is not None:
                rows = torch.isin(query_cols, torch.tensor(m.queries, device=dev))
            elif self.first_query is not None:
                rows = query_cols >= self.first_query
            else:
                rows = ~torch.isin(query_cols, torch.tensor(m.positions, device=dev))
            out |= rows.view(-1, 1) & keys.view(1, -1)
        return out

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
            pairs = self.pairs(layer, query_cols, width)
            if not bool(pairs.any()):
                return None
            if mask is None:  # sdpa's plain causal case: build the mask it would have used
                keys = torch.arange(width, device=hidden.device)
                mask = (keys.view(1, -1) <= query_cols.view(-1, 1)).view(1, 1, n_q, width)
            if mask.dtype == torch.bool:
                mask = mask & ~pairs
            else:
                mask = mask.masked_fill(pairs, torch.finfo(mask.dtype).min)
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook
