"""The hook runner: registers PyTorch hooks for one engine call, applies interventions, captures sites.

Why plain `torch` hooks rather than an nnsight trace per token: streaming generation yields a
record after every forward, and the engine's own KV-cached loop must run between tokens;
nnsight's `generate` runs the whole generation inside one trace. nnsight stays the tool for
ad-hoc traces and remote NDIF execution (`ModelHandle.nnsight`), and a test checks that both
read the same activations.

One hook per (module, input/output): interventions on that module's sites run first, in the
order given, then captures read the edited value, so a capture shows what the model computed on.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from probes.interventions import Intervention
from probes.routing import RouterRule
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
    """What the hooks need to know about the forward in flight."""

    batch: int = 1
    seq: int = 1
    phase: str = "trace"  # "trace", "prefill", "context" (prompt part that predicts nothing) or "decode"
    last_only: bool = False  # capture only the last position (generation)


@dataclass
class _Handler:
    site: Site
    interventions: list[Intervention] = field(default_factory=list)
    capture: bool = False
    rules: list[RouterRule] = field(default_factory=list)  # replace the router's whole output tuple


class HookRunner:
    """Context manager: hooks in on enter, out on exit; `captured` holds the latest forward's values."""

    def __init__(self, handle: Any, capture: list[Site], interventions: list[Intervention]):
        self.handle = handle
        self.ctx = ForwardContext()
        self.captured: dict[str, torch.Tensor] = {}
        self._groups: dict[tuple[str, str], list[_Handler]] = defaultdict(list)
        by_site: dict[str, _Handler] = {}
        for iv in interventions:
            if isinstance(iv, RouterRule):  # one rule may cover every MoE layer (`router.*`)
                iv.validate(handle.arch)
                for site in iv.sites(handle.arch):
                    by_site.setdefault(site.name, _Handler(site)).rules.append(iv)
                continue
            site = iv.validate(handle.arch)
            by_site.setdefault(site.name, _Handler(site)).interventions.append(iv)
        for site in capture:
            by_site.setdefault(site.name, _Handler(site)).capture = True
        family = handle.family
        for handler in by_site.values():
            key = (handler.site.module_path(family), handler.site.spec.read)
            self._groups[key].append(handler)
        self._removers: list[Any] = []
        self._replaced: list[Any] = []  # router modules whose forward a rule replaces during this call
        self._columns: dict[str, int] = defaultdict(int)  # tokens each router has seen: the noise's column
        self.needs_eager = any(h.site.spec.needs_eager_attention for h in by_site.values())

    def __enter__(self) -> "HookRunner":
        model = self.handle.model
        self._saved_attn = None
        if self.needs_eager and model.config._attn_implementation != "eager":
            self._saved_attn = model.config._attn_implementation
            model.set_attn_implementation("eager")
        for (path, read), handlers in self._groups.items():
            module = get_module(model, path)
            for h in handlers:
                if h.rules:
                    self._replace_forward(h, module)
            if not any(h.interventions or h.capture for h in handlers):
                continue  # a router with a rule and nothing to capture or edit: a hook would only cost time
            if read == "input":
                hook = module.register_forward_pre_hook(self._pre_hook(handlers), with_kwargs=True)
            else:
                hook = module.register_forward_hook(self._post_hook(handlers))
            self._removers.append(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._removers:
            hook.remove()
        self._removers.clear()
        for module in self._replaced:
            del module.forward  # the instance attribute goes; the class's forward is back
        self._replaced.clear()
        if self._saved_attn is not None:
            self.handle.model.set_attn_implementation(self._saved_attn)

    # --- shape conventions: every site is seen as [batch, seq, ...] inside the handlers ---

    def _to_canonical(self, site: Site, x: torch.Tensor) -> torch.Tensor:
        return to_canonical(site, x, self.handle.arch, self.ctx.batch)

    def _from_canonical(self, site: Site, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if site.kind == "attn_pattern":
            return x.transpose(1, 2)
        return x.reshape(like.shape)

    def _run(self, handlers: list[_Handler], x: torch.Tensor) -> torch.Tensor:
        for h in handlers:
            if not h.interventions and not h.capture:
                continue
            view = self._to_canonical(h.site, x)
            if h.interventions:
                view = self._apply(h.interventions, view)
                x = self._from_canonical(h.site, view, x)
            if h.capture:
                kept = view[:, -1:] if self.ctx.last_only else view
                self.captured[h.site.name] = kept.detach().clone()
        return x

    def _apply(self, interventions: list[Intervention], view: torch.Tensor) -> torch.Tensor:
        for iv in interventions:
            if iv.where == "generated" and self.ctx.phase == "context":
                continue
            if iv.where == "generated" and self.ctx.phase == "prefill":
                # only the last prompt position predicts a generated token
                view = torch.cat([view[:, :-1], iv.edit(view[:, -1:])], dim=1)
            else:
                view = iv.edit(view)
        return view

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

    def _replace_forward(self, h: _Handler, module: Any) -> None:
        """Router rules replace the router's forward for this call: the router computes its logits and the
        rule its (gates, indices), which the MoE block uses. Replacing the forward, rather than rewriting
        the router's output in a hook, spares the router's own softmax and top-k, which the rule would
        discard (about 10% of a toy MoE's decode step). Hooks on the router still run around it."""
        own_forward = module.forward
        model_type = self.handle.arch.model_type

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
            batch = self.ctx.batch
            seq = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0] // batch
            start = self._columns[h.site.name]
            self._columns[h.site.name] = start + seq
            if len(h.rules) == 1:
                output = h.rules[0].routed_forward(module, hidden_states, model_type, h.site.layer, batch,
                                                   start, self.ctx.phase)
                if output is not None:
                    return output
            output = own_forward(hidden_states, *args, **kwargs)
            for rule in h.rules:  # each rule replaces the choice before it (where it applies)
                output = rule.route(module, output, model_type, h.site.layer, batch, start, self.ctx.phase)
            return output

        module.forward = forward
        self._replaced.append(module)

    def _pre_hook(self, handlers: list[_Handler]):
        def hook(module: Any, args: Any, kwargs: Any) -> Any:
            if args:
                return (self._run(handlers, args[0]), *args[1:]), kwargs
            kwargs["hidden_states"] = self._run(handlers, kwargs["hidden_states"])
            return args, kwargs

        return hook
