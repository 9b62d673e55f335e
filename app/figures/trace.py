"""Figure builders of the trace explorer and the steering panel, plus the coloured-token HTML.

Each builder takes a result object (anything with `to_dict()`) or that dict itself, and returns
`styled(fig)`. `FIGURES` maps a figure name to its builder, so `thoughtscope export NAME --from
RESULT.json` rebuilds exactly the figure the app showed from the JSON the app exported.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from app.figures.template import PALETTE, SEQUENTIAL, styled

MAX_CELL_LABELS = 900  # more heat-map cells than this and the per-cell token labels go (hover keeps them)


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _show(token: str) -> str:
    """A token as a readable label: visible whitespace, at most 12 characters."""
    text = token.replace("\n", "\\n").replace("\t", "\\t")
    text = text if text.strip() else text.replace(" ", "\u2423")
    return text if len(text) <= 12 else text[:11] + "\u2026"


def _position_axis(tokens: Sequence[str], first: int = 0) -> dict[str, Any]:
    """Numeric positions (duplicate tokens would merge on a categorical axis) labelled with tokens."""
    if len(tokens) > 48:
        return dict(title="position")
    return dict(title="position", tickmode="array", tickvals=list(range(first, first + len(tokens))),
                ticktext=[_show(t) for t in tokens], tickangle=-60)


# ----------------------------------------------------------------- generated tokens

def records_data(records: Sequence[Any]) -> dict[str, Any]:
    """Token records (objects or their dicts) -> the columns the entropy figure and its export use."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else r for r in records]
    return {
        "tokens": [r["text"] for r in rows],
        "entropies": [r["entropy"] for r in rows],
        "logprobs": [r["logprob"] for r in rows],
        "top_tokens": [r.get("top_tokens", []) for r in rows],
        "top_probs": [r.get("top_probs", []) for r in rows],
    }


def entropy_figure(data: Any) -> go.Figure:
    """Entropy of each next-token distribution and the surprisal of the token drawn, per step."""
    d = _data(data)
    steps = list(range(len(d["tokens"])))
    labels = [_show(t) for t in d["tokens"]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=d["entropies"], mode="lines+markers", name="entropy (nats)",
                             customdata=labels, hovertemplate="step %{x} %{customdata}<br>entropy %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=steps, y=[-lp for lp in d["logprobs"]], mode="lines", name="surprisal -log p (nats)",
                             line=dict(dash="dot"), customdata=labels,
                             hovertemplate="step %{x} %{customdata}<br>-log p %{y:.3f}<extra></extra>"))
    fig.update_layout(xaxis=dict(title="generated token"), yaxis=dict(title="nats", rangemode="tozero"),
                      height=320, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
    return styled(fig, "Entropy per generated token")


def _shade(value: float, lo: float, hi: float, rgb: tuple[int, int, int]) -> str:
    alpha = 0.0 if hi <= lo else min(1.0, max(0.0, (value - lo) / (hi - lo)))
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{0.08 + 0.72 * alpha:.2f})"


def tokens_html(records: Sequence[Any], colour_by: str = "entropy") -> str:
    """Generated tokens as HTML spans shaded by entropy or surprisal; hovering shows the top-k rivals.

    Plain spans with `title` attributes: no script, no CDN. One hue at varying strength reads the
    same under colour-vision deficiencies.
    """
    d = records_data(records)
    if colour_by == "entropy":
        values, rgb, unit = d["entropies"], (230, 159, 0), "entropy"
    else:
        values, rgb, unit = [-lp for lp in d["logprobs"]], (0, 114, 178), "surprisal"
    hi = max([*values, 1e-9])
    spans = []
    for i, token in enumerate(d["tokens"]):
        rivals = "&#10;".join(f"{html.escape(repr(t))}  {p:.3f}" for t, p in zip(d["top_tokens"][i], d["top_probs"][i]))
        tip = (f"step {i}: {html.escape(repr(token))}&#10;entropy {d['entropies'][i]:.3f} nats, "
               f"log p {d['logprobs'][i]:.3f}&#10;top alternatives:&#10;{rivals}")
        shown = html.escape(token).replace("\n", "&#8629;<br>")
        spans.append(f'<span class="ts-tok" title="{tip}" style="background:{_shade(values[i], 0.0, hi, rgb)};'
                     f'border-radius:3px;padding:1px 0;white-space:pre-wrap">{shown}</span>')
    legend = (f'<div style="font-size:0.8em;color:#555;margin-top:0.4em">shade = {unit} '
              f'(0 to {hi:.2f} nats); hover a token for its top alternatives</div>')
    return ('<div class="ts-tokens" style="font-family:ui-monospace,Menlo,monospace;line-height:1.9;'
            f'font-size:0.95em">{"".join(spans)}</div>{legend if spans else ""}')


# ----------------------------------------------------------------- trace read-outs

def logit_lens_figure(data: Any) -> go.Figure:
    """Layer x position heat map of the logit lens' top-token probability, the token written in each cell."""
    d = _data(data)
    probs = np.asarray(d["top_probs"], dtype=float)
    positions = d.get("positions") or list(range(probs.shape[1]))
    labels = [[_show(t) for t in row] for row in d["top_tokens"]]
    inputs = [_show(t) for t in d["tokens"]]
    heat = go.Heatmap(
        z=probs, x=positions, y=d["layers"], colorscale=SEQUENTIAL, zmin=0, zmax=1,
        colorbar=dict(title="p(top)"), text=labels,
        customdata=[[inputs[j] for j in range(len(positions))] for _ in d["layers"]],
        hovertemplate="layer %{y}, position %{x} (input %{customdata})<br>top %{text}: %{z:.3f}<extra></extra>",
    )
    if probs.size <= MAX_CELL_LABELS:
        heat.update(texttemplate="%{text}", textfont=dict(size=9))
    fig = go.Figure(heat)
    fig.update_layout(xaxis=_position_axis(d["tokens"], positions[0] if positions else 0),
                      yaxis=dict(title="layer", dtick=1 if len(d["layers"]) <= 16 else None),
                      height=max(320, 40 + 22 * len(d["layers"])))
    return styled(fig, "Logit lens: top token and its probability")


def attention_figure(data: Any) -> go.Figure:
    """One head's attention pattern: query position (rows) attends to key position (columns)."""
    d = _data(data)
    w = np.asarray(d["weights"], dtype=float)
    labels = [_show(t) for t in d["tokens"]]
    fig = go.Figure(go.Heatmap(
        z=w, colorscale=SEQUENTIAL, zmin=0, zmax=float(w.max()) if w.size else 1, colorbar=dict(title="weight"),
        customdata=[[f"{labels[q]} \u2192 {labels[k]}" for k in range(w.shape[1])] for q in range(w.shape[0])],
        hovertemplate="query %{y} \u2192 key %{x}<br>%{customdata}<br>weight %{z:.3f}<extra></extra>",
    ))
    fig.update_layout(xaxis=_position_axis(d["tokens"]) | dict(title="key position"),
                      yaxis=_position_axis(d["tokens"]) | dict(title="query position", autorange="reversed"),
                      height=520)
    return styled(fig, f"Attention pattern, layer {d['layer']} head {d['head']}")


def residual_norm_figure(data: Any) -> go.Figure:
    """Residual-stream norm leaving each layer: mean over positions, and the last position."""
    d = _data(data)
    norms = np.asarray(d["norms"], dtype=float)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=d["layers"], y=norms.mean(1), mode="lines+markers", name="mean over positions"))
    fig.add_trace(go.Scatter(x=d["layers"], y=norms[:, -1], mode="lines+markers", name="last position",
                             line=dict(dash="dash")))
    fig.update_layout(xaxis=dict(title="layer", dtick=1 if len(d["layers"]) <= 16 else None),
                      yaxis=dict(title="||resid_post||", rangemode="tozero"), height=320)
    return styled(fig, "Residual stream norm per layer")


def steering_figure(data: Any) -> go.Figure:
    """Per-step entropy of the unsteered and the steered generation (same prompt, same seed)."""
    d = _data(data)
    fig = go.Figure()
    for (name, part), colour in zip((("unsteered", d["unsteered"]), (f"steered (scale {d['scale']:g})", d["steered"])),
                                    PALETTE):
        fig.add_trace(go.Scatter(
            x=list(range(len(part["tokens"]))), y=part["entropies"], mode="lines+markers", name=name,
            line=dict(color=colour), customdata=[_show(t) for t in part["tokens"]],
            hovertemplate="step %{x} %{customdata}<br>entropy %{y:.3f}<extra></extra>",
        ))
    fig.update_layout(xaxis=dict(title="generated token"), yaxis=dict(title="entropy (nats)", rangemode="tozero"),
                      height=320, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
    return styled(fig, f"Steering at {d['site']}: entropy per token")


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "entropy": entropy_figure,
    "logit_lens": logit_lens_figure,
    "attention": attention_figure,
    "residual_norms": residual_norm_figure,
    "steering": steering_figure,
}
