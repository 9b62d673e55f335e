"""Figure builder of the growth curves (`thoughtscope bench curves`, benchmarks/curves.py): cost against size.

`curve_figure(data)` draws seconds against the size for the measured path and its baseline (log-log, so a
linear shape is a line of slope 1 and attention's quadratic term bends it towards slope 2), the expected
shape fitted to the points below the top as a dotted line, and peak memory on a second panel when measured.
`FIGURES` maps the name to the builder for `thoughtscope export growth_curve --from docs/curves/NAME.json`.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import PALETTE, export_size, styled


def curve_figure(data: Any) -> go.Figure:
    """data: name, model, x_label, x [sizes], series {label: [seconds]}, shape, fit {ratio, holds, predicted_top},
    memory {label: [MB]} (may be empty), machine, note."""
    data = dict(data)
    memory = {k: v for k, v in (data.get("memory") or {}).items() if v}
    cols = 2 if memory else 1
    fig = make_subplots(rows=1, cols=cols, subplot_titles=["time (s)"] + (["peak memory (MB)"] if memory else []))
    xs = list(data["x"])
    for i, (label, ys) in enumerate(data["series"].items()):
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=label.replace("_", " "),
                                 line=dict(color=PALETTE[i % len(PALETTE)])), row=1, col=1)
    fit = data.get("fit") or {}
    if fit:
        first = next(iter(data["series"].values()))
        fig.add_trace(go.Scatter(x=[xs[-2], xs[-1]], y=[first[-2], fit["predicted_top"]], mode="lines+markers",
                                 name=f"{data['shape']} shape from the lower points",
                                 line=dict(color="#777777", dash="dot"), marker=dict(symbol="x")), row=1, col=1)
    for i, (label, ys) in enumerate(memory.items()):
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=label.replace("_", " "),
                                 line=dict(color=PALETTE[(i + 4) % len(PALETTE)], dash="dash")), row=1, col=2)
    times = [y for ys in data["series"].values() for y in ys] + ([fit["predicted_top"]] if fit else [])
    for col, values in ((1, times), (2, [y for ys in memory.values() for y in ys])):
        if col > cols:
            continue
        fig.update_xaxes(type="log", title_text=data.get("x_label", "size"), tickvals=xs,
                         ticktext=[f"{x:,}" for x in xs], minor=dict(showgrid=False), row=1, col=col)
        ticks = log_ticks(values)
        fig.update_yaxes(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks], minor=dict(showgrid=False),
                         row=1, col=col)
    verdict = (f"top / shape {fit['ratio']:.2f} ({'holds' if fit['holds'] else 'does not hold'})" if fit else "")
    styled(fig, f"{data['name'].replace('_', ' ')}: {data['model']}, {verdict}")
    # the legend sits below the panels, so the right margin styled() keeps for a legend beside them goes
    fig.update_layout(legend=dict(orientation="h", y=-0.25), margin=dict(b=110, r=30))
    return export_size(fig, 960 if memory else 720, 460)


def log_ticks(values: list[float]) -> list[float]:
    """1-2-5 steps of every decade the positive `values` span, so a log axis reads without plotly's unlabelled
    minor digits (which showed "2" for both 0.2 and 2).

    >>> log_ticks([0.15, 3.8])
    [0.2, 0.5, 1.0, 2.0]
    """
    positive = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not positive:
        return []
    lo, hi = min(positive), max(positive)
    ticks = [float(f"{m * 10.0 ** e:.12g}") for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    if len(inside) >= 2:
        return inside
    return sorted({max(t for t in ticks if t <= lo), *inside, min(t for t in ticks if t >= hi)})


FIGURES = {"growth_curve": curve_figure}
