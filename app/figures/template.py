"""The one figure template: fonts, sizes and a colour-blind-safe palette used by every figure.

Every builder in `app.figures` returns `styled(fig)`, so the pages, the export buttons and
`thoughtscope export` all produce the same look.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

from app.figures.margins import settle_margins

# Okabe-Ito: distinguishable under the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
SEQUENTIAL = "Viridis"
# Light-to-dark blues for heat maps that carry text in their cells: plotly picks black or white text
# per cell for contrast, and every shade stays readable (no bright yellow end).
CELL_SCALE = [[0.0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1.0, "#08306b"]]
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
        # automargin: the margins grow to hold rotated tick labels and the axis title below them, so
        # titles never overlap ticks and an export never cuts them off
        xaxis=dict(showgrid=True, gridcolor="#e5e5e5", zeroline=False, linecolor="#444", ticks="outside",
                   automargin=True, title=dict(standoff=8)),
        yaxis=dict(showgrid=True, gridcolor="#e5e5e5", zeroline=False, linecolor="#444", ticks="outside",
                   automargin=True, title=dict(standoff=8)),
        legend=dict(bgcolor="rgba(255,255,255,0.8)"),
        colorscale=dict(sequential=SEQUENTIAL, diverging=DIVERGING),
    )
)


def export_size(fig: go.Figure, width: int | None = None, height: int | None = None) -> go.Figure:
    """Record the size a figure needs when exported (the page stretches it to the column instead):
    `layout.meta.export_width/height`, read by `app.export.figure_bytes`."""
    meta = dict(fig.layout.meta or {})
    if width:
        meta["export_width"] = int(width)
    if height:
        meta["export_height"] = int(height)
    fig.update_layout(meta=meta)
    return fig


def styled(fig: go.Figure, title: str | None = None) -> go.Figure:
    """Apply the project template (and a title) to a figure, with the margins its labels will need set up
    front; returns the same figure.

    Traces get fixed ids (plotly.js otherwise draws each with a random one), so the same figure
    always exports to the same SVG bytes."""
    fig.update_layout(template="thoughtscope")
    for i, trace in enumerate(fig.data):
        if trace.uid is None:
            trace.uid = f"t{i}"
    if title is not None:
        fig.update_layout(title=dict(text=title, x=0.01, xanchor="left"))
    return settle_margins(fig)  # the browser draws it once (app/figures/margins.py says why)
