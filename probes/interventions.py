"""Interventions: small dataclasses the engine applies at every forward (the basis of every slider).

Each one names its site, checks itself against the model before any work starts (`validate`),
edits the activation in its `edit` method (a few lines), and says what it did (`describe`), so a
record and a figure can report it. They compose: the engine applies them in the order given.

- `AddVector`: h + scale * v (activation addition; Turner et al. 2023).
- `ProjectionRescale`: h - alpha * w (w.h) with unit w; alpha = 1 removes the component along w,
  alpha = -1 doubles it (RISE, Zhang et al. 2025).
- `HeadAblation`: zero- or mean-ablate chosen heads at the per-head attention output `z.L`.
- `MaskAttention`: chosen queries (by default the generated tokens) may not attend to the given
  key positions, in every layer or chosen layers.

Example:
    >>> import torch
    >>> iv = AddVector("resid_post.0", torch.ones(64), scale=2.0)
    >>> iv.describe()
    'add 2 * v (|v|=8) at resid_post.0'
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from thoughtscope.errors import BadInputError
from probes.sites import Site, validate_site

RESIDUAL_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")
WHERE = ("all", "generated")

# Every kind the engine applies (interventions, attention masks, router rules, KV-cache policies),
# by its wire name. A class registers itself by defining `kind`; nothing else changes to add one.
KINDS: dict[str, type["Registered"]] = {}


class Registered:
    """Base of everything that travels in `interventions=`: it has a wire name (`kind`), its spec is
    its constructor's arguments (read back from attributes of the same names), and `tensor_fields`
    name the arguments that are tensors (sent as safetensors bytes, never pickle)."""

    kind: ClassVar[str] = ""
    tensor_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("kind")
        if name:
            if name in KINDS and KINDS[name].__qualname__ != cls.__qualname__:
                raise TypeError(f"two classes claim the intervention kind {name!r}: {KINDS[name]} and {cls}")
            KINDS[name] = cls

    @classmethod
    def parameters(cls) -> list[str]:
        """The constructor's argument names: what a spec holds besides `kind`."""
        return [n for n in inspect.signature(cls.__init__).parameters if n != "self"]

    def spec(self) -> dict[str, Any]:
        """{'kind': ..., <constructor argument>: value, ...}; tensors stay tensors (the wire encodes them)."""
        return {"kind": self.kind, **{name: getattr(self, name) for name in self.parameters()}}

    @classmethod
    def from_spec(cls, fields: dict[str, Any]) -> "Registered":
        unknown = sorted(set(fields) - set(cls.parameters()))
        if unknown:
            raise BadInputError(f"{cls.kind!r} takes {cls.parameters()}; unknown field(s) {unknown}")
        try:
            return cls(**fields)
        except TypeError as err:  # a missing required argument
            raise BadInputError(f"{cls.kind!r}: {err}") from err


def kind_of(name: str) -> type[Registered]:
    """The registered class of a wire name; an unknown name lists the known ones."""
    if name not in KINDS:
        raise BadInputError(f"unknown intervention kind {name!r}; known kinds: {', '.join(sorted(KINDS))}")
    return KINDS[name]


MAX_SCALE = 1e6  # beyond this any activation overflows float32 arithmetic downstream


def _finite(value: float, what: str) -> float:
    if isinstance(value, bool):
        raise BadInputError(f"{what} must be a number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError) as err:
        raise BadInputError(f"{what} must be a number, got {value!r}") from err
    if not math.isfinite(value) or abs(value) > MAX_SCALE:
        raise BadInputError(f"{what} must be a finite number of magnitude at most {MAX_SCALE:g}, got {value}")
    return value


def _as_vector(v: Any, width: int, what: str) -> torch.Tensor:
    vec = torch.as_tensor(v, dtype=torch.float32).flatten() if not isinstance(v, torch.Tensor) else v.flatten()
    if vec.numel() != width:
        raise BadInputError(f"{what} has width {vec.numel()} but the site has width {width} (d_model)")
    if not torch.isfinite(vec).all():
        raise BadInputError(f"{what} contains NaN or infinite values")
    return vec


@dataclass
class Intervention(Registered):
    """Base: a site, where it applies (`all` positions or only the `generated` ones), and `edit`."""

    site: str
    where: str = "all"
    kinds: ClassVar[tuple[str, ...]] = RESIDUAL_KINDS

    def validate(self, arch: Any) -> Site:
        site = validate_site(self.site, arch)
        if site.kind not in self.kinds:
            raise BadInputError(
                f"{type(self).__name__} applies to {', '.join(k + '.L' for k in self.kinds)}, not {self.site!r}"
            )
        if self.where not in WHERE:
            raise BadInputError(f"where={self.where!r}; use one of {WHERE}")
        self._check(arch)
        return site

    def _check(self, arch: Any) -> None:
        """Subclasses check their own parameters here."""

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def per_row_count(self) -> int | None:
        """How many batch rows this intervention's per-row values are for (None: it applies to any batch)."""
        return None


def _scales(value: Any, what: str) -> float | list[float]:
    """One finite number, or a flat list of them (one per batch row: a list, tuple or 1-D tensor)."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "ndim") and value.ndim > 0):
        values = value.tolist() if hasattr(value, "tolist") else list(value)
        if not values or any(isinstance(v, (list, tuple)) for v in values):
            raise BadInputError(f"a per-row {what} is a flat list of numbers, one per batch row; got {value!r}")
        return [_finite(v, f"{what} of row {i}") for i, v in enumerate(values)]
    return _finite(value, what)


def _row_factor(scales: float | list[float], x: torch.Tensor, iv: "Intervention") -> Any:
    """A scalar as it is; per-row scales as a [batch, 1, ...] tensor for `x` [batch, ...], checked against
    the batch (the number of rows is known only when the intervention first applies)."""
    if not isinstance(scales, list):
        return scales
    if len(scales) != x.shape[0]:
        raise BadInputError(f"{type(iv).__name__} at {iv.site} has {len(scales)} per-row scales but the batch has "
                            f"{x.shape[0]} rows; give one per sequence (prompts x n_samples)")
    return torch.tensor(scales, dtype=x.dtype, device=x.device).view(-1, *([1] * (x.dim() - 1)))


@dataclass
class AddVector(Intervention):
    """Add `scale * vector` to the activation at `site` (activation addition, Turner et al. 2023).

    `scale` is one number, or one number per batch row (a list or 1-D tensor as long as the batch:
    `prompts` x `n_samples` in `generate`, the sequences of `capture_batch`): row b gets
    `scale[b] * vector`, so one batched generation steers the same prompt at several scales (the
    Steering page's slider grid). Its length is checked against the batch when it first applies.
    """

    kind: ClassVar[str] = "add"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: torch.Tensor = None
    scale: float | list[float] = 1.0

    def __init__(self, site: str, vector: Any, scale: float | Sequence[float] = 1.0, where: str = "all"):
        self.site, self.where, self.vector, self.scale = site, where, vector, scale

    def per_row_count(self) -> int | None:
        return len(self.scale) if isinstance(self.scale, list) else None

    def _check(self, arch: Any) -> None:
        self.scale = _scales(self.scale, "steering scale")
        self.vector = _as_vector(self.vector, arch.d_model, "steering vector")

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        v = self.vector.to(x.dtype).to(x.device)
        # row b: x_b + scale_b * v, the same float32 product as a single-row call with that scale
        return x + _row_factor(self.scale, x, self) * v

    def describe(self) -> str:
        if isinstance(self.scale, list):
            scales = ", ".join(f"{s:g}" for s in self.scale)
            return f"add [{scales}] * v per row (|v|={float(self.vector.norm()):.3g}) at {self.site}"
        return f"add {self.scale:g} * v (|v|={float(self.vector.norm()):.3g}) at {self.site}"


@dataclass
class ProjectionRescale(Intervention):
    """h' = h - alpha * w (w.h) with w normalised (RISE): alpha 1 removes the w component, -1 doubles it.

    `alpha` is one number, or one per batch row as `AddVector`'s scale (the RISE page's alpha grid)."""

    kind: ClassVar[str] = "rescale"
    tensor_fields: ClassVar[tuple[str, ...]] = ("direction",)
    direction: torch.Tensor = None
    alpha: float | list[float] = 1.0

    def __init__(self, site: str, direction: Any, alpha: float | Sequence[float] = 1.0, where: str = "all"):
        self.site, self.where, self.direction, self.alpha = site, where, direction, alpha

    def per_row_count(self) -> int | None:
        return len(self.alpha) if isinstance(self.alpha, list) else None

    def _check(self, arch: Any) -> None:
        self.alpha = _scales(self.alpha, "alpha")
        w = _as_vector(self.direction, arch.d_model, "direction")
        norm = float(w.norm())
        if norm == 0.0:
            raise BadInputError("direction is the zero vector; it has no direction to rescale along")
        self.direction = w / norm

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        w = self.direction.to(x.dtype).to(x.device)
        return x - _row_factor(self.alpha, x, self) * (x @ w).unsqueeze(-1) * w

    def describe(self) -> str:
        if isinstance(self.alpha, list):
            return f"rescale along w by alpha=[{', '.join(f'{a:g}' for a in self.alpha)}] per row at {self.site}"
        return f"rescale along w by alpha={self.alpha:g} at {self.site}"


@dataclass
class HeadAblation(Intervention):
    """Zero- or mean-ablate attention heads at `z.L` (per-head output before o_proj).

    Mean ablation needs `means` of shape [n_heads, head_dim] (e.g. `Engine.head_means`),
    because the mean over one decode step is the step itself.
    """

    kind: ClassVar[str] = "ablate_heads"
    tensor_fields: ClassVar[tuple[str, ...]] = ("means",)
    heads: list[int] = field(default_factory=list)
    mode: str = "zero"
    means: torch.Tensor | None = None
    kinds: ClassVar[tuple[str, ...]] = ("z",)

    def __init__(self, layer: int, heads: list[int], mode: str = "zero", means: Any = None, where: str = "all"):
        self.site, self.where = f"z.{layer}", where
        self.heads, self.mode, self.means = list(heads) if isinstance(heads, (list, tuple)) else heads, mode, means

    @property
    def layer(self) -> int:
        return int(self.site.split(".", 1)[1])

    def _check(self, arch: Any) -> None:
        if not isinstance(self.heads, list) or not self.heads:
            raise BadInputError("HeadAblation needs a non-empty list of heads")
        bad = [h for h in self.heads if not (isinstance(h, int) and 0 <= h < arch.n_heads)]
        if bad:
            raise BadInputError(f"heads {bad} out of range; this model has heads 0..{arch.n_heads - 1}")
        if self.mode not in ("zero", "mean"):
            raise BadInputError(f"ablation mode {self.mode!r}; use 'zero' or 'mean'")
        if self.mode == "mean":
            if self.means is None:
                raise BadInputError("mean ablation needs means [n_heads, head_dim]; compute them with Engine.head_means")
            self.means = torch.as_tensor(self.means, dtype=torch.float32)
            if tuple(self.means.shape) != (arch.n_heads, arch.head_dim):
                raise BadInputError(f"means has shape {tuple(self.means.shape)}, expected ({arch.n_heads}, {arch.head_dim})")
            if not torch.isfinite(self.means).all():
                raise BadInputError("the mean-ablation means contain NaN or infinite values")

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        idx = torch.tensor(self.heads, device=x.device)
        if self.mode == "zero":
            x[..., idx, :] = 0
        else:
            x[..., idx, :] = self.means[idx].to(x.dtype).to(x.device)
        return x

    def describe(self) -> str:
        return f"{self.mode}-ablate heads {self.heads} at {self.site}"


@dataclass
class MaskAttention(Registered):
    """Queries may not attend to the key `positions`, in every layer or in the chosen `layers`.

    In `generate`, the queries are the generated tokens (and the last prompt token, which predicts
    the first of them) and `positions` index the prompt; without `layers` this goes through the
    2D attention mask, so it works with any attention implementation. In a teacher-forced
    `trace`/`capture`/`capture_batch`, `queries` names the query positions (default: every
    position that is not itself masked), and a pre-hook on each chosen layer's attention edits the
    4D mask (eager or sdpa attention; see `probes.attention_masks`). Positions are token indices
    of the whole sequence.
    """

    kind: ClassVar[str] = "mask_attention"
    positions: list[int]
    queries: list[int] | None = None
    layers: list[int] | None = None
    site: ClassVar[str] = "attention_mask"
    where: ClassVar[str] = "generated"

    def validate(self, arch: Any) -> None:
        for name, values in (("positions", self.positions), ("queries", self.queries)):
            if values is None and name == "queries":
                continue
            if not isinstance(values, list) or not values:
                raise BadInputError(f"MaskAttention needs a non-empty list of {name}")
            if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in values):
                raise BadInputError(f"MaskAttention {name} must be non-negative token indices")
        if self.layers is not None:
            if not isinstance(self.layers, list) or not self.layers:
                raise BadInputError("MaskAttention layers must be a non-empty list (or None for every layer)")
            bad = [x for x in self.layers if isinstance(x, bool) or not isinstance(x, int)
                   or not 0 <= x < arch.n_layers]
            if bad:
                raise BadInputError(f"MaskAttention layers {bad} out of range; this model has layers 0..{arch.n_layers - 1}")

    def describe(self) -> str:
        def show(xs: list[int]) -> str:
            return str(xs) if len(xs) <= 8 else f"{xs[:8]}..."

        text = f"mask attention to {len(self.positions)} positions {show(self.positions)}"
        if self.queries is not None:
            text += f" from {len(self.queries)} queries {show(self.queries)}"
        if self.layers is not None:
            text += f" in layers {show(self.layers)}"
        return text


def load_vector(path: str | Path, key: str | None = None) -> torch.Tensor:
    """Read a steering vector from a .safetensors file (the only format accepted: never pickle).

    With one tensor in the file `key` may be omitted.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"vector file {path} does not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise BadInputError(f"{path.name} is not a readable .safetensors file ({err}); save vectors with "
                            "safetensors.torch.save_file({'vector': v}, path)") from err
    if key is None:
        if len(tensors) != 1:
            raise BadInputError(f"{path.name} holds {sorted(tensors)}; say which one with key=")
        key = next(iter(tensors))
    if key not in tensors:
        raise BadInputError(f"{path.name} has no tensor {key!r}; it holds {sorted(tensors)}")
    return tensors[key].float()


def load_vector_bytes(data: bytes, key: str | None = None) -> torch.Tensor:
    """Same as `load_vector`, for bytes (an upload in the app, a request body in the server)."""
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises several types for garbage input
        raise BadInputError(f"the upload is not a valid .safetensors file ({err})") from err
    if key is None and len(tensors) == 1:
        key = next(iter(tensors))
    if key not in tensors:
        raise BadInputError(f"the .safetensors upload holds {sorted(tensors)}; say which tensor to use")
    return tensors[key].float()
