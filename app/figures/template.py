"""The one figure template: fonts, sizes and a colour-blind-safe palette used by every figure.

Every builder in `app.figures` returns `styled(fig)`, so the pages, the export buttons and
`thoughtscope export` all produce the same look.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

# Okabe-Ito: distinguishable under the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
SEQUENTIAL = "Viridis"
DIVERGING = "RdBu_r"
FONT = dict(family="Helvetica, Arial, sans-serif", size=13, color="#222222")
EXPORT_SIZE = dict(width=720, height=420, scale=2)  # a one-column paper figure at 2x

pio.templates["thoughtscope"] = go.layout.Template(
    layout=go.Layout(
        font=FONT,
        colorway=PALETTE,
        paper_bgcolor="white",
        plot_bgcolor="white",
        margin=dict(l=60, r=20, t=50, b=50),
        xaxis=dict(showgrid=True, gridcolor="#e5e5e5", zeroline=False, linecolor="#444", ticks="outside"),
        yaxis=dict(showgrid=True, gridcolor="#e5e5e5", zeroline=False, linecolor="#444", ticks="outside"),
        legend=dict(bgcolor="rgba(255,255,255,0.8)"),
        colorscale=dict(sequential=SEQUENTIAL, diverging=DIVERGING),
    )
)


def styled(fig: go.Figure, title: str | None = None) -> go.Figure:
    """Apply the project template (and a title) to a figure; returns the same figure."""
    fig.update_layout(template="thoughtscope")
    if title is not None:
        fig.update_layout(title=dict(text=title, x=0.01, xanchor="left"))
    return fig
