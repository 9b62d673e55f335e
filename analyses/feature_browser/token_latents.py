"""The SAE latents of one trace: the top latents of the whole trace, and the latents active at each token
(Neuronpedia's per-prompt and per-token feature lists [recon]).

One teacher-forced pass (`Backend.capture_batch`, every position's row at the SAE's site) and one
SAE encode of those rows; clicking a token then only reads a row of the stored activations, so
the list for a token is exactly `sae.encode` of that token's captured activation.

Example:
    >>> from probes import Engine
    >>> from saes.train import SAETrainSettings, make_training_sae
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> sae = make_training_sae(64, SAETrainSettings(d_sae=8))
    >>> found = trace_latents(engine, engine.encode("Wait, let me check."), sae, "resid_post.1")
    >>> found.acts.shape[1]
    8
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from analyses.feature_browser.index import check_site
from probes.backend import Backend
from probes.sites import site_width
from saes.io import check_fits
from thoughtscope.errors import BadInputError

SCORES = ("max", "sum")


def check_sae(sae: Any, backend: Backend, site: str) -> None:
    """A clear error for an SAE of another width than the site's own or (when its config names one) of another
    model or site."""
    info = backend.info()
    width = site_width(site, backend.arch())  # checks the site's layer too
    if width is None:
        raise BadInputError(f"site {site!r} has no fixed width per token (it grows with the sequence); an SAE reads "
                            "one vector per token, e.g. at resid_post.<layer>")
    check_fits(sae, width, site)
    meta = getattr(sae.cfg, "metadata", None)
    trained_on = getattr(meta, "model_name", None)
    if trained_on and info.get("model_id") and trained_on != info["model_id"]:
        raise BadInputError(f"this SAE was trained on {trained_on}, not {info['model_id']}; pick an SAE of this "
                            "model (or train one on the RISE page)")
    hook = getattr(meta, "hook_name", None)
    if hook and hook != site and "." in str(hook) and not str(hook).startswith("blocks."):
        raise BadInputError(f"this SAE was trained at {hook}, not {site}; pick the SAE's own site")


@dataclass
class TraceLatents:
    """Latent activations `acts` [T, d_sae] of a trace's tokens `token_ids` at `site`."""

    site: str
    token_ids: list[int]
    tokens: list[str]
    acts: torch.Tensor

    def at_token(self, position: int, k: int = 20) -> list[dict[str, Any]]:
        """The latents active (> 0) at token `position`, most active first (at most `k`)."""
        if not isinstance(position, int) or not 0 <= position < len(self.token_ids):
            raise BadInputError(f"token {position!r} out of range; this trace has tokens 0..{len(self.token_ids) - 1}")
        row = self.acts[position]
        active = torch.nonzero(row > 0).flatten()
        order = active[torch.argsort(row[active], descending=True, stable=True)][:k]
        return [{"latent": int(j), "activation": float(row[j])} for j in order]

    def top_of_trace(self, k: int = 20, score: str = "max", skip_first: bool = True) -> list[dict[str, Any]]:
        """The `k` latents with the highest max (or summed) activation over the trace, with the token where
        each peaks; the first token (the attention sink) is left out by default."""
        if score not in SCORES:
            raise BadInputError(f"score {score!r}; rank latents by one of {', '.join(SCORES)}")
        acts = self.acts[1:] if skip_first and self.acts.shape[0] > 1 else self.acts
        offset = self.acts.shape[0] - acts.shape[0]
        values = acts.max(0).values if score == "max" else acts.sum(0)
        order = torch.argsort(values, descending=True, stable=True)[:k]
        out = []
        for j in order.tolist():
            if values[j] <= 0:
                break
            peak = int(acts[:, j].argmax()) + offset
            out.append({"latent": j, "score": float(values[j]), "peak_position": peak, "peak_token": self.tokens[peak],
                        "n_tokens_active": int((acts[:, j] > 0).sum())})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "token_ids": self.token_ids, "tokens": self.tokens,
                "n_active": (self.acts > 0).sum(1).tolist()}


@torch.no_grad()
def trace_latents(backend: Backend, token_ids: Sequence[int], sae: Any, site: str,
                  rows: torch.Tensor | None = None) -> TraceLatents:
    """Capture `site` at every token of `token_ids` (one pass) and encode each row with `sae`; with `rows`
    (the site's [T, d] activations a trace already holds, e.g. the trace explorer's pass) no pass runs."""
    ids = [int(i) for i in token_ids]
    if not ids:
        raise BadInputError("the trace has no tokens: generate or paste one first")
    check_site(site)
    check_sae(sae, backend, site)
    if rows is None:
        rows = backend.capture_batch([ids], [site], positions=[list(range(len(ids)))])[site]
    elif rows.shape[0] != len(ids):
        raise BadInputError(f"{rows.shape[0]} stored rows for {len(ids)} tokens: read the trace again")
    z = sae.encode(rows.float().to(sae.W_enc.dtype))
    z = (z.to_dense() if z.is_sparse else z).float().cpu()
    return TraceLatents(site, ids, backend.token_texts(ids), z)
