"""Steering edits: six ways to change a residual activation, where they act, and proof that they did.

Each edit is one registered dataclass (wire name `kind`, travels to the model server as JSON through
`probes.interventions.KINDS`) that overrides one method, `steer(x) -> x'`, over the activation
`[batch, seq, d_model]`. The base class `SteerEdit` owns the plumbing: which token positions it acts
on (`tokens`, a `start`/`stop` range, special and chat-template tokens skipped by default), which
batch rows (`rows`; a per-row list of strengths works too, as `AddVector`'s scale), and the record of
what it did (`fired`: the L2 norm it added at each position, which every `TokenRecord.fired` and
`Trace.fired` report under the term's name).

| kind | what | where it comes from |
|---|---|---|
| `additive` | h + s v | activation addition (Turner et al. 2023); `AddVector` ("add") is the same edit without masks |
| `norm_scaled` | h + s ‖h‖ v/‖v‖ | norm-matched steering of vllm-lens (`norm_match`, after Activation Oracles, arXiv 2512.15674) |
| `project_out` | h - s (h.û) û | directional ablation (Arditi et al. 2024); interp-engine's orthogonal edit with coeff 1 - s |
| `projection_cap` | h + (clamp(h.û, lo, hi) - h.û) û | interp-engine's `ProjectionCapSpec` (clamp the projection into [min, max]) |
| `sae_clamp` | h + (value - z_i(h)) W_dec[i] | SAE feature clamping (Templeton et al. 2024): encode, set latent i, decode, keep the error |
| `swap` | h + s (h.û) (v̂ - û) | our spelling of interp-engine's swap: move the component along u onto v |

Positions (documented in docs/steering.md): position p of a row whose prompt has P tokens is a prompt
position when p < P and a generated one when p >= P. The record of generated token t reports what
acted at position P - 1 + t, the position whose forward chose it; so a `tokens="generated"` edit first
changes the second generated token (the first is chosen at the last prompt position).

Example:
    >>> import torch
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> v = torch.ones(64)
    >>> recs = list(engine.generate("one two three", max_new_tokens=2,
    ...                             interventions=[Additive("resid_post.0", v, strength=2.0, term="up")]))
    >>> round(recs[0].fired["up"], 3)   # 2 * |v| = 2 * 8, added at the position that chose token 0
    16.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probes.interventions import RESIDUAL_KINDS, Intervention, _as_vector, _scales
from probes.token_masks import MAX_TERMS, SteerRun  # noqa: F401  (MAX_TERMS re-exported)
from thoughtscope import checks
from thoughtscope.errors import BadInputError

TOKENS = ("both", "prompt", "generated")


@dataclass
class SteerEdit(Intervention):
    """Base of the steering edits: a site, a strength (one number, or one per batch row), a token mask,
    batch rows, and a term name for the records. Subclasses implement `steer(x, s)` (s broadcasts over
    `x` [batch, seq, d]) and `_check_edit(arch)`.

    - `tokens`: "both" (default), "prompt" (positions < P) or "generated" (positions >= P);
    - `start`, `stop`: a range of absolute token positions (stop exclusive; None: open);
    - `skip_special`: leave the tokenizer's special tokens and the chat template's own tokens alone
      (`probes.token_masks`);
    - `rows`: the batch rows (prompts x n_samples) this term acts on; None: every row;
    - `term`: the name the records use (default `kind@site`; a stack gives each term its own).
    """

    strength: float | list[float] = 1.0
    tokens: str = "both"
    start: int | None = None
    stop: int | None = None
    skip_special: bool = True
    rows: list[int] | None = None
    term: str = ""
    kinds: ClassVar[tuple[str, ...]] = RESIDUAL_KINDS

    def per_row_count(self) -> int | None:
        return len(self.strength) if isinstance(self.strength, list) else None

    def _check(self, arch: Any) -> None:
        if self.where != "all":
            raise BadInputError(f"{self.name()}: steering edits say where they act with tokens= ('prompt', "
                                f"'generated' or 'both') and start=/stop=, not where={self.where!r}")
        self.strength = _scales(self.strength, f"{self.kind} strength")
        checks.choice("tokens", self.tokens, TOKENS)
        checks.integer("start", self.start, low=0, none_ok=True)
        checks.integer("stop", self.stop, low=1, none_ok=True)
        if self.start is not None and self.stop is not None and self.stop <= self.start:
            raise BadInputError(f"the token range start={self.start}, stop={self.stop} is empty; stop must exceed start")
        if not isinstance(self.skip_special, bool):
            raise BadInputError(f"skip_special must be true or false, got {self.skip_special!r}")
        if self.rows is not None:
            self.rows = checks.int_list("rows", self.rows, low=0)
            if not self.rows:
                raise BadInputError("rows must name at least one batch row (or be None for every row)")
        if not isinstance(self.term, str) or len(self.term) > 128:
            raise BadInputError(f"term must be a name of at most 128 characters, got {self.term!r}")
        self._check_edit(arch)

    def _check_edit(self, arch: Any) -> None:
        """Subclasses check their own tensors and values here."""

    # ----- one engine call (probes.calls): the call's shared steering run, a hook at the site -----

    def bind(self, call: Any) -> "SteerEdit":
        bound = super().bind(call)
        rows = call.batch_rows
        if bound.rows is not None and rows is not None and max(bound.rows) >= rows:
            raise BadInputError(f"{bound.name()} names rows {bound.rows} but the batch has {rows} rows "
                                "(prompts x n_samples)")
        lengths = [n for n in call.lengths if n] if call.lengths else []
        if bound.start is not None and lengths:
            # a range starts inside the prompt (or, for generated tokens, inside the generation)
            limit = min(lengths) + (call.max_new_tokens if bound.tokens == "generated" else 0)
            if bound.start >= limit:
                raise BadInputError(f"{bound.name()}'s token range starts at {bound.start}, outside the prompt of "
                                    f"{min(lengths)} tokens{' and its generation' if bound.tokens == 'generated' else ''}"
                                    f"; positions are token indices 0..{limit - 1}")
        call.part(SteerRun.KEY, lambda: SteerRun(call)).members.append(bound)
        return bound

    def install(self, call: Any) -> Any:
        stack = contextlib.ExitStack()
        self.run_ = stack.enter_context(call.part(SteerRun.KEY, lambda: SteerRun(call)))
        stack.enter_context(call.runner.editing(self.site_, self))
        return stack

    def apply(self, view: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The edit where this term's mask holds; the norm it added is reported to the records (`ctx.fire`)."""
        out, report = self.run_.apply(self, view)
        if report is not None:
            ctx.fire(self.name(), report)
        return out

    def name(self) -> str:
        return self.term or f"{self.kind}@{self.site}"

    def strength_factor(self, x: torch.Tensor) -> Any:
        """The strength as a scalar, or per row as a [batch, 1, 1] tensor for `x` [batch, seq, d]."""
        s = self.strength
        if not isinstance(s, list):
            return s
        if len(s) != x.shape[0]:
            raise BadInputError(f"{self.name()} has {len(s)} per-row strengths but the batch has {x.shape[0]} rows")
        return torch.tensor(s, dtype=x.dtype, device=x.device).view(-1, 1, 1)

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        """The edit at every position (no mask): what `steer` computes."""
        return self.steer(x, self.strength_factor(x))

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        raise NotImplementedError

    def _strength_text(self) -> str:
        s = self.strength
        return "[" + ", ".join(f"{v:g}" for v in s) + "] per row" if isinstance(s, list) else f"{s:g}"

    def _where_text(self) -> str:
        parts = [] if self.tokens == "both" else [f"{self.tokens} tokens"]
        if self.start is not None or self.stop is not None:
            parts.append(f"positions {self.start or 0}..{'' if self.stop is None else self.stop - 1}")
        if self.rows is not None:
            parts.append(f"rows {self.rows}")
        return (" on " + ", ".join(parts)) if parts else ""

    def describe(self) -> str:
        return f"{self.name()}: {self.kind} {self._strength_text()} at {self.site}{self._where_text()}"


def _unit(v: torch.Tensor, what: str) -> torch.Tensor:
    norm = float(v.norm())
    if norm == 0.0:
        raise BadInputError(f"{what} is the zero vector; it has no direction")
    return v / norm


@dataclass
class Additive(SteerEdit):
    """h + s v: activation addition (Turner et al. 2023, "Activation Addition"), with the token mask,
    rows and records of `SteerEdit`. The vector is used as given (its norm matters)."""

    kind: ClassVar[str] = "additive"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: Any = None

    def __init__(self, site: str, vector: Any, strength: float | Sequence[float] = 1.0, tokens: str = "both",
                 start: int | None = None, stop: int | None = None, skip_special: bool = True,
                 rows: list[int] | None = None, term: str = "", where: str = "all"):
        self.site, self.where, self.vector, self.strength = site, where, vector, strength
        self.tokens, self.start, self.stop, self.skip_special, self.rows, self.term = (
            tokens, start, stop, skip_special, rows, term)

    def _check_edit(self, arch: Any) -> None:
        self.vector = _as_vector(self.vector, arch.d_model, f"{self.name()} vector")

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        return x + s * self.vector.to(x.device, x.dtype)


@dataclass
class NormScaled(SteerEdit):
    """h + s ‖h‖ v̂: the added vector's norm is `s` times the activation's own norm at that position, so
    one strength means the same at every layer and position (vllm-lens' `norm_match`, from the
    Activation Oracles paper, arXiv 2512.15674)."""

    kind: ClassVar[str] = "norm_scaled"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: Any = None

    __init__ = Additive.__init__

    def _check_edit(self, arch: Any) -> None:
        self.vector = _unit(_as_vector(self.vector, arch.d_model, f"{self.name()} vector"), f"{self.name()} vector")

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        return x + s * x.norm(dim=-1, keepdim=True) * self.vector.to(x.device, x.dtype)


@dataclass
class ProjectOut(SteerEdit):
    """h - s (h.û) û: strength 1 removes the component along the direction (directional ablation, Arditi
    et al. 2024); other strengths scale it by 1 - s (interp-engine's orthogonal edit, coeff = 1 - s)."""

    kind: ClassVar[str] = "project_out"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: Any = None

    __init__ = Additive.__init__

    _check_edit = NormScaled._check_edit

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        u = self.vector.to(x.device, x.dtype)
        return x - s * (x @ u).unsqueeze(-1) * u


@dataclass
class ProjectionCap(SteerEdit):
    """Clamp the component along û into [`low`, `high`] (either may be None): h + (clamp(h.û) - h.û) û.
    From interp-engine's `ProjectionCapSpec`; the strength scales the correction (1: the cap holds)."""

    kind: ClassVar[str] = "projection_cap"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector",)
    vector: Any = None
    low: float | None = None
    high: float | None = None

    def __init__(self, site: str, vector: Any, low: float | None = None, high: float | None = None,
                 strength: float | Sequence[float] = 1.0, tokens: str = "both", start: int | None = None,
                 stop: int | None = None, skip_special: bool = True, rows: list[int] | None = None,
                 term: str = "", where: str = "all"):
        Additive.__init__(self, site, vector, strength, tokens, start, stop, skip_special, rows, term, where)
        self.low, self.high = low, high

    def _check_edit(self, arch: Any) -> None:
        NormScaled._check_edit(self, arch)
        self.low = checks.number("low", self.low, none_ok=True)
        self.high = checks.number("high", self.high, none_ok=True)
        if self.low is None and self.high is None:
            raise BadInputError("a projection cap needs low= (at least) or high= (at most), or both")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise BadInputError(f"the projection cap's low={self.low} exceeds high={self.high}")

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        u = self.vector.to(x.device, x.dtype)
        c = x @ u
        capped = c.clamp(min=self.low, max=self.high)
        return x + s * (capped - c).unsqueeze(-1) * u

    def describe(self) -> str:
        return f"{super().describe()} (projection in [{self.low}, {self.high}])"


@dataclass
class SAEClamp(SteerEdit):
    """Set SAE latent `latent` to `value`, keeping the SAE's reconstruction error: with z = enc(h) and
    z' = z but z'_i = value, h' = dec(z') + (h - dec(z)) = h + (value - z_i) W_dec[i] (feature clamping,
    Templeton et al. 2024, "Scaling Monosemanticity"). The weights travel inline in SAELens' names:
    W_enc [d, n], b_enc [n], W_dec [n, d], b_dec [d], and `threshold` [n] for a JumpReLU SAE (else
    ReLU); z_i = act((h - b_dec) . W_enc[:, i] + b_enc[i]). The strength scales the change."""

    kind: ClassVar[str] = "sae_clamp"
    tensor_fields: ClassVar[tuple[str, ...]] = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
    latent: int = 0
    value: float = 0.0
    W_enc: Any = None
    b_enc: Any = None
    W_dec: Any = None
    b_dec: Any = None
    threshold: Any = None

    def __init__(self, site: str, latent: int, value: float, W_enc: Any = None, b_enc: Any = None,
                 W_dec: Any = None, b_dec: Any = None, threshold: Any = None,
                 strength: float | Sequence[float] = 1.0, tokens: str = "both", start: int | None = None,
                 stop: int | None = None, skip_special: bool = True, rows: list[int] | None = None,
                 term: str = "", where: str = "all"):
        self.site, self.where, self.latent, self.value, self.strength = site, where, latent, value, strength
        self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold = W_enc, b_enc, W_dec, b_dec, threshold
        self.tokens, self.start, self.stop, self.skip_special, self.rows, self.term = (
            tokens, start, stop, skip_special, rows, term)

    @classmethod
    def from_sae(cls, site: str, sae: Any, latent: int, value: float, only_latent: bool = True,
                 **kwargs: Any) -> "SAEClamp":
        """From a SAELens SAE object (or anything with W_enc, b_enc, W_dec, b_dec [, threshold]).

        The edit reads only latent `latent`'s encoder column and decoder row, so by default (`only_latent`)
        just those travel, as a one-latent SAE (its latent 0, the record named `sae_clamp[<latent>]@<site>`):
        a 16k-latent SAE of a 576-wide site would be 75 MB of JSON, past the model server's body limit."""
        weights = {k: getattr(sae, k).detach().float().cpu() for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
        thr = getattr(sae, "threshold", None)
        thr = None if thr is None else thr.detach().float().cpu()
        n = weights["W_enc"].shape[-1]
        checks.integer("latent", latent, low=0, high=n - 1, why=f"this SAE has {n} latents")
        if only_latent:
            i = [int(latent)]
            weights = {"W_enc": weights["W_enc"][:, i], "b_enc": weights["b_enc"][i], "W_dec": weights["W_dec"][i],
                       "b_dec": weights["b_dec"]}
            thr = None if thr is None else thr[i]
            kwargs.setdefault("term", f"sae_clamp[{int(latent)}]@{site}")
            latent = 0
        return cls(site, latent, value, **weights, threshold=thr, **kwargs)

    def _check_edit(self, arch: Any) -> None:
        if any(getattr(self, k) is None for k in ("W_enc", "W_dec")):
            raise BadInputError(f"{self.name()} clamps an SAE latent but was given no SAE (W_enc and W_dec); "
                                f"train or load an SAE for {self.site} first")
        d = arch.d_model
        w_enc = torch.as_tensor(self.W_enc, dtype=torch.float32)
        if w_enc.ndim != 2 or w_enc.shape[0] != d:
            raise BadInputError(f"{self.name()}: W_enc has shape {list(w_enc.shape)}; the site has width {d}, so "
                                f"W_enc must be [{d}, n_latents] (an SAE of another site or model?)")
        n = w_enc.shape[1]
        shapes = {"b_enc": [n], "W_dec": [n, d], "b_dec": [d], "threshold": [n]}
        fixed = {}
        for name, shape in shapes.items():
            t = getattr(self, name)
            if t is None:
                t = torch.zeros(shape) if name in ("b_enc", "b_dec") else None
            else:
                t = torch.as_tensor(t, dtype=torch.float32)
                if list(t.shape) != shape:
                    raise BadInputError(f"{self.name()}: {name} has shape {list(t.shape)}, expected {shape}")
            if t is not None and not torch.isfinite(t).all():
                raise BadInputError(f"{self.name()}: {name} contains NaN or infinite values")
            fixed[name] = t
        if not torch.isfinite(w_enc).all():
            raise BadInputError(f"{self.name()}: W_enc contains NaN or infinite values")
        self.latent = checks.integer("latent", self.latent, low=0, high=n - 1, why=f"this SAE has {n} latents")
        self.value = checks.number("value", self.value)
        self.W_enc = w_enc
        for name, t in fixed.items():
            setattr(self, name, t)

    def latent_of(self, x: torch.Tensor) -> torch.Tensor:
        """z_i of `x` [..., d]: the clamped latent's activation before the edit."""
        i = self.latent
        pre = (x - self.b_dec.to(x.device, x.dtype)) @ self.W_enc[:, i].to(x.device, x.dtype) + float(self.b_enc[i])
        if self.threshold is not None:
            return pre * (pre > float(self.threshold[i])) * (pre > 0)
        return pre.clamp(min=0)

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        delta = (self.value - self.latent_of(x)).unsqueeze(-1)
        return x + s * delta * self.W_dec[self.latent].to(x.device, x.dtype)

    def describe(self) -> str:
        return f"{super().describe()} (latent {self.latent} := {self.value:g})"


@dataclass
class Swap(SteerEdit):
    """Move the component along u onto v: with c = h.û, h' = h + s c (v̂ - û); strength 1 swaps it whole
    (h.û becomes 0 when u is orthogonal to v, and the c moves onto v̂). Named in interp-engine's list of
    edits; this formula is ours."""

    kind: ClassVar[str] = "swap"
    tensor_fields: ClassVar[tuple[str, ...]] = ("vector", "target")
    vector: Any = None
    target: Any = None

    def __init__(self, site: str, vector: Any, target: Any, strength: float | Sequence[float] = 1.0,
                 tokens: str = "both", start: int | None = None, stop: int | None = None,
                 skip_special: bool = True, rows: list[int] | None = None, term: str = "", where: str = "all"):
        Additive.__init__(self, site, vector, strength, tokens, start, stop, skip_special, rows, term, where)
        self.target = target

    def _check_edit(self, arch: Any) -> None:
        NormScaled._check_edit(self, arch)
        self.target = _unit(_as_vector(self.target, arch.d_model, f"{self.name()} target"), f"{self.name()} target")

    def steer(self, x: torch.Tensor, s: Any) -> torch.Tensor:
        u, v = self.vector.to(x.device, x.dtype), self.target.to(x.device, x.dtype)
        return x + s * (x @ u).unsqueeze(-1) * (v - u)


EDITS: tuple[type[SteerEdit], ...] = (Additive, NormScaled, ProjectOut, ProjectionCap, SAEClamp, Swap)
