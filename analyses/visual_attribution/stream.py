"""Streaming attribution: while a VLM generates, each finished span gets its raw attention per region
and, with a fitted `AmortizedAttribution`, its predicted effects, from the attention rows the
generation already computed (vSTREAM, Kang et al. 2026, arXiv 2604.16587; issue 14, item 6).

Each generated token's record carries the attention of the query that predicted it (`attn_pattern.L`
captured at the new position, every layer), so a span's features are the mean over its tokens of
the attention to each region's visual tokens, per layer and head: the same numbers
`attribution.attention_features` reads from a teacher-forced trace of the finished text (tested).
No extra forward pass is run. Spans end at a token ending in ',', '.' or ':' (that token is left
out) and at the end of the generation (an end-of-sequence token is left out).

Example:
    >>> from probes import Engine
    >>> from probes.vision import spec_of
    >>> import numpy as np
    >>> engine = Engine.from_id("tiny-random:llava")
    >>> from analyses.visual_attribution.regions import grid_regions
    >>> events = list(stream_attribution(engine, "see <image> now", np.zeros((32, 32, 3), np.uint8),
    ...                                  grid_regions(spec_of(engine), 2, 2), max_new_tokens=4))
    >>> events[-1].span is not None and events[-1].span.attention.shape == (4,)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from analyses.visual_attribution.regions import Region, positions
from probes.backend import Backend, require
from probes.vision import expand, spec_of

DELIMITERS = (",", ".", ":")


@dataclass
class SpanAttribution:
    """A finished span: token positions [start, end) of the whole sequence, its text, raw attention and
    predicted effects (nats; None without an estimator) per region, and its features [regions, L*H]."""

    index: int
    start: int
    end: int
    text: str
    attention: np.ndarray
    predicted: np.ndarray | None
    features: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "start": self.start, "end": self.end, "text": self.text,
                "attention": self.attention.tolist(),
                "predicted": None if self.predicted is None else self.predicted.tolist()}


@dataclass
class StreamEvent:
    """One generated token's record, and the span it finished (if any)."""

    record: Any
    span: SpanAttribution | None = None


def stream_attribution(backend: Backend, prompt: Any, image: Any, regions: Sequence[Region], estimator: Any = None,
                       max_new_tokens: int = 64, delimiters: Sequence[str] = DELIMITERS) -> Iterator[StreamEvent]:
    """Generate greedily from `prompt` (with `<image>`) and `image`, yielding one event per token; a
    span's attribution arrives with the token that ends it."""
    require(backend, "vision", "generate", "attention")
    spec = spec_of(backend)
    ids, _ = expand(spec, backend.encode(prompt), 1)
    pos = [positions(spec, ids, r) for r in regions]  # checks regions before any model work
    n_layers = backend.arch().n_layers
    sites = [f"attn_pattern.{layer}" for layer in range(n_layers)]
    eos = set(backend.eos_ids())
    rows: list[np.ndarray] = []  # per generated token: [regions, L*H]
    texts: list[str] = []
    start, n_spans = 0, 0
    for rec in backend.generate(prompt, images=[image], max_new_tokens=max_new_tokens, capture=sites, top_k=0):
        pat = torch.stack([rec.activations[s].float() for s in sites])  # [L, H, kv]
        rows.append(torch.stack([pat[..., p].sum(-1).reshape(-1) for p in pos]).numpy())
        texts.append(rec.text)
        t = len(rows) - 1
        ends_here = rec.text.strip().endswith(tuple(delimiters)) and rec.text.strip() != ""
        stop = t + 1 if not ends_here and not (rec.finished and rec.token_id in eos) else t
        span = None
        if (ends_here or rec.finished) and stop > start:
            feats = np.mean(rows[start:stop], axis=0)
            predicted = estimator.predict(feats) if estimator is not None else None
            span = SpanAttribution(n_spans, len(ids) + start, len(ids) + stop, "".join(texts[start:stop]).strip(),
                                   feats.mean(-1), predicted, feats)
            n_spans += 1
        if ends_here or rec.finished:
            start = t + 1
        yield StreamEvent(rec, span)
