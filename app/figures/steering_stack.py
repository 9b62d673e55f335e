"""Figures of the steering stack: the proof-of-application strip under the steered text, and the per-token KL
between the steered and the unsteered model's next-token distributions.

`FIGURES` maps names to builders for `thoughtscope export`, `TABLES` to tidy tables.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from app.figures.template import styled


def _show(token: str) -> str:
    return token.replace("\n", "\u21b5").replace(" ", "\u2423") or "\u2205"


def stack_strip_figure(data: dict[str, Any]) -> go.Figure:
    """One row per stack term, one column per steered token: the L2 norm the term added at the position
    that chose the token, as the engine recorded it (blank: the term did not act there)."""
    terms, applied = data["terms"], data["applied"]
    tokens = data["steered"]["tokens"]
    z = [[a.get(name) for a in applied] for name in terms]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(len(tokens))), y=terms, colorscale="Blues", zmin=0, colorbar=dict(title="|added|"),
        customdata=[[_show(t) for t in tokens] for _ in terms], hoverongaps=False,
        hovertemplate="%{y}<br>token %{x} %{customdata}<br>added |v| = %{z:.3g}<extra></extra>"))
    fig.update_layout(xaxis=dict(title="steered token", tickmode="array", tickvals=list(range(len(tokens))),
                                 ticktext=[_show(t)[:8] for t in tokens]),
                      yaxis=dict(autorange="reversed"), height=140 + 28 * len(terms))
    return styled(fig, "Which stack terms acted at each steered token (engine records)")


def stack_strip_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (steered token, term): whether it acted and the norm it added."""
    rows = []
    for step, (token, acted) in enumerate(zip(data["steered"]["tokens"], data["applied"])):
        for name in data["terms"]:
            rows.append({"step": step, "token": token, "term": name, "acted": name in acted,
                         "added_norm": acted.get(name)})
    return rows


def stack_kl_figure(data: dict[str, Any]) -> go.Figure:
    """One bar per steered token: KL(steered || unsteered) of the next-token distributions at the position that
    chose it (`analyses.steering_stack.stack_token_kl`); dark where the unsteered text has the same token there."""
    tokens, kl, same = data["tokens"], data["kl"], data["same_token"]
    colours = ["#1f4e79" if s else "#e07b39" for s in same]
    fig = go.Figure(go.Bar(
        x=list(range(len(tokens))), y=kl, marker_color=colours, customdata=[_show(t) for t in tokens],
        hovertemplate="token %{x} %{customdata}<br>KL = %{y:.4g} nats<extra></extra>"))
    fig.update_layout(xaxis=dict(title="steered token (orange: another token than the unsteered text's)",
                                 tickmode="array", tickvals=list(range(len(tokens))),
                                 ticktext=[_show(t)[:8] for t in tokens]),
                      yaxis=dict(title="KL (nats)", rangemode="tozero"), height=320, showlegend=False)
    return styled(fig, f"How far the stack moved each next-token distribution (mean KL {data['mean_kl']:.3g} nats)")


def stack_kl_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per steered token: its KL and whether the unsteered text has the same token there."""
    return [{"step": t, "token": token, "token_id": tid, "kl_nats": kl, "same_token_as_unsteered": bool(same)}
            for t, (token, tid, kl, same) in enumerate(zip(data["tokens"], data["token_ids"], data["kl"],
                                                           data["same_token"]))]


FIGURES = {"steering_stack": stack_strip_figure, "steering_stack_kl": stack_kl_figure}
TABLES = {"steering_stack": stack_strip_table, "steering_stack_kl": stack_kl_table}
