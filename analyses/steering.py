"""Steering directions and steered-versus-unsteered generations.

A direction is the difference of the mean activations of two prompt sets at one site
(difference of means: activation addition, Turner et al. 2023; contrastive activation addition,
Rimsky et al. 2024), a vector loaded from a .safetensors file, or an SAE decoder row.
`steered_comparison` generates with and without `AddVector(site, vector, scale)` from the same
seed, so the only difference between the two texts is the intervention.

Scales mean something: with `unit="norm"` the vector added is `scale x (mean activation norm at the
site) x v/|v|`, so a scale of 0.5 adds half a typical activation whatever |v| is (raw
difference-of-means vectors differ in length by orders of magnitude between sites and models).

Speed: a greedy steered generation starts from a draft (the unsteered text, or the text of the
nearest scale already computed), checked in one teacher-forced pass; only the tokens after the
first disagreement are generated (`generate_from_draft`, the accept rule of speculative decoding).
The prompt's cached state cannot be reused: steering changes the prompt's keys and values too.
`steering_sweep` runs several scales side by side with a quality measure: the steered text's
perplexity under the unsteered model.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probes.engine import Sampling
from thoughtscope.errors import BadInputError
from probes.interventions import AddVector
from probes.records import TokenRecord

REDUCTIONS = ("mean", "last")


def _clean_prompts(prompts: Sequence[str], what: str) -> list[str]:
    kept = [p.strip() for p in prompts if isinstance(p, str) and p.strip()]
    if not kept:
        raise BadInputError(f"prompt set {what} is empty; give at least one prompt (one per line)")
    return kept


def mean_activation(backend: Any, prompts: Sequence[str], site: str, reduce: str = "mean",
                    chat: bool = False) -> torch.Tensor:
    """Mean activation at `site` over prompts; per prompt the mean over positions or the last position."""
    if reduce not in REDUCTIONS:
        raise BadInputError(f"reduce={reduce!r}; use one of {REDUCTIONS}")
    rows = []
    for prompt in prompts:
        acts = backend.trace(prompt, capture=[site], chat=chat).activations[site].float()
        rows.append(acts.mean(0) if reduce == "mean" else acts[-1])
    return torch.stack(rows).mean(0).cpu()


def diff_of_means_direction(backend: Any, prompts_a: Sequence[str], prompts_b: Sequence[str], site: str,
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
    draft: str = "none"  # what the steered text was checked against first: "unsteered", "other", "none"

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


def site_norm(backend: Any, prompt: Any, site: str, chat: bool = False) -> float:
    """Mean L2 norm of the activation at `site` over the prompt's positions, the first excluded (the
    first token is an attention sink whose residual norm is many times the others'): the unit of
    `unit="norm"` steering scales."""
    acts = backend.capture(prompt, [site], chat=chat)[site].float()
    norms = acts.norm(dim=-1)
    return float((norms[1:] if len(norms) > 1 else norms).mean())


def steering_vector(direction: Any, unit: str = "raw", reference_norm: float | None = None) -> torch.Tensor:
    """The vector `AddVector` adds at scale 1: `direction` itself, or its unit vector times `reference_norm`."""
    if unit not in UNITS:
        raise BadInputError(f"unit={unit!r}; use one of {UNITS}")
    v = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "raw":
        return v
    norm = float(v.norm())
    if norm == 0.0 or not torch.isfinite(v).all():
        raise BadInputError("the direction is zero (or not finite): it has no direction to scale along")
    if reference_norm is None or not reference_norm > 0:
        raise BadInputError("unit='norm' needs the site's mean activation norm (site_norm) as reference_norm")
    return v / norm * float(reference_norm)


def generate_text(backend: Any, prompt: Any, *, interventions: Sequence[Any] = (), max_new_tokens: int = 32,
                  sampling: Sampling | None = None, seed: int = 0, chat: bool = False) -> GeneratedText:
    records = list(backend.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                    interventions=list(interventions), chat=chat))
    return GeneratedText.from_records(records)


def _greedy(sampling: Sampling | None) -> bool:
    return sampling is None or sampling.greedy


def generate_from_draft(backend: Any, prompt: Any, draft: GeneratedText, *, interventions: Sequence[Any] = (),
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
    last = f"resid_post.{backend.info()['arch']['n_layers'] - 1}"
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


def continuation_perplexity(backend: Any, prompt: Any, continuation_ids: Sequence[int], chat: bool = False,
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


def steered_comparison(backend: Any, prompt: Any, site: str, direction: torch.Tensor, scale: float, *,
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


NEIGHBOUR = 0.15  # a scale this close to one already made (same sign) drafts from its text


def choose_draft(known: dict[float, SteeringComparison], base: GeneratedText, scale: float,
                 neighbour: float = NEIGHBOUR) -> GeneratedText | None:
    """What a slider move to `scale` should check before generating, or None to generate directly.

    The check is one teacher-forced pass over prompt + draft: on the embedded model with the one-shot
    prompt it costs about half a 48-token generation (the prompt dominates), so it runs only where it
    may pay: the text of a neighbouring scale already made, else the unsteered text, unless a scale
    nearer zero on the same side already kept none of it (a stronger push will not keep more).
    """
    near = min(known, key=lambda s: abs(s - scale), default=None)
    if near is not None and abs(near - scale) <= neighbour and near * scale > 0:
        return known[near].steered
    derailed = [s for s, r in known.items() if s * scale > 0 and abs(s) <= abs(scale) and r.reused_tokens == 0
                and r.draft == "unsteered"]
    return None if derailed else base


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


def steering_sweep(backend: Any, prompt: Any, site: str, direction: torch.Tensor, scales: Sequence[float], *,
                   max_new_tokens: int = 32, sampling: Sampling | None = None, seed: int = 0, chat: bool = False,
                   unit: str = "norm", reference_norm: float | None = None,
                   unsteered: GeneratedText | None = None, on_progress: Any = None) -> SteeringSweep:
    """`steered_comparison` at every scale (smallest |scale| first, each drafting from the nearest scale done)."""
    scales = sorted({float(s) for s in scales})
    if not scales:
        raise BadInputError("give at least one scale to sweep")
    direction = torch.as_tensor(direction, dtype=torch.float32).flatten()
    if unit == "norm" and reference_norm is None:
        reference_norm = site_norm(backend, prompt, site, chat)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, **kwargs)
    done: dict[float, SteeringComparison] = {}
    for i, scale in enumerate(sorted(scales, key=abs)):
        near = min(done, key=lambda s: abs(s - scale), default=None)
        draft = done[near].steered if near is not None and abs(near - scale) < abs(scale) else base
        done[scale] = steered_comparison(backend, prompt, site, direction, scale, unsteered=base, unit=unit,
                                         reference_norm=reference_norm, draft=draft, quality=True, **kwargs)
        if on_progress is not None:
            on_progress(i + 1, len(scales))
    return SteeringSweep(site, unit, None if reference_norm is None else float(reference_norm),
                         float(direction.norm()), base, continuation_perplexity(backend, prompt, base.token_ids, chat),
                         [done[s] for s in scales])


def sae_feature_direction(folder: str, feature: int, d_model: int, site: str = "") -> torch.Tensor:
    """The decoder row of one feature of a saved SAE (SAELens format, see `saes.io`): the direction
    that feature writes into the residual stream."""
    from saes.io import check_fits, load_sae

    if not str(folder).strip():
        raise BadInputError("give the folder of a saved SAE (cfg.json + sae_weights.safetensors)")
    sae = load_sae(str(folder).strip())
    check_fits(sae, d_model, site)
    n = int(sae.W_dec.shape[0])
    if not 0 <= int(feature) < n:
        raise BadInputError(f"feature {feature} out of range; this SAE has features 0..{n - 1}")
    return sae.W_dec[int(feature)].detach().float().cpu()
