"""Figures of the contrast between two sets of steps: the volcano plot and its tidy table.

Builders take `ContrastResult.to_dict()` (through `app.export.plain`): every feature's standardised
mean difference against -log10 of its Benjamini-Hochberg q-value, one colour per site; the top
features are named.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

from app.figures.template import PALETTE, styled


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _minus_log10(q: float) -> float:
    return -math.log10(max(q, 1e-300))


def volcano_figure(data: Any) -> go.Figure:
    """Effect size (SMD, A - B) against -log10 q for every feature; the dashed line is the FDR level."""
    d = _data(data)
    fig = go.Figure()
    for i, (site, f) in enumerate(d["features"].items()):
        fig.add_trace(go.Scattergl(
            x=f["smd"], y=[_minus_log10(q) for q in f["q"]], mode="markers", name=site,
            marker=dict(color=PALETTE[i % len(PALETTE)], size=6, opacity=0.7),
            customdata=[[j, a] for j, a in enumerate(f["auroc"])],
            hovertemplate=f"{site} #%{{customdata[0]}}<br>SMD %{{x:.3f}}<br>AUROC %{{customdata[1]:.3f}}"
                          "<br>-log10 q %{y:.2f}<extra></extra>"))
    alpha = d["settings"]["alpha"]
    fig.add_hline(y=_minus_log10(alpha), line_dash="dash", line_color="grey",
                  annotation_text=f"q = {alpha}", annotation_position="top left")
    top = d["top"][:8]
    fig.add_trace(go.Scatter(x=[r["smd"] for r in top], y=[_minus_log10(r["q"]) for r in top], mode="text",
                             text=[f"{r['site'].split(':')[0]} {r['feature']}" for r in top],
                             textposition="top center", showlegend=False, hoverinfo="skip"))
    fig.update_layout(xaxis=dict(title="standardised mean difference (A - B)"),
                      yaxis=dict(title="-log10 q (Benjamini-Hochberg)"), height=460)
    rule = d.get("rule", {})
    return styled(fig, f"{rule.get('A', 'A')} vs {rule.get('B', 'B')}: {d['n_significant']} features at q <= {alpha}")


def volcano_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"site": site, "feature": j, "smd": f["smd"][j], "auroc": f["auroc"][j], "p": f["p"][j], "q": f["q"][j]}
            for site, f in d["features"].items() for j in range(len(f["smd"]))]


def top_table(data: Any) -> list[dict[str, Any]]:
    """The top features with their development intervals and held-out AUROC (what the page lists)."""
    d = _data(data)
    rows = []
    for r in d["top"]:
        s, a, h = r["smd_interval"], r["auroc_interval"], r["heldout_auroc"]
        rows.append({"rank": r["rank"], "site": r["site"], "feature": r["feature"], "smd": round(r["smd"], 3),
                     "smd 95%": f"[{s['low']:.2f}, {s['high']:.2f}]", "auroc": round(r["auroc"], 3),
                     "auroc 95%": f"[{a['low']:.2f}, {a['high']:.2f}]", "q": r["q"], "significant": r["significant"],
                     "held-out auroc": round(h["estimate"], 3), "held-out 95%": f"[{h['low']:.2f}, {h['high']:.2f}]"})
    return rows


FIGURES: dict[str, Callable[[Any], go.Figure]] = {"contrast_volcano": volcano_figure}
TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {"contrast_volcano": volcano_table}
