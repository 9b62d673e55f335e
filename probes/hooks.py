"""The hook runner: registers PyTorch hooks for one engine call, applies site edits, captures sites.

Why plain `torch` hooks rather than an nnsight trace per token: streaming generation yields a
record after every forward, and the engine's own KV-cached loop must run between tokens;
nnsight's `generate` runs the whole generation inside one trace. nnsight stays the tool for
ad-hoc traces and remote NDIF execution (`ModelHandle.nnsight`), and a test checks that both
read the same activations.

One hook per (module, input/output): edits on that module's sites run first, in the order they
were installed, then captures read the edited value, so a capture shows what the model computed on.
The runner knows no intervention kind: a site edit installs itself (`Intervention.install` ->
`runner.editing(site, edit)`) and the runner calls its `apply(view, ctx)`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from probes.sites import Site, get_module


def to_canonical(site: Site, x: torch.Tensor, arch: Any, batch: int) -> torch.Tensor:
    """A module's raw tensor -> the site's [batch, seq, ...] view (heads split, router un-flattened)."""
    if site.kind in ("q", "z"):
        return x.view(*x.shape[:-1], arch.n_heads, -1)
    if site.kind in ("k", "v"):
        return x.view(*x.shape[:-1], arch.n_kv_heads, -1)
    if site.kind in ("router", "experts", "expert_gates"):  # the router flattens batch and sequence
        return x.view(batch, -1, x.shape[-1])
    if site.kind == "attn_pattern":
        return x.transpose(1, 2)  # [B, H, T, kv] -> [B, T, H, kv]: position axis second
    return x


@dataclass
class ForwardContext:
    """What the hooks need to know about the forward in flight, and what installed edits report of it.

    `positions` [batch, seq] are the token positions of this forward's columns (0 = a sequence's first
    real token, whatever its left padding; None where the engine gives none); `prompt_lengths` the
    prompt tokens of each row in a generation (None in a teacher-forced pass). `fired` collects what
    installed interventions report (`fire`): a [batch, seq] tensor under a name (one number per row and
    position of this forward, NaN where nothing acted), read into the records: `TokenRecord.fired[name]`
    is its row's value at the last position (the one that chose the token), `Trace.fired[name]` the
    [seq] values of its one row ([rows, seq] when row masks ran several)."""

    batch: int = 1
    seq: int = 1
    phase: str = "trace"  # "trace", "prefill", "context" (prompt part that predicts nothing) or "decode"
    last_only: bool = False  # capture only the last position (generation)
    positions: torch.Tensor | None = None
    prompt_lengths: list[int] | None = None
    fired: dict[str, torch.Tensor] = field(default_factory=dict)

    def fire(self, name: str, values: torch.Tensor) -> None:
        """Report `values` [batch, seq] (this forward's rows and positions) under `name`; a later report
        under the same name in the same forward replaces it."""
        self.fired[name] = values.detach().float().cpu()

    def take_fired(self) -> dict[str, torch.Tensor]:
        fired, self.fired = self.fired, {}
        return fired


@dataclass
class _Handler:
    site: Site
    edits: list[Any] = field(default_factory=list)  # installed site edits: objects with apply(view, ctx)
    capture: bool = False


class StepBlocks:
    """Slots for one site's per-step values [batch, 1, ...], allocated a block at a time: blocks start at
    `FIRST` slots and double up to `MOST` slots or `BLOCK_BYTES`, so a short stream wastes little and a long one
    allocates a block per few hundred steps. A slot is written once and never reused; a block lives while any
    record holds a view of it. A value of another shape than the block's (attention patterns grow by a key each
    step) is copied on its own, and the site is copied on its own from then on.

    A record's value pickled on its own carries its whole block (pickle writes a view's storage: 590 kB for
    one 2.3 kB slot of SmolLM2's 256-slot block); `.clone()` a value before pickling it (safetensors, the
    server's wire format, writes the view's bytes only)."""

    FIRST, MOST, BLOCK_BYTES = 16, 256, 1 << 20

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.used = 0
        self.size = 0
        self.varying = False

    @classmethod
    def next_size(cls, size: int, slot_bytes: int) -> int:
        """Slots of the block after one of `size` slots (0: the first block), for values of `slot_bytes`."""
        cap = max(1, min(cls.MOST, cls.BLOCK_BYTES // max(1, slot_bytes)))
        return min(cap, max(cls.FIRST, 2 * size))

    @classmethod
    def slots_for(cls, steps: int, slot_bytes: int) -> int:
        """Slots allocated once `steps` values of `slot_bytes` each are kept (what a stream's memory estimate
        counts: the last block's unused slots are held too)."""
        total = size = 0
        while total < steps:
            size = cls.next_size(size, slot_bytes)
            total += size
        return total

    def keep(self, value: torch.Tensor) -> torch.Tensor:
        if self.varying:
            return value.clone()
        block = self.block
        if block is not None and block.shape[1:] != value.shape:  # the shape changed between steps
            self.varying, self.block = True, None
            return value.clone()
        if block is None or self.used == block.shape[0] or block.dtype != value.dtype or block.device != value.device:
            self.size = self.next_size(self.size, value.numel() * value.element_size())
            block = self.block = torch.empty((self.size, *value.shape), dtype=value.dtype, device=value.device)
            self.used = 0
        slot = block[self.used]
        self.used += 1
        slot.copy_(value)
        return slot


class HookRunner:
    """Context manager: hooks in on enter, out on exit; `captured` holds the latest forward's values.

    Edits join with `editing(site, edit)` before or while the runner is entered (a hook is registered
    for a module the first time something needs it)."""

    def __init__(self, handle: Any, capture: list[Site]):
        self.handle = handle
        self.ctx = ForwardContext()
        self.captured: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, StepBlocks] = {}  # per captured site: where decode steps' values are kept
        self._groups: dict[tuple[str, str], list[_Handler]] = defaultdict(list)
        self._by_site: dict[str, _Handler] = {}
        for site in capture:
            self._handler(site).capture = True
        self._removers: dict[tuple[str, str], Any] = {}
        self._entered = False
        self.needs_eager = any(h.site.spec.needs_eager_attention for h in self._by_site.values())
        self._saved_attn: str | None = None

    def _handler(self, site: Site) -> _Handler:
        if site.name not in self._by_site:
            handler = self._by_site[site.name] = _Handler(site)
            self._groups[(site.module_path(self.handle.family), site.spec.read)].append(handler)
        return self._by_site[site.name]

    @contextlib.contextmanager
    def editing(self, site: Site, edit: Any) -> Iterator[None]:
        """`edit.apply(view, ctx)` runs at `site` (after the edits installed before it) until the block ends."""
        handler = self._handler(site)
        handler.edits.append(edit)
        if self._entered:
            self._hook(site.module_path(self.handle.family), site.spec.read)
        try:
            yield
        finally:
            handler.edits.remove(edit)

    def __enter__(self) -> "HookRunner":
        model = self.handle.model
        if self.needs_eager and model.config._attn_implementation != "eager":
            self._saved_attn = model.config._attn_implementation
            model.set_attn_implementation("eager")
        self._entered = True
        for path, read in list(self._groups):
            self._hook(path, read)
        return self

    def _hook(self, path: str, read: str) -> None:
        key = (path, read)
        handlers = self._groups[key]
        if key in self._removers or not any(h.edits or h.capture for h in handlers):
            return
        module = get_module(self.handle.model, path)
        if read == "input":
            self._removers[key] = module.register_forward_pre_hook(self._pre_hook(handlers), with_kwargs=True)
        else:
            self._removers[key] = module.register_forward_hook(self._post_hook(handlers))

    def __exit__(self, *exc: Any) -> None:
        for hook in self._removers.values():
            hook.remove()
        self._removers.clear()
        self._entered = False
        if self._saved_attn is not None:
            self.handle.model.set_attn_implementation(self._saved_attn)
            self._saved_attn = None

    # --- shape conventions: every site is seen as [batch, seq, ...] inside the handlers ---

    def _to_canonical(self, site: Site, x: torch.Tensor) -> torch.Tensor:
        return to_canonical(site, x, self.handle.arch, self.ctx.batch)

    def _from_canonical(self, site: Site, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if site.kind == "attn_pattern":
            return x.transpose(1, 2)
        return x.reshape(like.shape)

    def _run(self, handlers: list[_Handler], x: torch.Tensor) -> torch.Tensor:
        for h in handlers:
            if not h.edits and not h.capture:
                continue
            view = self._to_canonical(h.site, x)
            if h.edits:
                for edit in h.edits:
                    view = edit.apply(view, self.ctx)
                x = self._from_canonical(h.site, view, x)
            if h.capture:
                kept = view[:, -1:] if self.ctx.last_only else view
                self.captured[h.site.name] = self._keep(h.site.name, kept.detach())
        return x

    def _keep(self, name: str, kept: torch.Tensor) -> torch.Tensor:
        """A copy of one forward's captured value that outlives the forward.

        One position per row (a decode step) goes into the next slot of a block of `StepBlocks`; the records of
        a stream keep views of it. Why not one small tensor per site and step: a stream keeps thousands of them,
        and freed heap stayed resident around them (glibc fragmentation, most likely among the holes each step's
        large transients leave; `malloc_trim` handed it back): a 2,048-token stream capturing all 30 sites of
        SmolLM2 peaked at 673-850 MB for 240 MB of captures and KV cache, faster than linear; with blocks, 324 MB
        (docs/curves.md, the issue's sizes). Longer captures (a prompt, a trace) are one tensor each, as before."""
        if kept.shape[1] != 1:
            return kept.clone()
        blocks = self._blocks.get(name)
        if blocks is None:
            blocks = self._blocks[name] = StepBlocks()
        return blocks.keep(kept)

    def _post_hook(self, handlers: list[_Handler]):
        def hook(module: Any, args: Any, output: Any) -> Any:
            by_index: dict[int, list[_Handler]] = defaultdict(list)
            for h in handlers:
                by_index[h.site.spec.index or 0].append(h)
            if isinstance(output, tuple):
                items = list(output)
                for i, hs in by_index.items():
                    if items[i] is not None:
                        items[i] = self._run(hs, items[i])
                return tuple(items)
            return self._run(by_index[0], output)

        return hook

    def _pre_hook(self, handlers: list[_Handler]):
        def hook(module: Any, args: Any, kwargs: Any) -> Any:
            if args:
                return (self._run(handlers, args[0]), *args[1:]), kwargs
            kwargs["hidden_states"] = self._run(handlers, kwargs["hidden_states"])
            return args, kwargs

        return hook
