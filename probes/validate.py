"""Validation: the engine's site captures against independent readers of the same weights.

For every site of a model (`probes.sites`), `validate` reads the same input through the engine
(`Engine.capture`, the hooks every figure uses) and through up to three other readers:

- `hf`: a plain Hugging Face forward: `hidden_states` (resid_pre.L = hidden_states[L],
  resid_post.L = hidden_states[L+1]; HF's last entry is after the final norm, so the engine's last
  resid_post goes through the model's own final norm first), `attentions` from an eager forward,
  `router_logits` where the family returns them, and the logits. It checks the site table itself:
  a wrong module path or a swapped layer disagrees with HF's own indexing.
- `nnsight`: nnsight 0.8's `TransformersModel` over the same module objects (probes.remote), which
  reads every site. It shares the site table with the engine, so it checks the hook mechanics
  (pre/post hooks, tuple indices, head splits, router un-flattening), not the table.
- `bridge`: TransformerLens's `TransformerBridge` over a copy of the weights, by its own hook names
  (`blocks.L.hook_resid_post`...), for the families it supports; the sites without a TL hook skip it.

A reader that cannot read a family or a site is listed with the reason (`skipped`), never passed in
silence; a site no reader could check is a warn. Per site and reader: max abs error, max relative
error (max |a - b| / max |b|, relative to the reference's scale, so near-zero entries do not blow up),
and the smallest per-position cosine. Then the logits against a float32 copy of the same weights
(top-1 agreement, max total-variation distance: a bf16/fp16 model shows its own drift), and streamed
generation: at random generated positions, the record's entropy and top-k equal a teacher-forced HF
forward over the generated sequence. Verdicts follow `TOLERANCES`, per dtype (docs/validation.md).

A full validation is cached as JSON in the user cache dir, one file per (fingerprint, dtype, device,
attention implementation); `cached_summary(handle)` is the badge the app and the server show.

Example:
    >>> from probes import Engine
    >>> report = validate(Engine.from_id("tiny-random:llama"))
    >>> report.verdict
    'pass'
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from probes.paths import user_cache_dir
from probes.sampling import Sampling
from probes.sites import SITE_KINDS, Site, list_sites, validate_site
from thoughtscope.errors import BadInputError, UnknownSiteError
from thoughtscope.imports import before_thread

VALIDATION_TEXT = ("The quick brown fox jumps over the lazy dog. 17 + 25 = 42, and 6 times 7 is 42 too. "
                   "Is that a coincidence?")
GENERATION_PROMPT = "Once upon a time, in a small village by the sea, there lived"
VERDICTS = ("pass", "warn", "fail")
READERS = ("hf", "nnsight", "bridge")


@dataclass(frozen=True)
class Tolerance:
    """Limits per dtype: a value within `*_pass` passes, within `*_warn` warns, beyond fails.

    `rel`/`cos`: engine vs a reader on the same weights in the same dtype (only float rounding
    differs: sdpa vs eager kernels, a different summation order); `tv`/`top1`: the model's logits vs a
    float32 copy of its weights; `gen`: streamed record vs teacher-forced forward (entropy in nats,
    top-k probabilities)."""

    rel_pass: float
    rel_warn: float
    cos_pass: float
    cos_warn: float
    tv_pass: float
    tv_warn: float
    top1_pass: float
    top1_warn: float
    gen_pass: float
    gen_warn: float


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rel_pass=1e-3, rel_warn=1e-2, cos_pass=0.99999, cos_warn=0.999,
                         tv_pass=1e-4, tv_warn=1e-3, top1_pass=1.0, top1_warn=0.99, gen_pass=1e-3, gen_warn=1e-2),
    "bfloat16": Tolerance(rel_pass=3e-2, rel_warn=1e-1, cos_pass=0.999, cos_warn=0.99,
                          tv_pass=0.05, tv_warn=0.2, top1_pass=0.9, top1_warn=0.7, gen_pass=0.05, gen_warn=0.2),
    "float16": Tolerance(rel_pass=1e-2, rel_warn=5e-2, cos_pass=0.9995, cos_warn=0.995,
                         tv_pass=0.02, tv_warn=0.1, top1_pass=0.95, top1_warn=0.8, gen_pass=0.02, gen_warn=0.1),
}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def tolerance_for(dtype: Any) -> Tolerance:
    name = _dtype_name(dtype)
    if name not in TOLERANCES:
        raise BadInputError(f"no validation tolerances for dtype {name}; known: {', '.join(TOLERANCES)}")
    return TOLERANCES[name]


def worst(verdicts: Sequence[str]) -> str:
    return max(verdicts, key=VERDICTS.index) if verdicts else "warn"


def _below(value: float, ok: float, warn: float) -> str:
    return "pass" if value <= ok else "warn" if value <= warn else "fail"


def _above(value: float, ok: float, warn: float) -> str:
    return "pass" if value >= ok else "warn" if value >= warn else "fail"


def classify_site(max_rel: float, cosine: float, tol: Tolerance) -> str:
    if not (math.isfinite(max_rel) and math.isfinite(cosine)):
        return "fail"
    return worst([_below(max_rel, tol.rel_pass, tol.rel_warn), _above(cosine, tol.cos_pass, tol.cos_warn)])


def classify_logits(tv: float, top1: float, tol: Tolerance) -> str:
    if not math.isfinite(tv):
        return "fail"
    return worst([_below(tv, tol.tv_pass, tol.tv_warn), _above(top1, tol.top1_pass, tol.top1_warn)])


# ----- comparing two readings of one site -----

def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max abs error, max relative error (to the reference's largest magnitude), smallest per-position cosine.

    Both are [seq, ...]; integer tensors (expert indices) compare by agreement (cosine = fraction equal)."""
    if tuple(ours.shape) != tuple(ref.shape):
        return {"max_abs": math.inf, "max_rel": math.inf, "cosine": -1.0,
                "note": f"shape {tuple(ours.shape)} vs reader's {tuple(ref.shape)}"}
    if not ours.is_floating_point():
        equal = (ours == ref).float().mean().item()
        mismatch = 0.0 if equal == 1.0 else math.inf
        return {"max_abs": float((ours != ref).sum().item()), "max_rel": mismatch, "cosine": equal}
    a, b = ours.detach().double().cpu(), ref.detach().double().cpu()
    diff = (a - b).abs()
    scale = b.abs().max().item()
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    norms = flat_a.norm(dim=-1) * flat_b.norm(dim=-1)
    dots = (flat_a * flat_b).sum(-1)
    # a position where both are zero (a masked pattern row) agrees exactly
    cos = torch.where(norms > 0, dots / norms.clamp(min=1e-300), torch.where(
        (flat_a.abs().sum(-1) + flat_b.abs().sum(-1)) == 0, 1.0, 0.0))
    return {"max_abs": max_abs, "max_rel": max_rel, "cosine": cos.min().item()}


@dataclass
class SiteCheck:
    """One site read by the engine and by one reader."""

    site: str
    reader: str
    max_abs: float
    max_rel: float
    cosine: float
    verdict: str
    note: str = ""


@dataclass
class Report:
    """One model's validation: a row per (site, reader), the readers skipped and why, logits, generation."""

    model_id: str
    key: dict[str, str]
    tolerance: dict[str, float]
    checks: list[SiteCheck] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {reader, what, reason}
    unchecked: list[str] = field(default_factory=list)  # sites no reader could read
    logits: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    complete: bool = True  # every site of the model (a --sites subset is not cached as the badge)

    @property
    def verdict(self) -> str:
        parts = [c.verdict for c in self.checks] + ["warn"] * bool(self.unchecked)
        parts += [part["verdict"] for part in (self.logits, self.generation) if part.get("verdict")]
        return worst(parts)

    def site_verdicts(self) -> dict[str, str]:
        """{site: the worst verdict over its readers}."""
        out: dict[str, list[str]] = {}
        for c in self.checks:
            out.setdefault(c.site, []).append(c.verdict)
        for site in self.unchecked:
            out.setdefault(site, []).append("warn")
        return {site: worst(v) for site, v in out.items()}

    def failing_sites(self) -> list[str]:
        return sorted(site for site, v in self.site_verdicts().items() if v == "fail")

    def by_kind(self) -> list[dict[str, Any]]:
        """One row per (site kind, reader): the worst layer's numbers (the table `thoughtscope validate` prints)."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for c in self.checks:
            kind = c.site.rsplit(".", 1)[0] if c.site != "logits" else "logits"
            row = rows.setdefault((kind, c.reader), {"kind": kind, "reader": c.reader, "sites": 0, "max_abs": 0.0,
                                                     "max_rel": 0.0, "cosine": 1.0, "worst_site": c.site,
                                                     "verdict": "pass", "note": ""})
            row["sites"] += 1
            if (VERDICTS.index(c.verdict), c.max_rel) > (VERDICTS.index(row["verdict"]), row["max_rel"]):
                row["worst_site"], row["note"] = c.site, c.note
            row["max_abs"], row["max_rel"] = max(row["max_abs"], c.max_abs), max(row["max_rel"], c.max_rel)
            row["cosine"] = min(row["cosine"], c.cosine)
            row["verdict"] = worst([row["verdict"], c.verdict])
        return list(rows.values())

    def summary(self) -> dict[str, Any]:
        """The badge: verdict, counts, the worst site, the logits' drift, the generation check."""
        verdicts = self.site_verdicts()
        failing = [c for c in self.checks if c.verdict != "pass"]
        worst_check = max(self.checks, key=lambda c: (VERDICTS.index(c.verdict), c.max_rel), default=None)
        return _json_safe({
            "verdict": self.verdict, **self.key, "model_id": self.model_id,
            "sites": len(verdicts), "sites_pass": sum(v == "pass" for v in verdicts.values()),
            "sites_warn": sum(v == "warn" for v in verdicts.values()),
            "sites_fail": sum(v == "fail" for v in verdicts.values()),
            "readers": sorted({c.reader for c in self.checks}),
            "skipped_readers": sorted({s["reader"] for s in self.skipped}),
            "worst": None if worst_check is None else {
                "site": worst_check.site, "reader": worst_check.reader, "max_rel": worst_check.max_rel,
                "cosine": worst_check.cosine, "verdict": worst_check.verdict},
            "not_passing": [f"{c.site} ({c.reader})" for c in failing][:8],
            "logits_top1": self.logits.get("top1_agreement"), "logits_tv": self.logits.get("max_tv"),
            "generation_verdict": self.generation.get("verdict"), "seconds": round(self.seconds, 2),
        })

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict
        d["summary"] = self.summary()
        return _json_safe(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        checks = [SiteCheck(**{k: (math.inf if v is None and k in ("max_abs", "max_rel") else v)
                               for k, v in c.items()}) for c in d.get("checks", [])]
        return cls(model_id=d["model_id"], key=d["key"], tolerance=d["tolerance"], checks=checks,
                   skipped=d.get("skipped", []), unchecked=d.get("unchecked", []), logits=d.get("logits", {}),
                   generation=d.get("generation", {}), seconds=d.get("seconds", 0.0), complete=d.get("complete", True))


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ----- the cache of validations: one JSON per (fingerprint, dtype, device, attention implementation) -----

def validation_key(handle: Any) -> dict[str, str]:
    return {"fingerprint": handle.fingerprint, "dtype": _dtype_name(handle.dtype), "device": handle.device.type,
            "attn_implementation": str(getattr(handle.model.config, "_attn_implementation", None) or "default")}


def validation_dir() -> Path:
    return user_cache_dir() / "validation"


def cache_path(handle: Any) -> Path:
    key = validation_key(handle)
    return validation_dir() / "{fingerprint}-{dtype}-{device}-{attn_implementation}.json".format(**key)


def cached_report(handle: Any) -> Report | None:
    path = cache_path(handle)
    try:
        return Report.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or a damaged file: validate again
        return None


_SUMMARIES: dict[str, tuple[int, dict[str, Any]]] = {}  # path -> (mtime_ns, summary): info() asks often


def cached_summary(handle: Any) -> dict[str, Any] | None:
    """The badge of this model as loaded (None until a full validation ran). Cheap: a stat, and a file
    read only when the file changed."""
    if getattr(handle, "remote", False):
        return None
    path = cache_path(handle)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    hit = _SUMMARIES.get(str(path))
    if hit is not None and hit[0] == mtime:
        return dict(hit[1])
    report = cached_report(handle)
    if report is None:
        return None
    _SUMMARIES[str(path)] = (mtime, report.summary())
    return report.summary()


def store(handle: Any, report: Report) -> Path:
    path = cache_path(handle)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{threading.get_ident()}")
    tmp.write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
    tmp.replace(path)  # atomic: a reader sees the old file or the new one, never half of one
    return path


_RUNNING: dict[str, threading.Thread] = {}
_RUNNING_LOCK = threading.Lock()


def badge(engine: Any, *, background: bool = True) -> dict[str, Any] | None:
    """The cached badge, or None while it is computed: with `background` the validation starts in a
    thread (once per key), so the caller's figure is never held up; a later call finds it cached."""
    summary = cached_summary(engine.handle)
    if summary is not None or getattr(engine.handle, "remote", False):
        return summary
    if not background:
        report = validate(engine)
        return report.summary()
    name = str(cache_path(engine.handle))
    # the validation imports TransformerLens, and through it `datasets` imports pandas, which a page's figures
    # then read half-imported (the trace explorer's tests on a fresh cache, 2026-12-07): thoughtscope.imports
    before_thread()
    with _RUNNING_LOCK:
        if name not in _RUNNING or not _RUNNING[name].is_alive():
            thread = threading.Thread(target=_validate_quietly, args=(engine,), daemon=True,
                                      name="thoughtscope-validate")
            _RUNNING[name] = thread
            thread.start()
    return None


def badge_running(engine: Any) -> bool:
    thread = _RUNNING.get(str(cache_path(engine.handle)))
    return thread is not None and thread.is_alive()


_FAILED: dict[str, str] = {}  # cache path -> why the background validation of that model failed


def background_error(engine: Any) -> str | None:
    """Why the background validation of this model failed (None if it did not)."""
    return _FAILED.get(str(cache_path(engine.handle)))


def _validate_quietly(engine: Any) -> None:
    import logging

    try:
        validate(engine)
    except Exception as err:  # a background badge must not take the app down; the badge says what went wrong
        _FAILED[str(cache_path(engine.handle))] = f"{type(err).__name__}: {err}"
        logging.getLogger(__name__).exception("background validation of %s failed", engine.handle.model_id)


# ----- the readers -----

def _site_names(handle: Any, sites: Sequence[str] | None) -> list[str]:
    """Every site of the model, or those asked: full names (`resid_post.3`) or kinds (`resid_post`, `logits`)."""
    every = [row["site"] for row in list_sites(handle.arch)]
    if not sites:
        return every
    chosen: list[str] = []
    for name in sites:
        name = name.strip()
        if name in SITE_KINDS:
            found = [s for s in every if s.rsplit(".", 1)[0] == name]
            if not found:
                spec = SITE_KINDS[name]
                why = "it has no MoE router" if spec.moe_only else f"its family has no {spec.part} module"
                raise UnknownSiteError(f"{handle.model_id} has no {name} sites: {why}; "
                                       f"its site kinds are {_kinds(every)}")
            chosen += found
        else:
            chosen.append(validate_site(name, handle.arch).name)
    return list(dict.fromkeys(chosen))


def _kinds(names: Sequence[str]) -> str:
    return ", ".join(dict.fromkeys(n.rsplit(".", 1)[0] if n != "logits" else n for n in names))


def _split(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(sites read under the model's own attention, attention patterns read under eager attention)."""
    pattern = [n for n in names if n.startswith("attn_pattern.")]
    return [n for n in names if n not in pattern], pattern


def _engine_reads(engine: Any, ids: list[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    plain, pattern = _split(names)
    out = engine.capture(ids, plain) if plain else {}
    if pattern:  # a user's trace of patterns runs eager; every other site runs the model's own attention
        out.update(engine.capture(ids, [n for n in pattern if n not in out]))
    return out


def _engine_reads_eager(engine: Any, ids: list[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The engine's reads under eager attention: what to hold against a reader that computes attention
    eagerly (the bridge), so that a kernel's rounding (large in bf16) is not taken for a wrong site."""
    model = engine.handle.model
    with engine.lock:
        saved = model.config._attn_implementation
        if saved == "eager":
            return _engine_reads(engine, ids, names)
        model.set_attn_implementation("eager")
        try:
            return _engine_reads(engine, ids, names)
        finally:
            model.set_attn_implementation(saved)


@torch.no_grad()
def _hf_reads(handle: Any, ids: list[int], names: Sequence[str], skipped: list[dict[str, str]]):
    """{site: tensor} from a plain HF forward, and the plain forward's logits."""
    model, arch = handle.model, handle.arch
    x = torch.tensor([ids], device=handle.device)
    kwargs: dict[str, Any] = {"output_router_logits": True} if arch.is_moe else {}
    out = model(input_ids=x, output_hidden_states=True, use_cache=False, **kwargs)
    hidden = out.hidden_states
    reads: dict[str, torch.Tensor] = {"logits": out.logits[0]}
    last = arch.n_layers - 1
    norm = _final_norm(handle)
    router = getattr(out, "router_logits", None)
    if arch.is_moe and not router and any(n.startswith("router.") for n in names):
        skipped.append({"reader": "hf", "what": "router", "reason": f"{arch.model_type}'s HF forward returns no "
                        "router_logits"})
    moe_layers = list(arch.moe_layers) or list(range(arch.n_layers))
    for name in names:
        site = Site(name.rsplit(".", 1)[0], int(name.rsplit(".", 1)[1])) if name != "logits" else None
        if site is None:
            continue
        if site.kind == "resid_pre":
            reads[name] = hidden[site.layer][0]
        elif site.kind == "resid_post" and site.layer < last:
            reads[name] = hidden[site.layer + 1][0]
        elif site.kind == "resid_post":
            # HF's last hidden state is after the final norm: the engine's value goes through that norm
            reads[name] = ("final_norm", hidden[-1][0])
        elif site.kind == "router" and router:
            index = moe_layers.index(site.layer) if len(router) == len(moe_layers) else site.layer
            reads[name] = router[index].reshape(1, len(ids), -1)[0]
    pattern = [n for n in names if n.startswith("attn_pattern.")]
    if pattern:
        saved = model.config._attn_implementation
        if saved != "eager":
            model.set_attn_implementation("eager")
        try:
            att = model(input_ids=x, output_attentions=True, use_cache=False).attentions
        finally:
            if saved != "eager":
                model.set_attn_implementation(saved)
        if not att or att[0] is None:
            skipped.append({"reader": "hf", "what": "attn_pattern", "reason": "the eager HF forward returned no "
                            "attentions"})
        else:
            for name in pattern:
                reads[name] = att[int(name.rsplit(".", 1)[1])][0].transpose(0, 1)
    return reads, norm


def _final_norm(handle: Any) -> Any:
    from probes.sites import FAMILIES, get_module

    path = FAMILIES[handle.family].get("final_norm")
    return get_module(handle.model, path) if path else None


def _nnsight_reads(handle: Any, ids: list[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    from probes.remote import nnsight_capture
    from probes.sites import parse_site

    plain, pattern = _split(names)
    out: dict[str, torch.Tensor] = {}
    for group in (plain, pattern):
        if not group:
            continue
        try:
            reads = nnsight_capture(handle, ids, [parse_site(n) for n in group], remote=False)
            # the logits come from the pass under the model's own attention (the pattern pass runs eager)
            out.update(reads if group is plain or "logits" not in out else {k: v for k, v in reads.items()
                                                                            if k != "logits"})
        except Exception as err:
            # nnsight reads modules in execution order; a site table out of that order (a mistake the
            # validator exists to catch) gets one trace per site instead, so the other readers still compare
            if "OutOfOrder" not in type(err).__name__:
                raise
            for name in group:
                out.update(nnsight_capture(handle, ids, [parse_site(name)], remote=False))
    return out


def _bridge_reads(handle: Any, ids: list[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    from probes.sites import parse_site

    bridge = handle.bridge
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(torch.tensor([ids], device=handle.device))
    out: dict[str, torch.Tensor] = {"logits": logits[0]}
    for name in names:
        site = parse_site(name)
        hook = site.tl_hook()
        if hook is None or hook not in cache:
            continue
        value = cache[hook][0]
        out[name] = value.transpose(0, 1) if site.kind == "attn_pattern" else value
    return out


def _short(err: Exception) -> str:
    text = str(err).split(". Available", 1)[0].split("\n", 1)[0]
    return f"{type(err).__name__}: {text[:240]}"


# ----- the checks -----

def check_sites(engine: Any, names: Sequence[str], tol: Tolerance, readers: Sequence[str] = READERS,
                text: str = VALIDATION_TEXT) -> tuple[list[SiteCheck], list[dict[str, str]], list[str]]:
    """Engine vs each reader at every site: (checks, readers skipped with the reason, sites no reader read)."""
    handle = engine.handle
    ids = engine.encode(text)
    names = list(dict.fromkeys([*names]))
    ours = _engine_reads(engine, ids, names)
    skipped: list[dict[str, str]] = []
    checks: list[SiteCheck] = []
    readings: dict[str, dict[str, Any]] = {}
    norm = None
    # Each reader holds the engine's lock for its own pass only: a figure's pass waits for one forward at
    # most, and no other call's hooks sit on the modules while a reader runs.
    if "hf" in readers:
        with engine.lock:
            readings["hf"], norm = _hf_reads(handle, ids, names, skipped)
    if "nnsight" in readers:
        try:
            with engine.lock:
                readings["nnsight"] = _nnsight_reads(handle, ids, names)
        except Exception as err:  # a family nnsight cannot trace: said, not passed
            skipped.append({"reader": "nnsight", "what": "all sites", "reason": _short(err)})
    if "bridge" in readers:
        try:
            with engine.lock:
                readings["bridge"] = _bridge_reads(handle, ids, names)
        except Exception as err:
            skipped.append({"reader": "bridge", "what": "all sites",
                            "reason": f"TransformerLens does not bridge {handle.arch.model_type}: {_short(err)}"})
    for reader in [r for r in readings if r != "hf" and "hf" in readings]:
        why = _disagrees_with_hf(reader, readings[reader], readings["hf"], handle, tol)
        if why:
            skipped.append({"reader": reader, "what": "all sites", "reason": why})
            del readings[reader]
    explained: set[str] = set()
    if "bridge" in readings and handle.arch.model_type in BRIDGE_POST_NORM_OUTPUTS:
        for name in [n for n in names if n.rsplit(".", 1)[0] in ("attn_out", "mlp_out")]:
            readings["bridge"].pop(name, None)
            explained.add(name)
        skipped.append({"reader": "bridge", "what": "attn_out, mlp_out",
                        "reason": f"in {handle.arch.model_type} TransformerLens's hook_attn_out/hook_mlp_out are "
                                  "after the block's post-norm; the engine's attn_out/mlp_out are before it "
                                  "(probes.sites), so they are not the same quantity"})
    eager_ours = None
    if "bridge" in readings and handle.model.config._attn_implementation != "eager":
        eager_ours = _engine_reads_eager(engine, ids, names)
    for reader, reads in readings.items():
        missing = [n for n in names if n not in reads and n not in explained]
        if missing and reader != "nnsight":
            skipped.append({"reader": reader, "what": _kinds(missing), "reason": _why_missing(reader, missing)})
        for name in names:
            if name not in reads:
                continue
            ref = reads[name]
            mine = ours[name]
            note = ""
            if isinstance(ref, tuple):  # ("final_norm", value): compare norm(engine) with HF's normed state
                with torch.no_grad():
                    mine, ref = norm(mine.unsqueeze(0))[0], ref[1]
                note = "through the final norm (HF's last hidden state is normed)"
            if reader == "bridge" and eager_ours is not None:
                mine = eager_ours[name]
                note = note or "engine read under eager attention, as the bridge computes"
            stats = compare(mine, ref)
            note = stats.pop("note", note)
            checks.append(SiteCheck(name, reader, stats["max_abs"], stats["max_rel"], stats["cosine"],
                                    classify_site(stats["max_rel"], stats["cosine"], tol), note))
    read = {c.site for c in checks}
    return checks, skipped, [n for n in names if n not in read]


# Families with post-norms after attention and MLP: TransformerLens's attn_out/mlp_out hooks sit after them.
BRIDGE_POST_NORM_OUTPUTS = ("gemma2", "gemma3", "gemma3_text", "olmo2")


def _disagrees_with_hf(reader: str, reads: dict[str, Any], hf: dict[str, Any], handle: Any, tol: Tolerance) -> str:
    """Why a reader is no reference for this model ('' when it is): its own logits differ from the plain HF
    forward's, so it computes a different function than the model, and its site readings would blame the engine."""
    if "logits" not in reads:
        return ""
    stats = compare(reads["logits"], hf["logits"])
    if classify_site(stats["max_rel"], stats["cosine"], tol) != "fail":
        return ""
    name = "TransformerLens" if reader == "bridge" else reader
    return (f"its logits differ from the plain HF forward's (max rel {stats['max_rel']:.3g}, min cosine "
            f"{stats['cosine']:.3f}): {name} computes a different function for {handle.arch.model_type}, "
            "so its hooks are no reference here")


def _why_missing(reader: str, missing: Sequence[str]) -> str:
    kinds = {n.rsplit(".", 1)[0] for n in missing}
    if reader == "hf":
        return ("a plain HF forward exposes hidden states, attentions, router logits and logits only; "
                f"{', '.join(sorted(kinds))} are left to the other readers")
    return "TransformerLens has no hook for these sites (MoE routing has no TL hook name)"


def reference_memory(handle: Any) -> tuple[int, int | None]:
    """(bytes a float32 copy of the weights needs, bytes free on the device or None if unknown)."""
    need = sum(p.numel() for p in handle.model.parameters()) * 4
    return need, free_memory_bytes(handle.device)


def free_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


@torch.no_grad()
def check_logits(engine: Any, tol: Tolerance, text: str = VALIDATION_TEXT) -> dict[str, Any]:
    """The engine's logits vs a float32 copy of the same weights: top-1 agreement and max total variation."""
    handle = engine.handle
    ids = engine.encode(text)
    ours = engine.capture(ids, ["logits"])["logits"].float()
    if handle.dtype == torch.float32:
        with engine.lock:
            ref = handle.model(input_ids=torch.tensor([ids], device=handle.device), use_cache=False).logits[0].float()
        source = "the model itself (it is float32)"
    else:
        need, free = reference_memory(handle)
        if free is not None and need * 1.2 > free:
            gib = 2**30
            return {"verdict": "warn", "reference": "not loaded",
                    "note": f"the float32 reference needs about {need / gib:.2f} GiB ({need // 4 / 1e9:.2f} B "
                            f"parameters x 4 bytes) plus activations, and {free / gib:.2f} GiB is free on "
                            f"{handle.device}: the logits' drift was not measured; free memory, or validate "
                            "on a machine with more"}
        with engine.lock:  # a copy taken while another call's hooks sit on the model would carry them
            reference = copy.deepcopy(handle.model).float()  # the same weights, upcast exactly
        try:
            ref = reference(input_ids=torch.tensor([ids], device=handle.device), use_cache=False).logits[0].float()
        finally:
            del reference
        source = f"a float32 copy of the {_dtype_name(handle.dtype)} weights"
    p, q = ours.softmax(-1), ref.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    max_tv = tv.max().item()
    return {"verdict": classify_logits(max_tv, top1, tol), "reference": source, "positions": len(ids),
            "top1_agreement": top1, "max_tv": max_tv, "mean_tv": tv.mean().item()}


@torch.no_grad()
def check_generation(engine: Any, tol: Tolerance, n_new: int = 12, n_checked: int = 4, seed: int = 0,
                     top_k: int = 5) -> dict[str, Any]:
    """Streamed records vs a teacher-forced HF forward over the generated sequence, at random generated positions.

    Top-k is compared tie-robustly: the reference's probability of each of the record's top ids, and the
    reference's own j-th largest probability against the record's j-th (a different, truly larger token
    would show there)."""
    handle = engine.handle
    prompt = engine.encode(GENERATION_PROMPT)
    records = list(engine.generate(prompt, max_new_tokens=n_new, sampling=Sampling(temperature=1.0), seed=seed,
                                   top_k=top_k))
    seq = prompt + [r.token_id for r in records]
    with engine.lock:
        logits = handle.model(input_ids=torch.tensor([seq], device=handle.device), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    gen = torch.Generator().manual_seed(seed)
    steps = sorted(torch.randperm(len(records), generator=gen)[:n_checked].tolist())
    ent_err = topk_err = 0.0
    for t in steps:
        rec = records[t]
        row = logp[len(prompt) + t - 1]
        ref_entropy = -(row.exp() * row).sum().item()
        ent_err = max(ent_err, abs(rec.entropy - ref_entropy))
        ref_p = row.exp()
        mine = torch.tensor(rec.top_probs, dtype=torch.float64)
        at_ids = ref_p[torch.tensor(rec.top_ids)].double()
        ref_top = ref_p.topk(len(rec.top_ids)).values.double()
        topk_err = max(topk_err, (mine - at_ids).abs().max().item(), (ref_top - mine).max().item())
    verdict = worst([_below(ent_err, tol.gen_pass, tol.gen_warn), _below(topk_err, tol.gen_pass, tol.gen_warn)])
    return {"verdict": verdict, "generated": len(records), "positions_checked": steps,
            "max_entropy_err": ent_err, "max_topk_prob_err": topk_err}


# ----- the whole validation -----

def validate(engine: Any, sites: Sequence[str] | None = None, readers: Sequence[str] = READERS,
             generation: bool = True, save: bool | None = None) -> Report:
    """Validate every site of the engine's model (or `sites`: names or kinds) and cache a full run as the badge."""
    handle = engine.handle
    if getattr(handle, "remote", False):
        raise BadInputError(remote_message(handle.model_id))
    unknown = [r for r in readers if r not in READERS]
    if unknown:
        raise BadInputError(f"unknown readers {unknown}; readers are {', '.join(READERS)}")
    tol = tolerance_for(handle.dtype)
    start = time.perf_counter()
    names = _site_names(handle, sites)
    checks, skipped, unchecked = check_sites(engine, names, tol, readers)
    logits = check_logits(engine, tol)
    gen = check_generation(engine, tol) if generation else {}
    report = Report(handle.model_id, validation_key(handle), asdict(tol), checks, skipped, unchecked, logits, gen,
                    complete=not sites and tuple(readers) == READERS and generation)
    report.seconds = time.perf_counter() - start
    if save if save is not None else report.complete:
        store(handle, report)
    return report


def remote_message(model_id: str) -> str:
    return (f"{model_id} runs on NDIF: its weights are not in this process, so there is no second reader of the "
            "same weights here and no float32 copy to measure drift against. What can be checked remotely is "
            "what nnsight's remote trace returns (the engine's traces of an ndif: model are exactly those reads). "
            "To validate the sites, load the same weights locally with hf:<repo id>.")


# ----- printing -----

def format_table(report: Report, per_site: bool = False) -> str:
    """The table `thoughtscope validate` prints (plain text, so docs/validation.md can hold it as is)."""
    key = report.key
    lines = [f"model {report.model_id}  fingerprint {key['fingerprint']}  {key['dtype']} on {key['device']}  "
             f"attention {key['attn_implementation']}  verdict {report.verdict.upper()}  ({report.seconds:.1f} s)"]
    head = f"{'site' if per_site else 'kind':<16} {'reader':<8} {'sites':>5} {'max abs':>10} {'max rel':>10} " \
           f"{'min cos':>10}  {'verdict':<7} worst site"
    lines += [head, "-" * len(head)]
    rows = ([{"kind": c.site, "reader": c.reader, "sites": 1, "max_abs": c.max_abs, "max_rel": c.max_rel,
              "cosine": c.cosine, "verdict": c.verdict, "worst_site": "", "note": c.note} for c in report.checks]
            if per_site else report.by_kind())
    for r in rows:
        note = f"  ({r['note']})" if r["note"] else ""
        lines.append(f"{r['kind']:<16} {r['reader']:<8} {r['sites']:>5} {_num(r['max_abs'])} {_num(r['max_rel'])} "
                     f"{r['cosine']:>10.7f}  {r['verdict']:<7} {r['worst_site']}{note}")
    for site in report.unchecked:
        lines.append(f"{site:<16} {'-':<8} no reader could read this site: warn")
    lg = report.logits
    if lg:
        if "max_tv" in lg:
            lines.append(f"logits vs fp32: top-1 agreement {lg['top1_agreement']:.4f}, max TV {lg['max_tv']:.3g}, "
                         f"mean TV {lg['mean_tv']:.3g} over {lg['positions']} positions; reference: "
                         f"{lg['reference']}  -> {lg['verdict']}")
        else:
            lines.append(f"logits vs fp32: {lg['note']}  -> {lg['verdict']}")
    g = report.generation
    if g:
        lines.append(f"streamed generation: {g['generated']} tokens, steps {g['positions_checked']} checked against "
                     f"a teacher-forced forward: max entropy error {g['max_entropy_err']:.3g} nats, max top-k "
                     f"probability error {g['max_topk_prob_err']:.3g}  -> {g['verdict']}")
    for s in report.skipped:
        lines.append(f"skipped: {s['reader']} for {s['what']}: {s['reason']}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return f"{'inf':>10}" if x is None or not math.isfinite(x) else f"{x:>10.3g}"
