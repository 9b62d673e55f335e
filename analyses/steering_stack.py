"""A steering stack: several directions steering one generation at once, each at its own site with its own
strength and edit method, under one global multiplier.

Neuronpedia steers with several features at once (a strength each and a global multiplier); this is the
same idea over every direction the workbench makes. A `StackTerm` is one direction at one site; a
`SteeringStack` holds up to `MAX_TERMS` (32) of them and compiles to the engine's interventions
(`interventions`), one per term, applied in the stack's order. A term's effective strength is
`strength x multiplier`; with `unit="norm"` the vector is `v/|v| x (mean activation norm at the site)`
(the Steering page's unit: 0.5 adds half a typical activation), with `unit="raw"` it is `v` as given.

Edit methods (`METHODS`, the wire names of `probes.edits`, where each is documented and cited):
`additive` (h + s v), `norm_scaled` (h + s |h| v/|v|), `project_out` (h - s (h.u) u), `projection_cap`
(the component along u clamped into [low, high]), `sae_clamp` (one SAE latent set to a value, the
reconstruction error kept). Each term becomes one edit with its own record name (`term_name`), so every
generated token's record says which terms acted there and the norm each added (`TokenRecord.fired`);
`StackGeneration.applied` keeps that per token and `never_acted` names a term that never did.

Where a direction comes from: one adapter per source, each returning a `StackTerm` whose `source`
says how to make it again (and is the reference a preset keeps):
`from_diff_of_means`, `from_vector_bytes` / `from_vector_file`, `from_sae_latent`,
`from_rise_behaviour`, `from_rise_confidence`, `from_fuzzy_concept`, `from_feature_browser`.

Presets (`to_preset` / `from_preset`, `save_preset` / `load_preset`): JSON with each direction inline
as base64 safetensors, or by reference to a stored SAE folder or vector file with its sha256 (checked
on load, so a changed file is an error, never a silently different direction). Every malformed field
is a `BadInputError` naming the term and the field.

Example:
    >>> import torch
    >>> stack = SteeringStack([StackTerm("resid_post.0", torch.tensor([3.0, 4.0]), 2.0, unit="raw")], 0.5)
    >>> edit = stack.interventions()[0]
    >>> edit.kind, edit.vector.tolist(), edit.strength, edit.term
    ('additive', [3.0, 4.0], 1.0, '1. vector at resid_post.0')
    >>> from_preset(to_preset(stack)).terms[0].direction.tolist()
    [3.0, 4.0]
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from analyses.steering import GeneratedText, diff_of_means_direction, generate_text, sae_feature_direction
from probes.backend import Backend
from probes.edits import MAX_TERMS, TOKENS, Additive, NormScaled, ProjectionCap, ProjectOut, SAEClamp
from probes.frozen_attention import FrozenAttention
from probes.interventions import RESIDUAL_KINDS, load_vector, load_vector_bytes
from probes.sites import parse_site
from saes.io import WEIGHTS_FILENAME, load_sae
from thoughtscope import checks
from thoughtscope.errors import BadInputError, ThoughtscopeError

MAX_STRENGTH = 1e4
UNITS = ("norm", "raw")
PRESET_FORMAT = "thoughtscope-steering-stack"
PRESET_VERSION = 1


def _common(term: "StackTerm", factor: float, name: str) -> dict[str, Any]:
    return dict(strength=factor, tokens=term.tokens, start=term.start, stop=term.stop,
                skip_special=term.skip_special, term=name)


def _additive(term: "StackTerm", factor: float, name: str, norm: float | None) -> Any:
    return Additive(term.site, term.vector(norm), **_common(term, factor, name))


def _norm_scaled(term: "StackTerm", factor: float, name: str, norm: float | None) -> Any:
    return NormScaled(term.site, term.direction, **_common(term, factor, name))


def _project_out(term: "StackTerm", factor: float, name: str, norm: float | None) -> Any:
    return ProjectOut(term.site, term.direction, **_common(term, factor, name))


def _projection_cap(term: "StackTerm", factor: float, name: str, norm: float | None) -> Any:
    return ProjectionCap(term.site, term.direction, low=term.params.get("low"), high=term.params.get("high"),
                         **_common(term, factor, name))


def _sae_clamp(term: "StackTerm", factor: float, name: str, norm: float | None) -> Any:
    sae = _load_sae(term.source["folder"], term.source.get("sha256", ""))
    return SAEClamp.from_sae(term.site, sae, int(term.source["latent"]), float(term.params["value"]),
                             **_common(term, factor, name))


@functools.lru_cache(maxsize=8)
def _load_sae(folder: str, sha256: str) -> Any:  # the sha in the key: a changed folder is read again
    return load_sae(folder)


# edit method (probes.edits' wire names: one spelling) -> how one term becomes an edit
# (factor = strength x multiplier; `norm` = the site's mean activation norm, for unit="norm")
METHODS = {"additive": _additive, "norm_scaled": _norm_scaled, "project_out": _project_out,
           "projection_cap": _projection_cap, "sae_clamp": _sae_clamp}


def _number(value: Any, what: str, bound: float = MAX_STRENGTH) -> float:
    return float(checks.number(what, value, low=-bound, high=bound))


def _vector(value: Any, what: str) -> torch.Tensor:
    try:
        v = torch.as_tensor(value, dtype=torch.float32).detach().flatten().cpu()
    except (TypeError, ValueError, RuntimeError) as err:
        raise BadInputError(f"{what} is not a vector of numbers ({err})") from err
    if v.numel() == 0:
        raise BadInputError(f"{what} is empty")
    if not torch.isfinite(v).all():
        raise BadInputError(f"{what} contains NaN or infinite values")
    if float(v.norm()) == 0.0:
        raise BadInputError(f"{what} is the zero vector: it has no direction to steer along")
    return v


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class StackTerm:
    """One direction at one site: its strength, edit method (`METHODS`), unit, where it acts (`tokens`:
    both / prompt / generated; a `start`..`stop` range of positions; special and chat-template tokens
    skipped unless `skip_special=False`), the method's own `params` (`projection_cap`: low/high;
    `sae_clamp`: value), a label for its slider, and `source` (what made it; a preset's reference when
    it names a stored file)."""

    site: str
    direction: torch.Tensor
    strength: float = 1.0
    method: str = "additive"
    unit: str = "norm"
    tokens: str = "both"
    start: int | None = None
    stop: int | None = None
    skip_special: bool = True
    label: str = ""
    source: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.direction = _vector(self.direction, f"the direction of {self.label or self.site!r}")

    @property
    def name(self) -> str:
        return self.label or f"{self.source.get('kind', 'vector')} at {self.site}"

    def check(self, d_model: int | None = None, what: str = "the term") -> None:
        """Every parameter checked without a model; `d_model` adds the width check."""
        try:
            site = parse_site(self.site)
        except ThoughtscopeError as err:
            raise BadInputError(f"{what}: {err}") from err
        if site.kind not in RESIDUAL_KINDS:
            raise BadInputError(f"{what} acts at {self.site!r}; a stack term acts at "
                                f"{', '.join(k + '.L' for k in RESIDUAL_KINDS)}")
        checks.choice(f"{what}'s edit method", self.method, list(METHODS))
        checks.choice(f"{what}'s unit", self.unit, UNITS)
        checks.choice(f"{what}'s tokens", self.tokens, TOKENS)
        checks.integer(f"{what}'s start", self.start, low=0, none_ok=True)
        checks.integer(f"{what}'s stop", self.stop, low=1, none_ok=True)
        if self.start is not None and self.stop is not None and self.stop <= self.start:
            raise BadInputError(f"{what}: the token range {self.start}..{self.stop} is empty")
        if not isinstance(self.skip_special, bool):
            raise BadInputError(f"{what}: skip_special must be true or false, got {self.skip_special!r}")
        _number(self.strength, f"{what}'s strength")
        if self.method == "projection_cap":
            low = checks.number(f"{what}'s cap low", self.params.get("low"), none_ok=True)
            high = checks.number(f"{what}'s cap high", self.params.get("high"), none_ok=True)
            if low is None and high is None or (low is not None and high is not None and low > high):
                raise BadInputError(f"{what}: a projection cap needs params low <= high (one may be omitted)")
        if self.method == "sae_clamp":
            if self.source.get("kind") != "sae":
                raise BadInputError(f"{what} clamps an SAE latent but its direction is not an SAE latent: add the "
                                    "term from an SAE (a saved SAE folder) to clamp it")
            checks.number(f"{what}'s clamp value", self.params.get("value"))
        if d_model is not None and self.direction.numel() != d_model:
            raise BadInputError(f"{what} ({self.name}) has width {self.direction.numel()} but {self.site} has "
                                f"width {d_model} (d_model): it was made on another model")

    @property
    def uses_norm(self) -> bool:
        return self.unit == "norm" and self.method == "additive"

    def vector(self, reference_norm: float | None = None) -> torch.Tensor:
        """The vector an `additive` term adds at strength 1 (the axis of every other method)."""
        if not self.uses_norm:
            return self.direction
        if reference_norm is None or not reference_norm > 0:
            raise BadInputError(f"{self.name}: unit 'norm' needs the mean activation norm at {self.site} "
                                "(reference_norms)")
        return self.direction / self.direction.norm() * float(reference_norm)


@dataclass
class SteeringStack:
    """Up to MAX_TERMS terms and a global multiplier; `interventions()` is what the engine applies."""

    terms: list[StackTerm] = field(default_factory=list)
    multiplier: float = 1.0

    def __post_init__(self) -> None:
        self.terms = list(self.terms)
        if len(self.terms) > MAX_TERMS:
            raise BadInputError(f"a steering stack holds at most {MAX_TERMS} terms; this one has {len(self.terms)}")

    def check(self, d_model: int | None = None) -> "SteeringStack":
        if len(self.terms) > MAX_TERMS:
            raise BadInputError(f"a steering stack holds at most {MAX_TERMS} terms; this one has {len(self.terms)}")
        _number(self.multiplier, "the global multiplier")
        for i, term in enumerate(self.terms):
            term.check(d_model, f"term {i + 1}")
        return self

    def add(self, term: StackTerm) -> "SteeringStack":
        """A new stack with `term` at the end (the bound checked before anything changes)."""
        if len(self.terms) >= MAX_TERMS:
            raise BadInputError(f"the steering stack is full ({MAX_TERMS} terms); remove one first")
        term.check(what=f"term {len(self.terms) + 1}")
        return replace(self, terms=[*self.terms, term])

    def remove(self, index: int) -> "SteeringStack":
        self._index(index)
        return replace(self, terms=[t for i, t in enumerate(self.terms) if i != index])

    def with_strength(self, index: int, strength: float) -> "SteeringStack":
        self._index(index)
        value = _number(strength, f"term {index + 1}'s strength")
        return replace(self, terms=[replace(t, strength=value) if i == index else t for i, t in enumerate(self.terms)])

    def _index(self, index: int) -> None:
        checks.integer("the term index", index, low=0, high=len(self.terms) - 1, why="a term of this stack")

    def norm_sites(self) -> list[str]:
        """The sites whose mean activation norm the `norm`-unit terms need."""
        return sorted({t.site for t in self.terms if t.uses_norm})

    def interventions(self, reference_norms: dict[str, float] | None = None, d_model: int | None = None,
                      skip_zero: bool = True) -> list[Any]:
        """One intervention per term, in order; terms whose effective strength is 0 are left out (they
        change nothing) unless `skip_zero=False`."""
        self.check(d_model)
        norms = reference_norms or {}
        out = []
        for i, term in enumerate(self.terms):
            factor = float(term.strength) * float(self.multiplier)
            if factor == 0.0 and skip_zero:
                continue
            out.append(METHODS[term.method](term, factor, self.term_name(i), norms.get(term.site)))
        return out

    def term_name(self, index: int) -> str:
        """The name the engine's records use for term `index` (distinct within the stack)."""
        return f"{index + 1}. {self.terms[index].name}"[:128]

    def describe(self, reference_norms: dict[str, float] | None = None) -> list[str]:
        return [iv.describe() for iv in self.interventions(reference_norms, skip_zero=False)]

    def key(self) -> str:
        """A short hash of everything that changes the generation (directions, sites, strengths...)."""
        h = hashlib.sha256(json.dumps(to_preset(self, inline=True), sort_keys=True).encode())
        return h.hexdigest()[:16]


def reference_norms(backend: Backend, prompt: Any, stack: SteeringStack, chat: bool = False) -> dict[str, float]:
    """Mean activation norm (first token excluded) at every site a `norm`-unit term needs, from one capture."""
    sites = stack.norm_sites()
    if not sites:
        return {}
    acts = backend.capture(prompt, sites, chat=chat)
    out = {}
    for site in sites:
        norms = acts[site].float().norm(dim=-1)
        out[site] = float((norms[1:] if len(norms) > 1 else norms).mean())
    return out


# ----------------------------------------------------------------------------- direction sources

def from_diff_of_means(backend: Backend, set_a: Sequence[str], set_b: Sequence[str], site: str, *, reduce: str = "mean",
                       chat: bool = False, strength: float = 1.0, label: str = "") -> StackTerm:
    """mean(site | set A) - mean(site | set B) (`analyses.steering.diff_of_means_direction`)."""
    v = diff_of_means_direction(backend, set_a, set_b, site, reduce, chat)
    source = {"kind": "diff_of_means", "set_a": [p for p in set_a if p.strip()], "set_b": [p for p in set_b if p.strip()],
              "reduce": reduce, "chat": bool(chat)}
    return StackTerm(site, v, strength, label=label or "difference of means", source=source)


def from_vector_bytes(data: bytes, site: str, *, key: str | None = None, strength: float = 1.0, label: str = "",
                      file_name: str = "") -> StackTerm:
    """An uploaded .safetensors vector (`probes.interventions.load_vector_bytes`); kept inline in a preset."""
    v = load_vector_bytes(data, key)
    source = {"kind": "upload", "file": file_name, "tensor": key, "sha256": hashlib.sha256(data).hexdigest()}
    return StackTerm(site, v, strength, label=label or (file_name or "uploaded vector"), source=source)


def from_vector_file(path: str | Path, site: str, *, key: str | None = None, strength: float = 1.0,
                     label: str = "") -> StackTerm:
    """A stored .safetensors vector; a preset refers to it by path and sha256."""
    v = load_vector(path, key)
    source = {"kind": "file", "path": str(path), "tensor": key, "sha256": sha256_file(path)}
    return StackTerm(site, v, strength, label=label or Path(path).name, source=source)


def from_sae_latent(folder: str | Path, latent: int, site: str, d_model: int, *, strength: float = 1.0,
                    label: str = "") -> StackTerm:
    """The decoder row of one latent of a SAELens-format SAE (saved by the RISE page, or any SAELens
    folder): what that latent writes into the residual stream. A preset refers to the folder and the
    sha256 of its weights."""
    latent = checks.integer("the SAE latent", latent, low=0)
    v = sae_feature_direction(str(folder), latent, d_model, site)
    source = {"kind": "sae", "folder": str(folder), "latent": int(latent),
              "sha256": sha256_file(Path(folder) / WEIGHTS_FILENAME)}
    return StackTerm(site, v, strength, label=label or f"SAE latent {latent}", source=source)


def from_rise_behaviour(layer: Any, behaviour: str, *, strength: float = 1.0, method: str = "additive") -> StackTerm:
    """A RISE behaviour vector (`LayerAnalysis.vectors[behaviour]`, unit length) at the layer's site."""
    vectors = getattr(layer, "vectors", None) or {}
    if behaviour not in vectors:
        raise BadInputError(f"no {behaviour!r} vector at {layer.site}; this layer has {sorted(vectors) or 'none'} "
                            "(harvest more problems or steer with a latent's column)")
    return StackTerm(layer.site, vectors[behaviour], strength, method=method, label=f"RISE {behaviour}",
                     source={"kind": "rise_behaviour", "behaviour": behaviour, "site": layer.site})


def from_rise_confidence(result: Any, w_dec: Any, *, n: int = 3, strength: float = 1.0) -> StackTerm:
    """A RISE confidence (entropy-lowering) vector: `ConfidenceResult.vector(w_dec, n)` at its site."""
    v = result.vector(w_dec, n)
    return StackTerm(result.site, v, strength, label="RISE confidence",
                     source={"kind": "rise_confidence", "columns": [int(c) for c in result.top_columns[:n]],
                             "site": result.site})


def from_fuzzy_concept(layer: Any, rule: int, site: str, *, strength: float = 1.0, label: str = "") -> StackTerm:
    """Concept `rule` of a fitted `FuzzyRuleLayer`: its direction (the concept minus the training mean)."""
    directions = layer.directions_
    n = int(directions.shape[0])
    rule = checks.integer("the fuzzy concept", rule, low=0, high=n - 1, why="a concept of this fuzzy layer")
    return StackTerm(site, directions[rule], strength, label=label or f"fuzzy concept {rule + 1}",
                     source={"kind": "fuzzy_concept", "rule": int(rule)})


def from_feature_browser(direction: Any, d_model: int, *, strength: float = 1.0, label: str = "") -> StackTerm:
    """A feature-browser direction (`SAELatent`, `Neuron` or `VectorDirection`): the vector it writes into
    the residual stream at its site. An SAE latent loaded from a folder is kept by reference. `label` names the
    term (default: "feature browser: " and the direction's name)."""
    direction.check(d_model)
    described = direction.describe()
    source = {"kind": "feature_browser", **{k: v for k, v in described.items() if k != "kind"},
              "direction_kind": described.get("kind")}
    folder = getattr(direction, "source", "")
    if described.get("kind") == "sae" and folder and Path(folder).is_dir():
        return from_sae_latent(folder, int(direction.latent), direction.site, d_model, strength=strength,
                               label=label or f"feature browser: SAE latent {direction.latent}")
    name = described.get("name") or described.get("kind")
    return StackTerm(direction.site, direction.write_vector(), strength,
                     label=label or f"feature browser: {name}" + (f" {described['index']}" if "index" in described else ""),
                     source=source)


# ----------------------------------------------------------------------------- presets

def _encode_vector(v: torch.Tensor) -> str:
    return base64.b64encode(save({"vector": v.contiguous()})).decode("ascii")


def _decode_vector(text: Any, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise BadInputError(f"{what}: 'inline' must be base64 text of a .safetensors file")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as err:
        raise BadInputError(f"{what}: 'inline' is not valid base64 ({err})") from err
    try:
        return load_vector_bytes(data, "vector")
    except BadInputError as err:
        raise BadInputError(f"{what}: {err}") from err


def to_preset(stack: SteeringStack, inline: bool = False, model_id: str = "") -> dict[str, Any]:
    """The stack as a JSON-ready dict. A term from a stored SAE or vector file is kept by reference (path and
    sha256) unless `inline`; every other direction inline as base64 safetensors."""
    terms = []
    for term in stack.terms:
        kind = term.source.get("kind")
        if not inline and kind == "sae":
            ref = {"sae": {k: term.source[k] for k in ("folder", "latent", "sha256")}}
        elif not inline and kind == "file":
            ref = {"file": {k: term.source[k] for k in ("path", "tensor", "sha256")}}
        else:
            ref = {"inline": _encode_vector(term.direction)}
        terms.append({"site": term.site, "strength": float(term.strength), "method": term.method, "unit": term.unit,
                      "tokens": term.tokens, "start": term.start, "stop": term.stop, "skip_special": term.skip_special,
                      "label": term.label, "source": term.source, "params": term.params, "direction": ref})
    out = {"format": PRESET_FORMAT, "version": PRESET_VERSION, "multiplier": float(stack.multiplier), "terms": terms}
    if model_id:
        out["model_id"] = model_id
    return out


TERM_FIELDS = {"site", "strength", "method", "unit", "tokens", "start", "stop", "skip_special", "label", "source",
               "params", "direction"}


def _resolve(ref: Any, site: str, what: str, d_model: int | None) -> torch.Tensor:
    if not isinstance(ref, dict) or len(ref) != 1 or next(iter(ref)) not in ("inline", "sae", "file"):
        raise BadInputError(f"{what}: 'direction' must be one of {{'inline': ...}}, {{'sae': ...}}, {{'file': ...}}")
    (how, body), = ref.items()
    if how == "inline":
        return _decode_vector(body, what)
    wanted = ("folder", "latent", "sha256") if how == "sae" else ("path", "tensor", "sha256")
    if not isinstance(body, dict) or set(body) != set(wanted):
        raise BadInputError(f"{what}: a {how} reference holds exactly {list(wanted)}")
    path = (checks.user_path(f"{what}'s SAE folder", body["folder"]) / WEIGHTS_FILENAME if how == "sae" else
            checks.user_path(f"{what}'s vector file", body["path"]))
    if not path.is_file():
        raise BadInputError(f"{what}: the stored {'SAE' if how == 'sae' else 'vector'} {path} does not exist here")
    if sha256_file(path) != body["sha256"]:
        raise BadInputError(f"{what}: {path} has changed since the preset was saved (its sha256 differs); "
                            "it would steer with another direction")
    if how == "file":
        return load_vector(path, body["tensor"])
    latent = body["latent"]
    latent = checks.integer(f"{what}'s SAE latent", latent, low=0)
    width = d_model if d_model is not None else int(load_sae(str(body["folder"])).cfg.d_in)
    return sae_feature_direction(str(body["folder"]), latent, width, site)


def from_preset(data: Any, d_model: int | None = None) -> SteeringStack:
    """A stack from `to_preset`'s dict, every field checked (a malformed one names its term and field)."""
    if not isinstance(data, dict) or data.get("format") != PRESET_FORMAT:
        raise BadInputError(f"not a steering-stack preset: a JSON object with \"format\": \"{PRESET_FORMAT}\"")
    if data.get("version") != PRESET_VERSION:
        raise BadInputError(f"preset version {data.get('version')!r}; this workbench reads version {PRESET_VERSION}")
    terms_data = data.get("terms")
    if not isinstance(terms_data, list):
        raise BadInputError("the preset's 'terms' must be a list")
    if len(terms_data) > MAX_TERMS:
        raise BadInputError(f"the preset has {len(terms_data)} terms; a stack holds at most {MAX_TERMS}")
    multiplier = _number(data.get("multiplier", 1.0), "the preset's multiplier")
    terms = []
    for i, raw in enumerate(terms_data):
        what = f"preset term {i + 1}"
        if not isinstance(raw, dict):
            raise BadInputError(f"{what} is not a JSON object")
        unknown, missing = sorted(set(raw) - TERM_FIELDS), sorted({"site", "direction"} - set(raw))
        if unknown or missing:
            raise BadInputError(f"{what}: " + "; ".join(
                ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])))
        for name in ("site", "method", "unit", "tokens", "label"):
            if name in raw and not isinstance(raw[name], str):
                raise BadInputError(f"{what}: '{name}' must be text, got {raw[name]!r}")
        for name in ("source", "params"):
            if not isinstance(raw.get(name, {}), dict):
                raise BadInputError(f"{what}: '{name}' must be a JSON object")
        vector = _resolve(raw["direction"], raw["site"], what, d_model)
        try:
            term = StackTerm(raw["site"], vector, _number(raw.get("strength", 1.0), f"{what}'s strength"),
                             raw.get("method", "additive"), raw.get("unit", "norm"), raw.get("tokens", "both"),
                             raw.get("start"), raw.get("stop"), raw.get("skip_special", True), raw.get("label", ""),
                             dict(raw.get("source", {})), dict(raw.get("params", {})))
        except BadInputError as err:
            raise BadInputError(f"{what}: {err}") from err
        term.check(d_model, what)
        terms.append(term)
    return SteeringStack(terms, multiplier)


def save_preset(stack: SteeringStack, path: str | Path, inline: bool = False, model_id: str = "") -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_preset(stack, inline, model_id), indent=1))
    return path


def preset_from_bytes(data: bytes, d_model: int | None = None) -> SteeringStack:
    """A stack from a preset file's bytes (an upload): not JSON, or not a preset, is a clear error."""
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise BadInputError(f"the preset is not a JSON file ({err})") from err
    return from_preset(parsed, d_model)


def load_preset(path: str | Path, d_model: int | None = None) -> SteeringStack:
    path = checks.user_path("preset file", path)
    if not path.is_file():
        raise BadInputError(f"preset file {path} does not exist")
    return preset_from_bytes(path.read_bytes(), d_model)


# ----------------------------------------------------------------------------- generating with a stack

@dataclass
class StackGeneration:
    """The unsteered and the stack-steered text of one prompt and seed. `interventions` says what the stack
    applied (one description per active term); `applied[t]` is the engine's record of steered token t:
    {term name: L2 norm it added at the position that chose the token} (`TokenRecord.fired`)."""

    stack_key: str
    multiplier: float
    term_names: list[str]
    interventions: list[str]
    unsteered: Any  # analyses.steering.GeneratedText
    steered: Any
    applied: list[dict[str, float]] = field(default_factory=list)
    reference_norms: dict[str, float] = field(default_factory=dict)
    active: list[str] = field(default_factory=list)  # the terms whose strength x multiplier is not 0
    frozen: Any = None  # the same stack with attention frozen to the unsteered model's (probes.frozen_attention)
    frozen_applied: list[dict[str, float]] = field(default_factory=list)

    def acted(self, name: str) -> list[bool]:
        return [name in a for a in self.applied]

    def never_acted(self) -> list[str]:
        """Active terms that acted at no generated token (a mask that excluded every position, say)."""
        return [n for n in self.active if not any(self.acted(n))]

    def to_dict(self) -> dict[str, Any]:
        return {"stack_key": self.stack_key, "multiplier": self.multiplier, "terms": list(self.term_names),
                "interventions": list(self.interventions), "reference_norms": dict(self.reference_norms),
                "applied": [dict(a) for a in self.applied], "never_acted": self.never_acted(),
                "unsteered": self.unsteered.to_dict(), "steered": self.steered.to_dict(),
                "divergence": token_divergence(self.unsteered, self.steered),
                **({} if self.frozen is None else {
                    "frozen": self.frozen.to_dict(), "frozen_applied": [dict(a) for a in self.frozen_applied],
                    "frozen_divergence": token_divergence(self.unsteered, self.frozen),
                    "frozen_vs_steered": token_divergence(self.steered, self.frozen)})}


def token_divergence(a: Any, b: Any) -> list[int]:
    """Per generated position: 1 where the two texts' tokens differ (or one text has ended), else 0."""
    n = max(len(a.token_ids), len(b.token_ids))
    ids_a, ids_b = list(a.token_ids) + [None] * n, list(b.token_ids) + [None] * n
    return [int(ids_a[i] != ids_b[i]) for i in range(n)]


def stack_generation(backend: Backend, prompt: Any, stack: SteeringStack, *, max_new_tokens: int = 32, seed: int = 0,
                     chat: bool = False, sampling: Any = None, unsteered: Any = None,
                     norms: dict[str, float] | None = None, frozen: bool = False) -> StackGeneration:
    """Generate with the whole stack (its edits in order) beside the unsteered text of the same seed; every
    steered token keeps the engine's record of which terms acted at it. A stack whose every strength is 0
    is the unsteered text. With `frozen`, the same stack again with attention frozen to the unsteered
    model's probabilities (`probes.frozen_attention.FrozenAttention`: the edits reach later positions only
    through the residual stream). Everything is checked before any model work."""
    d_model = backend.arch().d_model
    stack.check(d_model)
    norms = dict(norms) if norms is not None else reference_norms(backend, prompt, stack, chat)
    edits = stack.interventions(norms, d_model)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, **kwargs)
    names = [stack.term_name(i) for i in range(len(stack.terms))]
    if not edits:
        none = [{} for _ in base.token_ids]
        return StackGeneration(stack.key(), float(stack.multiplier), names, [], base, base, none, norms,
                               frozen=base if frozen else None, frozen_applied=none if frozen else [])
    records = list(backend.generate(prompt, interventions=edits, **kwargs))
    frozen_records = []
    if frozen:
        frozen_records = list(backend.generate(prompt, interventions=[*edits, FrozenAttention()], **kwargs))
    return StackGeneration(stack.key(), float(stack.multiplier), names, [e.describe() for e in edits], base,
                           GeneratedText.from_records(records), [dict(r.fired) for r in records], norms,
                           [e.term for e in edits], GeneratedText.from_records(frozen_records) if frozen else None,
                           [dict(r.fired) for r in frozen_records])


def stack_token_kl(backend: Backend, prompt: Any, stack: SteeringStack, generation: StackGeneration, *,
                   seed: int = 0, chat: bool = False, sampling: Any = None) -> dict[str, Any]:
    """How far the stack moved the model's next-token distribution at each steered token: KL(steered || unsteered)
    in nats, both distributions at temperature 1, after the same prefix (the prompt and the steered tokens before
    it). `token_divergence` says whether the chosen tokens differ; this says by how much the distributions do,
    also where the greedy token stayed.

    The steered distributions are the steered generation's own: it is made again with the stack (same seed and
    decoding, the stack's reference norms as recorded) capturing `logits` at each new token, and refused if it
    does not give the same tokens. The unsteered ones come from one teacher-forced pass of the unsteered model
    over the prompt and the steered text (`logits` captured). Two model calls; through a server, two requests.
    Returns {"tokens", "token_ids", "kl" [steered tokens], "mean_kl", "max_kl", "same_token" (1 where the
    unsteered text has the same token at that position)}."""
    steered = generation.steered
    n = len(steered.token_ids)
    same = [1 - d for d in token_divergence(generation.unsteered, steered)[:n]]
    if n == 0:
        raise BadInputError("the steered text has no tokens: nothing to compare")
    out = {"tokens": list(steered.tokens), "token_ids": list(steered.token_ids), "same_token": same,
           "measure": "KL(steered || unsteered) of the next-token distributions, nats, temperature 1"}
    d_model = backend.arch().d_model
    stack.check(d_model)
    edits = stack.interventions(dict(generation.reference_norms), d_model)
    if not edits:  # every strength 0: the steered model is the unsteered one
        return {**out, "kl": [0.0] * n, "mean_kl": 0.0, "max_kl": 0.0}
    records = list(backend.generate(prompt, interventions=edits, capture=["logits"], max_new_tokens=n,
                                    sampling=sampling, seed=seed, chat=chat))
    if [r.token_id for r in records] != list(steered.token_ids):
        raise BadInputError("the stack did not give the same steered text again (another seed, decoding or stack "
                            "than the one shown?): generate it again, then measure")
    prompt_ids = backend.encode(prompt, chat=chat)
    base = backend.trace(list(prompt_ids) + list(steered.token_ids[:-1]), capture=["logits"])
    rows = base.activations["logits"][len(prompt_ids) - 1:].float()  # row t: after the prompt and t steered tokens
    steered_logp = torch.log_softmax(torch.stack([r.activations["logits"].float() for r in records]), dim=-1)
    base_logp = torch.log_softmax(rows, dim=-1)
    kl = (steered_logp.exp() * (steered_logp - base_logp)).sum(-1).clamp_min(0.0)  # float rounding below 0
    values = [float(v) for v in kl]
    return {**out, "kl": values, "mean_kl": sum(values) / n, "max_kl": max(values)}


# ----------------------------------------------------------------------------- one term's slider stops in one batch

def grid_key(stack: SteeringStack, index: int) -> str:
    """What a term's grid depends on: the whole stack except term `index`'s strength."""
    stack._index(index)
    preset = to_preset(stack, inline=True)
    preset["terms"][index]["strength"] = "grid"
    return hashlib.sha256(json.dumps(preset, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class StackGrid:
    """Term `index` at every strength of `stops`, the rest of the stack as it was, made in ONE batched greedy
    generation (one row per stop, the term's strength per row); `generation(strength)` is a lookup."""

    key: str
    index: int
    stops: list[float]
    rows: dict[float, StackGeneration]
    seconds: float = 0.0

    def generation(self, strength: float) -> StackGeneration:
        strength = float(strength)
        if strength not in self.rows:
            raise BadInputError(f"strength {strength:g} is not a stop of this grid; its stops are "
                                f"{', '.join(f'{s:g}' for s in self.stops)}")
        return self.rows[strength]


def stack_grid(backend: Any, prompt: Any, stack: SteeringStack, index: int, stops: Sequence[float], *,
               max_new_tokens: int = 32, seed: int = 0, chat: bool = False, unsteered: Any = None,
               norms: dict[str, float] | None = None, frozen: bool = False,
               on_progress: Any = None) -> StackGrid:
    """Greedy generations of the stack with term `index` at each of `stops`, in one batched generation (and,
    with `frozen`, one more with attention frozen): the prompt once per stop, that term's edit with one
    strength per row. Each row is the stack's single-row generation at that strength (tested on
    tiny-random:llama; rows of one prompt need no padding). `on_progress(stage, step, max_new_tokens)` after
    every decoding step (a job's Stop raises there: the stream is closed and nothing is kept)."""
    d_model = backend.arch().d_model
    stack.check(d_model)
    stack._index(index)
    values = sorted({_number(s, "a grid stop") + 0.0 for s in stops})
    if not values or len(values) > 64:
        raise BadInputError(f"a term's grid needs 1..64 stops, got {len(values)}")
    norms = dict(norms) if norms is not None else reference_norms(backend, prompt, stack, chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, max_new_tokens=max_new_tokens,
                                                                 seed=seed, chat=chat)
    varied = SteeringStack([replace(t, strength=1.0) if i == index else t for i, t in enumerate(stack.terms)],
                           stack.multiplier)
    edits = varied.interventions(norms, d_model)
    name = varied.term_name(index)
    factors = [v * float(stack.multiplier) for v in values]
    for e in edits:
        if e.term == name:
            e.strength = factors
    started = time.perf_counter()

    def batch(extra: list[Any], stage: str) -> list[list[Any]]:
        rows: list[list[Any]] = [[] for _ in values]
        if not any(e.term == name for e in edits):  # multiplier 0: every row is the unsteered text
            return rows
        stream = backend.generate(prompt, n_samples=len(values), max_new_tokens=max_new_tokens, seed=seed,
                                  chat=chat, top_k=0, interventions=[*edits, *extra])
        try:
            step = -1
            for rec in stream:
                rows[rec.batch_index].append(rec)
                if on_progress is not None and rec.step != step:
                    step = rec.step
                    on_progress(stage, step + 1, max_new_tokens)
        finally:
            stream.close()
        return rows

    steered = batch([], f"term {index + 1}: {len(values)} stops in one batch")
    frozen_rows = batch([FrozenAttention()], "the same with frozen attention") if frozen else None
    names = [stack.term_name(i) for i in range(len(stack.terms))]
    out = {}
    for b, (value, factor) in enumerate(zip(values, factors)):
        active = [e.term for e in edits if e.term != name or factor != 0.0]
        if not active:  # nothing acts in this row: the unsteered text, as `stack_generation` gives it
            one = replace(stack, terms=[replace(t, strength=value) if i == index else t
                                        for i, t in enumerate(stack.terms)])
            out[value] = stack_generation(backend, prompt, one, max_new_tokens=max_new_tokens, seed=seed, chat=chat,
                                          unsteered=base, norms=norms, frozen=frozen)
            continue

        def records(recs: list[Any]) -> tuple[Any, list[dict[str, float]]]:
            fired = [{k: v for k, v in r.fired.items() if k in active} for r in recs]
            return GeneratedText.from_records(recs), fired

        text, applied = records(steered[b])
        frozen_text, frozen_applied = records(frozen_rows[b]) if frozen_rows is not None else (None, [])
        one = replace(stack, terms=[replace(t, strength=value) if i == index else t for i, t in enumerate(stack.terms)])
        descriptions = [iv.describe() for iv in one.interventions(norms, d_model)]
        out[value] = StackGeneration(one.key(), float(stack.multiplier), names, descriptions, base, text, applied,
                                     norms, active, frozen_text, frozen_applied)
    return StackGrid(grid_key(stack, index), index, values, out, time.perf_counter() - started)
