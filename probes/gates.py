"""Mixed full/local attention with one learnable gate per layer and KV head: how RLKV learns its head map.

Du et al. 2025, "Which Heads Matter for Reasoning? RL-Guided KV Cache Compression" (RLKV, arXiv
2510.08525), after DuoAttention (Xiao et al. 2024, arXiv 2410.10819): every KV head's attention is

    out = alpha[l, h] * full_attention + (1 - alpha[l, h]) * local_attention

where the local attention reads only the first `sink` and the last `recent` positions (by token
position, so a left-padded batch sees the same window as each sequence alone), and the query heads
of a GQA group share their KV head's gate. The model stays frozen; only the L x H_kv gates get
gradients. Both attentions come from one score matrix: the two softmaxes are mixed and multiply
the values once, which is the same as mixing the two outputs.

It reaches the model as an attention function registered in transformers' `AttentionInterface`
under `GATES_NAME`, with a mask function registered for the same name in `AttentionMaskInterface`
(without one the causal mask silently disappears and the logits drift by tens of nats). The mask
transformers builds (causal, padding, a Gemma layer's own sliding window) is the full attention's
mask; the local one is that mask AND the sink + recent window. Works for decoders whose attention
modules call the attention interface with (query, key, value, mask, scaling): Llama/SmolLM2,
Mistral, Qwen2/2-MoE, Qwen3/3-MoE, OLMoE, Mixtral, Gemma/Gemma 2 (soft-capped scores) / Gemma 3.

`GateSession` (what `Engine.head_gates` returns) is a context manager: inside it the model runs the
mixed attention with the session's gates `alpha` (an `nn.Parameter` [layers, kv_heads]), both for
sampling (`session.generate`, any Engine.generate argument) and for gradients of sequence
log-probabilities (`session.logprobs`). It holds the engine lock for its duration: training runs in
the process that holds the model.

Example:
    >>> import torch
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> with engine.head_gates(sink=1, recent=2) as session:
    ...     lp = session.logprobs([engine.encode("one two three four five")], starts=[2])[0]
    ...     lp.sum().backward()
    >>> tuple(session.alpha.shape), session.alpha.grad.abs().sum() > 0
    ((2, 2), tensor(True))
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from probes import cancel
from probes.sites import FAMILIES, get_module
from thoughtscope import checks
from thoughtscope.errors import BadInputError

GATES_NAME = "thoughtscope_head_gates"
# Model types whose attention modules call the attention interface as this function expects
# (checked on tiny random models of llama, qwen2, qwen3 and gemma3 by the tests).
GATE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmoe", "mixtral", "gemma",
                    "gemma2", "gemma3", "gemma3_text")
# attention module -> the session whose gates it runs: kept here, not stamped on the model's modules
_SESSIONS: "weakref.WeakKeyDictionary[Any, GateSession]" = weakref.WeakKeyDictionary()


def check_gate_model(handle: Any) -> None:
    """A `BadInputError` (before any model work) when this model has no mixed-attention function."""
    if getattr(handle, "remote", False):
        raise BadInputError("head gates train in the process that holds the weights; ndif: models cannot run them")
    if handle.arch.model_type not in GATE_MODEL_TYPES:
        raise BadInputError(f"mixed full/local attention (RLKV head gates) exists for {', '.join(GATE_MODEL_TYPES)}; "
                            f"this model is {handle.arch.model_type!r}")


def check_gates(gates: Any, shape: tuple[int, int], what: str = "gates") -> torch.Tensor:
    """Gates as a float tensor of `shape` with values in [0, 1], or a `BadInputError`."""
    try:
        g = torch.as_tensor(gates, dtype=torch.float32).detach().clone()
    except (TypeError, ValueError, RuntimeError) as err:
        raise BadInputError(f"{what} must be a [layers, kv_heads] array of numbers: {err}") from err
    if tuple(g.shape) != tuple(shape):
        raise BadInputError(f"{what} have shape {tuple(g.shape)}; this model needs {tuple(shape)} (layers x KV heads): "
                            "were they learned on another model?")
    if not torch.isfinite(g).all() or g.min() < 0 or g.max() > 1:
        raise BadInputError(f"{what} must lie in [0, 1]")
    return g


def window_mask(key_positions: torch.Tensor, query_positions: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """bool [B, q, k]: key position p is in query position q's local window (p < sink or p > q - recent).

    >>> window_mask(torch.arange(6).view(1, -1), torch.tensor([[5]]), sink=1, recent=2).int().tolist()
    [[[1, 0, 0, 0, 1, 1]]]
    """
    kp, qp = key_positions[:, None, :], query_positions[:, :, None]
    return (kp < sink) | (kp > qp - recent)


def mixed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                    window: torch.Tensor, alpha: torch.Tensor, scale: float,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha * full + (1 - alpha) * local attention for one layer.

    query [B, H * rep, q, D] (query head i reads KV head i // rep), key/value [B, H, k, D],
    allowed bool [B, q, k] (the full attention's mask), window bool [B, q, k] (the local window),
    alpha [H]. Returns (output [B, H * rep, q, D], mixed probabilities [B, H * rep, q, k]).
    """
    batch, n_q, t, dim = query.shape
    heads, n = key.shape[1], key.shape[2]
    rep = n_q // heads
    grouped = query.reshape(batch, heads, rep * t, dim)  # the rep query heads of a KV head as rows: no key copies
    scores = (grouped @ key.transpose(-1, -2)).float() * scale  # [B, H, rep * t, k]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    low = torch.finfo(torch.float32).min

    def rows(mask: torch.Tensor) -> torch.Tensor:
        return mask[:, None, None].expand(batch, 1, rep, t, n).reshape(batch, 1, rep * t, n)

    local = allowed & window
    local = local | ~local.any(-1, keepdim=True)  # a padding query reads something finite
    p_full = scores.masked_fill(~rows(allowed), low).softmax(-1)
    p_local = scores.masked_fill(~rows(local), low).softmax(-1)
    a = alpha.to(scores.dtype).view(1, heads, 1, 1)
    probs = a * p_full + (1 - a) * p_local
    out = probs.to(value.dtype) @ value  # [B, H, rep * t, D]
    return out.view(batch, n_q, t, dim), probs.view(batch, n_q, t, n)


def _bool_allowed(mask: Any, batch: int, t: int, n: int, device: torch.device) -> torch.Tensor:
    """transformers' 4D mask (bool or additive, [B, 1, q, >= k]) -> bool [B, q, k]; None means plain causal."""
    if mask is None:
        q = torch.arange(n - t, n, device=device).view(-1, 1)
        return (torch.arange(n, device=device).view(1, -1) <= q).expand(batch, -1, -1)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0, :, -n:].expand(batch, -1, -1)


def _gated_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    session = _SESSIONS.get(module)
    if session is None:  # a module outside any session (should not happen while the name is set): plain attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise BadInputError("head gates do not support learned attention sinks")
    batch, _, t, dim = query.shape
    n = key.shape[2]
    allowed = _bool_allowed(attention_mask, batch, t, n, query.device)
    qpos = kwargs.get("position_ids")
    qpos = (torch.arange(n - t, n, device=query.device).view(1, -1) if qpos is None else qpos.to(query.device))
    qpos = qpos.expand(batch, -1)
    # Keys are columns 0..n-1 of a left-padded batch; the last query is always a real token, so its
    # position fixes every column's position (padding columns come out negative and are masked anyway).
    kpos = torch.arange(n, device=query.device).view(1, -1) - (n - 1) + qpos[:, -1:]
    window = window_mask(kpos, qpos, session.sink, session.recent)
    scale = scaling if scaling is not None else dim ** -0.5
    out, probs = mixed_attention(query, key, value, allowed, window, session.alpha[module.layer_idx], scale, softcap)
    return out.transpose(1, 2).contiguous(), probs


def register_gated_attention() -> None:
    """Register the mixed attention and its mask function under `GATES_NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from probes.kv_policy import _materialised_mask

    AttentionInterface.register(GATES_NAME, _gated_attention)
    AttentionMaskInterface.register(GATES_NAME, _materialised_mask)


class GateSession:
    """The model running mixed attention with learnable gates `alpha` [layers, kv_heads] (see the module docstring).

    Made by `Engine.head_gates(sink, recent, init=1.0, gates=None)`; use it as a context manager.
    """

    def __init__(self, engine: Any, sink: int = 128, recent: int = 256, init: float = 1.0, gates: Any = None):
        handle = engine.handle
        check_gate_model(handle)
        arch = handle.arch
        self.sink, self.recent = checks.window(sink, recent, arch.context_length,
                                               hint="a local head would read everything; choose a smaller window")
        shape = (arch.n_layers, arch.n_kv_heads)
        if gates is None:
            gates = torch.full(shape, float(checks.number("init", init, low=0, high=1)))
        self.alpha = torch.nn.Parameter(check_gates(gates, shape).to(handle.device))
        self.engine, self.handle = engine, handle
        self.active = False
        self._saved: str | None = None
        self._modules: list[Any] = []

    def __enter__(self) -> "GateSession":
        self.engine.lock.acquire()
        try:
            register_gated_attention()
            model = self.handle.model
            paths = FAMILIES[self.handle.family]
            self._modules = [get_module(model, f"{paths['layers']}.{i}.{paths['attn']}")
                             for i in range(self.handle.arch.n_layers)]
            for module in self._modules:
                _SESSIONS[module] = self
            self._saved = model.config._attn_implementation
            model.set_attn_implementation(GATES_NAME)
            self.active = True
        except BaseException:
            self.engine.lock.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.active = False
            for module in self._modules:
                _SESSIONS.pop(module, None)
            if self._saved is not None:
                self.handle.model.set_attn_implementation(self._saved)
        finally:
            self.engine.lock.release()

    def _check_active(self) -> None:
        if not self.active:
            raise BadInputError("use the gate session inside its `with` block")

    def clamp_(self) -> None:
        """Keep every gate in [0, 1] (after an optimiser step)."""
        with torch.no_grad():
            self.alpha.clamp_(0.0, 1.0)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`Engine.generate` under the mixed attention with the current gates (no gradients).

        KV policies and attention-pattern captures are refused: both would switch the attention away."""
        self._check_active()
        if any(getattr(iv, "replaces_attention", False) for iv in kwargs.get("interventions", ())):
            raise BadInputError("a KV policy replaces the attention; generate with it outside the gate session")
        if any(str(site).startswith("attn_pattern") for site in kwargs.get("capture", ())):
            raise BadInputError("attn_pattern captures switch to eager attention; capture them outside the gate session")
        return self.engine.generate(*args, **kwargs)

    def logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[torch.Tensor]:
        """Log-probabilities of tokens `sequences[b][starts[b]:]` under the mixed attention, with gradients to `alpha`.

        One left-padded forward over the batch; only the rows the tokens need are projected to the
        vocabulary. Returns one float32 tensor [len(seq) - start] per sequence."""
        self._check_active()
        seqs = [self.engine.encode(list(seq)) for seq in sequences]
        if len(seqs) != len(starts) or not seqs:
            raise BadInputError(f"logprobs needs one start per sequence, got {len(starts)} for {len(seqs)}")
        for seq, start in zip(seqs, starts):
            checks.integer("start", start, low=1, high=len(seq) - 1, why="a token with a prefix before it")
        dev = self.handle.device
        width = max(map(len, seqs))
        pad = self.handle.tokenizer.pad_token_id or 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
        for b, seq in enumerate(seqs):
            ids[b, width - len(seq):] = torch.tensor(seq, device=dev)
            mask[b, width - len(seq):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(seq) - start for seq, start in zip(seqs, starts)) + 1
        cancel.check()  # a job's Stop ends an RLKV training step here (probes.cancel)
        with torch.enable_grad():
            logits = self.handle.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                                       logits_to_keep=keep).logits  # [B, keep, vocab]: columns width-keep..width-1
            out = []
            for b, (seq, start) in enumerate(zip(seqs, starts)):
                n = len(seq) - start
                rows = logits[b, keep - 1 - n:keep - 1].float()  # row j predicts token start + j
                target = torch.tensor(seq[start:], device=dev).view(-1, 1)
                out.append(rows.log_softmax(-1).gather(-1, target).view(-1))
        return out

    def state(self) -> dict[str, Any]:
        return {"sink": self.sink, "recent": self.recent, "gates": self.alpha.detach().cpu().clone()}


def binarised(gates: torch.Tensor, sparsity: float, tiebreak: Any = None) -> torch.Tensor:
    """bool [layers, kv_heads]: the top (1 - sparsity) fraction of heads by gate keep the full cache.

    Gates clamped at 1 tie; `tiebreak` (same shape, higher first) orders them, e.g. how hard training
    still pushed each gate up; remaining ties break by head order (layer-major), so the result is
    deterministic.

    >>> binarised(torch.tensor([[0.9, 0.1], [0.5, 0.7]]), 0.5).tolist()
    [[True, False], [False, True]]
    >>> binarised(torch.tensor([[1.0, 1.0], [0.5, 0.7]]), 0.75, tiebreak=torch.tensor([[0.1, 0.3], [0, 0]])).tolist()
    [[False, True], [False, False]]
    """
    checks.number("sparsity", sparsity, low=0, high=1, high_open=True, why="the fraction of heads made local")
    flat = torch.as_tensor(gates, dtype=torch.float32).flatten().tolist()
    second = [0.0] * len(flat) if tiebreak is None else torch.as_tensor(tiebreak, dtype=torch.float32).flatten().tolist()
    if len(second) != len(flat):
        raise BadInputError(f"tiebreak has {len(second)} values for {len(flat)} gates")
    n_full = int(round((1 - sparsity) * len(flat)))
    order = sorted(range(len(flat)), key=lambda i: (-flat[i], -second[i], i))
    full = torch.zeros(len(flat), dtype=torch.bool)
    full[order[:n_full]] = True
    return full.view(torch.as_tensor(gates).shape)
