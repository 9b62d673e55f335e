"""Steering directions and steered-versus-unsteered generations.

A direction is the difference of the mean activations of two prompt sets at one site
(difference of means: activation addition, Turner et al. 2023; contrastive activation addition,
Rimsky et al. 2024), a vector loaded from a .safetensors file, or an SAE decoder row.
`steered_comparison` generates with and without `AddVector(site, vector, scale)` from the same
seed, so the only difference between the two texts is the intervention.

Scales mean something: with `unit="norm"` the vector added is `scale x (mean activation norm at the
site) x v/|v|`, so a scale of 0.5 adds half a typical activation whatever |v| is (raw
difference-of-means vectors differ in length by orders of magnitude between sites and models).

Speed: `steering_grid` generates one direction at every stop of a scale grid in ONE batched greedy
generation (the prompt repeated, one row per scale, `AddVector` with one scale per row), so a
slider that snaps to the grid's stops answers by a lookup. The rows are the single-row steered
generations token for token (tested on tiny-random:llama; measured on SmolLM2-135M at the Steering
page's 16 stops). The prompt's cached state cannot be shared between rows: steering changes the
prompt's keys and values too. `generate_from_draft` is the other route to one greedy scale: a
draft (the unsteered text) checked in one teacher-forced pass, only the tokens after the first
disagreement generated (the accept rule of speculative decoding).
`steering_sweep` runs several scales side by side with a quality measure: the steered text's
perplexity under the unsteered model (greedy: from one batched grid).

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> v = diff_of_means_direction(engine, ["I love it"], ["I hate it"], "resid_post.0")
    >>> cmp = steered_comparison(engine, "Today I feel", "resid_post.0", v, scale=4.0, max_new_tokens=8)
    >>> cmp.unsteered_text != cmp.steered_text
    True
    >>> sweep = steering_sweep(engine, "Today I feel", "resid_post.0", v, [-1, 0, 1], max_new_tokens=8)
    >>> sweep.to_dict()["scales"], sweep.unit
    ([-1.0, 0.0, 1.0], 'norm')
    >>> grid = steering_grid(engine, "Today I feel", "resid_post.0", v, scale_grid(-1, 1, 0.5), max_new_tokens=8)
    >>> grid.scales, grid.comparison(1.0).steered_text == sweep.rows[2].steered_text
    ([-1.0, -0.5, 0.0, 0.5, 1.0], True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probes.backend import Backend
from probes.engine import Sampling
from saes.io import check_fits, load_sae
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from probes.interventions import AddVector
from probes.records import TokenRecord

REDUCTIONS = ("mean", "last")


def _clean_prompts(prompts: Sequence[str], what: str) -> list[str]:
    kept = [p.strip() for p in prompts if isinstance(p, str) and p.strip()]
    if not kept:
        raise BadInputError(f"prompt set {what} is empty; give at least one prompt (one per line)")
    return kept


def mean_activation(backend: Backend, prompts: Sequence[str], site: str, reduce: str = "mean",
                    chat: bool = False) -> torch.Tensor:
    """Mean activation at `site` over prompts; per prompt the mean over positions or the last position."""
    checks.choice("reduce", reduce, REDUCTIONS)
    rows = []
    for prompt in prompts:
        acts = backend.trace(prompt, capture=[site], chat=chat).activations[site].float()
        rows.append(acts.mean(0) if reduce == "mean" else acts[-1])
    return torch.stack(rows).mean(0).cpu()


def diff_of_means_direction(backend: Backend, prompts_a: Sequence[str], prompts_b: Sequence[str], site: str,
                            reduce: str = "mean", chat: bool = False) -> torch.Tensor:
    """mean(site | prompts_a) - mean(site | prompts_b): adding it pushes the model from B towards A."""
    a = _clean_prompts(prompts_a, "A")
    b = _clean_prompts(prompts_b, "B")
    return mean_activation(backend, a, site, reduce, chat) - mean_activation(backend, b, site, reduce, chat)


@dataclass
class GeneratedText:
    """One generation, reduced to what a figure or an export needs."""

    tokens: list[str] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: Sequence[TokenRecord]) -> "GeneratedText":
        return cls([r.text for r in records], [r.entropy for r in records], [r.logprob for r in records],
                   [r.token_id for r in records])

    def __add__(self, other: "GeneratedText") -> "GeneratedText":
        return GeneratedText(self.tokens + other.tokens, self.entropies + other.entropies,
                             self.logprobs + other.logprobs, self.token_ids + other.token_ids)

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": list(self.tokens), "token_ids": list(self.token_ids),
                "entropies": list(self.entropies), "logprobs": list(self.logprobs)}


UNITS = ("norm", "raw")  # scale x mean ||site|| along v/|v|, or scale x v as given


@dataclass
class SteeringComparison:
    """The same prompt and seed generated without and with a steering vector added at `site`.

    With `unit="norm"` the vector added is `scale * reference_norm * v/|v|`: `scale` is a fraction of
    the mean residual norm at the site (`site_norm`), so 0.5 means "half a typical activation";
    with `unit="raw"` it is `scale * v`. `reused_tokens` counts the steered tokens taken from a draft
    (the unsteered text or a neighbouring scale) after one teacher-forced check; `perplexity` is the
    steered continuation's perplexity under the unsteered model (how far steering pushed the text
    from what the model finds likely).
    """

    site: str
    scale: float
    seed: int
    direction_norm: float
    unsteered: GeneratedText
    steered: GeneratedText
    unit: str = "raw"
    reference_norm: float | None = None
    reused_tokens: int = 0
    perplexity: float | None = None
    # where the steered text came from: checked against a draft ("unsteered", "other"), generated
    # alone ("none"), or one row of a batched grid ("grid")
    draft: str = "none"

    @property
    def unsteered_text(self) -> str:
        return self.unsteered.text

    @property
    def steered_text(self) -> str:
        return self.steered.text

    @property
    def added_norm(self) -> float:
        """|the vector added| at each position."""
        base = self.reference_norm if self.unit == "norm" else self.direction_norm
        return abs(self.scale) * float(base or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "scale": self.scale, "unit": self.unit, "seed": self.seed,
                "direction_norm": self.direction_norm, "reference_norm": self.reference_norm,
                "added_norm": self.added_norm, "reused_tokens": self.reused_tokens, "draft": self.draft,
                "perplexity": self.perplexity,
                "unsteered": self.unsteered.to_dict(), "steered": self.steered.to_dict()}


def site_norm(backend: Backend, prompt: Any, site: str, chat: bool = False) -> float:
    """Mean L2 norm of the activation at `site` over the prompt's positions, the first excluded (the
    first token is an attention sink whose residual norm is many times the others'): the unit of
    `unit="norm"` steering scales."""
    acts = backend.capture(prompt, [site], chat=chat)[site].float()
    norms = acts.norm(dim=-1)
    return float((norms[1:] if len(norms) > 1 else norms).mean())


def steering_vector(direction: Any, unit: str = "raw", reference_norm: float | None = None) -> torch.Tensor:
    """The vector `AddVector` adds at scale 1: `direction` itself, or its unit vector times `reference_norm`."""
    checks.choice("unit", unit, UNITS)
    v = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "raw":
        return v
    norm = float(v.norm())
    if norm == 0.0 or not torch.isfinite(v).all():
        raise BadInputError("the direction is zero (or not finite): it has no direction to scale along")
    if reference_norm is None or not reference_norm > 0:
        raise BadInputError("unit='norm' needs the site's mean activation norm (site_norm) as reference_norm")
    return v / norm * float(reference_norm)


def generate_text(backend: Backend, prompt: Any, *, interventions: Sequence[Any] = (), max_new_tokens: int = 32,
                  sampling: Sampling | None = None, seed: int = 0, chat: bool = False) -> GeneratedText:
    records = list(backend.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                    interventions=list(interventions), chat=chat))
    return GeneratedText.from_records(records)


def _greedy(sampling: Sampling | None) -> bool:
    return sampling is None or sampling.greedy


def generate_from_draft(backend: Backend, prompt: Any, draft: GeneratedText, *, interventions: Sequence[Any] = (),
                        max_new_tokens: int = 32, chat: bool = False) -> tuple[GeneratedText, int]:
    """Greedy generation under `interventions` that starts by checking a `draft` continuation.

    One teacher-forced pass over prompt + draft (with the interventions) gives the greedy choice at
    every draft position; the draft is kept up to the first position where the choice differs,
    that choice is taken, and only the rest is generated. The result is the greedy generation (up
    to float ties between a full pass and a cached decode); returns it and the tokens kept.
    Speculative decoding's accept rule with a free draft: the unsteered text, or the text of a
    neighbouring steering scale.
    """
    prompt_ids = backend.encode(prompt, chat=chat)
    draft_ids = [int(t) for t in draft.token_ids[:max_new_tokens]]
    if not draft_ids:
        return generate_text(backend, prompt_ids, interventions=interventions, max_new_tokens=max_new_tokens), 0
    last = f"resid_post.{backend.arch().n_layers - 1}"
    n_prompt = len(prompt_ids)
    trace = backend.trace(prompt_ids + draft_ids, capture=[last], interventions=list(interventions))
    # the final residual read through the final norm and unembedding is the model's own logits
    read = backend.readout(trace.activations[last][n_prompt - 1:n_prompt - 1 + len(draft_ids)], norm=True, top_k=1)
    choice = [int(i) for i in read.top_ids[:, 0]]
    kept = next((i for i, (c, t) in enumerate(zip(choice, draft_ids)) if c != t), len(draft_ids))
    ids = draft_ids[:kept]
    entropies = [float(trace.entropies[n_prompt - 1 + i]) for i in range(kept)]
    logprobs = [float(trace.logprobs[n_prompt + i]) for i in range(kept)]
    if kept < len(draft_ids):
        ids.append(choice[kept])
        entropies.append(float(trace.entropies[n_prompt - 1 + kept]))
        logprobs.append(float(torch.log(read.top_probs[kept, 0])))
    context = prompt_ids[-8:]
    texts = backend.token_texts(context + ids)[len(context):]
    head = GeneratedText(texts, entropies, logprobs, ids)
    eos = set(backend.eos_ids())
    if len(ids) >= max_new_tokens or (ids and ids[-1] in eos):
        return head, kept
    tail = generate_text(backend, prompt_ids + ids, interventions=interventions,
                         max_new_tokens=max_new_tokens - len(ids))
    return head + tail, kept


def continuation_perplexity(backend: Backend, prompt: Any, continuation_ids: Sequence[int], chat: bool = False,
                            interventions: Sequence[Any] = ()) -> float | None:
    """exp(mean -log p) of the continuation's tokens after the prompt (under `interventions`, by default
    none: the unsteered model). None for an empty continuation."""
    ids = [int(t) for t in continuation_ids]
    if not ids:
        return None
    prompt_ids = backend.encode(prompt, chat=chat)
    trace = backend.trace(prompt_ids + ids, interventions=list(interventions))
    lp = trace.logprobs[len(prompt_ids):len(prompt_ids) + len(ids)].double()
    return float(torch.exp(-lp.mean()))


def steered_comparison(backend: Backend, prompt: Any, site: str, direction: torch.Tensor, scale: float, *,
                       max_new_tokens: int = 32, sampling: Sampling | None = None, seed: int = 0,
                       chat: bool = False, unsteered: GeneratedText | None = None, unit: str = "raw",
                       reference_norm: float | None = None, draft: GeneratedText | None = None,
                       check_draft: bool = True, quality: bool = False) -> SteeringComparison:
    """Generate with and without the direction; pass `unsteered` to reuse a baseline already made.

    Greedy decoding with `check_draft` starts from a draft (`draft`, else the unsteered text)
    through `generate_from_draft`; otherwise, and for sampled decoding, it generates from scratch
    with the same seed. With `unit="norm"`, `scale` is a fraction of the site's mean activation
    norm (measured on this prompt unless `reference_norm`). `quality` adds the steered text's
    perplexity under the unsteered model.
    """
    direction = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "norm" and reference_norm is None:
        reference_norm = site_norm(backend, prompt, site, chat)
    steer = AddVector(site, steering_vector(direction, unit, reference_norm), scale=scale)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, **kwargs)
    reused, drafted = 0, "none"
    if float(scale) == 0.0:
        steered, reused, drafted = base, len(base.token_ids), "unsteered"
    elif check_draft and _greedy(sampling) and (draft or base).token_ids:
        steered, reused = generate_from_draft(backend, prompt, draft or base, interventions=[steer],
                                              max_new_tokens=max_new_tokens, chat=chat)
        drafted = "unsteered" if draft is None or draft is base else "other"
    else:
        steered = generate_text(backend, prompt, interventions=[steer], **kwargs)
    ppl = continuation_perplexity(backend, prompt, steered.token_ids, chat) if quality else None
    return SteeringComparison(site, float(scale), int(seed), float(direction.norm()), base, steered, unit,
                              None if reference_norm is None else float(reference_norm), reused, ppl, drafted)


def scale_grid(low: float = -2.0, high: float = 2.0, step: float = 0.25) -> list[float]:
    """The stops low, low + step, ..., high (0 among them when the range spans it): the scales a slider
    that snaps to `step` can show. Rounded to 6 decimals, so 0.1 steps give 0.3, not 0.30000000000000004."""
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(step)) or step <= 0 or high < low:
        raise BadInputError(f"a scale grid needs finite low <= high and step > 0, got {low}, {high}, {step}")
    n = int(round((high - low) / step))
    if n > MAX_GRID_ROWS:
        raise BadInputError(f"{n + 1} stops is more than {MAX_GRID_ROWS} rows of one batched generation; "
                            "use a larger step or a narrower range")
    return [round(low + i * step, 6) + 0.0 for i in range(n + 1)]  # + 0.0: -0.0 becomes 0.0


MAX_GRID_ROWS = 64  # rows of one batched generation: beyond this a grid costs more than it saves


@dataclass
class SteeringGrid:
    """One direction's greedy steered generation at every scale of a grid, made in one batched generation.

    `texts` holds the steered text of every nonzero scale (scale 0 is `unsteered`); `seconds` is the
    wall time of the batched generation; `perplexities` fills in as `add_perplexities` computes them.
    A slider that snaps to `scales` reads `comparison(scale)`: no model call.
    """

    site: str
    unit: str
    reference_norm: float | None
    direction_norm: float
    seed: int
    unsteered: GeneratedText
    texts: dict[float, GeneratedText]
    seconds: float = 0.0
    perplexities: dict[float, float | None] = field(default_factory=dict)
    unsteered_perplexity: float | None = None

    @property
    def scales(self) -> list[float]:
        return sorted({0.0, *self.texts})

    def snap(self, scale: float) -> float:
        """The grid scale nearest to `scale`."""
        return min(self.scales, key=lambda s: (abs(s - float(scale)), s))

    def comparison(self, scale: float) -> SteeringComparison:
        """The steered and unsteered texts at one grid scale (`draft="grid"`), with its perplexity if known."""
        scale = float(scale)
        if scale != 0.0 and scale not in self.texts:
            raise BadInputError(f"scale {scale:g} is not on this grid; its scales are "
                                f"{', '.join(f'{s:g}' for s in self.scales)} (snap first: grid.snap(scale))")
        steered = self.unsteered if scale == 0.0 else self.texts[scale]
        ppl = self.unsteered_perplexity if scale == 0.0 else self.perplexities.get(scale)
        return SteeringComparison(self.site, scale, self.seed, self.direction_norm, self.unsteered, steered, self.unit,
                                  self.reference_norm, 0, ppl, "grid")

    def sweep(self, scales: Sequence[float]) -> "SteeringSweep":
        """The sweep view of some of the grid's scales (their perplexities as far as computed)."""
        rows = [self.comparison(s) for s in sorted({float(s) for s in scales})]
        return SteeringSweep(self.site, self.unit, self.reference_norm, self.direction_norm, self.unsteered,
                             self.unsteered_perplexity, rows)


def steering_grid(backend: Backend, prompt: Any, site: str, direction: torch.Tensor, scales: Sequence[float], *,
                  max_new_tokens: int = 32, seed: int = 0, chat: bool = False, unit: str = "norm",
                  reference_norm: float | None = None, unsteered: GeneratedText | None = None,
                  on_progress: Any = None, watch: float | None = None, on_watched: Any = None) -> SteeringGrid:
    """Greedy steered generations at every scale in ONE batched generation: the prompt once per nonzero
    scale, `AddVector(site, v, scale=[one scale per row])`. Without `unsteered`, a row at scale 0 makes
    it in the same batch. `on_progress(step, max_new_tokens)` after every generated position;
    `on_watched(text so far)` after every token of the row at scale `watch` (a page streams the scale
    its slider shows while the whole grid is made).

    Each row is the single-row greedy generation at its scale (rows of one prompt need no padding;
    only float differences between batched and single-row matrix products could split them, and
    none did on tiny-random:llama or on SmolLM2-135M at the Steering page's 16 scales).
    """
    values = sorted({float(s) + 0.0 for s in scales})
    if not values:
        raise BadInputError("give at least one scale for the grid")
    if len(values) > MAX_GRID_ROWS:
        raise BadInputError(f"{len(values)} scales is more than {MAX_GRID_ROWS} rows of one batched generation")
    direction = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "norm" and reference_norm is None:
        reference_norm = site_norm(backend, prompt, site, chat)
    vector = steering_vector(direction, unit, reference_norm)
    rows = [s for s in values if s != 0.0]
    if unsteered is None:
        rows.append(0.0)
    texts: dict[float, GeneratedText] = {}
    started = time.perf_counter()
    if rows:
        records: dict[int, list[TokenRecord]] = {b: [] for b in range(len(rows))}
        stream = backend.generate(prompt, n_samples=len(rows), max_new_tokens=max_new_tokens, seed=seed, chat=chat,
                                  top_k=0, interventions=[AddVector(site, vector, scale=rows)])
        step = -1
        watched = rows.index(float(watch)) if watch is not None and float(watch) in rows else None
        for rec in stream:
            records[rec.batch_index].append(rec)
            if on_progress is not None and rec.step != step:
                step = rec.step
                on_progress(step + 1, max_new_tokens)
            if on_watched is not None and rec.batch_index == watched:
                on_watched(GeneratedText.from_records(records[watched]))
        texts = {s: GeneratedText.from_records(records[b]) for b, s in enumerate(rows)}
    if unsteered is None:
        unsteered = texts.pop(0.0)
    return SteeringGrid(site, unit, None if reference_norm is None else float(reference_norm),
                        float(direction.norm()), int(seed), unsteered, texts, time.perf_counter() - started)


def add_perplexities(backend: Backend, prompt: Any, grid: SteeringGrid, scales: Sequence[float] | None = None, *,
                     chat: bool = False, on_progress: Any = None) -> SteeringGrid:
    """Fill in the perplexity under the unsteered model of the grid's texts at `scales` (default: all)
    and of the unsteered text: one teacher-forced pass each, skipping those already known."""
    wanted = [float(s) for s in (grid.scales if scales is None else scales)]
    for s in wanted:
        grid.comparison(s)  # an off-grid scale fails here, before any model work
    todo = [s for s in wanted if s != 0.0 and s not in grid.perplexities]
    if grid.unsteered_perplexity is None:
        grid.unsteered_perplexity = continuation_perplexity(backend, prompt, grid.unsteered.token_ids, chat)
    for i, s in enumerate(todo):
        grid.perplexities[s] = continuation_perplexity(backend, prompt, grid.texts[s].token_ids, chat)
        if on_progress is not None:
            on_progress(i + 1, len(todo))
    return grid


@dataclass
class SteeringSweep:
    """Several scales of one direction side by side, each with its perplexity under the unsteered model."""

    site: str
    unit: str
    reference_norm: float | None
    direction_norm: float
    unsteered: GeneratedText
    unsteered_perplexity: float | None
    rows: list[SteeringComparison]

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site, "unit": self.unit, "reference_norm": self.reference_norm,
            "direction_norm": self.direction_norm, "unsteered": self.unsteered.to_dict(),
            "unsteered_perplexity": self.unsteered_perplexity,
            "scales": [r.scale for r in self.rows], "added_norms": [r.added_norm for r in self.rows],
            "perplexities": [r.perplexity for r in self.rows], "reused_tokens": [r.reused_tokens for r in self.rows],
            "texts": [r.steered_text for r in self.rows], "n_tokens": [len(r.steered.tokens) for r in self.rows],
            "mean_entropies": [sum(r.steered.entropies) / max(1, len(r.steered.entropies)) for r in self.rows],
        }


def steering_sweep(backend: Backend, prompt: Any, site: str, direction: torch.Tensor, scales: Sequence[float], *,
                   max_new_tokens: int = 32, sampling: Sampling | None = None, seed: int = 0, chat: bool = False,
                   unit: str = "norm", reference_norm: float | None = None,
                   unsteered: GeneratedText | None = None, on_progress: Any = None) -> SteeringSweep:
    """Several scales side by side, each with its perplexity under the unsteered model.

    Greedy decoding: one batched `steering_grid` over the scales, then one perplexity pass per text.
    Sampled decoding: each scale generated alone from `seed` (a batch would give each row other random
    numbers than a single generation from that seed, so steered and unsteered texts would differ by
    more than the steering)."""
    scales = sorted({float(s) for s in scales})
    if not scales:
        raise BadInputError("give at least one scale to sweep")
    direction = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "norm" and reference_norm is None:
        reference_norm = site_norm(backend, prompt, site, chat)
    if _greedy(sampling):
        grid = steering_grid(backend, prompt, site, direction, scales, max_new_tokens=max_new_tokens, seed=seed,
                             chat=chat, unit=unit, reference_norm=reference_norm, unsteered=unsteered)
        add_perplexities(backend, prompt, grid, scales, chat=chat, on_progress=on_progress)
        return grid.sweep(scales)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, **kwargs)
    rows = []
    for i, scale in enumerate(scales):
        rows.append(steered_comparison(backend, prompt, site, direction, scale, unsteered=base, unit=unit,
                                       reference_norm=reference_norm, quality=True, **kwargs))
        if on_progress is not None:
            on_progress(i + 1, len(scales))
    return SteeringSweep(site, unit, None if reference_norm is None else float(reference_norm),
                         float(direction.norm()), base, continuation_perplexity(backend, prompt, base.token_ids, chat),
                         rows)


def sae_feature_direction(folder: str, feature: int, d_model: int, site: str = "") -> torch.Tensor:
    """The decoder row of one feature of a saved SAE (SAELens format, see `saes.io`): the direction
    that feature writes into the residual stream."""
    if not str(folder).strip():
        raise BadInputError("give the folder of a saved SAE (cfg.json + sae_weights.safetensors)")
    sae = load_sae(str(folder).strip())
    check_fits(sae, d_model, site)
    n = int(sae.W_dec.shape[0])
    if not 0 <= int(feature) < n:
        raise BadInputError(f"feature {feature} out of range; this SAE has features 0..{n - 1}")
    return sae.W_dec[int(feature)].detach().float().cpu()
