"""Input x gradient: a first-order attribution of one chosen output to the input tokens (and to sites).

For each input position i, score_i = sum_d x[i, d] * dF/dx[i, d], where x are the input token
embeddings and F the chosen output (Shrikumar et al. 2016, "Not just a black box", arXiv
1605.01713; the "gradient x input" baseline that attribution methods such as vSTREAM, METHODS.md
section 4, compare against). When F is linear in x the scores sum exactly to F(x) - F(0), the
output's change from an all-zero embedding baseline; for a transformer the sum is only a
first-order estimate, so the result reports both F(x) and F(0) to make the gap visible.
The same score is available at residual-stream sites (`resid_pre.L`, `resid_post.L`,
`attn_out.L`, `mlp_out.L`): activation x gradient per position.

Targets (`target=`), summed over the target `positions` p (a token position: its prediction is
read at row p - 1, so p = len(text) means the token after the text):
- `logprob`: log p(token_p | tokens < p);
- `logit`: the logit of token_p;
- `logit_diff`: logit of token_p minus logit of `foil`.
token_p is the text's own token at p unless `token` names one (required for p = len(text)).

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> att = engine.input_x_gradient("two plus two is", target="logprob")
    >>> att.scores.shape[0] == len(att.token_ids)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probes.sites import Site, get_module
from thoughtscope import checks
from thoughtscope.errors import BadInputError

TARGETS = ("logprob", "logit", "logit_diff")
GRAD_SITE_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")


@dataclass
class GradientAttribution:
    """Input x gradient of one output: `scores [seq]` per input token, `site_scores {site: [seq]}`."""

    token_ids: list[int]
    target: str  # what F is, in words
    positions: list[int]  # the target positions p
    scores: torch.Tensor  # [seq] float32
    target_value: float  # F(x)
    baseline_value: float  # F with every input embedding set to zero
    site_scores: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def completeness_gap(self) -> float:
        """sum(scores) - (F(x) - F(0)): zero for an output linear in the embeddings."""
        return float(self.scores.sum()) - (self.target_value - self.baseline_value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "target": self.target,
            "positions": list(self.positions),
            "scores": self.scores.tolist(),
            "target_value": self.target_value,
            "baseline_value": self.baseline_value,
            "site_scores": {name: v.tolist() for name, v in self.site_scores.items()},
        }


def check_target(target: str, n_tokens: int, vocab_size: int, positions: Sequence[int] | None = None,
                 token: int | None = None, foil: int | None = None) -> list[int]:
    """Validate a target (before any model work) and return its positions."""
    checks.choice("target", target, TARGETS)
    for name, tid in (("token", token), ("foil", foil)):
        if tid is not None and (not checks.is_integer(tid) or not 0 <= tid < vocab_size):
            raise BadInputError(f"{name} must be a token id in 0..{vocab_size - 1}, got {tid!r}")
    if target == "logit_diff" and foil is None:
        raise BadInputError("target 'logit_diff' needs foil= (the token id whose logit is subtracted)")
    if positions is None:
        positions = [n_tokens] if token is not None else [n_tokens - 1]
    positions = list(positions)
    if not positions:
        raise BadInputError("give at least one target position")
    top = n_tokens if token is not None else n_tokens - 1
    bad = [p for p in positions if not checks.is_integer(p) or not 1 <= p <= top]
    if bad:
        hint = "" if token is not None else f" (position {n_tokens}, after the text, needs token=)"
        raise BadInputError(f"target positions {bad[:5]} are outside 1..{top}{hint}; a position p is predicted "
                            "from the tokens before it")
    repeated = sorted({p for p in positions if positions.count(p) > 1}) if len(set(positions)) < len(positions) else []
    if repeated:  # each target position counts once; a repeat would only multiply the [positions, vocab] rows
        raise BadInputError(f"target positions repeat: {repeated[:5]}; give each position once")
    return positions


def check_sites(sites: Sequence[Site]) -> None:
    bad = [s.name for s in sites if s.kind not in GRAD_SITE_KINDS]
    if bad:
        raise BadInputError(f"gradient scores are defined at {', '.join(k + '.L' for k in GRAD_SITE_KINDS)}; "
                            f"not at {bad}")


def _objective(logits: torch.Tensor, ids: list[int], target: str, positions: list[int],
               token: int | None, foil: int | None) -> torch.Tensor:
    rows = logits[0, [p - 1 for p in positions]].float()  # [n, vocab]
    wanted = torch.tensor([token if token is not None else ids[p] for p in positions], device=rows.device)
    if target == "logprob":
        return rows.log_softmax(-1).gather(-1, wanted.view(-1, 1)).sum()
    chosen = rows.gather(-1, wanted.view(-1, 1)).sum()
    if target == "logit":
        return chosen
    return chosen - rows[:, foil].sum()


def input_x_gradient(handle: Any, ids: list[int], *, target: str = "logprob", positions: Sequence[int] | None = None,
                     token: int | None = None, foil: int | None = None,
                     sites: Sequence[Site] = (), model_inputs: dict[str, Any] | None = None) -> GradientAttribution:
    """Input x gradient of one output of `handle.model` on `ids` (checks run first; no weights get gradients).

    The caller holds whatever hooks should apply (interventions, attention masks) around the call.
    `model_inputs` go with the forward (a VLM's pixel inputs, probes.vision): the image tokens' features
    replace their embeddings inside the model, so their scores are read at `resid_pre.0`, not in `scores`;
    the all-zero baseline F(0) runs without them (no image).
    """
    positions = check_target(target, len(ids), handle.arch.vocab_size, positions, token, foil)
    check_sites(sites)
    model = handle.model
    input_ids = torch.tensor([ids], device=handle.device)
    captured: dict[str, torch.Tensor] = {}
    removers = [_grab(model, site, handle.family, captured) for site in sites]
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds, use_cache=False, **(model_inputs or {})).logits
            value = _objective(logits, ids, target, positions, token, foil)
            wrt = [embeds, *(captured[s.name] for s in sites)]
            grads = torch.autograd.grad(value, wrt)
    finally:
        for remover in removers:
            remover.remove()
    scores = (embeds.detach().float() * grads[0].float()).sum(-1)[0].cpu()
    site_scores = {s.name: (captured[s.name].detach().float() * g.float()).sum(-1)[0].cpu()
                   for s, g in zip(sites, grads[1:])}
    with torch.no_grad():
        base_logits = model(inputs_embeds=torch.zeros_like(embeds), use_cache=False).logits
        baseline = _objective(base_logits, ids, target, positions, token, foil)
    what = {"logprob": "log p", "logit": "logit", "logit_diff": "logit difference"}[target]
    described = f"{what} of {'token ' + str(token) if token is not None else 'the text tokens'} at {positions}"
    if target == "logit_diff":
        described += f" minus foil {foil}"
    return GradientAttribution(list(ids), described, positions, scores, float(value.detach()), float(baseline),
                               site_scores)


def _grab(model: Any, site: Site, family: str, captured: dict[str, torch.Tensor]) -> Any:
    """A hook that keeps the live (graph-attached) activation at `site`."""
    module = get_module(model, site.module_path(family))
    if site.spec.read == "input":
        def pre(mod: Any, args: Any, kwargs: Any) -> None:
            captured[site.name] = args[0] if args else kwargs["hidden_states"]

        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def post(mod: Any, args: Any, output: Any) -> None:
        captured[site.name] = output[site.spec.index or 0] if isinstance(output, tuple) else output

    return module.register_forward_hook(post)
