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

The compressed cache these policies drive, its layouts and the models it supports are described in
`probes.kv_cache`.

Example:
    >>> from probes import Engine
    >>> from probes.kv_policies import SinkRecent
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> recs = list(engine.generate("one two three four five six", max_new_tokens=4,
    ...                             interventions=[SinkRecent(sink=2, recent=3)]))
    >>> recs[-1].kv_bytes == 2 * 2 * (2 + 3) * 2 * 16 * 4   # layers, kv heads, entries, k+v, head_dim, fp32
    True
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from probes.kv_cache import CacheView, check_model, compressed_attention, new_cache
from probes.registered import Registered
from thoughtscope import checks
from thoughtscope.errors import BadInputError


class KVPolicy(Registered):
    """Base of KV-cache policies. Subclasses override `keep` (or use one of the bases below).

    `keep(view) -> bool [batch, heads, entries]`: which entries of `view` stay in the cache after
    this forward. `visible(view) -> bool [batch, heads, queries, entries] | None`: which entries
    each new query may read (None: all present, causally); override it only when a policy must
    also restrict the prompt's own attention (a sliding window), so that dropping never changes
    what a later query would have read.

    A policy installs itself into a generation: it asks the call for its compressed cache
    (`call.cache_factory`) and switches the model's attention to it for the call (`install`).
    Declared constraints: generation only, at most one per call, it replaces the attention.
    """

    modes: ClassVar[tuple[str, ...]] = ("generate",)
    elsewhere: ClassVar[str] = "a KV policy shapes the cache during generation; pass it to generate()"
    exclusive: ClassVar[str] = "kv_policy"
    exclusive_hint: ClassVar[str] = "pass at most one KV policy; combine rules in one KVPolicy subclass"
    replaces_attention: ClassVar[bool] = True

    def bind(self, call: Any) -> "KVPolicy":
        check_model(call.handle)
        bound = self.validate(call.arch)
        total = max(call.lengths, default=0) + call.max_new_tokens
        if bound.max_entries() is not None and bound.max_entries() >= total:
            warnings.warn(f"{bound.describe()} keeps up to {bound.max_entries()} entries per head, more than this "
                          f"generation's {total} tokens: nothing will be dropped", stacklevel=4)
        call.cache_factory = lambda: new_cache(call.handle, bound)
        return bound

    def install(self, call: Any) -> Any:
        return compressed_attention(call.handle.model, call.cache, want_weights=call.runner.needs_eager)

    def keep(self, view: CacheView) -> torch.Tensor:
        return torch.ones_like(view.valid)

    def visible(self, view: CacheView) -> torch.Tensor | None:
        return None

    def max_entries(self) -> int | None:
        """The most entries a compressed head keeps (None: unbounded); a generation shorter than this drops nothing."""
        return None

    def local_heads(self, layer: int, n_kv_heads: int) -> torch.Tensor | None:
        """bool [n_kv_heads]: for a positional policy, which heads of `layer` keep only sink + recent entries
        (the others keep everything), so the cache can use its fast window layout; None (the default) for a
        policy that decides entry by entry through `keep`/`visible` (the general layout)."""
        return None

    def describe(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.parameters() if n not in self.tensor_fields)
        return f"KV policy {type(self).__name__}({args})"


@dataclass
class KeepAll(KVPolicy):
    """Keep every entry: the compressed cache's plumbing with nothing dropped (equals the plain cache)."""

    kind: ClassVar[str] = "kv_keep_all"

    def local_heads(self, layer: int, n_kv_heads: int) -> torch.Tensor:
        return torch.zeros(n_kv_heads, dtype=torch.bool)


class WindowPolicy(KVPolicy):
    """Base of positional policies: a local head keeps (and reads) the first `sink` and last `recent`
    positions; other heads keep everything. Subclasses override `is_local` and define `sink`, `recent`."""

    sink: int
    recent: int

    def is_local(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        """bool [len(heads)]: which of these KV heads of `layer` keep only sink + recent entries."""
        raise NotImplementedError

    def _check(self, arch: Any) -> None:
        checks.window(self.sink, self.recent, arch.context_length, owner=type(self).__name__,
                      hint="nothing would ever be dropped; use KeepAll or a smaller window")

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

    def local_heads(self, layer: int, n_kv_heads: int) -> torch.Tensor:
        return self.is_local(layer, torch.arange(n_kv_heads)).bool().cpu()


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
        self.full_heads_ = full

    def is_local(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        return ~self.full_heads_[layer, heads.cpu()]

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
        checks.integer(f"{type(self).__name__}.budget", self.budget, low=1)
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
        for name in ("window", "kernel"):  # a window or pooling wider than the context reads nothing more
            checks.integer(f"SnapKVPolicy.{name}", getattr(self, name), low=1, high=arch.context_length)
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


