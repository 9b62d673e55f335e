"""Read-outs of one teacher-forced trace: the logit lens, residual-stream norms, attention patterns.

Logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"): decode every layer's
residual stream with the model's own final norm and unembedding, as if the model stopped at that
layer; the top token and its probability per (layer, position) show where a prediction forms.
At the last layer the lens is the model's actual next-token distribution. No tuned lens here.

Every function is pure over a `Trace` (plus, for the lens, the final norm and unembedding that
`lens_readout` takes from a local model), so the app, the CLI and tests share them.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> trace = engine.trace("2 + 2 =", capture=resid_sites(engine.handle.arch.n_layers))
    >>> lens = logit_lens(trace, *lens_readout(engine))
    >>> lens.top_probs.shape  # [layers, positions]
    (2, 5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thoughtscope.errors import BadInputError
from probes.records import Trace
from probes.sites import FAMILIES, get_module, parse_site


def resid_sites(n_layers: int) -> list[str]:
    """`resid_post.L` for every layer: what the logit lens and the residual norms read."""
    return [f"resid_post.{layer}" for layer in range(n_layers)]


def _resid_layers(trace: Trace) -> list[int]:
    layers = sorted(s.layer for s in map(parse_site, trace.activations) if s.kind == "resid_post")
    if not layers:
        raise BadInputError("the trace holds no resid_post.L captures; trace with capture=resid_sites(n_layers)")
    return layers


@dataclass
class LogitLensResult:
    """Top token and its probability per (layer, position) of a trace."""

    tokens: list[str]  # the input token at each position
    layers: list[int]
    top_ids: np.ndarray  # [layers, positions]
    top_tokens: list[list[str]]  # [layers][positions]
    top_probs: np.ndarray  # [layers, positions]
    start: int = 0  # index of the first position shown (see `window`)

    def window(self, start: int, stop: int) -> "LogitLensResult":
        """The same lens over positions [start, stop) only (long prompts do not fit one figure)."""
        start, stop = max(0, start), min(len(self.tokens), stop)
        if start >= stop:
            raise BadInputError(f"empty position window [{start}, {stop}); the trace has {len(self.tokens)} positions")
        return LogitLensResult(self.tokens[start:stop], list(self.layers), self.top_ids[:, start:stop],
                               [row[start:stop] for row in self.top_tokens], self.top_probs[:, start:stop],
                               self.start + start)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": list(self.tokens),
            "layers": list(self.layers),
            "positions": list(range(self.start, self.start + len(self.tokens))),
            "top_ids": self.top_ids.tolist(),
            "top_tokens": [list(r) for r in self.top_tokens],
            "top_probs": self.top_probs.tolist(),
        }


@torch.no_grad()
def logit_lens(
    trace: Trace,
    final_norm: Callable[[torch.Tensor], torch.Tensor],
    unembed: torch.Tensor,
    decode: Callable[[int], str],
    bias: torch.Tensor | None = None,
) -> LogitLensResult:
    """softmax(unembed @ final_norm(resid_post.L)) at every layer and position; keep the top token.

    `unembed` is [vocab, d_model] (an `lm_head.weight`), `decode` maps a token id to its text.
    """
    layers = _resid_layers(trace)
    ids, probs = [], []
    for layer in layers:
        h = trace.activations[f"resid_post.{layer}"].float()
        normed = final_norm(h.to(unembed.device, unembed.dtype)).float()
        logits = normed @ unembed.float().T
        if bias is not None:
            logits = logits + bias.float()
        p, i = torch.softmax(logits, dim=-1).max(dim=-1)
        ids.append(i.cpu())
        probs.append(p.cpu())
    top_ids = torch.stack(ids).numpy()
    return LogitLensResult(
        tokens=list(trace.tokens),
        layers=layers,
        top_ids=top_ids,
        top_tokens=[[decode(int(t)) for t in row] for row in top_ids],
        top_probs=torch.stack(probs).numpy(),
    )


def lens_readout(backend: Any) -> tuple[Callable, torch.Tensor, Callable[[int], str], torch.Tensor | None]:
    """(final_norm, unembed, decode, bias) of a model whose weights live in this process.

    A server backend keeps its weights on the server, so its lens cannot be read here.
    """
    handle = getattr(backend, "handle", None)
    if handle is None or getattr(handle, "remote", False):
        raise BadInputError("the logit lens needs the model's final norm and unembedding in this process; "
                            "pick the in-process backend in the sidebar to see it")
    paths = FAMILIES[handle.family]
    norm = get_module(handle.model, paths["final_norm"])
    head = handle.model.get_output_embeddings()
    tok = handle.tokenizer
    return norm, head.weight, lambda i: tok.decode([i]), getattr(head, "bias", None)


@dataclass
class ResidualNorms:
    """L2 norm of the residual stream leaving each layer, at every position."""

    tokens: list[str]
    layers: list[int]
    norms: np.ndarray  # [layers, positions]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "layers": list(self.layers), "norms": self.norms.tolist()}


def residual_norms(trace: Trace) -> ResidualNorms:
    layers = _resid_layers(trace)
    norms = torch.stack([trace.activations[f"resid_post.{layer}"].float().norm(dim=-1).cpu() for layer in layers])
    return ResidualNorms(list(trace.tokens), layers, norms.numpy())


@dataclass
class AttentionPattern:
    """Attention weights of one head: rows are query positions, columns key positions."""

    tokens: list[str]
    layer: int
    head: int
    weights: np.ndarray  # [queries, keys]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "layer": self.layer, "head": self.head,
                "weights": self.weights.tolist()}


def attention_pattern(trace: Trace, layer: int, head: int) -> AttentionPattern:
    """One head's pattern from a trace that captured `attn_pattern.<layer>` ([seq, heads, kv])."""
    site = f"attn_pattern.{layer}"
    if site not in trace.activations:
        raise BadInputError(f"the trace holds no {site}; trace with capture=['{site}']")
    pattern = trace.activations[site]
    if not 0 <= head < pattern.shape[1]:
        raise BadInputError(f"head {head} out of range; layer {layer} has heads 0..{pattern.shape[1] - 1}")
    return AttentionPattern(list(trace.tokens), layer, head, pattern[:, head].float().cpu().numpy())


def layer_choices(sites: Sequence[dict[str, Any]], kind: str = "resid_post") -> list[int]:
    """Layers that have a site of `kind`, from a backend's `sites()` rows."""
    return sorted(parse_site(r["site"]).layer for r in sites if r["site"].startswith(kind + "."))


def trace_with_completion(backend: Any, prompt: Any, generated_ids: Sequence[int], capture: Sequence[str],
                          chat: bool = False) -> Trace:
    """A teacher-forced trace of a prompt followed by the tokens a generation produced from it."""
    prompt_ids = backend.trace(prompt, chat=chat).token_ids
    return backend.trace(list(prompt_ids) + [int(i) for i in generated_ids], capture=list(capture))
