"""Figure builders of the CoT entropy page (Xu et al., entropy phases + CUSUM early exit).

Each builder takes a result of `analyses.cot_entropy` (or its `to_dict()`) and returns
`styled(fig)`: the entropy curve with its phases, the CUSUM statistic, the intermediate-answer
strip, the calibration densities with the log-likelihood ratio, the accuracy-vs-tokens Pareto
plot and the voting bars. Builders that show an exit take an optional `threshold`, so an h
slider moves the exit without recomputing anything. `FIGURES` maps names to builders for export.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import PALETTE, styled

UNCERTAIN_COLOUR, CONFIDENT_COLOUR = PALETTE[1], PALETTE[2]  # orange, green
CORRECT_COLOUR, WRONG_COLOUR, NONE_COLOUR = PALETTE[2], PALETTE[3], "#999999"


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def exit_at(d: dict[str, Any], threshold: float | None = None) -> tuple[int | None, int | None]:
    """(alarm step, generated tokens at exit) of a trace analysis dict at h = `threshold`."""
    h = d["threshold"] if threshold is None else threshold
    hits = [i for i, s in enumerate(d["statistic"]) if s >= h]
    if not hits:
        return None, None
    boundary = d["step_probe_tokens"][hits[0]]
    detected = {b: at for b, at in d["step_ends"]}
    return hits[0], detected.get(boundary, boundary)


def entropy_curve_figure(analysis: Any, threshold: float | None = None) -> go.Figure:
    """Per-token entropy (raw and smoothed), step ends, and the uncertainty/confidence phases split at the alarm."""
    d = _data(analysis)
    n = len(d["entropies"])
    x = list(range(1, n + 1))
    _, exit_token = exit_at(d, threshold)
    fig = go.Figure()
    split = exit_token if exit_token is not None else n
    fig.add_vrect(x0=0.5, x1=split + 0.5, fillcolor=UNCERTAIN_COLOUR, opacity=0.12, line_width=0,
                  annotation_text="uncertainty", annotation_position="top left")
    if exit_token is not None:
        fig.add_vrect(x0=split + 0.5, x1=n + 0.5, fillcolor=CONFIDENT_COLOUR, opacity=0.12, line_width=0,
                      annotation_text=f"confidence: {n - exit_token} redundant tokens", annotation_position="top right")
        fig.add_vline(x=split + 0.5, line=dict(color=PALETTE[3], width=2, dash="dash"))
    tokens = [t.replace("\n", "\\n") for t in d.get("token_texts", [""] * n)]
    fig.add_trace(go.Scatter(x=x, y=d["entropies"], mode="lines+markers", name="entropy", customdata=tokens,
                             line=dict(color=PALETTE[0], width=1), marker=dict(size=4), opacity=0.5,
                             hovertemplate="token %{x} %{customdata}<br>%{y:.3f} nats<extra></extra>"))
    smoothed = d.get("smoothed_entropies")
    if smoothed is not None:
        fig.add_trace(go.Scatter(x=x, y=smoothed, mode="lines", name=f"mean of {d.get('smoothing_window', '')}",
                                 line=dict(color=PALETTE[0], width=3)))
    for boundary, _detected in d.get("step_ends", []):
        fig.add_vline(x=boundary + 0.5, line=dict(color="#bbbbbb", width=1, dash="dot"))
    fig.update_layout(xaxis_title="generated token", yaxis_title="entropy (nats)", hovermode="x unified")
    return styled(fig, "Token entropy and the CUSUM exit")


def cusum_figure(analysis: Any, threshold: float | None = None) -> go.Figure:
    """The CUSUM statistic per probed step with the threshold h and the alarm."""
    d = _data(analysis)
    h = d["threshold"] if threshold is None else threshold
    steps = list(range(1, len(d["statistic"]) + 1))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=steps, y=d["log_ratios"], name="Z = log f1/f0", marker_color=PALETTE[5], opacity=0.6))
    fig.add_trace(go.Scatter(x=steps, y=d["statistic"], mode="lines+markers", name="S (CUSUM)",
                             line=dict(color=PALETTE[0], width=3)))
    fig.add_hline(y=h, line=dict(color=PALETTE[3], dash="dash"), annotation_text=f"h = {h:g}")
    alarm, _ = exit_at(d, threshold)
    if alarm is not None:
        fig.add_vline(x=alarm + 1, line=dict(color=PALETTE[3], width=2))
    fig.update_layout(xaxis_title="step (probe)", yaxis_title="statistic", barmode="overlay")
    return styled(fig, "CUSUM statistic")


def answer_strip_figure(analysis: Any, threshold: float | None = None) -> go.Figure:
    """The intermediate answer at each step end, coloured correct / wrong / none; the exit is ringed."""
    d = _data(analysis)
    xs, answers, correct = d["step_probe_tokens"], d["step_probe_answers"], d["step_probe_correct"]
    colours = [NONE_COLOUR if a is None or c is None else CORRECT_COLOUR if c else WRONG_COLOUR
               for a, c in zip(answers, correct)]
    alarm, _ = exit_at(d, threshold)
    fig = go.Figure(go.Scatter(
        x=xs, y=[0] * len(xs), mode="markers+text", text=[a if a is not None else "?" for a in answers],
        textposition="top center", marker=dict(size=18, color=colours, symbol="square",
                                                line=dict(width=[3 if i == alarm else 0 for i in range(len(xs))],
                                                          color="black")),
        customdata=d["step_probe_entropies"], name="intermediate answers",
        hovertemplate="after %{x} tokens: %{text}<br>mean entropy %{customdata:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[len(d["entropies"])], y=[0], mode="markers+text", name="final answer",
                             text=[d.get("final_answer") or "?"], textposition="top center",
                             marker=dict(size=18, symbol="diamond", color=PALETTE[0])))
    fig.update_layout(xaxis_title="generated tokens at the probe", height=220,
                      yaxis=dict(visible=False, range=[-1, 1.5]), showlegend=False)
    target = d.get("target")
    return styled(fig, "Intermediate answers" + (f" (target {target})" if target is not None else ""))


def calibration_figure(detector: Any) -> go.Figure:
    """The fitted densities f0 (uncertainty) and f1 (confidence) and Z = log f1 - log f0 (right axis)."""
    d = _data(detector)
    edges = np.asarray(d["bin_edges"])
    centres, widths = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, label, colour in (("uncertain", "f0 uncertainty", UNCERTAIN_COLOUR),
                               ("confident", "f1 confidence", CONFIDENT_COLOUR)):
        fig.add_trace(go.Bar(x=centres, y=d[f"density_{key}"], width=widths, name=f"{label} (n={d[f'n_{key}']})",
                             marker_color=colour, opacity=0.6))
    fig.add_trace(go.Scatter(x=centres, y=d["log_ratio"], mode="lines+markers", name="log f1/f0",
                             line=dict(color=PALETTE[7], shape="hvh")), secondary_y=True)
    fig.update_layout(barmode="overlay", xaxis_title="probe answer entropy (nats)")
    fig.update_yaxes(title_text="density", secondary_y=False)
    fig.update_yaxes(title_text="log-likelihood ratio", secondary_y=True, showgrid=False)
    return styled(fig, "Calibration densities")


def pareto_figure(report: Any, measure: str = "generated") -> go.Figure:
    """Accuracy vs mean tokens (generated, or with probes) of CUSUM at each h and the baselines."""
    d = _data(report)
    key = {"generated": "mean_generated_tokens", "with_probes": "mean_tokens_with_probes"}.get(measure)
    if key is None:
        raise ValueError("measure is 'generated' or 'with_probes'")
    methods = d["methods"]
    cusum = [m for m in methods if m["name"].startswith("cusum")]
    fig = go.Figure()
    if cusum:
        fig.add_trace(go.Scatter(x=[m[key] for m in cusum], y=[m["accuracy"] for m in cusum], mode="lines+markers+text",
                                 text=[m["name"].replace("cusum ", "") for m in cusum], textposition="top center",
                                 name="CUSUM (h sweep)", line=dict(color=PALETTE[0], width=2), marker=dict(size=9)))
    symbols = {"vanilla": "square", "deer": "diamond", "dynasor": "triangle-up"}
    for i, m in enumerate(m for m in methods if not m["name"].startswith("cusum")):
        fig.add_trace(go.Scatter(x=[m[key]], y=[m["accuracy"]], mode="markers+text", text=[m["name"]],
                                 textposition="bottom center", name=m["name"],
                                 marker=dict(size=13, symbol=symbols.get(m["name"], "circle"),
                                             color=PALETTE[(i + 1) % len(PALETTE)])))
    label = "mean generated tokens" if measure == "generated" else "mean tokens incl. probes"
    fig.update_layout(xaxis_title=label, yaxis_title="accuracy", yaxis_tickformat=".0%")
    return styled(fig, f"Accuracy vs tokens: {d.get('model', '')} on {d.get('task', '')} (n={d.get('n_eval', '')})")


def voting_figure(report: Any) -> go.Figure:
    """Single-sample accuracy, majority (self-consistency) and CUSUM-weighted voting."""
    d = _data(report)
    names = ["single sample", "majority", "CUSUM-weighted"]
    values = [d["sample_accuracy"], d["majority_accuracy"], d["weighted_accuracy"]]
    fig = go.Figure(go.Bar(x=names, y=values, marker_color=[PALETTE[5], PALETTE[1], PALETTE[0]],
                           text=[f"{v:.0%}" for v in values], textposition="outside"))
    fig.update_layout(yaxis_title="accuracy", yaxis_tickformat=".0%", yaxis_range=[0, max(1.0, *values) * 1.1])
    return styled(fig, f"Voting over {d.get('samples', '')} samples (n={d.get('n_eval', '')})")


FIGURES: dict[str, Callable[..., go.Figure]] = {
    "cot_entropy_curve": entropy_curve_figure,
    "cot_cusum": cusum_figure,
    "cot_answer_strip": answer_strip_figure,
    "cot_calibration": calibration_figure,
    "cot_pareto": pareto_figure,
    "cot_voting": voting_figure,
}
