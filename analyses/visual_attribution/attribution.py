"""Visual attribution of reasoning spans: exhaustive causal effects, attention features, raw attention.

For a traced sequence holding one image, a reasoning span (token positions [start, end)) and a set
of image regions (analyses.visual_attribution.regions):

- `exhaustive_effects`: the drop in the span's log-probability (nats) when attention to a region's
  visual tokens is masked in every layer (MaskAttention, the masked-trace slot): one teacher-forced
  pass per region plus one unmasked pass, all spans of the sequence read from the same passes.
  This is vSTREAM's ground-truth effect (Kang et al. 2026, arXiv 2604.16587).
- `attention_features`: per (span, region), the attention the span's tokens pay to the region's
  tokens, per layer and head (averaged over the span's queries, summed over the region's keys): the
  amortized estimator's input, read from one pass with `attn_pattern` captured.
- `raw_attention`: the mean of those features over layers and heads (the attention baseline).

Everything goes through the Backend (in-process or a model server); images travel as bytes.

Example:
    >>> from probes import Engine
    >>> from probes.vision import spec_of
    >>> import numpy as np
    >>> engine = Engine.from_id("tiny-random:llava")
    >>> spec = spec_of(engine)
    >>> image = np.zeros((32, 32, 3), dtype=np.uint8)
    >>> trace = engine.trace("see <image> a b c", images=[image])
    >>> from analyses.visual_attribution.regions import grid_regions
    >>> regions = grid_regions(spec, 2, 2)
    >>> spans = [(len(trace.token_ids) - 3, len(trace.token_ids))]
    >>> exhaustive_effects(engine, "see <image> a b c", image, spans, regions).shape
    (1, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from analyses.visual_attribution.regions import Region, positions
from probes.attention_masks import RowMask
from probes.backend import Backend, require
from probes.interventions import MaskAttention
from probes.vision import expand, image_token_groups, spec_of
from thoughtscope import checks
from thoughtscope.errors import BadInputError

Progress = Callable[[int, int], None] | None


def check_spans(spans: Sequence[Sequence[int]], n_tokens: int, image_end: int) -> list[tuple[int, int]]:
    """Spans as (start, end) token positions, each non-empty, inside the sequence, after position 0."""
    out = []
    for span in spans:
        if len(span) != 2:
            raise BadInputError(f"a span is (start, end) token positions; got {span!r}")
        start, end = int(span[0]), int(span[1])
        if not 1 <= start < end <= n_tokens:
            raise BadInputError(f"span {span!r} is not a non-empty range inside 1..{n_tokens} (the traced tokens)")
        out.append((start, end))
    if not out:
        raise BadInputError("give at least one span to attribute")
    return out


def span_logprobs(logprobs: torch.Tensor, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    lp = torch.as_tensor(logprobs).double()
    return np.array([float(lp[s:e].sum()) for s, e in spans])


def exhaustive_effects(backend: Backend, text: Any, image: Any, spans: Sequence[Sequence[int]],
                       regions: Sequence[Region], on_progress: Progress = None, batch_size: int = 32) -> np.ndarray:
    """[n_spans, n_regions]: the span's log-prob drop (nats) with attention to the region masked in
    every layer.

    Batched over regions: one forward holds up to `batch_size` masked copies of the sequence (a
    `RowMask` per region, probes.attention_masks), the first forward also the unmasked row, so K
    regions cost ceil((K + 1) / batch_size) forwards of up to `batch_size` rows. `batch_size=1`
    runs one unmasked pass plus one masked `trace` per region (the unbatched reference)."""
    require(backend, "vision", "trace", "interventions")
    if not regions:
        raise BadInputError("give at least one region")
    spec = spec_of(backend)
    ids = expand(spec, backend.encode(text), 1)[0]  # the token layout, as the backend expands it
    spans = check_spans(spans, len(ids), 0)
    return masked_drops(backend, text, image, spans, region_positions(spec, ids, regions), on_progress,
                        batch_size).T


def masked_drops(backend: Backend, text: Any, image: Any, spans: Sequence[tuple[int, int]],
                 position_sets: Sequence[Sequence[int]], on_progress: Progress = None,
                 batch_size: int = 32) -> np.ndarray:
    """[n_sets, n_spans]: each span's log-prob drop (nats) with attention to one set of token positions
    masked in every layer, the sets `batch_size` rows per forward (RowMask; row 0 of the first forward
    unmasked); `batch_size=1`: one `trace` per set with a plain MaskAttention."""
    checks.integer("batch_size", batch_size, low=1)
    sets = [list(p) for p in position_sets]
    out = np.zeros((len(sets), len(spans)))
    if batch_size == 1:
        base_lp = span_logprobs(backend.trace(text, images=[image]).logprobs, spans)
        for j, p in enumerate(sets):
            masked = backend.trace(text, images=[image], interventions=[MaskAttention(positions=p)])
            out[j] = base_lp - span_logprobs(masked.logprobs, spans)
            if on_progress is not None:
                on_progress(j + 1, len(sets))
        return out
    chunks, first = [], 0  # chunks of sets; the first chunk's row 0 is the unmasked pass
    while first < len(sets):
        room = batch_size - (0 if chunks else 1)
        chunks.append(list(range(first, min(first + room, len(sets)))))
        first += room
    base_lp = None
    for c, chunk in enumerate(chunks):
        offset = 1 if c == 0 else 0
        tr = backend.trace(text, images=[image],
                           interventions=[RowMask(positions=sets[j], rows=[offset + i]) for i, j in enumerate(chunk)])
        lp = torch.as_tensor(tr.logprobs)
        lp = lp.reshape(-1, lp.shape[-1])  # a one-row chunk comes back 1-D
        if c == 0:
            base_lp = span_logprobs(lp[0], spans)
        for i, j in enumerate(chunk):
            out[j] = base_lp - span_logprobs(lp[offset + i], spans)
        if on_progress is not None:
            on_progress(chunk[-1] + 1, len(sets))
    return out


def attention_features(backend: Backend, text: Any, image: Any, spans: Sequence[Sequence[int]],
                       regions: Sequence[Region], trace: Any = None) -> np.ndarray:
    """[n_spans, n_regions, n_layers * n_heads]: attention from the span's tokens to the region's
    tokens, per layer and head (mean over the span's queries, sum over the region's keys). Pass a
    `trace` that captured every `attn_pattern.L` to reuse it (streaming does)."""
    if trace is None:  # one pass computing only the attention rows the features read
        return attention_features_batch(backend, [(text, image, spans, regions)])[0]
    sites = [f"attn_pattern.{layer}" for layer in range(backend.arch().n_layers)]
    spec = spec_of(backend)
    missing = [s for s in sites if s not in trace.activations]
    if missing:
        raise BadInputError(f"the trace lacks {missing[:3]}...: capture every attn_pattern layer")
    ids = trace.token_ids
    spans = check_spans(spans, len(ids), 0)
    # [layers, seq(query), heads, kv]
    pat = torch.stack([trace.activations[s].float() for s in sites])
    return _span_region_features(pat, [range(s - 1, e - 1) for s, e in spans], _region_matrix(spec, ids, regions))


def attention_features_batch(backend: Backend, scenes: Sequence[tuple[Any, Any, Sequence[Sequence[int]],
                                                                     Sequence[Region]]],
                             batch_size: int = 32) -> list[np.ndarray]:
    """`attention_features` of many scenes (text, image, spans, regions), `batch_size` scenes a forward.

    The pass computes only the attention rows the features read (the queries predicting a span's tokens,
    over every key: `capture_batch` with `positions`, which an engine computes as rows,
    probes.attention_rows); each text is tokenised once. Each forward holds up to `batch_size` scenes as right-padded rows (`capture_batch` with images and
    `positions`): only the attention rows the features read are computed, and the forward ends inside the
    last layer's attention. A causal model's real tokens never see the padding after them, so each scene's
    features equal its own one-scene pass (tests/test_visual_attribution_engine.py compares them). This is
    the row budget exhaustive ablation already gets (`exhaustive_effects`' `batch_size`, one forward of
    K + 1 rows per scene), given to the amortized side: one forward pays the model's fixed per-forward cost
    (vision tower call, masks, every module's call) for many scenes. Every scene is checked before model
    work."""
    require(backend, "vision", "trace", "interventions")
    checks.integer("batch_size", batch_size, low=1)
    if not scenes:
        raise BadInputError("give at least one scene")
    spec = spec_of(backend)
    sites = [f"attn_pattern.{layer}" for layer in range(backend.arch().n_layers)]
    prepared = []  # (text ids, span query rows, region matrix, queries) per scene
    for i, (text, _image, spans, regions) in enumerate(scenes):
        text_ids = backend.encode(text)
        ids = expand(spec, text_ids, 1)[0]  # the token layout, as the backend expands it
        try:
            spans = check_spans(spans, len(ids), 0)
            region_matrix = _region_matrix(spec, ids, regions)
        except BadInputError as e:
            raise BadInputError(f"scene {i}: {e}" if len(scenes) > 1 else str(e)) from None
        queries = sorted({q for s, e in spans for q in range(s - 1, e - 1)})
        at = {q: j for j, q in enumerate(queries)}
        prepared.append((text_ids, [[at[q] for q in range(s - 1, e - 1)] for s, e in spans], region_matrix, queries))
    out = []
    for first in range(0, len(scenes), batch_size):
        chunk = range(first, min(first + batch_size, len(scenes)))
        rows = backend.capture_batch([prepared[i][0] for i in chunk], sites, positions=[prepared[i][3] for i in chunk],
                                     images=[scenes[i][1] for i in chunk])
        pat = torch.stack([rows[s] for s in sites])  # [layers, all scenes' queries, heads, width]
        offset = 0
        for i in chunk:
            _ids, span_rows, region_matrix, queries = prepared[i]
            own = pat[:, offset:offset + len(queries)]  # keys past the scene's length are padding (weight 0)
            offset += len(queries)
            out.append(_span_region_features(own, span_rows, region_matrix))
    return out


def region_positions(spec: Any, ids: Sequence[int], regions: Sequence[Region]) -> list[list[int]]:
    """Each region's visual-token positions in the expanded sequence `ids` (regions.positions, with the
    image's tokens found once for all regions instead of once per region)."""
    groups = image_token_groups(spec, ids)
    if not groups:
        raise BadInputError("image 0 is not in this sequence (it holds 0 images)")
    n_cells = spec.grid * spec.grid
    out = []
    for r in regions:
        bad = [c for c in r.cells if not 0 <= c < n_cells]
        if bad or not r.cells:
            raise BadInputError(f"region {r.name!r} has cells {bad or '[]'} outside 0..{n_cells - 1}")
        out.append([groups[0][spec.lead + c] for c in r.cells])
    return out


def _region_matrix(spec: Any, ids: Sequence[int], regions: Sequence[Region]) -> torch.Tensor:
    """[tokens, regions]: 1 where a token is one of the region's visual tokens."""
    # filled in numpy: one torch index_put per region costs more than the whole matrix
    out = np.zeros((len(ids), len(regions)), dtype=np.float32)
    for j, pos in enumerate(region_positions(spec, ids, regions)):
        out[pos, j] = 1.0
    return torch.from_numpy(out)


def _span_region_features(pat: torch.Tensor, span_rows: Sequence[Sequence[int]], regions: torch.Tensor) -> np.ndarray:
    """[n_spans, n_regions, layers * heads] from attention rows pat [layers, rows, heads, kv]: each span's
    rows averaged, summed over each region's keys (one product with the region matrix per span). Kept as
    a loop over spans: one product for all spans sums in another order, and the shipped study's estimator
    is rebuilt byte for byte (tests/test_shipped_pages_b.py); the loop costs ~0.1 ms per scene."""
    feats = np.zeros((len(span_rows), regions.shape[1], pat.shape[0] * pat.shape[2]))
    for i, picked in enumerate(span_rows):
        # index_select: the same rows as pat[:, list(picked)], without the list made into an index at each use
        rows = pat.index_select(1, torch.as_tensor(list(picked), dtype=torch.long, device=pat.device))
        mean = rows.float().mean(1)  # [layers, heads, kv]: the queries that predict the span's tokens
        feats[i] = (mean[..., :regions.shape[0]] @ regions).permute(2, 0, 1).reshape(regions.shape[1], -1).numpy()
    return feats


def raw_attention(features: np.ndarray) -> np.ndarray:
    """The attention baseline: features averaged over layers and heads -> [n_spans, n_regions]."""
    return np.asarray(features).mean(-1)


def gradient_scores(backend: Backend, text: Any, image: Any, spans: Sequence[Sequence[int]],
                    regions: Sequence[Region]) -> np.ndarray:
    """The input x gradient baseline [n_spans, n_regions]: activation x gradient of the span's log-prob
    at the language model's input (`resid_pre.0`, where the image tokens hold the projected patch
    features), summed over each region's tokens. One forward and backward pass per span (the
    gradient slot, probes.gradients)."""
    require(backend, "vision", "grad")
    spec = spec_of(backend)
    ids = backend.trace(text, images=[image]).token_ids
    spans = check_spans(spans, len(ids), 0)
    pos = [positions(spec, ids, r) for r in regions]
    out = np.zeros((len(spans), len(regions)))
    for i, (s, e) in enumerate(spans):
        att = backend.input_x_gradient(text, target="logprob", positions=list(range(s, e)), sites=["resid_pre.0"],
                                       images=[image])
        site = att.site_scores["resid_pre.0"].double()
        out[i] = [float(site[p].sum()) for p in pos]
    return out
