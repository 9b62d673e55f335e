"""The batch methods of an `ndif:` model, run as nnsight traces (on NDIF, or rehearsed with `remote="local"`).

An `ndif:` model has no weights here: each engine call becomes one nnsight trace (`lm.trace`, or `lm.generate`
for a generation) whose body reads and edits the same sites the engine's hooks do. The body is shipped to NDIF
by value (`shipped_by_value`, below), so it reuses the engine's own pieces rather than re-deriving them:
`to_canonical` for the site views, each bound intervention's `apply(view, ctx)` for the edit
(`probes.interventions`, `probes.edits`: the same maths), and after a generation `Engine._step_records` builds
the records from the saved per-step logits, exactly as the engine's loop does (records after the run, never
streamed). Attention masks of a teacher-forced pass (`MaskAttention`, `RowMask`) edit each chosen layer's
attention inputs inside the trace with the engine's own `AttentionMasker` (one rule, shipped by value), and a
VLM's images travel as trace inputs (pixel values, a Qwen-VL's image grid and token types), so visual
attribution's exhaustive effects run through one trace.

Shipping by value: a request ships this project's code it needs (`SHIPPED_BY_VALUE`: probes, thoughtscope)
by value, scoped to the request (`shipped_by_value`: cloudpickle's by-value registry, the one `nnsight.register`
fills; module-level caches travel empty; lru_cache'd functions re-wrapped; zero-argument `super()` methods keep
their `__class__` cell), so a stock NDIF server (no thoughtscope) can run it. nnsight alone would ship nothing
by value: it sees the editable install as an installed package.

The rehearsal is strict (`StrictRehearsal`): nnsight's `remote="local"` hides sys.path entries outside
site-packages, but an editable install's finder lives in site-packages, so hidden modules would be re-imported
from it. Here the request is deserialised and run with every project package out of sys.modules and refused by
a finder first on sys.meta_path (`without_project`), and with cloudpickle's class registry emptied so shipped
classes are rebuilt from source as in a fresh server process: a by-reference name or a run-time project import
fails the rehearsal as it would fail on NDIF. Still not rehearsed: a server's different Python, torch or
transformers version (functions travel as source; dataclass-generated methods as bytecode, tied to the Python
version).

`remote="local"` (nnsight 0.8) serialises the trace exactly as a real NDIF request, deserialises it
with this project unimportable, and runs it here: that is how the tests rehearse this path on
`tiny-random:` models and the embedded model (`rehearse`, model id `ndif-local:<zoo id>`).

`VERDICTS` says, for every capability of `probes.engine.CAPABILITIES`, whether an `ndif:` backend
serves it (through a trace), recomputes it (the same result by another route) or refuses it, and why
(after Neuronpedia interp-engine's `SUPPORTED_POINTS.md`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from probes.hooks import ForwardContext, to_canonical
from probes.registered import KINDS
from probes.remote import _envoy, _read_order
from probes.sites import FAMILIES, Site
from probes.token_masks import SteerRun  # module level: a shipped method finds it in its globals (by value)
from thoughtscope.errors import BadInputError

# capability -> (verdict, reason): what an ndif: backend does with it
VERDICTS: dict[str, tuple[str, str]] = {
    "trace": ("served", "one nnsight trace reads every asked site and the logits"),
    "capture_batch": ("served", "one nnsight trace over the right-padded batch; a prefix state is refused (see fork)"),
    "interventions": ("served", "site edits (add, rescale, ablate_heads and the steering edits) run inside the trace "
                                "through the same apply(); attention masks (MaskAttention, RowMask) in teacher-forced "
                                "passes edit each chosen layer's 4-D attention mask inside the trace (the engine's "
                                "AttentionMasker rule; eager or sdpa attention); masks in generate, router rules and "
                                "KV policies are refused: they replace module internals (the 2-D mask of a stream, "
                                "the router's forward, the cache) that a trace does not reach"),
    "generate": ("recomputed", "one nnsight generate: the same tokens, log-probs, entropies, captures and steering "
                               "reports, but the records come after the whole run, not streamed token by token "
                               "(a server sends them after it; a cancel or --max-stream-s acts between records, "
                               "not inside the run); masks and images in generate are refused"),
    "readout": ("served", "the final norm and the unembedding run on the vectors inside a trace"),
    "router": ("served", "router sites (router, experts, expert_gates) are read in traces and generations of an "
                         "MoE model; router rules (expert sampling) are refused"),
    "fork": ("refused", "prefix states are KV caches held in the process that ran the prefix; an NDIF trace returns "
                        "only the values it saves"),
    "grad": ("refused", "input x gradient runs a backward pass from input embeddings with the engine's hooks; "
                        "it is not ported to nnsight's remote backward"),
    "attention": ("refused", "attention patterns need eager attention, which the NDIF deployment does not run"),
    "kv_policy": ("refused", "a KV-cache policy replaces the generation's cache object, which a trace cannot ship"),
    "vision": ("refused", "an ndif: model loads no image processor here, so images cannot become pixel values "
                          "and image tokens (the ndif-local: rehearsal of a local VLM ships them as trace inputs)"),
    "head_gates": ("refused", "RLKV head gates train parameters inside the model's attention; that needs local weights"),
    "frozen_attention": ("refused", "frozen attention replaces the attention function; that needs local weights"),
}


VISION_SERVED = ("pixel values (and a Qwen-VL's image grid and token types) travel as inputs of the trace, whose "
                 "model computes its own (3-D rotary) positions: traces, captures and capture_batch with images, "
                 "attention masks over image tokens included; generation with images is refused (its decode "
                 "steps need the engine's 3-D positions)")


def verdict(capability: str) -> tuple[str, str]:
    return VERDICTS.get(capability, ("refused", "not ported to nnsight traces"))


def capability_report(handle: Any) -> list[dict[str, str]]:
    """Rows {capability, verdict, reason} for an ndif: model (router on a dense model is refused: no router)."""
    rows = []
    for name in VERDICTS:  # every capability of probes.engine.CAPABILITIES (a test holds the two equal)
        status, reason = verdict(name)
        if name == "router" and not handle.arch.is_moe:
            status, reason = "refused", f"{handle.arch.model_type} is a dense model: it has no router"
        if name == "vision" and handle._extras.get("vision") is not None:
            status, reason = "served", VISION_SERVED
        rows.append({"capability": name, "verdict": status, "reason": reason})
    return rows


def refused(handle: Any, what: str, capability: str) -> BadInputError:
    """The error for a refused capability: which, and why."""
    return BadInputError(f"{what} is refused on {handle.model_id}, which runs on NDIF (capability "
                         f"'{capability}'): {verdict(capability)[1]}; load the model locally with hf: for it")


def check_intervention(handle: Any, iv: Any) -> None:
    """Site edits and attention masks are served; every other kind is refused with its reason, before any request
    (masks in a generation are refused by `generate`)."""
    from probes.attention_masks import MaskAttention
    from probes.interventions import Intervention
    from probes.routing import RouterRule

    if isinstance(iv, RouterRule) or not isinstance(iv, (Intervention, MaskAttention)):
        raise BadInputError(f"{type(iv).__name__} ({iv.kind}) is refused on {handle.model_id}, which runs on NDIF: "
                            "router rules and KV policies replace module internals a trace does not reach; site "
                            "edits (add, rescale, ablate_heads, steering edits) and attention masks in "
                            "teacher-forced passes are served")


def _masker(handle: Any, call: Any) -> Any:
    """The call's attention masks as the engine's `AttentionMasker` (its `pairs` and mask edit, shipped by value
    in the trace body: the same rule), or None. No hooks: the trace edits each chosen layer's attention inputs."""
    from probes.attention_masks import AttentionMasker, AttentionMasks

    part = call.parts.get(AttentionMasks)
    if part is None or not part.masks:
        return None
    return AttentionMasker(None, part.masks)  # the handle (the weights) stays here: pairs() reads the masks only


def _mask_layers(masker: Any, n_layers: int) -> list[int]:
    return sorted({layer for m in masker.masks for layer in (m.layers if m.layers is not None else range(n_layers))})


def remote_mode(handle: Any) -> bool | str:
    """What `remote=` the handle's traces take: True (NDIF) or "local" (the rehearsal)."""
    return handle._extras.get("ndif_remote", True)


# ----- shipping this project by value, and a rehearsal that proves it -----

# what travels by value in a request (cloudpickle ships these packages' classes and functions as source)
SHIPPED_BY_VALUE = ("probes", "thoughtscope")
# this project's top-level packages: a stock NDIF server has none of them
PROJECT_PACKAGES = ("probes", "thoughtscope", "analyses", "app", "saes", "cache")


def _empty_cache(d: Any) -> tuple:
    return (type(d), ())


# module-level caches a shipped function may refer to: they travel empty (a server fills its own)
_CACHE_TYPES = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, threading.local)


def _lru(wrapped: Any, maxsize: Any, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(wrapped)


def _lru_reduce(cached: Any) -> Any:
    """An lru_cache'd function of this project travels as its function (by value) re-wrapped, cache empty;
    any other one by reference, as pickle does."""
    wrapped = cached.__wrapped__
    if getattr(wrapped, "__module__", "").split(".")[0] in SHIPPED_BY_VALUE:
        params = cached.cache_parameters()
        return (_lru, (wrapped, params["maxsize"], params["typed"]))
    return cached.__reduce__()


def _load_method(source: str, name: str, defaults: Any, kwdefaults: Any, annotations: Any, filename: str,
                 line: int) -> Any:
    """nnsight's `_load_function` for a method that uses zero-argument `super()`: the source is compiled inside a
    class body, so its code keeps the `__class__` cell (filled by `_fill_method` with the shipped class)."""
    import builtins
    import textwrap
    import types

    padded = "\n" * max(line - 2, 0) + "class _Shipped:\n" + textwrap.indent(source, "    ")
    module_code = compile(padded, f"[{name}:{line}] {filename}", "exec")
    body = next(c for c in module_code.co_consts if isinstance(c, types.CodeType))
    code = [c for c in body.co_consts if isinstance(c, types.CodeType) and c.co_name == name][-1]
    cells = tuple(types.CellType() for _ in code.co_freevars)
    func = types.FunctionType(code, {"__builtins__": builtins.__dict__}, name, defaults, cells)
    if kwdefaults:
        func.__kwdefaults__ = kwdefaults
    if annotations:
        func.__annotations__ = annotations
    return func


def _fill_method(func: Any, state: dict) -> None:
    state = dict(state)
    for name, cell in zip(func.__code__.co_freevars, func.__closure__):
        cell.cell_contents = state.pop(name)
    func.__globals__.update(state)


def _reduce_keeping_class_cell(original: Any) -> Any:
    def reduce(pickler: Any, func: Any) -> Any:
        rv = original(pickler, func)
        if func.__code__.co_freevars != ("__class__",) or len(rv) != 6 or rv[0].__name__ != "_load_function":
            return rv
        _, args, state, a, b, _ = rv
        return (_load_method, args, {**state, "__class__": func.__closure__[0].cell_contents}, a, b, _fill_method)
    return reduce


@contextlib.contextmanager
def shipped_by_value() -> Iterator[None]:
    """While serialising a request: this project's modules pickle by value (cloudpickle's registry, the one
    `nnsight.register` fills), and a module-level cache that a shipped function refers to (a weak dictionary,
    e.g. token_masks' tokenizer pieces, or a thread-local, e.g. routing's generators) travels empty (the server
    fills its own), an lru_cache'd function as its function re-wrapped, and a method using zero-argument
    `super()` with its `__class__` cell (nnsight's source reducer recompiles a function at module level, which
    loses the cell). Scoped to the request,
    so other cloudpickle users in this process (Ray) keep pickling the project by reference."""
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES, Pickler

    added = [m for m in SHIPPED_BY_VALUE if m not in _PICKLE_BY_VALUE_MODULES]
    table = Pickler._dispatch_table
    reducers = {**{t: _empty_cache for t in _CACHE_TYPES}, functools._lru_cache_wrapper: _lru_reduce}
    weak = [t for t in reducers if t not in table]
    from nnsight.intervention.serialization import CustomCloudPickler

    source_reduce = CustomCloudPickler._dynamic_function_reduce
    CustomCloudPickler._dynamic_function_reduce = _reduce_keeping_class_cell(source_reduce)
    _PICKLE_BY_VALUE_MODULES.update(added)
    for t in weak:
        table[t] = reducers[t]
    # the kind registry travels with the shipped modules: kinds registered from an importable module outside
    # this project (a test file, a user's package) would travel by reference to a module the server lacks,
    # so they stay behind for the request (a kind defined in __main__ travels by value, as cloudpickle does)
    foreign = {k: c for k, c in KINDS.items()
               if c.__module__.split(".")[0] not in (*SHIPPED_BY_VALUE, "__main__")}
    for k in foreign:
        del KINDS[k]
    try:
        yield
    finally:
        KINDS.update(foreign)
        CustomCloudPickler._dynamic_function_reduce = source_reduce
        _PICKLE_BY_VALUE_MODULES.difference_update(added)
        for t in weak:
            table.pop(t, None)


class _NoProject(importlib.abc.MetaPathFinder):
    """A finder that refuses this project's packages (first on sys.meta_path, ahead of the editable install's)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in PROJECT_PACKAGES:
            raise ModuleNotFoundError(f"No module named {name!r} (the ndif-local: rehearsal runs the request as a "
                                      "stock NDIF server would: without thoughtscope installed)", name=name)
        return None


@contextlib.contextmanager
def without_project() -> Iterator[None]:
    """This project's modules out of sys.modules and unimportable, as on a server without thoughtscope; put back
    after. Code already loaded keeps its module globals: only a by-reference name or a run-time import fails."""
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in PROJECT_PACKAGES}
    blocker = _NoProject()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)
        for name in [n for n in sys.modules if n.split(".")[0] in PROJECT_PACKAGES]:
            sys.modules.pop(name)  # nothing should be here; never keep a half-import
        sys.modules.update(hidden)


class StrictRehearsal:
    """nnsight's `remote="local"` backend made strict: the request is serialised as NDIF would receive it (this
    project by value), then deserialised AND run with this project unimportable (`without_project`), with
    cloudpickle's class registry emptied meanwhile so every shipped class is rebuilt from its source, as in a
    fresh server process (in-process cloudpickle would otherwise hand back the live classes). A request that
    refers to this project by reference, or imports it while it runs, fails here as it would on NDIF.

    For tests and rehearsal only: while a request deserialises and runs, the project is unimportable for every
    thread of this process (nnsight runs a trace's body in worker threads), so a concurrent lazy project import
    elsewhere (a server thread serving another request) fails for that moment."""

    def __init__(self, model: Any):
        from nnsight.intervention.backends.local import LocalSimulationBackend

        self.simulation = LocalSimulationBackend(model)
        self.model = model

    def __call__(self, tracer: Any) -> None:
        import linecache

        import cloudpickle.cloudpickle as cp
        from nnsight.schema.request import RequestModel

        with shipped_by_value():
            blob = RequestModel.serialize(tracer, compress=False)
        persistent = self.model._remoteable_persistent_objects()
        filename = tracer.info.frame.f_code.co_filename
        saved_line = linecache.cache.get(filename)
        by_id, by_class = cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS
        cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS = weakref.WeakValueDictionary(), \
            weakref.WeakKeyDictionary()
        try:
            with without_project():
                hidden = self.simulation._hide_local_modules()  # nnsight's own hiding, for the deserialise
                try:
                    restored = RequestModel.deserialize(blob, persistent, compress=False)
                finally:
                    self.simulation._restore(hidden)
                    cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS = by_id, by_class
                    if saved_line is not None:
                        linecache.cache[filename] = saved_line
                    else:
                        linecache.cache.pop(filename, None)
                tracer.info.code = restored.info.code
                tracer.execute(tracer.info.code)
        finally:
            cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS = by_id, by_class


class _ShipByValue:
    """nnsight's NDIF backend with this project shipped by value in the request (`shipped_by_value`)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, tracer: Any) -> Any:
        with shipped_by_value():
            return self.inner(tracer)


def backend(handle: Any) -> Any:
    """The nnsight backend of the handle's traces: NDIF with this project by value, or the strict rehearsal."""
    lm = handle.nnsight
    if remote_mode(handle) == "local":
        return StrictRehearsal(lm)
    return _ShipByValue(lm._remote_backend(True, True, None, False))


def rehearse(handle: Any) -> Any:
    """A handle that behaves as an `ndif:` model (no local hooks, every call an nnsight trace) but runs its
    traces with `remote="local"` over the weights of a loaded local `handle` (shared, never changed: the
    rehearsal registers no hooks). `Engine(rehearse(engine.handle))` is how the tests pair the two paths;
    the model id `ndif-local:<zoo id>` opens one (probes.zoo)."""
    import dataclasses

    # one nnsight wrapper per module tree, shared; a local VLM's vision spec (its processor) turns images into
    # the pixel inputs the trace ships
    extras = {"ndif_remote": "local", "vision": handle.vision, "nnsight": handle.nnsight}
    return dataclasses.replace(handle, model_id=f"ndif-local:{handle.model_id}", remote=True, _extras=extras)


# ----- the program a trace body runs (shipped to NDIF by value) -----


@dataclass
class _Handler:
    site: Site
    edits: list[Any] = field(default_factory=list)
    capture: bool = False


@dataclass
class _Group:
    path: str
    read: str  # "input", "output", or "inputs" (an attention module's (args, kwargs): a mask edit)
    handlers: list[_Handler]
    mask_layer: int | None = None

    @property
    def edits(self) -> bool:
        return any(h.edits for h in self.handlers)


@dataclass
class SiteProgram:
    """What one forward does at each module it touches, in forward order: the engine's hook runner as data.

    `run(group, value)` is what a hook would do (edits in order, then the capture of the edited view);
    it runs inside the trace body, on the server, with `ctx` the forward's `ForwardContext`."""

    arch: Any
    groups: list[_Group]
    ctx: ForwardContext
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    masker: Any = None  # the call's AttentionMasker (probes.attention_masks), or None

    @classmethod
    def build(cls, handle: Any, capture: list[Site], edits: list[Any], ctx: ForwardContext,
              masker: Any = None) -> "SiteProgram":
        family = handle.family
        by_site: dict[str, _Handler] = {}
        order: dict[tuple[str, str], tuple[int, int]] = {}
        groups: dict[tuple[str, str], list[_Handler]] = {}

        def handler(site: Site) -> _Handler:
            if site.name not in by_site:
                by_site[site.name] = _Handler(site)
                key = (site.module_path(family), site.spec.read)
                groups.setdefault(key, []).append(by_site[site.name])
                order[key] = _read_order(site)
            return by_site[site.name]

        for site in capture:
            if site.name != "logits":
                handler(site).capture = True
        for edit in edits:
            handler(edit.site_).edits.append(edit)
        mask_layers: dict[tuple[str, str], int] = {}
        if masker is not None:  # each masked layer's attention inputs: after the layer's input, before q_proj
            paths = FAMILIES[family]
            for layer in _mask_layers(masker, handle.arch.n_layers):
                key = (f"{paths['layers']}.{layer}.{paths['attn']}", "inputs")
                groups[key], order[key], mask_layers[key] = [], (layer, 0.5), layer
        keys = sorted(groups, key=lambda k: order[k])
        return cls(handle.arch, [_Group(path, read, groups[(path, read)], mask_layers.get((path, read)))
                                 for path, read in keys], ctx, masker=masker)

    def step(self, lm: Any, group: _Group) -> None:
        """What the hooks at `group`'s module do, inside the trace body: read (and write back) its value."""
        env = _envoy(lm, group.path)
        if group.read == "inputs":  # the engine's AttentionMasker pre-hook, on the module's (args, kwargs)
            args, kwargs = env.inputs
            edited = self.masker._hook(group.mask_layer)(None, args, kwargs)
            if edited is not None:
                env.inputs = edited
        elif group.read == "input":
            value = self.run(group, env.input)
            if group.edits:
                env.input = value
        else:
            value = self.run(group, env.output)
            if group.edits:
                env.output = value

    def run(self, group: _Group, value: Any) -> Any:
        if isinstance(value, tuple):
            items = list(value)
            for h in group.handlers:
                i = h.site.spec.index or 0
                items[i] = self._one(h, items[i])
            return tuple(items)
        for h in group.handlers:
            value = self._one(h, value)
        return value

    def _one(self, h: _Handler, x: torch.Tensor) -> torch.Tensor:
        view = to_canonical(h.site, x, self.arch, self.ctx.batch)
        if h.edits:
            for edit in h.edits:
                view = edit.apply(view, self.ctx)
            x = view.reshape(x.shape)
        if h.capture:
            kept = view[:, -1:] if self.ctx.last_only else view
            # a copy per step, not a slot of `probes.hooks.StepBlocks` as in the engine's hooks: each step's
            # values travel back serialised, and a view would carry its whole block's storage with it
            self.captured[h.site.name] = kept.detach().clone()
        return x

    def results(self) -> dict[str, Any]:
        return {"captured": dict(self.captured), "fired": self.ctx.take_fired()}


def _bound_edits(call: Any, ids_batch: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> list[Any]:
    """The call's bound site edits, with each steering term's token mask worked out here for a teacher-forced
    forward (the engine's `SteerRun` reads it from a model pre-hook, which a trace has no place for)."""
    from probes.token_masks import SteerRun

    run = call.parts.get(SteerRun.KEY)
    if run is not None:
        run._before_forward(None, (ids_batch,), {"position_ids": positions, "attention_mask": mask})
        for term in run.members:
            term.run_ = _FixedMask(run.masks[id(term)])
    return _site_edits(call)


def _site_edits(call: Any) -> list[Any]:
    """The call's bound site edits, in order (its attention masks go to the masker)."""
    from probes.attention_masks import MaskAttention

    return [b for b in call.bound if not isinstance(b, MaskAttention)]


class _FixedMask:
    """A steering term's mask for one forward, carried with the term (ids differ once the term is shipped)."""

    shadow = False

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def apply(self, term: Any, view: torch.Tensor):
        self.masks = {id(term): self.mask}
        return SteerRun.apply(self, term, view)


def forward(handle: Any, call: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, sites: list[Site],
            want_logits: bool = True, stop_after_last_site: bool = False,
            vision: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], Any, dict]:
    """One teacher-forced forward as an nnsight trace: ({site: [batch, seq, ...]}, logits [batch, seq, vocab]
    or None, {fired name: [batch, seq]})."""
    import nnsight

    lm = handle.nnsight
    batch, seq = input_ids.shape
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    positions = torch.arange(seq).expand(batch, seq)
    ctx = ForwardContext(batch=batch, seq=seq, phase="trace", positions=positions)
    program = SiteProgram.build(handle, sites, _bound_edits(call, input_ids, mask, positions), ctx,
                                masker=_masker(handle, call))
    want_logits = want_logits or any(s.name == "logits" for s in sites)
    inputs = {"input_ids": input_ids, "attention_mask": mask, **(vision or {})}
    head = _envoy_path(handle, Site("logits", None))
    with lm.trace(inputs, backend=backend(handle)) as tracer:
        for group in program.groups:
            program.step(lm, group)
        logits = _envoy(lm, head).output if want_logits else None
        out = nnsight.save({"program": program.results(), "logits": logits})
        if not want_logits and stop_after_last_site:
            tracer.stop()
    logits = out["logits"]
    if logits is not None and "logits" in [s.name for s in sites]:
        out["program"]["captured"]["logits"] = logits.detach()
    return out["program"]["captured"], logits, out["program"]["fired"]


def trace_rows(handle: Any, call: Any, ids: list[int], sites: list[Site], logits_to_keep: int = 0,
               vision: dict[str, Any] | None = None):
    """`Engine._capture_forward` of an ndif: model: ({site: [seq, ...]}, logits [seq, vocab] or None), or with
    row masks (`call.rows` > 1) the same ids as that many batch rows, [rows, seq, ...] out; the edits' reports
    are left in `call.runner.ctx.fired` as after a local forward. A capture that returns no logits reads none
    and stops after its deepest site."""
    check_sites(handle, sites)
    layered = all(s.layer is not None for s in sites)
    n_rows = call.rows
    if n_rows > 1 and vision:  # every row sees the same image(s), as in the engine
        vision = {k: v.repeat(n_rows, *[1] * (v.ndim - 1)) if torch.is_tensor(v) else v for k, v in vision.items()}
    acts, logits, fired = forward(handle, call, torch.tensor([ids] * n_rows), None, sites,
                                  want_logits=logits_to_keep == 0 or not layered, stop_after_last_site=layered,
                                  vision=vision)
    call.runner.ctx.fired = fired
    if n_rows > 1:
        return acts, logits
    return {name: v[0] for name, v in acts.items()}, None if logits is None else logits[0]


def _envoy_path(handle: Any, site: Site) -> str:
    return site.module_path(handle.family)


def readout_rows(handle: Any, rows: torch.Tensor, norm: bool) -> torch.Tensor:
    """Logits of `rows` [n, d_model] through the final norm (with `norm`) and the unembedding, in one trace.

    The trace runs the model on one token (its output is ignored) so the body may call the two modules."""
    import nnsight

    lm = handle.nnsight
    norm_path = FAMILIES[handle.family]["final_norm"]
    head_path = _envoy_path(handle, Site("logits", None))
    with lm.trace({"input_ids": torch.zeros(1, 1, dtype=torch.long)}, backend=backend(handle)):
        x = _envoy(lm, norm_path)(rows) if norm else rows
        logits = nnsight.save(_envoy(lm, head_path)(x))
    return logits


class EngineChoice:
    """A logits processor that makes `generate` pick the token the engine's sampler picks (`Engine._choose`
    with the engine's seeded generator), so a sampled NDIF generation equals the engine's token for token.
    Built on the server on first use (a torch generator does not travel)."""

    def __init__(self, choose: Any, sampling: Any, seed: int):
        self.choose, self.sampling, self.seed, self.gen = choose, sampling, int(seed), None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.gen is None:
            self.gen = torch.Generator(device="cpu").manual_seed(self.seed)
        logp = torch.log_softmax(scores.float(), dim=-1)
        chosen = self.choose(None, scores, logp, self.sampling, self.gen)  # Engine._choose, shipped by value
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(-1, chosen.view(-1, 1), 0.0)


def generate_steps(handle: Any, call: Any, input_ids: torch.Tensor, mask: torch.Tensor, sites: list[Site],
                   max_new_tokens: int, sampling: Any, seed: int, eos_ids: list[int], pad_id: int,
                   choose: Any) -> list[dict]:
    """One nnsight `generate` under the call's site edits: per decoding step, the last position's logits
    [batch, vocab], captures {site: [batch, 1, ...]} and reports {name: [batch, 1]}."""
    import nnsight
    from transformers import GenerationConfig, LogitsProcessorList

    from probes.token_masks import SteerRun

    lm = handle.nnsight
    batch, seq = input_ids.shape
    flat = (mask.cumsum(-1) - 1).clamp(min=0)
    ctx = ForwardContext(batch=batch, seq=seq, phase="prefill", last_only=True, positions=flat,
                         prompt_lengths=[int(n) for n in mask.sum(-1)])
    run = call.parts.get(SteerRun.KEY)
    if run is not None:  # the prompt's masks here (it needs the tokenizer); a step's masks on the server
        run._before_forward(None, (input_ids,), {"position_ids": flat, "attention_mask": mask})
        run = _ShippedRun.of(run)
        for term in run.members:
            term.run_ = run
    program = SiteProgram.build(handle, sites, _site_edits(call), ctx)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                              pad_token_id=pad_id)
    head = _envoy_path(handle, Site("logits", None))
    embed = _embedding_path(handle) if run is not None else None
    inputs = {"input_ids": input_ids, "attention_mask": mask}
    with lm.generate(inputs, generation_config=config, backend=backend(handle),
                     logits_processor=LogitsProcessorList([EngineChoice(choose, sampling, seed)])) as tracer:
        steps = nnsight.save([])
        state = {"mask": mask, "flat": flat}
        for t in tracer.iter[:max_new_tokens]:
            if t > 0:
                state["mask"] = torch.cat([state["mask"], torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
                state["flat"] = state["flat"][:, -1:] + 1
                program.ctx.phase, program.ctx.seq, program.ctx.positions = "decode", 1, state["flat"]
            if embed is not None:
                run.see(t, _envoy(lm, embed).input, state["flat"], state["mask"])
            for group in program.groups:
                program.step(lm, group)
            steps.append({"logits": _envoy(lm, head).output[:, -1].detach().clone(), **program.results()})
    return list(steps)


class _ShippedRun:
    """The steering run as it travels: the prompt's excluded positions worked out here, each step's term masks
    computed on the server from that step's token ids (`SteerRun._mask`, the same rule)."""

    shadow = False

    @classmethod
    def of(cls, run: Any) -> "_ShippedRun":
        shipped = cls()
        shipped.members, shipped.prompt_lens = run.members, run.prompt_lens
        shipped.excluded, shipped._special = run.excluded, run._special
        shipped.first = {i: run.masks[id(m)] for i, m in enumerate(run.members)}
        shipped.masks_by_index = dict(shipped.first)
        return shipped

    def see(self, step: int, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
        if step == 0:  # the prompt: its masks were worked out before the request
            self.masks_by_index = dict(self.first)
            return
        valid = mask[:, -ids.shape[1]:].bool()
        self.masks_by_index = {i: SteerRun._mask(self, m, ids.cpu(), positions.cpu(), valid)
                               for i, m in enumerate(self.members)}

    def apply(self, term: Any, view: torch.Tensor):
        index = next(i for i, m in enumerate(self.members) if m is term)
        self.masks = {id(term): self.masks_by_index[index]}
        return SteerRun.apply(self, term, view)


def _embedding_path(handle: Any) -> str:
    embedding = handle.model.get_input_embeddings()
    return next(name for name, module in handle.model.named_modules() if module is embedding)


# ----- the engine's ndif: branches (probes.engine calls these) -----

# what each engine call that needs local weights falls under (its capability, for the refusal's reason)
_CALL_CAPABILITY = {"prefill": "fork", "fork": "fork", "minimize_entropy": "grad", "input_x_gradient": "grad",
                    "head gates": "head_gates"}


def refused_call(handle: Any, what: str) -> BadInputError:
    return refused(handle, what, _CALL_CAPABILITY.get(what, what))


def check_sites(handle: Any, sites: list[Site]) -> None:
    eager = [s.name for s in sites if s.spec.needs_eager_attention]
    if eager:
        raise refused(handle, f"capturing {', '.join(eager)}", "attention")


def capture_batch(handle: Any, call: Any, sequences: list[list[int]], sites: list[Site], prefix: Any,
                  positions: Any, stop_after_last_site: bool, pad_id: int,
                  vision: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """`Engine.capture_batch` of an ndif: model: the right-padded batch in one trace (no prefix state)."""
    if prefix is not None:
        raise refused(handle, "capture_batch with a prefix state", "fork")
    check_sites(handle, sites)
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        input_ids[b, :len(seq)] = torch.tensor(seq)
        mask[b, :len(seq)] = 1
    spec = handle._extras.get("vision")
    if vision and "image_grid_thw" in vision and "mm_token_type_ids" not in vision:
        # rows of unequal lengths (probes.vision.prepare gives types for equal ones): a Qwen-VL computes its
        # 3-D positions from the padded rows' token types and the padding mask
        vision = {**vision, "mm_token_type_ids": (input_ids == spec.image_token_id).int() * mask.int()}
    only_layers = all(s.layer is not None for s in sites)
    captured, _, _ = forward(handle, call, input_ids, mask, sites, want_logits=not only_layers,
                             stop_after_last_site=stop_after_last_site and only_layers, vision=vision)
    if positions is None:
        return captured
    return {name: torch.cat([v[b, list(pos)] for b, pos in enumerate(positions)]) for name, v in captured.items()}


def generate(engine: Any, ids: list[list[int]], sites: list[Site], max_new_tokens: int, sampling: Any, seed: int,
             call: Any, top_k: int, stop: tuple[str, ...], vision: dict[str, Any] | None = None) -> "RecordsAfterRun":
    """`Engine.generate` of an ndif: model: one nnsight generate, then the records built from its saved steps
    by the engine's own `_step_records` (the same tokens, log-probs, entropies, top-k, captures, reports).

    Every check runs here; the generation itself runs on the first record asked for (as a local stream
    starts), so a server runs it in its producer thread, in its queue place, and sends the records after it."""
    handle = engine.handle
    check_sites(handle, sites)
    from probes.attention_masks import AttentionMasks

    if vision:
        raise BadInputError(f"generate with images is refused on {handle.model_id}, which runs on NDIF: a VLM's "
                            "decode steps need the engine's own (3-D rotary) positions, which one nnsight generate "
                            "does not reproduce; trace/capture with images are served")
    if AttentionMasks in call.parts:
        raise BadInputError(f"MaskAttention in generate is refused on {handle.model_id}, which runs on NDIF: a "
                            "generation's masks hide prompt columns of a token-by-token stream (with the last "
                            "prompt token fed alone), which one nnsight generate does not reproduce; mask a "
                            "teacher-forced trace/capture (served), or load the model locally with hf:")

    def run() -> tuple[list[Any], list[str]]:
        input_ids, mask = engine._left_pad(ids)
        steps = generate_steps(handle, call, input_ids, mask, sites, max_new_tokens, sampling, seed,
                               engine.eos_ids(), engine.tok.pad_token_id or 0, type(engine)._choose)
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        described = call.described()
        step = _Rows([list(x) for x in ids], [False] * len(ids), [""] * len(ids))
        records = []
        for t, saved in enumerate(steps):
            runner = _SavedForward(saved)
            _, recs = engine._step_records(saved["logits"], sampling, gen, top_k, step, t, runner, described)
            done_now = t == max_new_tokens - 1
            for rec in recs:
                b = rec.batch_index
                step.ids[b].append(rec.token_id)
                step.texts[b] += rec.text
                rec.finished = done_now or rec.token_id in engine._eos or any(s in step.texts[b] for s in stop)
                step.finished[b] = rec.finished
            records += recs
            if all(step.finished):
                break
        return records, step.texts

    return RecordsAfterRun(run)


@dataclass
class _Rows:
    """What `Engine._step_records` reads of a generation in flight: each row's ids so far, whether it ended."""

    ids: list[list[int]]
    finished: list[bool]
    texts: list[str]


class _SavedForward:
    """What `Engine._step_records` reads of a hook runner, from one saved decoding step."""

    def __init__(self, saved: dict[str, Any]):
        self.captured = saved["captured"]
        self.ctx = ForwardContext(fired=dict(saved["fired"]))


class RecordsAfterRun:
    """The `TokenStream` of an ndif: generation: the whole run happens on the first `next` (or `text`), then its
    records come one by one (nothing streams while it runs). `close` before the first record runs nothing."""

    def __init__(self, run: Any):
        self.records: list[Any] = []
        self._run = run
        self._pending: list[Any] = []
        self._texts: list[str] = []

    def _start(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            records, self._texts = run()
            self._pending = list(records)

    def __iter__(self) -> "RecordsAfterRun":
        return self

    def __next__(self) -> Any:
        self._start()
        if not self._pending:
            raise StopIteration
        rec = self._pending.pop(0)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        self._run, self._pending = None, []

    def text(self, batch_index: int = 0) -> str:
        self._start()
        return self._texts[batch_index] if self._texts else ""
