"""What the engine hands out: one `TokenRecord` per generated token and a `Trace` per teacher-forced pass.

Both are plain dataclasses over tensors, so analyses consume them without knowing whether the
model ran in this process or behind the model server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TokenRecord:
    """One generated token of one sequence of a batch.

    `activations` maps a site name (`resid_post.3`) to the activation at the new token's
    position: shape `[d]` for residual sites, `[heads, head_dim]` for q/k/v, `[heads, kv_len]`
    for `attn_pattern.L`, `[n_experts]` for `router.L`, `[vocab]` for `logits`.
    """

    step: int  # 0 for the first generated token
    batch_index: int  # which prompt/sample of the batch this token belongs to
    token_id: int
    text: str  # the decoded piece this token adds to the text
    logprob: float  # log p(token) under the (untempered) model distribution
    entropy: float  # entropy in nats of the full next-token distribution the token was drawn from
    top_ids: list[int] = field(default_factory=list)
    top_tokens: list[str] = field(default_factory=list)
    top_probs: list[float] = field(default_factory=list)
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    interventions: list[str] = field(default_factory=list)  # descriptions of what was applied
    finished: bool = False  # True on the token that ends this sequence (EOS or max_new_tokens)
    kv_bytes: int | None = None  # bytes of keys + values the KV cache held for this sequence when the token was chosen
    # steering terms (probes.edits) that acted at the position that chose this token: {term: L2 norm added}
    fired: dict[str, float] = field(default_factory=dict)

    def to_dict(self, with_activations: bool = False) -> dict[str, Any]:
        out = {
            "step": self.step,
            "batch_index": self.batch_index,
            "token_id": self.token_id,
            "text": self.text,
            "logprob": self.logprob,
            "entropy": self.entropy,
            "top_ids": list(self.top_ids),
            "top_tokens": list(self.top_tokens),
            "top_probs": list(self.top_probs),
            "interventions": list(self.interventions),
            "finished": self.finished,
            "kv_bytes": self.kv_bytes,
            "fired": dict(self.fired),
        }
        if with_activations:
            out["activations"] = {k: v.tolist() for k, v in self.activations.items()}
        return out


@dataclass
class Trace:
    """A teacher-forced pass: token ids, per-position entropies/log-probs, and captured activations.

    `activations[site]` has the position axis first: `[seq, ...]` (batch axis dropped).
    `logprobs[i]` is log p(token i | tokens < i); `logprobs[0]` is NaN.
    """

    text: str
    token_ids: list[int]
    tokens: list[str]
    activations: dict[str, torch.Tensor]
    logprobs: torch.Tensor
    entropies: torch.Tensor  # entropy of the next-token distribution at each position
    # steering terms (probes.edits): {term: [seq] L2 norm added at each position, NaN where it did not act}
    fired: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "tokens": list(self.tokens),
            "logprobs": self.logprobs.tolist(),
            "entropies": self.entropies.tolist(),
            "sites": sorted(self.activations),
        }


@dataclass
class Readout:
    """Vectors decoded through a model's unembedding (`Backend.readout`), one row per vector.

    `top_*` [n, top_k] and `bottom_*` [n, bottom_k]: token ids and logits (probabilities for the
    top); `token_probs`/`token_ranks` [n]: probability and rank (0 = top) of one asked-for token per
    row, None when no tokens were asked for.
    """

    top_ids: torch.Tensor
    top_logits: torch.Tensor
    top_probs: torch.Tensor
    bottom_ids: torch.Tensor
    bottom_logits: torch.Tensor
    token_probs: torch.Tensor | None = None
    token_ranks: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if v is not None}
