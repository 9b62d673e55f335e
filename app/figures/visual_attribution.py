"""Figures of the visual attribution page (and of `thoughtscope export`): the image beside a heat map of
one span's scores over the model's token grid. Builders take a plain dict and compute nothing.

`data`: `image` (rows of [r, g, b] uint8, at most 96 pixels a side), `scores` ([grid][grid] floats),
`title` and `method` (what the scores are: raw attention, exhaustive effect in nats, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import styled


def heatmap_figure(data: Any) -> go.Figure:
    """The image (left) and the span's scores per visual token, reading order top-left first (right)."""
    d = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["image", d.get("method", "scores")], horizontal_spacing=0.08)
    fig.add_trace(go.Image(z=d["image"], name="image"), row=1, col=1)
    fig.add_trace(go.Heatmap(z=d["scores"], colorscale="Viridis", name=d.get("method", "scores"),
                             colorbar=dict(title=d.get("unit", ""))), row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2, scaleanchor="x2")
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=False)
    fig.update_layout(height=380)
    return styled(fig, d.get("title", "visual attribution"))


FIGURES: dict[str, Callable[[Any], go.Figure]] = {"vis_attr_heatmap": heatmap_figure}
