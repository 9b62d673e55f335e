"""Image regions for visual attribution: which visual tokens a region covers.

Three kinds (METHODS.md, method 4; vSTREAM, Kang et al. 2026, arXiv 2604.16587):
- `grid_regions`: the model's token grid cut into `rows` x `cols` blocks;
- `cluster_regions`: agglomerative (Ward) clusters of the visual tokens' features (the language
  model's input embeddings at the image tokens, i.e. the projected patch features), restricted to
  grid neighbours so each cluster is a connected patch of the image (scikit-learn);
- `box_regions`, `mask_regions`: pixel boxes (x0, y0, x1, y1) and H x W boolean masks of the image as
  given, mapped to the visual tokens they cover through the engine's resize and the family's patch and
  merge geometry (probes.image_regions); `regions_from_json` reads a list of them (the page's upload);
- `object_regions`: a toy-vlm scene's true object boxes, plus the background (the study's "objects" option).

A region is a set of token cells (0..grid^2-1, reading order) and, when it came from pixels, the box it
was drawn as; `positions` turns it into token positions of one traced sequence (probes.vision). Every
check runs before model work.

Example:
    >>> from probes.vision import VisionSpec
    >>> spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    >>> [r.cells for r in grid_regions(spec, 1, 3)]
    [(0, 3, 6), (1, 4, 7), (2, 5, 8)]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from probes.image_regions import check_box, check_mask, check_min_coverage, region_cells
from probes.vision import VisionSpec, image_token_groups
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

MAX_REGIONS = 256  # per image: each region is one masked row of the exhaustive effects
MAX_REGIONS_JSON_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Region:
    """A named set of token cells of one image (reading order of the model's token grid)."""

    name: str
    cells: tuple[int, ...]
    box: tuple[float, float, float, float] | None = None  # as drawn, in pixels of the image as given

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "cells": list(self.cells)}
        if self.box is not None:
            d["box"] = list(self.box)
        return d


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
    with importing("sklearn.cluster", "sklearn.feature_extraction.image"):  # lazy: scikit-learn takes seconds to import
        from sklearn.cluster import AgglomerativeClustering
        from sklearn.feature_extraction.image import grid_to_graph

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


def _names(names: Sequence[str] | None, n: int, kind: str) -> list[str]:
    names = list(names) if names is not None else [f"{kind} {i}" for i in range(n)]
    if len(names) != n:
        raise BadInputError(f"{len(names)} names for {n} {kind}es" if kind == "box" else
                            f"{len(names)} names for {n} {kind}s")
    if not 1 <= n <= MAX_REGIONS:
        raise BadInputError(f"give 1..{MAX_REGIONS} regions; got {n}")
    return [str(v) for v in names]


def box_regions(spec: VisionSpec, boxes: Sequence[Sequence[float]], size: tuple[int, int],
                names: Sequence[str] | None = None, min_coverage: float = 0.0) -> list[Region]:
    """One region per pixel box (x0, y0, x1, y1; exclusive ends) of an image of `size` (width, height): the
    visual tokens the box covers by more than `min_coverage` of their area (default: any overlap)."""
    names = _names(names, len(boxes), "box")
    return [Region(name, tuple(region_cells(spec, box, size, min_coverage)), check_box(box, size))
            for name, box in zip(names, boxes)]


def mask_regions(spec: VisionSpec, masks: Sequence[Any], size: tuple[int, int],
                 names: Sequence[str] | None = None, min_coverage: float = 0.0) -> list[Region]:
    """One region per H x W boolean mask of an image of `size` (width, height); its box is the mask's bounds."""
    names = _names(names, len(masks), "mask")
    out = []
    for name, mask in zip(names, masks):
        m = check_mask(mask, size)
        ys, xs = np.nonzero(m)
        bounds = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
        out.append(Region(name, tuple(region_cells(spec, m, size, min_coverage)), bounds))
    return out


def regions_from_json(spec: VisionSpec, data: Any, size: tuple[int, int]) -> list[Region]:
    """Regions from a JSON document (text, bytes or the parsed object), drawn on the image as given:

        {"size": [W, H],                      # optional: the image the regions were drawn on
         "min_coverage": 0.0,                 # optional: a token belongs if the region covers more of it
         "regions": [{"name": "ring", "box": [x0, y0, x1, y1]},
                     {"name": "sky", "mask": [[0, 1, ...], ...]}]}   # H rows of W 0/1 values

    (a bare list of region objects is read as "regions"). Every region is checked (NaN, zero area,
    outside the image, a mask of another size) before any model work."""
    if isinstance(data, (bytes, bytearray, str)):
        if len(data) > MAX_REGIONS_JSON_BYTES:
            raise BadInputError(f"the regions JSON is {len(data)} bytes; the limit is {MAX_REGIONS_JSON_BYTES}")
        try:
            data = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise BadInputError(f"the regions file is not JSON ({err})") from err
    doc = {"regions": data} if isinstance(data, list) else data
    if not isinstance(doc, dict) or not isinstance(doc.get("regions"), list):
        raise BadInputError('regions JSON: {"regions": [{"name": ..., "box": [x0, y0, x1, y1]} or '
                            '{"name": ..., "mask": [[0/1, ...], ...]}, ...]}')
    w, h = size
    drawn = doc.get("size")
    if drawn is not None and not (isinstance(drawn, list) and len(drawn) == 2):
        raise BadInputError(f'regions JSON: "size" is [width, height] of the image they were drawn on; got {drawn!r}')
    if drawn is not None and list(drawn) != [w, h]:
        raise BadInputError(f"these regions were drawn on a {drawn[0]}x{drawn[1]} image but the image is {w}x{h}: "
                            "draw them on this image (or drop \"size\")")
    min_coverage = check_min_coverage(doc.get("min_coverage", 0.0))
    items = doc["regions"]
    _names(None, len(items), "region")  # the count check
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or (("box" in item) == ("mask" in item)):
            raise BadInputError(f"region {i}: give exactly one of \"box\" or \"mask\"")
        name = str(item.get("name", f"region {i}"))
        try:
            if "box" in item:
                out.extend(box_regions(spec, [item["box"]], size, [name], min_coverage))
            else:
                try:
                    mask = np.asarray(item["mask"])
                except ValueError as err:  # ragged rows
                    raise BadInputError(f"a mask is H rows of W 0/1 values ({err})") from err
                out.extend(mask_regions(spec, [mask], size, [name], min_coverage))
        except BadInputError as err:
            raise BadInputError(f"region {i} ({name!r}): {err}") from err
    return out


def object_regions(spec: VisionSpec, example: Any, background: bool = True) -> list[Region]:
    """A toy-vlm scene's objects as regions (their true pixel boxes, probes.toys.vlm), in reading order,
    and with `background` one more region of every token no object box touches (so the regions cover the
    image, as the grid cells do)."""
    size = (int(example.image.shape[1]), int(example.image.shape[0]))
    regions = box_regions(spec, [o.box for o in example.objects], size,
                          [f"{o.cell_name} {o.colour} {o.shape}" for o in example.objects])
    taken = {c for r in regions for c in r.cells}
    rest = tuple(c for c in range(spec.grid * spec.grid) if c not in taken)
    if background and rest:
        regions.append(Region("background", rest))
    return regions


def positions(spec: VisionSpec, token_ids: Sequence[int], region: Region, image_index: int = 0) -> list[int]:
    """Token positions of a region's visual tokens in a traced (expanded) sequence."""
    groups = image_token_groups(spec, token_ids)
    if not 0 <= image_index < len(groups):
        raise BadInputError(f"image {image_index} is not in this sequence (it holds {len(groups)} images)")
    bad = [c for c in region.cells if not 0 <= c < spec.grid * spec.grid]
    if bad or not region.cells:
        raise BadInputError(f"region {region.name!r} has cells {bad or '[]'} outside 0..{spec.grid ** 2 - 1}")
    return [groups[image_index][spec.lead + c] for c in region.cells]


def cell_map(spec: VisionSpec, regions: Sequence[Region], values: Sequence[float],
             empty: float = 0.0) -> np.ndarray:
    """A [grid, grid] map with each region's value painted on its cells (a heat map over the image); a cell
    in several regions gets their mean, a cell in none `empty` (NaN draws nothing there)."""
    total, count = np.zeros(spec.grid * spec.grid), np.zeros(spec.grid * spec.grid)
    for region, v in zip(regions, values):
        total[list(region.cells)] += float(v)
        count[list(region.cells)] += 1
    out = np.where(count > 0, total / np.maximum(count, 1), empty)
    return out.reshape(spec.grid, spec.grid)
