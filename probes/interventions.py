"""Interventions: small dataclasses the engine applies at every forward (the basis of every slider).

Each one names its site, checks itself against the model before any work starts (`validate`,
which returns a per-call copy holding the derived values and leaves the object as given), edits the
activation in its `edit` method (a few lines), and says what it did (`describe`), so a record and a
figure can report it. Each installs itself into an engine call (`install(call)`: a hook on the
call's runner at its site; see `probes.registered`). They compose: the engine applies them in the
order given.

- `AddVector`: h + scale * v (activation addition; Turner et al. 2023).
- `ProjectionRescale`: h - alpha * w (w.h) with unit w; alpha = 1 removes the component along w,
  alpha = -1 doubles it (RISE, Zhang et al. 2025).
- `HeadAblation`: zero- or mean-ablate chosen heads at the per-head attention output `z.L`.
- `MaskAttention` (defined in `probes.attention_masks`, re-exported here): chosen queries (by default
  the generated tokens) may not attend to the given key positions, in every layer or chosen layers.

Example:
    >>> import torch
    >>> iv = AddVector("resid_post.0", torch.ones(64), scale=2.0)
    >>> iv.describe()
    'add 2 * v (|v|=8) at resid_post.0'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from probes.attention_masks import MaskAttention, RowMask  # noqa: F401  (re-exported: the masks live with their masker)
from probes.registered import KINDS, MODES, Registered, kind_of  # noqa: F401  (re-exported)
from probes.sites import Site, validate_site
from thoughtscope import checks
from thoughtscope.errors import BadInputError

RESIDUAL_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")
WHERE = ("all", "generated")


MAX_SCALE = 1e6  # beyond this any activation overflows float32 arithmetic downstream


def _finite(value: Any, what: str) -> float:
    """`value` as a float when it is a finite number of magnitude at most MAX_SCALE (a 0-d tensor or
    array counts as its item)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return float(checks.number(what, value, low=-MAX_SCALE, high=MAX_SCALE,
                               why=f"a magnitude beyond {MAX_SCALE:g} overflows float32 downstream"))


def _as_vector(v: Any, width: int, what: str) -> torch.Tensor:
    vec = torch.as_tensor(v, dtype=torch.float32).flatten() if not isinstance(v, torch.Tensor) else v.flatten()
    if vec.numel() != width:
        raise BadInputError(f"{what} has width {vec.numel()} but the site has width {width} (d_model)")
    if not torch.isfinite(vec).all():
        raise BadInputError(f"{what} contains NaN or infinite values")
    if vec.numel() and float(vec.abs().max()) > MAX_SCALE:  # its norm (and h + v) would overflow float32
        raise BadInputError(f"{what} has an entry of magnitude {float(vec.abs().max()):.3g}; entries beyond "
                            f"{MAX_SCALE:g} overflow float32 downstream")
    return vec


@dataclass
class Intervention(Registered):
    """Base of site edits: a site, where it applies (`all` positions or only the `generated` ones), and `edit`.

    The subclass surface: `site`, `where` (keyword-only), `edit(x)` over the site's [batch, seq, ...]
    view, `describe()`, and the check hook `_check(arch)`, which runs on the per-call copy (derived
    values end in `_`). `apply(view, ctx)` is what the hook runner calls: it honours `where`, edits,
    and reports `report(before, after)` (None by default) into the records (`TokenRecord.fired`)."""

    site: str
    where: str = field(default="all", kw_only=True)
    kinds: ClassVar[tuple[str, ...]] = RESIDUAL_KINDS

    def validate(self, arch: Any) -> "Intervention":
        site = validate_site(self.site, arch)
        if site.kind not in self.kinds:
            raise BadInputError(
                f"{type(self).__name__} applies to {', '.join(k + '.L' for k in self.kinds)}, not {self.site!r}"
            )
        if self.where not in WHERE:
            raise BadInputError(f"where={self.where!r}; use one of {WHERE}")
        bound = super().validate(arch)
        bound.site_ = site
        return bound

    def bind(self, call: Any) -> "Intervention":
        bound = self.validate(call.arch)
        count, rows = bound.per_row_count(), call.batch_rows
        if rows is not None and count is not None and count != rows:
            raise BadInputError(f"{type(self).__name__} at {self.site} has {count} per-row scales but the batch "
                                f"has {rows} rows; give one per sequence (prompts x n_samples)")
        return bound

    def install(self, call: Any) -> Any:
        return call.runner.editing(self.site_, self)

    def apply(self, view: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The edited view for the forward in flight (`ctx`: `probes.hooks.ForwardContext`)."""
        if self.where == "generated" and ctx.phase == "context":
            return view
        if self.where == "generated" and ctx.phase == "prefill":
            # only the last prompt position predicts a generated token
            out = torch.cat([view[:, :-1], self.edit(view[:, -1:])], dim=1)
        else:
            out = self.edit(view)
        report = self.report(view, out)
        if report:
            for name, values in report.items():
                ctx.fire(name, values)
        return out

    def report(self, before: torch.Tensor, after: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """What this edit reports of the forward in flight: {name: [batch, seq] tensor} (e.g. the norm it
        added at each position; `TokenRecord.fired`, `Trace.fired`), or None (the default: nothing)."""
        return None

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
    Steering page's slider grid). Its length is checked against the batch when the call is made.
    """

    kind: ClassVar[str] = "add"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: Any
    scale: float | Sequence[float] = 1.0

    def _check(self, arch: Any) -> None:
        self.scale_ = _scales(self.scale, "steering scale")
        self.vector_ = _as_vector(self.vector, arch.d_model, "steering vector")

    def per_row_count(self) -> int | None:
        scale = _given(self, "scale")
        return len(scale) if isinstance(scale, list) else None

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        v = self.vector_.to(x.dtype).to(x.device)
        # row b: x_b + scale_b * v, the same float32 product as a single-row call with that scale
        return x + _row_factor(self.scale_, x, self) * v

    def describe(self) -> str:
        scale, norm = _given(self, "scale"), float(torch.as_tensor(_given(self, "vector"), dtype=torch.float32).norm())
        if isinstance(scale, list):
            scales = ", ".join(f"{s:g}" for s in scale)
            return f"add [{scales}] * v per row (|v|={norm:.3g}) at {self.site}"
        return f"add {scale:g} * v (|v|={norm:.3g}) at {self.site}"


@dataclass
class ProjectionRescale(Intervention):
    """h' = h - alpha * w (w.h) with w normalised (RISE): alpha 1 removes the w component, -1 doubles it.

    `alpha` is one number, or one per batch row as `AddVector`'s scale (the RISE page's alpha grid)."""

    kind: ClassVar[str] = "rescale"
    tensor_fields: ClassVar[tuple[str, ...]] = ("direction",)
    direction: Any
    alpha: float | Sequence[float] = 1.0

    def _check(self, arch: Any) -> None:
        self.alpha_ = _scales(self.alpha, "alpha")
        w = _as_vector(self.direction, arch.d_model, "direction")
        norm = float(w.norm())
        if norm == 0.0:
            raise BadInputError("direction is the zero vector; it has no direction to rescale along")
        self.direction_ = w / norm

    def per_row_count(self) -> int | None:
        alpha = _given(self, "alpha")
        return len(alpha) if isinstance(alpha, list) else None

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        w = self.direction_.to(x.dtype).to(x.device)
        return x - _row_factor(self.alpha_, x, self) * (x @ w).unsqueeze(-1) * w

    def describe(self) -> str:
        alpha = _given(self, "alpha")
        if isinstance(alpha, list):
            return f"rescale along w by alpha=[{', '.join(f'{a:g}' for a in alpha)}] per row at {self.site}"
        return f"rescale along w by alpha={alpha:g} at {self.site}"


def _given(iv: Any, name: str) -> Any:
    """A parameter as checked when `iv` is a per-call copy (`name_`), else as given (a tensor scale as a list)."""
    value = iv.__dict__.get(name + "_", getattr(iv, name))
    return value.tolist() if isinstance(value, torch.Tensor) and name not in type(iv).tensor_fields else value


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
    means: Any = None
    kinds: ClassVar[tuple[str, ...]] = ("z",)

    # The spec names the layer (the wire format since the first server), the base holds the site `z.L`.
    def __init__(self, layer: int, heads: list[int], mode: str = "zero", means: Any = None, *, where: str = "all"):
        self.site, self.where, self.heads, self.mode, self.means = f"z.{layer}", where, heads, mode, means

    @property
    def layer(self) -> int:
        return int(self.site.split(".", 1)[1])

    def _check(self, arch: Any) -> None:
        heads = list(self.heads) if isinstance(self.heads, (list, tuple)) else self.heads
        if not isinstance(heads, list) or not heads:
            raise BadInputError("HeadAblation needs a non-empty list of heads")
        bad = [h for h in heads if not (checks.is_integer(h) and 0 <= h < arch.n_heads)]
        if bad:
            raise BadInputError(f"heads {bad} out of range; this model has heads 0..{arch.n_heads - 1}")
        if self.mode not in ("zero", "mean"):
            raise BadInputError(f"ablation mode {self.mode!r}; use 'zero' or 'mean'")
        self.heads_, self.means_ = heads, None
        if self.mode == "mean":
            if self.means is None:
                raise BadInputError("mean ablation needs means [n_heads, head_dim]; compute them with Engine.head_means")
            means = torch.as_tensor(self.means, dtype=torch.float32)
            if tuple(means.shape) != (arch.n_heads, arch.head_dim):
                raise BadInputError(f"means has shape {tuple(means.shape)}, expected ({arch.n_heads}, {arch.head_dim})")
            if not torch.isfinite(means).all():
                raise BadInputError("the mean-ablation means contain NaN or infinite values")
            self.means_ = means

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        idx = torch.tensor(self.heads_, device=x.device)
        if self.mode == "zero":
            x[..., idx, :] = 0
        else:
            x[..., idx, :] = self.means_[idx].to(x.dtype).to(x.device)
        return x

    def describe(self) -> str:
        heads = list(self.heads) if isinstance(self.heads, (list, tuple)) else self.heads
        return f"{self.mode}-ablate heads {heads} at {self.site}"


def load_vector(path: str | Path, key: str | None = None) -> torch.Tensor:
    """Read a steering vector from a .safetensors file (the only format accepted: never pickle).

    With one tensor in the file `key` may be omitted.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checks.user_path("vector file", path)
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
