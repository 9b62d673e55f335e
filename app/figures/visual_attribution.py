"""Figures of the visual attribution page (and of `thoughtscope export`): a heat map of one span's scores
laid over the image, one cell per region of the model's token grid, and the faithfulness of each method
with intervals. Builders take a plain dict and compute nothing.

Heat map `data`: `image` (rows of [r, g, b] uint8, at most 96 pixels a side), `scores` ([grid][grid]
floats, reading order top-left first), `title` and `method` (what the scores are: raw attention,
exhaustive effect in nats, ...), optionally `unit`, `opacity` (of the heat map over the image, 0.5) and
`boxes` ([{name, box: [x0, y0, x1, y1]}] in the image's pixels: the regions as drawn, outlined). A score of
None draws nothing (a token in no region).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import styled


def heatmap_figure(data: Any) -> go.Figure:
    """The span's scores per visual token as a semi-transparent heat map over the image: one cell per
    region, each covering the pixels its token sees (the image is resized to the tower's square input,
    so a token's cell is the matching fraction of the image)."""
    d = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    scores = d["scores"]
    height, width = len(d["image"]), len(d["image"][0])
    rows, cols = len(scores), len(scores[0])
    fig = go.Figure(go.Image(z=d["image"], name="image", hoverinfo="skip"))
    # go.Image puts pixel i at x = i (its extent is -0.5 .. width - 0.5); the heat map's cells tile that extent.
    dx, dy = width / cols, height / rows
    fig.add_trace(go.Heatmap(z=scores, x0=-0.5 + dx / 2, dx=dx, y0=-0.5 + dy / 2, dy=dy, colorscale="Viridis",
                             opacity=float(d.get("opacity", 0.5)), xgap=1, ygap=1, name=d.get("method", "scores"),
                             colorbar=dict(title=d.get("unit", "")),
                             hovertemplate="%{z:.4g}<extra>%{fullData.name}</extra>"))
    for item in d.get("boxes", []):  # the regions as drawn (pixel edges sit half a pixel before their centres)
        x0, y0, x1, y1 = item["box"]
        fig.add_shape(type="rect", x0=x0 - 0.5, y0=y0 - 0.5, x1=x1 - 0.5, y1=y1 - 0.5, line=dict(color="white", width=2),
                      label=dict(text=item["name"], textposition="top left", font=dict(color="white", size=11)))
    fig.update_xaxes(showticklabels=False, range=[-0.5, width - 0.5], showgrid=False, zeroline=False)
    fig.update_yaxes(showticklabels=False, range=[height - 0.5, -0.5], showgrid=False, zeroline=False,
                     scaleanchor="x")
    fig.update_layout(height=420, width=520)
    return styled(fig, d.get("title", "visual attribution"))


# two-line panel titles: four one-line titles overlap each other at the page's width
FAITHFULNESS_PANELS = (("spearman", "Spearman vs exhaustive<br>(higher better)"),
                       ("lds", "linear datamodeling<br>score (higher better)"),
                       ("hit", "true-cell<br>hit rate"),
                       ("deletion_top1", "drop, top-1 cell<br>deleted (nats)"))
METHOD_ORDER = ("amortized", "attention", "gradient", "exhaustive")


def faithfulness_figure(data: Any) -> go.Figure:
    """One panel per measure: each method's estimate with its 95% bootstrap interval.

    `data["metrics"]`: `<method>_<measure>` -> {estimate, low, high, n} (`StudyResult.to_dict()`)."""
    d = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    metrics = d["metrics"]
    panels = [(m, t) for m, t in FAITHFULNESS_PANELS if any(f"{x}_{m}" in metrics for x in METHOD_ORDER)]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for _, t in panels], horizontal_spacing=0.07)
    for c, (measure, _) in enumerate(panels, start=1):
        names = [x for x in METHOD_ORDER if isinstance(metrics.get(f"{x}_{measure}"), dict)]
        rows = [metrics[f"{x}_{measure}"] for x in names]
        fig.add_trace(go.Bar(x=names, y=[r["estimate"] for r in rows], name=measure, showlegend=False,
                             error_y=dict(type="data", symmetric=False,
                                          array=[r["high"] - r["estimate"] for r in rows],
                                          arrayminus=[r["estimate"] - r["low"] for r in rows])), row=1, col=c)
    n = next((v["n"] for v in metrics.values() if isinstance(v, dict)), 0)
    fig.update_layout(height=390, margin=dict(t=105))  # room for the title above the two-line panel titles
    return styled(fig, f"faithfulness against exhaustive ablation, {n} held-out spans (95% intervals)")


def heatmap_table(data: Any) -> list[dict[str, Any]]:
    """One row per cell of the heat map (the model's token grid, reading order): its grid row and column and
    the score drawn there (None: a token in no region), with the method and unit. The image is in the JSON."""
    d = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    return [{"grid_row": r, "grid_col": c, "score": score, "method": d.get("method", ""), "unit": d.get("unit", "")}
            for r, row in enumerate(d["scores"]) for c, score in enumerate(row)]


def faithfulness_table(data: Any) -> list[dict[str, Any]]:
    """One row per (method, measure): the estimate over the held-out spans and its 95% interval (a measure
    without an interval, such as R^2 over all pairs, has only its estimate)."""
    d = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    rows = []
    for key, value in d["metrics"].items():
        method, _, measure = key.partition("_")  # method names hold no underscore: amortized, attention, ...
        m = value if isinstance(value, dict) else {"estimate": value}
        rows.append({"method": method, "measure": measure, "estimate": m.get("estimate"), "low": m.get("low"),
                     "high": m.get("high"), "n": m.get("n"), "confidence": m.get("confidence"),
                     "interval": m.get("method")})
    return rows


FIGURES: dict[str, Callable[[Any], go.Figure]] = {"vis_attr_heatmap": heatmap_figure,
                                                  "vis_attr_faithfulness": faithfulness_figure}
TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {"vis_attr_heatmap": heatmap_table,
                                                           "vis_attr_faithfulness": faithfulness_table}
