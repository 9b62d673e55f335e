"""Figure builders of the trace explorer and the steering panel, their tidy tables, and the coloured-token HTML.

Each builder takes a result's plain dict (`app.export.plain(result)`, what the JSON export holds)
and returns `styled(fig)`. `FIGURES` maps a figure name to its builder, so `thoughtscope export
NAME --from RESULT.json` rebuilds exactly the figure the app showed from the JSON the app
exported; `TABLES` maps the same names to the tidy table (one row per observation, one column
per variable) that the CSV export writes.

Layouts follow the tools researchers already read: the logit lens as the tuned-lens paper and
the LLM Transparency Tool draw it (layer x position, the top token written in each cell, or the
probability and rank of the token that actually comes next); attention as CircuitsVis draws it
(token labels on both axes, a grid of every head of a layer, a log colour scale so the
first-token sink does not wash out the rest).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import CELL_SCALE, PALETTE, SEQUENTIAL, export_size, styled

MAX_CELL_LABELS = 2400  # more heat-map cells than this and the per-cell labels go (hover keeps them)
MAX_TICK_LABELS = 64  # more positions than this and the axis shows numbers instead of tokens
LOG_FLOOR = 1e-4  # attention weights below this share the lowest colour of the log scale


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _show(token: str, width: int = 12) -> str:
    """A token as a readable label: visible whitespace, at most `width` characters."""
    text = token.replace("\n", "\\n").replace("\t", "\\t")
    text = text if text.strip() else text.replace(" ", "\u2423")
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _num(x: Any) -> float:
    """None (a NaN in JSON) -> nan, for numpy."""
    return math.nan if x is None else float(x)


def _position_axis(tokens: Sequence[str], first: int = 0, title: str = "position") -> dict[str, Any]:
    """Numeric positions (duplicate tokens would merge on a categorical axis) labelled with tokens."""
    if len(tokens) > MAX_TICK_LABELS:
        return dict(title=title)
    return dict(title=title, tickmode="array", tickvals=list(range(first, first + len(tokens))),
                ticktext=[_show(t) for t in tokens], tickangle=-60, tickfont=dict(size=11))


# ----------------------------------------------------------------- generated tokens

def records_data(records: Sequence[Any], special: Sequence[int] = ()) -> dict[str, Any]:
    """Token records (objects or their dicts) -> the columns the entropy figure and its export use.
    `special`: ids of special tokens (end of turn...), flagged so displays can hide them."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else r for r in records]
    hidden = {int(i) for i in special}
    return {
        "tokens": [r["text"] for r in rows],
        "token_ids": [r.get("token_id") for r in rows],
        "special": [r.get("token_id") in hidden for r in rows],
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
    fig.add_trace(go.Scatter(x=steps, y=[_num(e) for e in d["entropies"]], mode="lines+markers",
                             name="entropy (nats)", customdata=labels,
                             hovertemplate="step %{x} %{customdata}<br>entropy %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=steps, y=[-_num(lp) for lp in d["logprobs"]], mode="lines",
                             name="surprisal -log p (nats)", line=dict(dash="dot"), customdata=labels,
                             hovertemplate="step %{x} %{customdata}<br>-log p %{y:.3f}<extra></extra>"))
    fig.update_layout(xaxis=_token_axis(d["tokens"], "generated token"), yaxis=dict(title="nats", rangemode="tozero"),
                      height=360, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
    return styled(fig, "Entropy per generated token")


def _token_axis(tokens: Sequence[str], title: str) -> dict[str, Any]:
    """Steps labelled by their tokens; past MAX_TICK_LABELS every k-th token, so labels never overlap."""
    every = max(1, -(-len(tokens) // MAX_TICK_LABELS))
    steps = list(range(0, len(tokens), every))
    return dict(title=title, tickmode="array", tickvals=steps, ticktext=[_show(tokens[i]) for i in steps],
                tickangle=-60, tickfont=dict(size=11))


def entropy_table(data: Any) -> list[dict[str, Any]]:
    """One row per generated token; its top-k rivals as columns alt1_token, alt1_prob, ..."""
    d = _data(data)
    rows = []
    for i, token in enumerate(d["tokens"]):
        row = {"step": i, "token": token, "token_id": (d.get("token_ids") or [None] * len(d["tokens"]))[i],
               "special": bool((d.get("special") or [False] * len(d["tokens"]))[i]),
               "entropy": d["entropies"][i], "logprob": d["logprobs"][i]}
        for k, (t, p) in enumerate(zip(d["top_tokens"][i], d["top_probs"][i]), start=1):
            row[f"alt{k}_token"], row[f"alt{k}_prob"] = t, p
        rows.append(row)
    return rows


def _shade(value: float, lo: float, hi: float, rgb: tuple[int, int, int]) -> str:
    alpha = 0.0 if hi <= lo else min(1.0, max(0.0, (value - lo) / (hi - lo)))
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{0.08 + 0.72 * alpha:.2f})"


# CSS-only tooltips (st.html runs no script): a token's box opens on hover and on keyboard focus.
TOKENS_CSS = """<style>
.ts-tokens{font-family:ui-monospace,Menlo,monospace;line-height:1.9;font-size:0.95em}
.ts-tok{position:relative;border-radius:3px;padding:1px 0;white-space:pre-wrap;cursor:default}
.ts-tok:focus{outline:1px solid #0072B2}
.ts-tip{display:none;position:absolute;left:0;top:1.7em;z-index:1000;min-width:14em;max-width:26em;
 background:#1f2328;color:#f5f5f5;padding:6px 8px;border-radius:5px;font-size:0.8em;line-height:1.35;
 white-space:normal;box-shadow:0 2px 8px rgba(0,0,0,.25);pointer-events:none}
.ts-tok:hover>.ts-tip,.ts-tok:focus>.ts-tip{display:block}
.ts-tip table{border-collapse:collapse;margin-top:3px}
.ts-tip td{padding:0 6px 0 0;font-family:ui-monospace,Menlo,monospace;white-space:pre}
.ts-tip .bar{display:inline-block;height:0.6em;background:#56B4E9;vertical-align:middle}
.ts-special{color:#888;font-size:0.75em;border:1px solid #bbb;border-radius:6px;padding:0 4px;margin:0 2px}
.ts-legend{font-size:0.8em;color:#555;margin-top:0.4em}
</style>"""


def _tip(step: int, token: str, entropy: float, logprob: float, rivals: Sequence[tuple[str, float]],
         special: bool) -> str:
    rows = "".join(f'<tr><td>{html.escape(repr(t))}</td><td>{p:.3f}</td>'
                   f'<td><span class="bar" style="width:{max(1, round(60 * p))}px"></span></td></tr>'
                   for t, p in rivals)
    kind = " (special token, hidden in the text)" if special else ""
    return (f'<span class="ts-tip" role="tooltip"><b>step {step}</b>: {html.escape(repr(token))}{kind}<br>'
            f'entropy {entropy:.3f} nats, log p {logprob:.3f}<br>top alternatives:<table>{rows}</table></span>')


def tokens_html(records: Sequence[Any], colour_by: str = "entropy", special: Sequence[int] = ()) -> str:
    """Generated tokens as HTML spans shaded by entropy or surprisal; hovering (or focusing) a token opens
    a tooltip with its entropy and its top-k rivals. Special tokens (`special` ids, e.g. end of turn)
    are not printed as text: they show as a small grey marker.

    CSS only: no script, no CDN. One hue at varying strength reads the same under colour-vision
    deficiencies.
    """
    d = records_data(records, special)
    if colour_by == "entropy":
        values, rgb, unit = d["entropies"], (230, 159, 0), "entropy"
    else:
        values, rgb, unit = [-lp for lp in d["logprobs"]], (0, 114, 178), "surprisal"
    hi = max([*values, 1e-9])
    spans = []
    for i, token in enumerate(d["tokens"]):
        tip = _tip(i, token, d["entropies"][i], d["logprobs"][i], list(zip(d["top_tokens"][i], d["top_probs"][i])),
                   d["special"][i])
        if d["special"][i]:
            spans.append(f'<span class="ts-tok ts-special" tabindex="0">end{tip}</span>')
            continue
        shown = html.escape(token).replace("\n", "&#8629;<br>")
        spans.append(f'<span class="ts-tok" tabindex="0" style="background:{_shade(values[i], 0.0, hi, rgb)}">'
                     f'{shown}{tip}</span>')
    legend = (f'<div class="ts-legend">shade = {unit} (0 to {hi:.2f} nats); hover a token for its top '
              'alternatives; "end" marks a special token (end of turn), not printed as text</div>')
    return f'{TOKENS_CSS}<div class="ts-tokens">{"".join(spans)}</div>{legend if spans else ""}'


def display_text(tokens: Sequence[str], token_ids: Sequence[int] = (), special: Sequence[int] = ()) -> str:
    """A generation as text to read: special tokens left out, and a text of whitespace only made
    visible (newline as \u21b5, space as \u2423), so a box is never blank while tokens exist."""
    hidden = {int(i) for i in special}
    ids = list(token_ids) or [None] * len(tokens)
    text = "".join(t for t, i in zip(tokens, ids) if i not in hidden)
    if text.strip() or not tokens:
        return text
    visible = text.replace("\n", "\u21b5\n").replace(" ", "\u2423").replace("\t", "\u21e5")
    return f"{visible}\n({len(tokens)} tokens, whitespace only)" if visible else f"({len(tokens)} special tokens only)"


# ----------------------------------------------------------------- logit lens

def _lens_cells(d: dict[str, Any], view: str) -> tuple[np.ndarray, list[list[str]], str, str]:
    if view == "next":
        z = np.array([[_num(x) for x in row] for row in d["next_probs"]], dtype=float)
        text = [["" if r is None or r < 0 else (str(r + 1) if r < 99 else "99+") for r in row]
                for row in d["next_ranks"]]
        return z, text, "p(next)", "Logit lens: probability (colour) and rank (text) of the next token"
    z = np.array([[_num(x) for x in row] for row in d["top_probs"]], dtype=float)
    return z, [[_show(t, 5) for t in row] for row in d["top_tokens"]], "p(top)", \
        "Logit lens: top token and its probability"


def _lens_figure(data: Any, view: str) -> go.Figure:
    d = _data(data)
    z, text, bar, title = _lens_cells(d, view)
    positions = d.get("positions") or list(range(z.shape[1]))
    layers = d["layers"]
    inputs = [_show(t) for t in d["tokens"]]
    nexts = [_show(t) for t in (d.get("next_tokens") or [""] * len(positions))]
    ranks = d.get("next_ranks") or [[-1] * len(positions) for _ in layers]
    probs = d.get("next_probs") or [[None] * len(positions) for _ in layers]
    custom = [[[inputs[j], _show(d["top_tokens"][i][j]), nexts[j],
                "-" if probs[i][j] is None else f"{probs[i][j]:.3f}",
                "-" if ranks[i][j] is None or ranks[i][j] < 0 else str(ranks[i][j] + 1)]
               for j in range(len(positions))] for i in range(len(layers))]
    heat = go.Heatmap(
        z=z, x=positions, y=layers, colorscale=CELL_SCALE, zmin=0, zmax=1, colorbar=dict(title=bar),
        text=text, customdata=custom, xgap=1, ygap=1,
        hovertemplate=("layer %{y}, position %{x} (input %{customdata[0]})<br>top %{customdata[1]}"
                       " (p %{z:.3f})<br>next %{customdata[2]}: p %{customdata[3]}, rank %{customdata[4]}"
                       "<extra></extra>"),
    )
    if z.size <= MAX_CELL_LABELS:
        heat.update(texttemplate="%{text}", textfont=dict(size=10))
    fig = go.Figure(heat)
    first = positions[0] if positions else 0
    prompt_len = d.get("prompt_len")
    if prompt_len is not None and first < prompt_len <= first + len(positions) - 1:
        fig.add_vline(x=prompt_len - 0.5, line=dict(color="#D55E00", width=2, dash="dash"))
        fig.add_annotation(x=prompt_len - 0.5, y=1, yref="paper", yanchor="bottom", xanchor="left",
                           text="generated \u2192", showarrow=False, font=dict(color="#D55E00", size=11))
    height = max(360, 140 + 22 * len(layers))
    fig.update_layout(xaxis=_position_axis(d["tokens"], first, "input token"),
                      yaxis=dict(title="layer", dtick=1 if len(layers) <= 40 else None), height=height)
    export_size(fig, width=max(720, 140 + 40 * len(positions)), height=height + 40)
    return styled(fig, title)


def logit_lens_figure(data: Any) -> go.Figure:
    """Layer x position heat map of the logit lens' top-token probability, the token written in each cell."""
    return _lens_figure(data, "top")


def logit_lens_next_figure(data: Any) -> go.Figure:
    """Layer x position heat map of p(the token that actually comes next), its rank written in each cell."""
    return _lens_figure(data, "next")


def logit_lens_table(data: Any) -> list[dict[str, Any]]:
    """One row per (layer, position)."""
    d = _data(data)
    positions = d.get("positions") or list(range(len(d["tokens"])))
    nexts = d.get("next_tokens")
    rows = []
    for i, layer in enumerate(d["layers"]):
        for j, pos in enumerate(positions):
            row = {"layer": layer, "position": pos, "input_token": d["tokens"][j],
                   "top_token": d["top_tokens"][i][j], "top_id": d["top_ids"][i][j], "top_prob": d["top_probs"][i][j]}
            if nexts is not None:
                row |= {"next_token": nexts[j], "next_prob": d["next_probs"][i][j], "next_rank": d["next_ranks"][i][j]}
            rows.append(row)
    return rows


# ----------------------------------------------------------------- attention

def _attention_z(w: np.ndarray, scale: str, floor: float = LOG_FLOOR) -> np.ndarray:
    if scale == "log":
        return np.log10(np.clip(w, floor, None))
    return w


def _colour_range(w: np.ndarray, d: dict[str, Any], scale: str) -> tuple[float, float]:
    """Log: 1e-4 .. 1. Linear: 0 .. the largest weight on any key but the first token of the sequence
    (the attention sink), so the sink saturates instead of washing out every other cell."""
    if scale == "log":
        return math.log10(LOG_FLOOR), 0.0
    rest = np.array(w, dtype=float)
    if (d.get("positions") or [0])[0] == 0 and rest.shape[-1] > 1:
        rest = rest[..., 1:]
    hi = float(np.nanmax(rest)) if rest.size else 1.0
    return 0.0, hi if hi > 0 else 1.0


def _attention_matrix(d: dict[str, Any], w: np.ndarray, earlier: Any) -> tuple[np.ndarray, list[int], list[str]]:
    """Causal upper triangle blanked; a first column of the mass on keys before the window, if any."""
    n = w.shape[-1]
    w = np.array(w, dtype=float)
    w[np.triu_indices(n, 1)] = np.nan
    first = (d.get("positions") or [0])[0]
    keys = list(range(first, first + n))
    labels = [_show(t) for t in d["tokens"]]
    if earlier is not None:
        w = np.concatenate([np.array(earlier, dtype=float).reshape(-1, 1), w], axis=1)
        keys = [first - 1, *keys]
        labels = ["\u00abearlier\u00bb", *labels]
    return w, keys, labels


def _boundary(fig: go.Figure, d: dict[str, Any], row: int | None = None, col: int | None = None) -> None:
    prompt_len, first = d.get("prompt_len"), (d.get("positions") or [0])[0]
    if prompt_len is None or not first < prompt_len <= first + len(d["tokens"]) - 1:
        return
    line = dict(color="#D55E00", width=1.5, dash="dash")
    where = {} if row is None else dict(row=row, col=col)
    fig.add_vline(x=prompt_len - 0.5, line=line, **where)
    fig.add_hline(y=prompt_len - 0.5, line=line, **where)


def attention_figure(data: Any) -> go.Figure:
    """One head's attention (query rows attend to key columns) with token labels, the prompt/generation
    boundary dashed, on a log or a sink-aware linear colour scale."""
    d = _data(data)
    scale = d.get("scale", "log")
    w, keys, key_labels = _attention_matrix(d, np.asarray(d["weights"], dtype=float), d.get("earlier"))
    lo, hi = _colour_range(np.asarray(d["weights"], dtype=float), d, scale)
    queries = d.get("positions") or list(range(w.shape[0]))
    q_labels = [_show(t) for t in d["tokens"]]
    bar = dict(title="weight", tickvals=[-4, -3, -2, -1, 0], ticktext=["\u22641e-4", "1e-3", "0.01", "0.1", "1"]) \
        if scale == "log" else dict(title="weight")
    fig = go.Figure(go.Heatmap(
        z=_attention_z(w, scale), x=keys, y=queries, colorscale=SEQUENTIAL, zmin=lo, zmax=hi, colorbar=bar,
        customdata=[[[q_labels[qi], key_labels[ki], "-" if math.isnan(w[qi, ki]) else f"{w[qi, ki]:.4f}"]
                     for ki in range(len(keys))] for qi in range(len(queries))],
        hovertemplate="query %{y} %{customdata[0]} \u2192 key %{x} %{customdata[1]}<br>weight %{customdata[2]}"
                      "<extra></extra>",
    ))
    _boundary(fig, d)
    xaxis = _position_axis(key_labels, keys[0], "key token") if len(keys) <= MAX_TICK_LABELS else dict(title="key position")
    if len(keys) <= MAX_TICK_LABELS:
        xaxis |= dict(tickvals=keys, ticktext=key_labels)
    fig.update_layout(xaxis=xaxis, yaxis=_position_axis(d["tokens"], queries[0], "query token")
                      | dict(autorange="reversed", tickangle=0),
                      height=max(480, 180 + 14 * len(queries)))
    export_size(fig, width=max(720, 200 + 16 * len(keys)), height=max(520, 220 + 16 * len(queries)))
    scale_name = "log colour" if scale == "log" else "linear colour, first token excluded from its range"
    return styled(fig, f"Attention pattern, layer {d['layer']} head {d['head']} ({scale_name})")


def attention_grid_figure(data: Any) -> go.Figure:
    """Every head of one layer as a small pattern (CircuitsVis-style grid), one shared colour scale."""
    d = _data(data)
    scale = d.get("scale", "log")
    weights = np.asarray(d["weights"], dtype=float)  # [heads, q, k]
    heads = d.get("heads") or list(range(weights.shape[0]))
    cols = min(len(heads), 4 if len(heads) > 9 else 3)
    rows = math.ceil(len(heads) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"head {h}" for h in heads],
                        horizontal_spacing=0.03, vertical_spacing=0.06)
    lo, hi = _colour_range(weights, d, scale)
    earlier = d.get("earlier")
    for i, head in enumerate(heads):
        w, keys, key_labels = _attention_matrix(d, weights[i], None if earlier is None else earlier[i])
        q_labels = [_show(t) for t in d["tokens"]]
        r, c = i // cols + 1, i % cols + 1
        fig.add_trace(go.Heatmap(
            z=_attention_z(w, scale), x=keys, y=d.get("positions") or list(range(w.shape[0])), coloraxis="coloraxis",
            customdata=[[[q_labels[qi], key_labels[ki]] for ki in range(len(keys))] for qi in range(w.shape[0])],
            hovertemplate=f"head {head}<br>query %{{y}} %{{customdata[0]}} \u2192 key %{{x}} %{{customdata[1]}}"
                          "<extra></extra>"), row=r, col=c)
        _boundary(fig, d, r, c)
        fig.update_yaxes(autorange="reversed", showticklabels=False, ticks="", row=r, col=c)
        fig.update_xaxes(showticklabels=False, ticks="", row=r, col=c)
    bar = dict(title="weight", tickvals=[-4, -3, -2, -1, 0], ticktext=["\u22641e-4", "1e-3", "0.01", "0.1", "1"]) \
        if scale == "log" else dict(title="weight")
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=lo, cmax=hi, colorbar=bar),
                      height=90 + 300 * rows)
    export_size(fig, width=160 + 260 * cols, height=90 + 270 * rows)
    scale_name = "log colour" if scale == "log" else "linear colour"
    return styled(fig, f"Every head of layer {d['layer']} ({scale_name}; dashed: prompt | generation)")


def attention_table(data: Any) -> list[dict[str, Any]]:
    """One row per (head, query, key) of the window (causal: keys up to the query), plus each query's
    mass on earlier keys as key position -1."""
    d = _data(data)
    weights = np.asarray(d["weights"], dtype=float)
    heads = d.get("heads") or ([d["head"]] if d.get("head") is not None else list(range(weights.shape[0])))
    if weights.ndim == 2:
        weights = weights[None]
    earlier = d.get("earlier")
    if earlier is not None and np.asarray(earlier).ndim == 1:
        earlier = [earlier]
    positions = d.get("positions") or list(range(weights.shape[1]))
    rows = []
    for h, head in enumerate(heads):
        for qi, q in enumerate(positions):
            if earlier is not None:
                rows.append({"layer": d["layer"], "head": head, "query": q, "query_token": d["tokens"][qi],
                             "key": -1, "key_token": "<earlier keys>", "weight": float(earlier[h][qi])})
            for ki in range(qi + 1):
                rows.append({"layer": d["layer"], "head": head, "query": q, "query_token": d["tokens"][qi],
                             "key": positions[ki], "key_token": d["tokens"][ki], "weight": float(weights[h, qi, ki])})
    return rows


# ----------------------------------------------------------------- residual norms

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


def residual_norm_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"layer": layer, "position": j, "token": d["tokens"][j], "norm": d["norms"][i][j]}
            for i, layer in enumerate(d["layers"]) for j in range(len(d["tokens"]))]


# ----------------------------------------------------------------- steering

def _scale_label(d: dict[str, Any], scale: float) -> str:
    if d.get("unit") == "norm":
        return f"scale {scale:g} \u00d7 mean \u2016{d['site']}\u2016"
    return f"scale {scale:g}"


def steering_figure(data: Any) -> go.Figure:
    """Per-step entropy of the unsteered and the steered generation (same prompt, same seed)."""
    d = _data(data)
    fig = go.Figure()
    for (name, part), colour in zip((("unsteered", d["unsteered"]), (f"steered ({_scale_label(d, d['scale'])})",
                                                                     d["steered"])), PALETTE):
        fig.add_trace(go.Scatter(
            x=list(range(len(part["tokens"]))), y=[_num(e) for e in part["entropies"]], mode="lines+markers",
            name=name, line=dict(color=colour), customdata=[_show(t) for t in part["tokens"]],
            hovertemplate="step %{x} %{customdata}<br>entropy %{y:.3f}<extra></extra>",
        ))
    fig.update_layout(xaxis=dict(title="generated token"), yaxis=dict(title="entropy (nats)", rangemode="tozero"),
                      height=320, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
    return styled(fig, f"Steering at {d['site']}: entropy per token")


def steering_table(data: Any) -> list[dict[str, Any]]:
    """One row per (generation, step): the texts are the tokens joined, so they are not repeated."""
    d = _data(data)
    rows = []
    for variant, scale in (("unsteered", 0.0), ("steered", d["scale"])):
        part = d[variant]
        ids = part.get("token_ids") or [None] * len(part["tokens"])
        for i, token in enumerate(part["tokens"]):
            rows.append({"generation": variant, "scale": scale, "unit": d.get("unit", "raw"), "site": d["site"],
                         "step": i, "token": token, "token_id": ids[i], "entropy": part["entropies"][i],
                         "logprob": part["logprobs"][i]})
    return rows


def steering_sweep_figure(data: Any) -> go.Figure:
    """Perplexity of each scale's steered text under the unsteered model (log axis): where steering
    starts to derail the text. The unsteered text's own perplexity is the dashed line."""
    d = _data(data)
    scales = d["scales"]
    excerpts = [_show(t.replace("\n", " "), 60) for t in d["texts"]]
    fig = go.Figure(go.Scatter(
        x=scales, y=[_num(p) for p in d["perplexities"]], mode="lines+markers", name="steered text",
        customdata=[[e, n, r] for e, n, r in zip(excerpts, d["n_tokens"], d["reused_tokens"])],
        # grid rows (one batched generation) reuse no draft: say "kept from a draft" only where a row did
        hovertemplate="scale %{x}<br>perplexity %{y:.3g}<br>%{customdata[1]} tokens"
                      + (", %{customdata[2]} kept from a draft" if any(d["reused_tokens"]) else "")
                      + "<br>%{customdata[0]}<extra></extra>"))
    if d.get("unsteered_perplexity") is not None:
        # on a log axis a shape takes the value, an annotation its log10 (plotly's rule): add_hline's own
        # annotation took the value, so the label sat at 10**ppl, far above the line
        fig.add_hline(y=d["unsteered_perplexity"], line=dict(dash="dash", color="#666"))
        fig.add_annotation(x=0, xref="x domain", xanchor="left", y=math.log10(d["unsteered_perplexity"]), yref="y",
                           yanchor="bottom", text="unsteered", showarrow=False)
    unit = f"scale (\u00d7 mean \u2016{d['site']}\u2016 = {d['reference_norm']:.3g})" if d.get("unit") == "norm" \
        else "scale (\u00d7 v)"
    fig.update_layout(xaxis=dict(title=unit), yaxis=dict(title="perplexity under the unsteered model", type="log"),
                      height=340, showlegend=False)
    return styled(fig, f"Steering sweep at {d['site']}: how far each scale moves the text")


def steering_sweep_table(data: Any) -> list[dict[str, Any]]:
    """One row per scale."""
    d = _data(data)
    return [{"site": d["site"], "unit": d.get("unit"), "scale": s, "added_norm": a, "perplexity": p,
             "n_tokens": n, "mean_entropy": e, "reused_tokens": r, "text": t}
            for s, a, p, n, e, r, t in zip(d["scales"], d["added_norms"], d["perplexities"], d["n_tokens"],
                                           d["mean_entropies"], d["reused_tokens"], d["texts"])]


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "entropy": entropy_figure,
    "logit_lens": logit_lens_figure,
    "logit_lens_next": logit_lens_next_figure,
    "attention": attention_figure,
    "attention_heads": attention_grid_figure,
    "residual_norms": residual_norm_figure,
    "steering": steering_figure,
    "steering_sweep": steering_sweep_figure,
}

TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "entropy": entropy_table,
    "logit_lens": logit_lens_table,
    "logit_lens_next": logit_lens_table,
    "attention": attention_table,
    "attention_heads": attention_table,
    "residual_norms": residual_norm_table,
    "steering": steering_table,
    "steering_sweep": steering_sweep_table,
}
