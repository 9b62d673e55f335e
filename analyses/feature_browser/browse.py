"""Browse one direction over an indexed corpus: top-activating contexts, a histogram, the logits it writes.

The SAEDashboard / Neuronpedia feature view [recon]: the contexts whose highest token activation is
largest (every token's activation kept, so the display can highlight them), the distribution of
activations over the whole corpus, and the tokens whose logits the direction's write vector
raises and lowers most, read through the unembedding without the final norm
(`Backend.readout(norm=False)`). Scores come from the stored rows (`CorpusIndex`): no model
forward, so a browse costs one matrix-vector product over the corpus plus the read-out.

Example:
    >>> from probes import Engine
    >>> from analyses.feature_browser import Neuron, build_index, load_corpus
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> index = build_index(engine, load_corpus("gsm8k-questions", n=8), "resid_post.1", store=None)
    >>> view = browse(index, Neuron(3, "resid_post.1"), engine, k=2)
    >>> len(view.contexts), view.contexts[0]["max_activation"] >= view.contexts[1]["max_activation"]
    (2, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from analyses.feature_browser.index import CorpusIndex
from probes.backend import Backend
from thoughtscope.errors import BadInputError

BLOCK_ROWS = 4_096  # rows converted to float32 at a time: bounded memory, and a block that stays in cache
# (measured on the 2-core CPU, 224k x 576 fp16 rows, one vector: 0.055 s in blocks of 4096, 0.30 s in blocks of 65536)


@dataclass
class FeatureBrowse:
    """One direction over one corpus: what the feature browser page draws and exports."""

    direction: dict[str, Any]
    site: str
    corpus: dict[str, Any]
    n_contexts: int
    n_tokens: int
    density: float  # fraction of tokens whose activation is > 0
    max_activation: float
    contexts: list[dict[str, Any]]  # rank, context, max_activation, max_position, tokens, activations
    histogram_counts: list[int]
    histogram_edges: list[float]
    histogram_of: str  # "active tokens" (SAE latents: activation > 0) or "all tokens"
    promoted: list[dict[str, Any]]  # token, token_id, logit
    suppressed: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def token_scores(index: CorpusIndex, direction: Any) -> torch.Tensor:
    """The direction's activation at every stored token [N] (float32), block by block."""
    direction.check(int(index.acts.shape[1]))
    out = torch.empty(index.n_rows, dtype=torch.float32)
    for lo in range(0, index.n_rows, BLOCK_ROWS):
        out[lo:lo + BLOCK_ROWS] = direction.scores(index.acts[lo:lo + BLOCK_ROWS].float())
    return out


def context_maxima(index: CorpusIndex, scores: torch.Tensor) -> torch.Tensor:
    """Each context's highest token activation [C]."""
    return torch.full((index.n_contexts,), -torch.inf).scatter_reduce(0, index.row_context, scores, "amax")


def top_contexts(index: CorpusIndex, scores: torch.Tensor, k: int, positive_only: bool) -> list[int]:
    """The `k` contexts with the highest maxima, ties to the earlier context; with `positive_only`,
    only contexts where the direction fires at all."""
    maxima = context_maxima(index, scores)
    order = torch.sort(maxima, descending=True, stable=True).indices[:k].tolist()
    return [c for c in order if not positive_only or maxima[c] > 0]


def _words(backend: Backend, ids: torch.Tensor, logits: torch.Tensor) -> list[dict[str, Any]]:
    return [{"token": backend.decode([int(i)]), "token_id": int(i), "logit": float(v)} for i, v in zip(ids, logits)]


def browse(index: CorpusIndex, direction: Any, backend: Backend | None = None, k: int = 20, bins: int = 40,
           n_logits: int = 10) -> FeatureBrowse:
    """The top `k` contexts of `direction` over `index`, its histogram, and (with a backend) the
    `n_logits` tokens its write vector promotes and suppresses most."""
    if direction.site != index.site:
        raise BadInputError(f"the direction reads {direction.site} but the corpus was indexed at {index.site}; "
                            "index the corpus at the direction's site")
    if not isinstance(k, int) or k < 1:
        raise BadInputError(f"k must be a positive number of contexts, got {k!r}")
    scores = token_scores(index, direction)
    sparse = direction.kind == "sae"
    contexts = []
    for rank, c in enumerate(top_contexts(index, scores, k, positive_only=sparse)):
        ids = index.context_ids(c)
        acts = scores[index.rows(c)]
        texts = backend.token_texts(ids) if backend is not None else [str(i) for i in ids]
        contexts.append({"rank": rank, "context": c, "max_activation": float(acts.max()),
                         "max_position": int(acts.argmax()) + 1, "token_ids": ids, "tokens": texts,
                         "activations": [None, *acts.tolist()]})
    values = (scores[scores > 0] if sparse else scores).numpy()
    if values.size:
        counts, edges = np.histogram(values, bins=bins)
    else:
        counts, edges = np.zeros(bins, dtype=int), np.linspace(0.0, 1.0, bins + 1)
    promoted, suppressed = [], []
    if backend is not None:
        read = backend.readout(direction.write_vector().view(1, -1), norm=False, top_k=n_logits, bottom_k=n_logits)
        promoted = _words(backend, read.top_ids[0], read.top_logits[0])
        suppressed = _words(backend, read.bottom_ids[0], read.bottom_logits[0])
    return FeatureBrowse(direction.describe(), index.site, index.corpus, index.n_contexts, index.n_rows,
                         float((scores > 0).float().mean()), float(scores.max()), contexts, counts.tolist(),
                         [float(e) for e in edges], "active tokens" if sparse else "all tokens", promoted, suppressed)
