"""Attention rows: the attention probabilities of a few query positions, without materialising seq x seq.

An `attn_pattern.L` capture needs eager attention, which materialises every layer's [heads, seq, seq]
probabilities. A reader that wants only some query rows (visual attribution reads the rows of the
tokens that predict a span, over every key) needs far less: for those queries q, the row is
softmax(q k^T * scale + mask), whose normaliser runs over all keys of that row only, so a row costs
O(keys) and the rows O(queries x keys), never O(seq^2). `AttentionRows` computes exactly that inside
the model's own attention modules (an attention function registered with transformers'
`AttentionInterface` under `ATTENTION_NAME`, with the sdpa mask function under the same name), and
the attention output itself comes from SDPA, as in an unhooked forward. The rows equal the eager
probabilities (`tests/test_compute_misses.py` compares them on tiny models).

The engine uses it in `capture_batch` when `positions` select rows and `attn_pattern` sites are
captured without interventions (`probes.engine.Engine.capture_batch`); with `stop` the forward ends
right after the deepest layer's rows are computed (the rest of that layer and the logits are never
needed). Supported: attention modules that call the attention interface with `num_key_value_groups`
and `scaling` (Llama/SmolLM2, Qwen2/2.5/3, Qwen-VL text models, Mistral, Mixtral, OLMoE, Llava's Llama);
soft-capped or sink attention is left to the eager path (`supported`).

Example:
    >>> import torch
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> ids = engine.encode("one two three four five")
    >>> rows = engine.capture_batch([ids], ["attn_pattern.0"], positions=[[2, 4]])["attn_pattern.0"]
    >>> tuple(rows.shape) == (2, engine.arch().n_heads, len(ids))    # [queries, heads, keys]
    True
    >>> full = engine.trace("one two three four five", capture=["attn_pattern.0"]).activations["attn_pattern.0"]
    >>> bool(torch.allclose(rows, full[[2, 4]], atol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from thoughtscope.errors import BadInputError

ATTENTION_NAME = "thoughtscope_attention_rows"
_OWNER = "_thoughtscope_attention_rows"  # (run, layer) on each attention module whose rows are recorded


def supported(model: Any) -> bool:
    """Whether `AttentionRows` reproduces this model's attention probabilities (no soft-capping, no sinks)."""
    configs = [model.config] + [getattr(model.config, name) for name in ("text_config", "language_config")
                                if getattr(model.config, name, None) is not None]
    return not any(getattr(c, "attn_logit_softcapping", None) or getattr(c, "model_type", "") == "gpt_oss"
                   for c in configs)


class AttentionRows:
    """For one forward: record the attention probabilities of the query columns `queries` (indices into the
    forward's query axis) at the attention `modules` {layer: module}; `rows[layer]` is [batch, heads,
    len(queries), keys]. `stop()` is called once the deepest layer's rows exist (it may raise to end the
    forward). The model runs on this module's attention function (SDPA for the output) inside the block."""

    def __init__(self, model: Any, modules: dict[int, Any], queries: Sequence[int],
                 stop: Callable[[], None] | None = None):
        if not queries:
            raise BadInputError("attention rows need at least one query position")
        self.model, self.modules, self.stop = model, dict(modules), stop
        self.queries = list(queries)
        self.deepest = max(self.modules)
        self.rows: dict[int, torch.Tensor] = {}
        self._saved: list[tuple[Any, Any]] | None = None
        # every layer of one forward sees the same queries, key count and mask: built at the first layer
        self._index: torch.Tensor | None = None
        self._allowed: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> "AttentionRows":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTENTION_NAME, _rows_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        self._saved = _switch(self.model, ATTENTION_NAME)
        for layer, module in self.modules.items():
            setattr(module, _OWNER, (self, layer))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module in self.modules.values():
            if getattr(module, _OWNER, None) is not None:
                delattr(module, _OWNER)
        if self._saved is not None:
            for config, implementation in self._saved:
                config._attn_implementation_internal = implementation
            self._saved = None

    def record(self, layer: int, module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Any,
               scaling: float | None) -> None:
        """softmax(q k^T * scale + mask) for the chosen queries [batch, heads, n, keys], as eager attention
        computes it (scores in the query's dtype, softmax in float32, cast back)."""
        groups = getattr(module, "num_key_value_groups", 1)
        scale = module.scaling if scaling is None else scaling
        if self._index is None or self._index.device != query.device:
            self._index = torch.as_tensor(self.queries, device=query.device)
        queries = self._index
        q = query.index_select(2, queries)
        k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        n_q, n_k = query.shape[2], key.shape[2]
        # the mask rows are the same in every layer of the forward (one mask object, or None): made once
        mask_key = (n_q, n_k, query.device, None if attention_mask is None else id(attention_mask))
        if self._allowed is not None and self._allowed[0] == mask_key:
            allowed = self._allowed[1]
        elif attention_mask is None:  # sdpa's causal skip: query column i sees keys up to i + (keys - queries)
            allowed = torch.arange(n_k, device=query.device)[None, :] <= (queries + (n_k - n_q))[:, None]
        else:
            allowed = attention_mask[:, :, :, :n_k].index_select(2, queries)
        self._allowed = (mask_key, allowed)
        if allowed.dtype == torch.bool:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        else:  # an additive float mask (0 or the dtype's minimum), as eager attention adds it
            scores = scores + allowed
        self.rows[layer] = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if layer == self.deepest and self.stop is not None:
            self.stop()


_CONFIGS = "_thoughtscope_attention_configs"  # the model's configs that carry an attention implementation


def _switch(model: Any, implementation: str) -> list[tuple[Any, Any]]:
    """Every config of `model` switched to `implementation`; returns what to restore. The first switch goes
    through `set_attn_implementation` (its checks, and it finds every sub-model's config); later ones set
    the same configs directly: the full call walks every module twice, a few ms per forward at toy scale."""
    configs = getattr(model, _CONFIGS, None)
    if configs is None:
        before = {id(c): (c, c._attn_implementation_internal) for c in _all_configs(model)}
        model.set_attn_implementation(implementation)
        configs = [c for c in _all_configs(model) if c._attn_implementation_internal == implementation]
        for c, value in before.values():
            c._attn_implementation_internal = value
        setattr(model, _CONFIGS, configs)
    saved = [(c, c._attn_implementation_internal) for c in configs]
    for c in configs:
        c._attn_implementation_internal = implementation
    return saved


def _all_configs(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
            for key in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, key, None)
                if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                    seen.setdefault(id(sub), sub)
    return list(seen.values())


def _rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """SDPA attention for the output; the recorded layers' chosen rows on the side."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise BadInputError("attention rows do not support soft-capped or sink attention (capture full patterns)")
    owner = getattr(module, _OWNER, None)
    if owner is not None:
        run, layer = owner
        run.record(layer, module, query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)
