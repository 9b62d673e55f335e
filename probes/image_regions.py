"""Image regions -> visual tokens: which of a vision-language model's image tokens a pixel box or a mask covers.

A region is given in the coordinates of the image as the user holds it: a box (x0, y0, x1, y1) in pixels
with exclusive ends, or an H x W boolean mask of the image's size. The engine resizes every image
(bicubic, no crop, probes.vision.preprocess) to the tower's square input of `spec.image_size` pixels, and
every supported family then gives one visual token per square of `spec.cell` input pixels, in reading order:

- `llava`: one token per `patch_size` patch (the patch grid; a CLS token first is `spec.lead`);
- `idefics3` / `smolvlm`: patches merged `scale_factor` x `scale_factor` by the pixel shuffle;
- `qwen2_vl` and the other patch-then-merge families: patches merged `spatial_merge_size` x
  `spatial_merge_size` by the merger.

So the whole map is two numbers of the `VisionSpec` (`image_size`, `grid`) and the image's own size:
`coverage` is the exact fraction of each token's square that a region covers (overlap areas after the
resize), `region_cells` the tokens covered by more than `min_coverage` of their area (default: any
overlap), `region_tokens` their positions in a traced sequence. Every check (NaN, zero area, a region
outside the image, a mask of the wrong size) raises `BadInputError` before any model work.

Example:
    >>> from probes.vision import VisionSpec
    >>> spec = VisionSpec("qwen2_vl", image_token_id=7, image_size=64, patch_size=8, merge=2)  # 4 x 4 tokens
    >>> region_cells(spec, (16, 0, 32, 16), (64, 64))  # exactly the second merged token of the first row
    [1]
    >>> region_cells(spec, (16, 0, 32, 16), (128, 128))  # the same box on a 128-pixel image: a quarter of it
    [0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from probes.vision import VisionSpec, image_token_groups
from thoughtscope.errors import BadInputError

# Overlaps below this fraction of a token's square are rounding (a box edge on a cell edge after scaling).
_EPS = 1e-9


def check_size(size: Sequence[int]) -> tuple[int, int]:
    """(width, height) of the image the regions are drawn on, each a positive integer."""
    if len(size) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
                                 for v in size):
        raise BadInputError(f"an image size is (width, height) in whole pixels >= 1; got {tuple(size)!r}")
    return int(size[0]), int(size[1])


def check_box(box: Any, size: Sequence[int]) -> tuple[float, float, float, float]:
    """A box as four finite floats (x0, y0, x1, y1) with x0 < x1, y0 < y1, inside the `size` (w, h) image."""
    w, h = check_size(size)
    if isinstance(box, (str, bytes)) or not hasattr(box, "__len__") or len(box) != 4:
        raise BadInputError(f"a box is (x0, y0, x1, y1) in pixels; got {box!r}")
    try:
        x0, y0, x1, y1 = (float(v) for v in box)
    except (TypeError, ValueError) as err:
        raise BadInputError(f"a box is four numbers (x0, y0, x1, y1); got {box!r}") from err
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        raise BadInputError(f"box {tuple(box)!r} holds NaN or infinite coordinates; give four pixel numbers")
    if not (x0 < x1 and y0 < y1):
        raise BadInputError(f"box {(x0, y0, x1, y1)} has zero area: it needs x0 < x1 and y0 < y1 "
                            "(exclusive ends, pixels)")
    if not (0 <= x0 and 0 <= y0 and x1 <= w and y1 <= h):
        raise BadInputError(f"box {(x0, y0, x1, y1)} is not inside the {w}x{h} image (0 <= x0 < x1 <= {w}, "
                            f"0 <= y0 < y1 <= {h})")
    return x0, y0, x1, y1


def check_mask(mask: Any, size: Sequence[int] | None = None) -> np.ndarray:
    """A boolean H x W mask (bool or 0/1 values) with at least one pixel set, of the image's size if given."""
    m = np.asarray(mask)
    if m.ndim != 2 or 0 in m.shape:
        raise BadInputError(f"a mask is a 2-d H x W array of the image's size; got shape {m.shape}")
    if m.dtype != bool:
        if not np.issubdtype(m.dtype, np.number) or not np.isin(m, (0, 1)).all():
            raise BadInputError("a mask holds booleans or 0/1 values only (no NaN, no other numbers)")
        m = m.astype(bool)
    if size is not None:
        w, h = check_size(size)
        if m.shape != (h, w):
            raise BadInputError(f"the mask is {m.shape[1]}x{m.shape[0]} (W x H) but the image is {w}x{h}: "
                                "draw the mask on the image as given")
    if not m.any():
        raise BadInputError("the mask is empty (zero area): set at least one pixel")
    return m


def _axis_overlap(lo: np.ndarray, hi: np.ndarray, n_pixels: int, spec: VisionSpec) -> np.ndarray:
    """[len(lo), grid]: the fraction of each token row/column that the intervals [lo, hi) (original pixels
    of an axis `n_pixels` long) cover once the axis is resized to the tower's input side."""
    scale = spec.image_size / n_pixels
    edges = np.arange(spec.grid + 1) * spec.cell
    a, b = np.asarray(lo, float)[:, None] * scale, np.asarray(hi, float)[:, None] * scale
    out = np.clip(np.minimum(b, edges[None, 1:]) - np.maximum(a, edges[None, :-1]), 0, None) / spec.cell
    out[out < _EPS] = 0.0  # an edge on a cell edge, off by rounding after the scaling
    return out


def coverage(spec: VisionSpec, region: Any, size: Sequence[int]) -> np.ndarray:
    """[grid, grid]: the fraction (0..1) of each visual token's square covered by a box or a mask of a
    `size` (width, height) image, after the engine's resize to the tower's input."""
    w, h = check_size(size)
    if isinstance(region, np.ndarray) and region.ndim == 2:
        m: Any = check_mask(region, (w, h)).astype(float)
        ox = _axis_overlap(np.arange(w), np.arange(1, w + 1), w, spec)  # [w, grid]
        oy = _axis_overlap(np.arange(h), np.arange(1, h + 1), h, spec)  # [h, grid]
        return oy.T @ m @ ox
    x0, y0, x1, y1 = check_box(region, (w, h))
    ox = _axis_overlap(np.array([x0]), np.array([x1]), w, spec)[0]
    oy = _axis_overlap(np.array([y0]), np.array([y1]), h, spec)[0]
    return np.outer(oy, ox)


def check_min_coverage(min_coverage: Any) -> float:
    try:
        v = float(min_coverage)
    except (TypeError, ValueError) as err:
        raise BadInputError(f"min_coverage is a fraction in [0, 1); got {min_coverage!r}") from err
    if not (math.isfinite(v) and 0 <= v < 1):
        raise BadInputError(f"min_coverage is a fraction in [0, 1) of a token's square; got {min_coverage!r}")
    return v


def region_cells(spec: VisionSpec, region: Any, size: Sequence[int], min_coverage: float = 0.0) -> list[int]:
    """Token cells (reading order, 0..grid^2-1) a box or mask covers by more than `min_coverage` of their area."""
    threshold = check_min_coverage(min_coverage)
    cover = coverage(spec, region, size).reshape(-1)
    cells = [int(c) for c in np.flatnonzero(cover > threshold + _EPS)]  # a region exactly at the threshold: out
    if not cells:
        raise BadInputError(f"the region covers no visual token by more than {threshold:.0%} of its area "
                            f"(largest: {cover.max():.0%}); lower min_coverage or draw a larger region")
    return cells


def region_tokens(spec: VisionSpec, ids: Sequence[int], region: Any, size: Sequence[int], image_index: int = 0,
                  min_coverage: float = 0.0) -> list[int]:
    """Positions, in the expanded sequence `ids`, of the visual tokens of image `image_index` that a box or
    mask of that image (`size` = its (width, height) as given to the model) covers."""
    groups = image_token_groups(spec, ids)
    if not 0 <= image_index < len(groups):
        raise BadInputError(f"image {image_index} is not in this sequence (it holds {len(groups)} images)")
    return [groups[image_index][spec.lead + c] for c in region_cells(spec, region, size, min_coverage)]


def cell_box(spec: VisionSpec, cell: int, size: Sequence[int]) -> tuple[float, float, float, float]:
    """The box (x0, y0, x1, y1), in pixels of the `size` (width, height) image, that visual token `cell` sees."""
    w, h = check_size(size)
    g = spec.grid
    if not (isinstance(cell, (int, np.integer)) and 0 <= cell < g * g):
        raise BadInputError(f"cell {cell!r} is not one of this model's {g * g} visual tokens (0..{g * g - 1})")
    r, c = divmod(int(cell), g)
    return (c * w / g, r * h / g, (c + 1) * w / g, (r + 1) * h / g)
