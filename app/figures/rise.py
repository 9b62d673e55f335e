"""Figures of the RISE page (and of `thoughtscope export`): step timeline, decoder-column map,
silhouette per layer, feature dashboard, steering table and bars. Builders take the result
dataclasses of `analyses.rise` (or their `to_dict()`), compute nothing, and return `styled` figures.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import PALETTE, styled

LABEL_COLOURS = {"reflection": PALETTE[3], "backtracking": PALETTE[0], "other": "#9a9a9a", None: "#dddddd"}


def step_timeline(trace: Any, top_latents: Any = None, title: str | None = None) -> go.Figure:
    """One bar per step of a trace, coloured by label; hover shows the text and the top latents.

    `trace` is an `analyses.rise.TraceRecord`; `top_latents` an optional [n_steps, k] array.
    """
    steps = trace.steps
    hover = []
    for i, step in enumerate(steps):
        latents = "" if top_latents is None else f"<br>top latents: {', '.join(str(int(x)) for x in top_latents[i])}"
        hover.append(f"<b>step {i}</b> ({step.label})<br>{_wrap(step.text)}{latents}")
    fig = go.Figure(go.Bar(
        x=[max(1, len(s.text)) for s in steps], y=["trace"] * len(steps), base=[s.start for s in steps],
        orientation="h", marker_color=[LABEL_COLOURS.get(s.label, PALETTE[4]) for s in steps],
        text=[s.label for s in steps], hovertext=hover, hoverinfo="text", showlegend=False,
    ))
    fig.update_layout(xaxis_title="character position in the trace", yaxis_visible=False, height=220, barmode="overlay")
    return styled(fig, title or f"Steps of {trace.problem.id} ({'correct' if trace.correct else 'wrong'})")


def decoder_map(layer: Any, title: str | None = None) -> go.Figure:
    """Decoder columns on the 2-D map of a `LayerAnalysis`, coloured by the label they were voted for."""
    labels = layer.association.column_labels
    fig = go.Figure()
    for label in ("other", "backtracking", "reflection", None):
        idx = [i for i, lab in enumerate(labels) if lab == label]
        if not idx:
            continue
        fig.add_trace(go.Scattergl(
            x=layer.coords[idx, 0], y=layer.coords[idx, 1], mode="markers", name=label or "no votes",
            marker=dict(color=LABEL_COLOURS[label], size=5 if label is None else 9, opacity=0.5 if label is None else 0.9),
            text=[f"column {i}" for i in idx], hoverinfo="text",
        ))
    sil = "n/a" if layer.silhouette is None else f"{layer.silhouette:.3f}"
    fig.update_layout(xaxis_title="map 1", yaxis_title="map 2")
    return styled(fig, title or f"Decoder columns at {layer.site} (silhouette {sil})")


def silhouette_curve(analysis: Any, title: str = "Behaviour separation per layer") -> go.Figure:
    """Silhouette of the behaviour groups of decoder columns, per layer (cosine; and on the map)."""
    layers = sorted(analysis.layers, key=lambda la: int(la.site.rsplit(".", 1)[1]))
    x = [int(la.site.rsplit(".", 1)[1]) for la in layers]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[la.silhouette for la in layers], mode="lines+markers",
                             name="decoder columns (cosine)"))
    fig.add_trace(go.Scatter(x=x, y=[la.silhouette_map for la in layers], mode="lines+markers",
                             name="2-D map", line=dict(dash="dash")))
    fig.update_layout(xaxis_title="layer", yaxis_title="silhouette")
    return styled(fig, title)


def feature_histogram(dashboard: Any) -> go.Figure:
    """Activation histogram of one latent over the steps where it fires."""
    edges = dashboard.histogram_edges
    mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    fig = go.Figure(go.Bar(x=mids, y=dashboard.histogram_counts, marker_color=PALETTE[0],
                           width=[b - a for a, b in zip(edges[:-1], edges[1:])]))
    fig.update_layout(xaxis_title="activation", yaxis_title="steps")
    return styled(fig, f"Latent {dashboard.latent} at {dashboard.site}: fires on {100 * dashboard.density:.1f}% of steps")


def feature_tokens(dashboard: Any) -> go.Figure:
    """Tokens the latent's decoder direction promotes (right) and suppresses (left) through the unembedding."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("suppressed", "promoted"), horizontal_spacing=0.18)
    for col, rows, colour in ((1, dashboard.suppressed_tokens, PALETTE[3]), (2, dashboard.promoted_tokens, PALETTE[2])):
        rows = list(reversed(rows))
        fig.add_trace(go.Bar(x=[v for _, v in rows], y=[repr(t) for t, _ in rows], orientation="h",
                             marker_color=colour, showlegend=False), row=1, col=col)
    fig.update_layout(height=360)
    return styled(fig, f"Latent {dashboard.latent}: logit effect of its decoder direction")


def feature_labels(dashboard: Any) -> go.Figure:
    """How often each behaviour label appears among the steps where the latent fires."""
    labels = list(dashboard.label_frequency)
    fig = go.Figure(go.Bar(x=labels, y=[dashboard.label_frequency[k] for k in labels],
                           marker_color=[LABEL_COLOURS.get(k, PALETTE[4]) for k in labels]))
    fig.update_layout(yaxis_title="steps where it fires")
    return styled(fig, f"Latent {dashboard.latent}: labels of its steps")


def steering_table(result: Any) -> go.Figure:
    """The steering table: per alpha, behaviour counts, length and accuracy."""
    rows = result.rows
    header = ["alpha", "reflection steps", "backtracking steps", "steps", "tokens", "accuracy", "n"]
    cells = [[f"{r.alpha:g}" for r in rows], [f"{r.mean_reflection_steps:.2f}" for r in rows],
             [f"{r.mean_backtracking_steps:.2f}" for r in rows], [f"{r.mean_steps:.2f}" for r in rows],
             [f"{r.mean_tokens:.1f}" for r in rows], [f"{100 * r.accuracy:.1f}%" for r in rows], [r.n for r in rows]]
    fig = go.Figure(go.Table(header=dict(values=header, fill_color="#eeeeee", align="left"),
                             cells=dict(values=cells, align="left")))
    fig.update_layout(height=80 + 30 * len(rows))
    return styled(fig, f"Steering {result.behaviour} at {result.site} ({result.mode})")


def steering_bars(result: Any) -> go.Figure:
    """Mean reflection and backtracking steps per trace against alpha."""
    x = [f"{r.alpha:g}" for r in result.rows]
    fig = go.Figure([
        go.Bar(x=x, y=[r.mean_reflection_steps for r in result.rows], name="reflection",
               marker_color=LABEL_COLOURS["reflection"]),
        go.Bar(x=x, y=[r.mean_backtracking_steps for r in result.rows], name="backtracking",
               marker_color=LABEL_COLOURS["backtracking"]),
    ])
    fig.update_layout(barmode="group", xaxis_title="alpha (1 removes the component, -1 doubles it)",
                      yaxis_title="steps per trace")
    return styled(fig, f"Behaviour counts while steering {result.behaviour}")


def confidence_curve(result: Any) -> go.Figure:
    """Mean next-token entropy over the optimisation of the confidence coefficients."""
    fig = go.Figure(go.Scatter(y=result.entropy_history, mode="lines", line=dict(color=PALETTE[0])))
    fig.update_layout(xaxis_title="iteration", yaxis_title="mean entropy (nats)")
    return styled(fig, f"Confidence coefficients at {result.site}")


def _wrap(text: str, width: int = 80) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) > width:
            lines.append(line)
            line = ""
        line += (" " if line else "") + w
    lines.append(line)
    return "<br>".join(lines)
