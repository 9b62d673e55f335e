"""Image regions for visual attribution: which visual tokens a region covers.

Three kinds (METHODS.md, method 4; vSTREAM, Kang et al. 2026, arXiv 2604.16587):
- `grid_regions`: the model's token grid cut into `rows` x `cols` blocks;
- `cluster_regions`: agglomerative (Ward) clusters of the visual tokens' features (the language
  model's input embeddings at the image tokens, i.e. the projected patch features), restricted to
  grid neighbours so each cluster is a connected patch of the image (scikit-learn);
- `box_regions`: pixel boxes, e.g. a toy scene's true object regions.

A region is a set of token cells (0..grid^2-1, reading order); `positions` turns it into token
positions of one traced sequence (probes.vision). Every check runs before model work.

Example:
    >>> from probes.vision import VisionSpec
    >>> spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    >>> [r.cells for r in grid_regions(spec, 1, 3)]
    [(0, 3, 6), (1, 4, 7), (2, 5, 8)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from probes.vision import VisionSpec, box_cells, image_token_groups
from thoughtscope.errors import BadInputError


@dataclass(frozen=True)
class Region:
    """A named set of token cells of one image (reading order of the model's token grid)."""

    name: str
    cells: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cells": list(self.cells)}


def grid_regions(spec: VisionSpec, rows: int, cols: int) -> list[Region]:
    """The token grid cut into `rows` x `cols` blocks (as even as the grid allows)."""
    g = spec.grid
    if not (isinstance(rows, int) and isinstance(cols, int) and 1 <= rows <= g and 1 <= cols <= g):
        raise BadInputError(f"a grid of {rows} x {cols} regions does not fit this model's {g} x {g} visual tokens "
                            f"(rows and cols must be 1..{g})")
    r_edges = np.linspace(0, g, rows + 1).round().astype(int)
    c_edges = np.linspace(0, g, cols + 1).round().astype(int)
    out = []
    for i in range(rows):
        for j in range(cols):
            in_rows, in_cols = range(r_edges[i], r_edges[i + 1]), range(c_edges[j], c_edges[j + 1])
            cells = tuple(r * g + c for r in in_rows for c in in_cols)
            out.append(Region(f"block {i},{j}", tuple(sorted(cells))))
    return out


def cluster_regions(spec: VisionSpec, features: Any, k: int) -> list[Region]:
    """`k` connected clusters of the visual tokens by Ward linkage on their features [grid^2, d]."""
    from sklearn.cluster import AgglomerativeClustering  # lazy: scikit-learn takes seconds to import
    from sklearn.feature_extraction.image import grid_to_graph  # lazy: scikit-learn takes seconds to import

    n = spec.grid * spec.grid
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != n:
        raise BadInputError(f"cluster_regions needs one feature row per visual token ({n}); got shape {x.shape}")
    if not (isinstance(k, int) and 1 <= k <= n):
        raise BadInputError(f"K={k} regions: K must be 1..{n}, the number of visual tokens of this model")
    if k == n:
        return [Region(f"cluster {i}", (i,)) for i in range(n)]
    labels = AgglomerativeClustering(n_clusters=k, linkage="ward",
                                     connectivity=grid_to_graph(spec.grid, spec.grid)).fit_predict(x)
    # number clusters by their first cell, so the order follows the image (reading order)
    order = sorted(set(labels.tolist()), key=lambda c: int(np.flatnonzero(labels == c)[0]))
    return [Region(f"cluster {i}", tuple(int(j) for j in np.flatnonzero(labels == c))) for i, c in enumerate(order)]


def box_regions(spec: VisionSpec, boxes: Sequence[Sequence[float]], size: tuple[int, int],
                names: Sequence[str] | None = None) -> list[Region]:
    """One region per pixel box (x0, y0, x1, y1) of an image of `size` (width, height)."""
    names = list(names) if names is not None else [f"box {i}" for i in range(len(boxes))]
    if len(names) != len(boxes):
        raise BadInputError(f"{len(names)} names for {len(boxes)} boxes")
    return [Region(name, tuple(box_cells(spec, box, size))) for name, box in zip(names, boxes)]


def positions(spec: VisionSpec, token_ids: Sequence[int], region: Region, image_index: int = 0) -> list[int]:
    """Token positions of a region's visual tokens in a traced (expanded) sequence."""
    groups = image_token_groups(spec, token_ids)
    if not 0 <= image_index < len(groups):
        raise BadInputError(f"image {image_index} is not in this sequence (it holds {len(groups)} images)")
    bad = [c for c in region.cells if not 0 <= c < spec.grid * spec.grid]
    if bad or not region.cells:
        raise BadInputError(f"region {region.name!r} has cells {bad or '[]'} outside 0..{spec.grid ** 2 - 1}")
    return [groups[image_index][spec.lead + c] for c in region.cells]


def cell_map(spec: VisionSpec, regions: Sequence[Region], values: Sequence[float]) -> np.ndarray:
    """A [grid, grid] map with each region's value painted on its cells (a heat map over the image)."""
    out = np.zeros(spec.grid * spec.grid)
    for region, v in zip(regions, values):
        out[list(region.cells)] = float(v)
    return out.reshape(spec.grid, spec.grid)
