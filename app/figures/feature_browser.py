"""Figures of the corpus feature browser (SAEDashboard / Neuronpedia style), their tidy tables, and the
highlighted top contexts as HTML.

Builders take `FeatureBrowse.to_dict()` (through `app.export.plain`); `FIGURES` and `TABLES` make
them rebuildable and exportable like every other figure.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import PALETTE, export_size, styled

EXCERPT = 8  # tokens either side of the top token in a context's label


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def direction_name(d: dict[str, Any]) -> str:
    x = d["direction"]
    if x["kind"] == "sae":
        return f"SAE latent {x['latent']} at {x['site']}"
    if x["kind"] == "neuron":
        return f"neuron {x['index']} at {x['site']}"
    return f"{x.get('name', 'vector')} at {x['site']}"


def _excerpt(context: dict[str, Any], width: int = EXCERPT) -> str:
    p = context["max_position"]
    toks = context["tokens"]
    lo, hi = max(0, p - width), min(len(toks), p + width + 1)
    left, mid, right = "".join(toks[lo:p]), toks[p], "".join(toks[p + 1:hi])
    text = ("\u2026" if lo else "") + f"{left}[{mid}]{right}" + ("\u2026" if hi < len(toks) else "")
    return " ".join(text.split())


def contexts_html(data: Any, limit: int | None = None) -> str:
    """Top contexts, each token shaded by its activation (orange up, blue below zero, relative to the
    largest |activation| shown), with a CSS tooltip giving the value; the top token is outlined."""
    d = _data(data)
    contexts = d["contexts"][:limit] if limit else d["contexts"]
    scale = max([abs(a) for c in contexts for a in c["activations"] if a is not None] + [1e-9])
    rows = []
    for c in contexts:
        spans = []
        for i, (tok, act) in enumerate(zip(c["tokens"], c["activations"])):
            text = html.escape(tok).replace("\n", "&#8629;")
            if act is None:
                spans.append(f'<span class="fb-tok fb-first" title="first token: not scored">{text}</span>')
                continue
            alpha = min(1.0, abs(act) / scale)
            rgb = "230,159,0" if act >= 0 else "86,180,233"
            top = " fb-top" if i == c["max_position"] else ""
            spans.append(f'<span class="fb-tok{top}" tabindex="0" style="background:rgba({rgb},{0.05 + 0.85 * alpha:.2f})">'
                         f'{text}<span class="fb-tip">{html.escape(repr(tok))}: {act:.4g}</span></span>')
        rows.append(f'<div class="fb-row"><span class="fb-rank">#{c["rank"] + 1} &middot; {c["max_activation"]:.3g}'
                    f' &middot; context {c["context"]}</span>{"".join(spans)}</div>')
    css = ("<style>.fb-row{font-family:ui-monospace,Menlo,monospace;font-size:0.88em;line-height:1.8;"
           "padding:4px 0;border-bottom:1px solid #eee;white-space:pre-wrap}"
           ".fb-rank{display:inline-block;min-width:15em;color:#555;font-size:0.9em}"
           ".fb-tok{position:relative;border-radius:2px}.fb-first{color:#999}"
           ".fb-top{outline:1.5px solid #D55E00}"
           ".fb-tip{display:none;position:absolute;left:0;top:1.6em;z-index:1000;background:#1f2328;color:#fff;"
           "padding:2px 6px;border-radius:4px;font-size:0.85em;white-space:nowrap;pointer-events:none}"
           ".fb-tok:hover>.fb-tip,.fb-tok:focus>.fb-tip{display:block}</style>")
    return css + f'<div class="fb-contexts">{"".join(rows)}</div>'


def contexts_figure(data: Any) -> go.Figure:
    """The top contexts' highest activations, each labelled with the text around its top token."""
    d = _data(data)
    cs = d["contexts"]
    labels = [f"#{c['rank'] + 1} {_excerpt(c)}" for c in cs]
    fig = go.Figure(go.Bar(x=[c["max_activation"] for c in cs], y=labels, orientation="h",
                           marker_color=PALETTE[1], customdata=[c["context"] for c in cs],
                           hovertemplate="context %{customdata}<br>max activation %{x:.4g}<extra></extra>"))
    height = 120 + 26 * max(1, len(cs))
    fig.update_layout(yaxis=dict(autorange="reversed", tickfont=dict(family="monospace", size=11)),
                      xaxis=dict(title="highest activation in the context"), height=height)
    export_size(fig, width=1000, height=height)
    return styled(fig, f"Top contexts of {direction_name(d)} in {d['corpus']['name']}")


def contexts_table(data: Any) -> list[dict[str, Any]]:
    """One row per top context (its text once, the top token and the activation there)."""
    d = _data(data)
    return [{"rank": c["rank"] + 1, "context": c["context"], "max_activation": c["max_activation"],
             "max_position": c["max_position"], "max_token": c["tokens"][c["max_position"]],
             "text": "".join(c["tokens"])} for c in d["contexts"]]


def histogram_figure(data: Any) -> go.Figure:
    """How often the direction takes each activation value over the corpus."""
    d = _data(data)
    edges, counts = d["histogram_edges"], d["histogram_counts"]
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
    fig = go.Figure(go.Bar(x=centres, y=counts, width=widths, marker_color=PALETTE[0],
                           hovertemplate="%{x:.3g}: %{y} tokens<extra></extra>"))
    fig.update_layout(xaxis=dict(title="activation"), yaxis=dict(title=f"tokens ({d['histogram_of']})"), height=320,
                      bargap=0.02)
    density = f"fires on {100 * d['density']:.2f}% of {d['n_tokens']:,} tokens" if d["direction"]["kind"] == "sae" \
        else f"{d['n_tokens']:,} tokens"
    return styled(fig, f"Activation histogram of {direction_name(d)} ({density})")


def histogram_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    e = d["histogram_edges"]
    return [{"bin_low": e[i], "bin_high": e[i + 1], "tokens": n, "of": d["histogram_of"]}
            for i, n in enumerate(d["histogram_counts"])]


def logits_figure(data: Any) -> go.Figure:
    """The tokens whose logits the direction's write vector raises most and lowers most (no final norm)."""
    d = _data(data)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["promoted", "suppressed"], horizontal_spacing=0.18)
    for col, (part, colour) in enumerate(((d["promoted"], PALETTE[2]), (d["suppressed"], PALETTE[3])), start=1):
        fig.add_trace(go.Bar(x=[w["logit"] for w in part], y=[repr(w["token"]) for w in part], orientation="h",
                             marker_color=colour, hovertemplate="%{y}: %{x:.3f}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", tickfont=dict(family="monospace", size=11), row=1, col=col)
        fig.update_xaxes(title_text="logit", row=1, col=col)
    height = 140 + 22 * max(1, len(d["promoted"]))
    fig.update_layout(showlegend=False, height=height)
    export_size(fig, width=820, height=height)
    return styled(fig, f"Logits {direction_name(d)} writes (unembedding, no final norm)")


def logits_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"effect": effect, "rank": i + 1, "token": w["token"], "token_id": w["token_id"], "logit": w["logit"]}
            for effect in ("promoted", "suppressed") for i, w in enumerate(d[effect])]


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "feature_contexts": contexts_figure,
    "feature_histogram": histogram_figure,
    "feature_logits": logits_figure,
}
TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "feature_contexts": contexts_table,
    "feature_histogram": histogram_table,
    "feature_logits": logits_table,
}
