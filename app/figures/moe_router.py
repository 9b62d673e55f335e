"""Figure builders of the MoE router page (Expert-Sample, METHODS.md section 6; Chen et al., arXiv 2602.02443).

Each builder takes a plain dict (what the JSON export holds, made by `analyses.moe_router.maps` or the
evaluation's `to_dict()`), computes nothing beyond layout, and returns `styled(fig)`:

- `scores_figure`: one token's sorted router probabilities at one layer, bars coloured by the head (top k_h),
  the rest of the model's top-k, the tail pool of m and the remainder, with the cumulative and largest-gap
  rules' head sizes marked and the experts the token actually used ringed;
- `heatmap_figure`: the experts each generated token used at each MoE layer (rows: layer and expert, columns:
  tokens, colour: gate);
- `divergence_figure`: across N samples, the mean Jaccard distance between expert sets per layer and step,
  and each sample's tokens with the steps where they leave sample 0's marked;
- `pass_at_figure`: pass@n against n for every method with 95% bootstrap intervals;
- `active_experts_figure`: greedy accuracy against the number of active experts, 95% intervals;
- `profile_figure`: a `RouterProfile` over a data set: the mean sorted router probability by rank, one line
  per MoE layer, the model's top-k marked (where the certain head ends and the tail begins).

`FIGURES` maps names to builders for `thoughtscope export`; `TABLES` gives tidy CSV rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analyses.tasks import task_label
from app.figures.template import CELL_SCALE, PALETTE, export_size, styled

PART_COLOURS = {"head": PALETTE[0], "routed": PALETTE[5], "pool": PALETTE[1], "rest": "#c8c8c8"}


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _part(rank: int, k_h: int, k: int, m: int) -> str:
    if rank < k_h:
        return "head"
    if rank < k:
        return "routed"
    if rank < k_h + m:
        return "pool"
    return "rest"


def scores_figure(data: Any) -> go.Figure:
    """data: probs [E] (sorted), experts [E] (their ids), k, k_h, m, chosen [k'], token, layer, step,
    cumulative_head, p, gap_head."""
    d = _data(data)
    probs, experts = d["probs"], d["experts"]
    k, k_h, m = int(d["k"]), int(d["k_h"]), int(d["m"])
    ranks = list(range(1, len(probs) + 1))
    fig = go.Figure()
    labels = {"head": f"head (top {k_h})", "routed": f"rest of the model's top-{k}",
              "pool": f"tail pool (next {m} after the head)", "rest": "never sampled"}
    for part in ("head", "routed", "pool", "rest"):
        idx = [i for i in range(len(probs)) if _part(i, k_h, k, m) == part]
        if not idx:
            continue
        fig.add_trace(go.Bar(x=[ranks[i] for i in idx], y=[probs[i] for i in idx], name=labels[part],
                             marker_color=PART_COLOURS[part], customdata=[experts[i] for i in idx],
                             hovertemplate="rank %{x}: expert %{customdata}<br>p = %{y:.4f}<extra></extra>"))
    chosen = set(d.get("chosen") or [])
    used = [i for i, e in enumerate(experts) if e in chosen]
    if used:
        fig.add_trace(go.Scatter(x=[ranks[i] for i in used], y=[probs[i] for i in used], mode="markers",
                                 name="used by the token", marker=dict(symbol="circle-open", size=13,
                                                                       line=dict(width=2, color=PALETTE[3]))))
    # the two rules' head ends, labelled on opposite sides of their lines so equal or neighbouring ends stay legible
    for rank, text, dash, side in ((d.get("cumulative_head"), f"cumulative p={d.get('p', 0.5):g}", "dot", "top right"),
                                   (d.get("gap_head"), "largest gap", "dash", "top left")):
        if rank:
            fig.add_vline(x=rank + 0.5, line=dict(color=PALETTE[7], dash=dash, width=1),
                          annotation_text=text, annotation_position=side)
    fig.update_layout(xaxis_title="rank of the expert (sorted router probability)", yaxis_title="router probability",
                      barmode="overlay", legend=dict(orientation="h", y=-0.3), bargap=0.15)
    token = str(d.get("token", "")).strip() or repr(d.get("token", ""))
    return export_size(styled(fig, f"Router scores at layer {d.get('layer')} for token {d.get('step')} "
                                   f"({token!r}): head {k_h} of {k}"), height=440)


def heatmap_figure(data: Any) -> go.Figure:
    """data: layers, tokens [T], experts [layers][T][k'], gates [layers][T][k'], n_experts: one row per
    (layer, expert used at least once), one column per generated token, the gate as colour."""
    d = _data(data)
    tokens = d["tokens"]
    rows, z = [], []
    for j, layer in enumerate(d["layers"]):
        used = sorted({int(e) for step in d["experts"][j] for e in step if int(e) >= 0})
        for e in used:
            row = []
            for t in range(len(tokens)):
                gate = next((g for x, g in zip(d["experts"][j][t], d["gates"][j][t]) if int(x) == e), None)
                row.append(gate)
            rows.append(f"L{layer} e{e}")
            z.append(row)
    columns = [f"{t}: {tok}" for t, tok in enumerate(tokens)]
    fig = go.Figure(go.Heatmap(z=z, x=columns, y=rows, colorscale=CELL_SCALE, colorbar=dict(title="gate"),
                               hoverongaps=False, xgap=1, ygap=1,
                               hovertemplate="%{y} at token %{x}<br>gate %{z:.3f}<extra></extra>"))
    fig.update_layout(xaxis_title="generated token", yaxis_title="layer and expert", yaxis_autorange="reversed",
                      xaxis_tickangle=-60, yaxis_dtick=1 if len(rows) <= 80 else None)
    title = f"Experts used at every layer (sample {d.get('sample', 0)})" + _rule_line(d.get("rule"))
    return export_size(styled(fig, title), width=max(720, 40 * len(tokens) + 200),
                       height=max(360, 120 + 14 * len(rows)))


def divergence_figure(data: Any) -> go.Figure:
    """data: layers, divergence [layers][steps] (None where fewer than two samples run), tokens [N][steps],
    forks [N]: top, mean pairwise Jaccard distance of the samples' expert sets; bottom, every sample's tokens,
    the ones after its fork from sample 0 in colour."""
    d = _data(data)
    tokens, forks = d["tokens"], d["forks"]
    steps = max((len(t) for t in tokens), default=0)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.45, 0.55],
                        subplot_titles=("routing divergence (mean Jaccard distance between samples' experts)",
                                        "tokens of each sample (coloured after it leaves sample 0's)"))
    fig.add_trace(go.Heatmap(z=d["divergence"], x=list(range(steps)), y=[f"L{layer}" for layer in d["layers"]],
                             colorscale=CELL_SCALE, zmin=0, zmax=1, colorbar=dict(title="distance", y=0.8, len=0.45),
                             hovertemplate="layer %{y}, step %{x}<br>distance %{z:.2f}<extra></extra>"), row=1, col=1)
    z, text = [], []
    for b, toks in enumerate(tokens):
        fork = forks[b]
        z.append([None if t >= len(toks) else (1.0 if fork is not None and t >= fork else 0.0) for t in range(steps)])
        text.append([toks[t] if t < len(toks) else "" for t in range(steps)])
    fig.add_trace(go.Heatmap(z=z, x=list(range(steps)), y=[f"sample {b}" for b in range(len(tokens))], text=text,
                             texttemplate="%{text}", showscale=False, zmin=0, zmax=1, xgap=1, ygap=1,
                             colorscale=[[0, "#eef3f8"], [1, "#f6c58f"]],
                             hovertemplate="%{y}, step %{x}: %{text}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title_text="generated step", row=2, col=1)
    fig.update_annotations(font_size=12)
    n = d.get("n_samples", len(tokens))
    return export_size(styled(fig, f"Where {n} samples part" + _rule_line(d.get("rule"))),
                       width=max(720, 36 * steps + 200), height=max(420, 200 + 22 * (len(tokens) + len(d["layers"]))))


def _rule_line(rule: str | None) -> str:
    """The router rule as a smaller second title line (a rule's description is long)."""
    return f"<br><sup>under {rule}</sup>" if rule else "<br><sup>the model's own routing</sup>"


def pass_at_figure(data: Any) -> go.Figure:
    """data: an `eval expert-sample` report (`methods`: name, pass_at {n: interval}): pass@n with 95% bands."""
    d = _data(data)
    fig = go.Figure()
    top = max((int(n) for m in d["methods"] for n in m["pass_at"]), default=1)
    for i, method in enumerate(d["methods"]):
        ns = sorted(int(n) for n in method["pass_at"])
        rows = [method["pass_at"][str(n)] for n in ns]
        colour = PALETTE[i % len(PALETTE)]
        if ns == [1] and top > 1:  # a deterministic method (greedy): its n samples are one, pass@n = pass@1
            ns, rows = [1, top], rows * 2
        if len(ns) > 1:
            fig.add_trace(go.Scatter(x=ns + ns[::-1], y=[r["high"] for r in rows] + [r["low"] for r in rows[::-1]],
                                     fill="toself", fillcolor=colour, opacity=0.15, line=dict(width=0), mode="lines",
                                     hoverinfo="skip", showlegend=False))
        fig.add_trace(go.Scatter(
            x=ns, y=[r["estimate"] for r in rows], mode="lines+markers", name=method["name"],
            line=dict(color=colour), error_y=None if len(ns) > 1 else dict(
                type="data", symmetric=False, array=[rows[0]["high"] - rows[0]["estimate"]],
                arrayminus=[rows[0]["estimate"] - rows[0]["low"]]),
            customdata=[[r["low"], r["high"]] for r in rows],
            hovertemplate=method["name"] + "<br>pass@%{x}: %{y:.3f} [%{customdata[0]:.3f}, %{customdata[1]:.3f}]"
                                           "<extra></extra>"))
    ticks = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= top]
    fig.update_layout(xaxis_title="n (samples per problem)", yaxis_title="pass@n (unbiased estimator)",
                      xaxis=dict(type="log", tickvals=ticks, ticktext=[str(n) for n in ticks], minor=dict(showgrid=False)),
                      yaxis_range=[0, 1.02], legend=dict(orientation="h", y=-0.3))
    n = d.get("n_eval")
    return export_size(styled(fig, f"pass@n on {n} evaluation problems (95% bootstrap intervals)" if n else
                              "pass@n (95% bootstrap intervals)"), height=460)


def active_experts_figure(data: Any) -> go.Figure:
    """data: an `eval active-experts` report (`rows`: active_experts, accuracy interval; `k`)."""
    d = _data(data)
    rows = sorted(d["rows"], key=lambda r: r["active_experts"])
    xs = [r["active_experts"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    fig = go.Figure(go.Scatter(
        x=xs, y=[a["estimate"] for a in acc], mode="lines+markers", line=dict(color=PALETTE[0]), name="greedy accuracy",
        error_y=dict(type="data", symmetric=False, array=[a["high"] - a["estimate"] for a in acc],
                     arrayminus=[a["estimate"] - a["low"] for a in acc]),
        hovertemplate="%{x} experts: %{y:.3f}<extra></extra>"))
    fig.update_layout(xaxis_title="active experts per token (top-k' at every MoE layer)", yaxis_title="greedy accuracy",
                      yaxis_range=[0, 1.02], xaxis_dtick=1)
    n = d.get("settings", {}).get("n")
    return styled(fig, f"Greedy accuracy as active experts shrink (model k = {d.get('k')}"
                       + (f", {n} problems)" if n else ")"))


def profile_figure(data: Any) -> go.Figure:
    """data: a `RouterProfile.to_dict()` (layers, k, n_experts, n_tokens, mean_sorted_probs [layers, E], top1,
    topk_mass; `task` when it was read on a task)."""
    d = _data(data)
    k = int(d["k"])
    fig = go.Figure()
    for i, (layer, probs) in enumerate(zip(d["layers"], d["mean_sorted_probs"])):
        ranks = list(range(1, len(probs) + 1))
        fig.add_trace(go.Scatter(x=ranks, y=probs, mode="lines+markers", name=f"layer {layer}",
                                 line=dict(color=PALETTE[i % len(PALETTE)]), marker=dict(size=4),
                                 hovertemplate=f"layer {layer}" + "<br>rank %{x}: mean p = %{y:.4f}<extra></extra>"))
    fig.add_vline(x=k + 0.5, line=dict(color=PALETTE[7], dash="dash", width=1), annotation_text=f"top-k = {k}",
                  annotation_position="top right")
    fig.update_layout(xaxis_title="rank of the expert (sorted router probability)",
                      yaxis_title="mean router probability (log)", yaxis_type="log", legend=dict(orientation="h", y=-0.3))
    where = f" on {task_label(d['task'])}" if d.get("task") else ""
    return export_size(styled(fig, f"Router profile{where}: mean sorted probabilities over {d['n_tokens']} tokens"),
                       height=420)


def _profile_rows(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"layer": layer, "rank": r + 1, "mean_probability": p}
            for layer, probs in zip(d["layers"], d["mean_sorted_probs"]) for r, p in enumerate(probs)]


def _pass_rows(data: Any) -> list[dict[str, Any]]:
    return [{"method": m["name"], "n": int(n), "pass_at": r["estimate"], "low": r["low"], "high": r["high"]}
            for m in _data(data)["methods"] for n, r in sorted(m["pass_at"].items(), key=lambda kv: int(kv[0]))]


def _score_rows(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"rank": i + 1, "expert": e, "probability": p, "part": _part(i, d["k_h"], d["k"], d["m"]),
             "used": e in set(d.get("chosen") or [])} for i, (p, e) in enumerate(zip(d["probs"], d["experts"]))]


def _heatmap_rows(data: Any) -> list[dict[str, Any]]:
    """One row per (layer, generated position, routing slot) holding an expert: the expert and its gate (-1 skipped)."""
    d = _data(data)
    return [{"layer": layer, "position": t, "token": d["tokens"][t], "slot": s, "expert": int(e), "gate": g,
             "sample": d.get("sample", 0)}
            for j, layer in enumerate(d["layers"]) for t in range(len(d["tokens"]))
            for s, (e, g) in enumerate(zip(d["experts"][j][t], d["gates"][j][t])) if int(e) >= 0]


def _divergence_rows(data: Any) -> list[dict[str, Any]]:
    """One row per (layer, step) of the top panel: mean Jaccard distance between the samples' expert sets (None
    with fewer than two samples live), the same over samples with identical text so far, distinct tokens
    among the live samples (each sample's tokens and forks are in the JSON)."""
    d = _data(data)
    same, distinct = d.get("same_prefix"), d.get("distinct_tokens") or []
    return [{"layer": layer, "step": t, "divergence": v, "same_prefix_divergence": same[j][t] if same else None,
             "distinct_tokens": distinct[t] if t < len(distinct) else None}
            for j, layer in enumerate(d["layers"]) for t, v in enumerate(d["divergence"][j])]


def _active_rows(data: Any) -> list[dict[str, Any]]:
    """One row per number of active experts: greedy accuracy, 95% interval, mean tokens, McNemar vs the model's k."""
    d = _data(data)
    rows = []
    for r in sorted(d["rows"], key=lambda r: r["active_experts"]):
        a, vs = r["accuracy"], r.get("vs_model_k") or {}
        rows.append({"active_experts": r["active_experts"], "model_k": d.get("k"), "accuracy": a["estimate"],
                     "low": a["low"], "high": a["high"], "n": a.get("n"), "mean_tokens": r.get("mean_tokens"),
                     "mcnemar_p": vs.get("p_value"), "gained": vs.get("gains"), "lost": vs.get("losses")})
    return rows


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "moe_scores": scores_figure,
    "moe_heatmap": heatmap_figure,
    "moe_divergence": divergence_figure,
    "moe_pass_at": pass_at_figure,
    "moe_active_experts": active_experts_figure,
    "moe_profile": profile_figure,
}
TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "moe_pass_at": _pass_rows,
    "moe_scores": _score_rows,
    "moe_heatmap": _heatmap_rows,
    "moe_divergence": _divergence_rows,
    "moe_active_experts": _active_rows,
    "moe_profile": _profile_rows,
}
