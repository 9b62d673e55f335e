"""Steering directions and steered-versus-unsteered generations.

A direction is the difference of the mean activations of two prompt sets at one site
(difference of means: activation addition, Turner et al. 2023; contrastive activation addition,
Rimsky et al. 2024), or a vector loaded from a .safetensors file. `steered_comparison` generates
with and without `AddVector(site, direction, scale)` from the same seed, so the only difference
between the two texts is the intervention.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> v = diff_of_means_direction(engine, ["I love it"], ["I hate it"], "resid_post.0")
    >>> cmp = steered_comparison(engine, "Today I feel", "resid_post.0", v, scale=4.0, max_new_tokens=8)
    >>> cmp.unsteered_text != cmp.steered_text
    True
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

    @classmethod
    def from_records(cls, records: Sequence[TokenRecord]) -> "GeneratedText":
        return cls([r.text for r in records], [r.entropy for r in records], [r.logprob for r in records])

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": list(self.tokens), "entropies": list(self.entropies),
                "logprobs": list(self.logprobs)}


@dataclass
class SteeringComparison:
    """The same prompt and seed generated without and with `scale * direction` added at `site`."""

    site: str
    scale: float
    seed: int
    direction_norm: float
    unsteered: GeneratedText
    steered: GeneratedText

    @property
    def unsteered_text(self) -> str:
        return self.unsteered.text

    @property
    def steered_text(self) -> str:
        return self.steered.text

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "scale": self.scale, "seed": self.seed, "direction_norm": self.direction_norm,
                "unsteered": self.unsteered.to_dict(), "steered": self.steered.to_dict()}


def generate_text(backend: Any, prompt: Any, *, interventions: Sequence[Any] = (), max_new_tokens: int = 32,
                  sampling: Sampling | None = None, seed: int = 0, chat: bool = False) -> GeneratedText:
    records = list(backend.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                    interventions=list(interventions), chat=chat))
    return GeneratedText.from_records(records)


def steered_comparison(backend: Any, prompt: Any, site: str, direction: torch.Tensor, scale: float, *,
                       max_new_tokens: int = 32, sampling: Sampling | None = None, seed: int = 0,
                       chat: bool = False, unsteered: GeneratedText | None = None) -> SteeringComparison:
    """Generate with and without the direction; pass `unsteered` to reuse a baseline already made."""
    direction = torch.as_tensor(direction, dtype=torch.float32).flatten()
    steer = AddVector(site, direction, scale=scale)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat)
    base = unsteered if unsteered is not None else generate_text(backend, prompt, **kwargs)
    steered = generate_text(backend, prompt, interventions=[steer], **kwargs)
    return SteeringComparison(site, float(scale), int(seed), float(direction.norm()), base, steered)


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
