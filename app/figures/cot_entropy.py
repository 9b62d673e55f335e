"""Figure builders of the CoT entropy page (Xu et al., entropy phases + CUSUM early exit).

Each builder takes a result of `analyses.cot_entropy` (or its `to_dict()`, what the JSON export
holds) and returns `styled(fig)`: the entropy curve with its phases, the CUSUM statistic, the
intermediate-answer strip, the calibration densities with the log-likelihood ratio, the
accuracy-vs-tokens plot with 95% intervals, the development-split choices, the voting bars and the
organism's alarm-delay distribution. Titles name the split a figure comes from. Builders that show
an exit take an optional `threshold`, so an h slider moves the exit without recomputing anything.
`FIGURES` maps names to builders for export, `TABLES` to their tidy tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analyses.tasks import task_label
from app.figures.template import PALETTE, export_size, styled

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
    # a fixed bar width and an axis that fits the probes made (a single probe is a bar, not the whole plot)
    fig.add_trace(go.Bar(x=steps, y=d["log_ratios"], name="Z = log f1/f0", marker_color=PALETTE[5], opacity=0.6,
                         width=0.5))
    fig.add_trace(go.Scatter(x=steps, y=d["statistic"], mode="lines+markers", name="S (CUSUM)",
                             line=dict(color=PALETTE[0], width=3)))
    fig.add_hline(y=h, line=dict(color=PALETTE[3], dash="dash"), annotation_text=f"h = {h:g}")
    alarm, _ = exit_at(d, threshold)
    if alarm is not None:
        fig.add_vline(x=alarm + 1, line=dict(color=PALETTE[3], width=2))
    fig.update_layout(xaxis=dict(title="step (probe)", range=[0.4, max(1, len(steps)) + 0.6], dtick=1),
                      yaxis_title="statistic", barmode="overlay")
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
        customdata=d["step_probe_entropies"], name="intermediate answers", showlegend=False,
        hovertemplate="after %{x} tokens: %{text}<br>mean entropy %{customdata:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[len(d["entropies"])], y=[0], mode="markers+text", name="final answer",
                             text=[d.get("final_answer") or "?"], textposition="top center",
                             marker=dict(size=18, symbol="diamond", color=PALETTE[0])))
    # legend entries for the colours and the ring (the squares above carry no legend of their own)
    for name, colour, ring in (("correct", CORRECT_COLOUR, 0), ("wrong", WRONG_COLOUR, 0),
                               ("no answer / no target", NONE_COLOUR, 0), ("answer at the alarm", "white", 3)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(size=14, symbol="square", color=colour,
                                             line=dict(width=ring, color="black"))))
    fig.update_layout(xaxis_title="generated tokens at the probe", height=240,
                      yaxis=dict(visible=False, range=[-1, 1.5]), showlegend=True,
                      legend=dict(orientation="h", yanchor="top", y=-0.45, x=0))
    target = d.get("target")
    return styled(fig, "Intermediate answers" + (f" (target {target})" if target is not None else ""))


def calibration_figure(detector: Any) -> go.Figure:
    """The calibration steps (normalised histograms), the fitted densities f0 (uncertainty) and f1
    (confidence), and Z = log f1 - log f0 (right axis): curves for a KDE, steps for a histogram."""
    d = _data(detector)
    edges = np.asarray(d["bin_edges"])
    centres, widths = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    kde = d.get("density", "histogram") == "kde"
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, label, colour in (("uncertain", "f0 uncertainty", UNCERTAIN_COLOUR),
                               ("confident", "f1 confidence", CONFIDENT_COLOUR)):
        bars = d[f"empirical_{key}"] if kde else d[f"density_{key}"]
        fig.add_trace(go.Bar(x=centres, y=bars, width=widths, name=f"{label} (n={d[f'n_{key}']})",
                             marker_color=colour, opacity=0.35 if kde else 0.6))
        if kde:
            fig.add_trace(go.Scatter(x=d["curve"]["x"], y=d["curve"][f"density_{key}"], mode="lines",
                                     name=f"{label.split()[0]} KDE", line=dict(color=colour, width=3)))
    if kde:
        fig.add_trace(go.Scatter(x=d["curve"]["x"], y=d["curve"]["log_ratio"], mode="lines", name="log f1/f0",
                                 line=dict(color=PALETTE[7], width=2)), secondary_y=True)
    else:
        fig.add_trace(go.Scatter(x=centres, y=d["log_ratio"], mode="lines+markers", name="log f1/f0",
                                 line=dict(color=PALETTE[7], shape="hvh")), secondary_y=True)
    bw = d.get("bandwidths") or [None, None]
    how = (f"KDE, bandwidths {bw[0]:.3g} / {bw[1]:.3g} nats" if kde and None not in bw
           else f"{len(widths)}-bin histogram")
    fig.update_layout(barmode="overlay", xaxis_title="probe answer entropy (nats)")
    fig.update_yaxes(title_text="density", secondary_y=False)
    fig.update_yaxes(title_text="log-likelihood ratio", secondary_y=True, showgrid=False)
    fig = styled(fig, "Calibration densities")
    fig.update_layout(title_subtitle_text=f"{how}; fitted on the calibration split")
    return fig


def _ci(m: dict[str, Any], key: str) -> tuple[float, float] | None:
    ci = m.get(key)
    return None if not ci else (ci["estimate"] - ci["low"], ci["high"] - ci["estimate"])


def pareto_figure(report: Any, measure: str | None = None) -> go.Figure:
    """Accuracy vs mean tokens (generated, or with probes) of each method on the evaluation split, with
    95% bootstrap intervals on both axes; each method at the setting chosen on development."""
    d = _data(report)
    measure = measure or d.get("measure", "generated")
    key, ci_key = {"generated": ("mean_generated_tokens", "generated_tokens_ci"),
                   "with_probes": ("mean_tokens_with_probes", "tokens_with_probes_ci")}.get(measure, (None, None))
    if key is None:
        raise ValueError("measure is 'generated' or 'with_probes'")
    symbols = {"vanilla": "square", "deer": "diamond", "dynasor": "triangle-up"}
    fig = go.Figure()
    lows, highs, xs = [], [], []
    for i, m in enumerate(d["methods"]):
        acc, tok = _ci(m, "accuracy_ci"), _ci(m, ci_key)
        setting = ", ".join(f"{k}={v}" for k, v in m.get("params", {}).items() if k != "name")
        cusum = m["name"].startswith("cusum")
        fig.add_trace(go.Scatter(
            x=[m[key]], y=[m["accuracy"]], mode="markers", name=m["name"] + (f" ({setting})" if setting else ""),
            marker=dict(size=14 if cusum else 12, symbol=symbols.get(m["name"], "circle"),
                        color=PALETTE[0] if cusum else PALETTE[(i + 1) % len(PALETTE)]),
            error_y=dict(type="data", symmetric=False, array=[acc[1]], arrayminus=[acc[0]], thickness=1.5)
            if acc else None,
            error_x=dict(type="data", symmetric=False, array=[tok[1]], arrayminus=[tok[0]], thickness=1.5)
            if tok else None,
            hovertemplate=f"{m['name']}<br>%{{x:.1f}} tokens<br>accuracy %{{y:.1%}}<extra></extra>"))
        lows.append(m["accuracy_ci"]["low"] if m.get("accuracy_ci") else m["accuracy"])
        highs.append(m["accuracy_ci"]["high"] if m.get("accuracy_ci") else m["accuracy"])
        xs += [m[ci_key]["low"], m[ci_key]["high"]] if m.get(ci_key) else [m[key]]
    # the accuracy axis stays inside [0, 1] (plotly's padding ran it to -50% at small n)
    pad = 0.05
    y_range = [max(0.0, min(lows) - pad), min(1.0, max(highs) + pad)] if lows else [0, 1]
    if y_range[1] - y_range[0] < 0.1:
        y_range = [max(0.0, y_range[0] - 0.05), min(1.0, y_range[1] + 0.05)]
    x_pad = max(1.0, 0.08 * (max(xs) - min(xs))) if xs else 1.0
    label = "mean generated tokens" if measure == "generated" else "mean tokens incl. probes"
    fig.update_layout(xaxis=dict(title=label, range=[max(0.0, min(xs) - x_pad), max(xs) + x_pad]) if xs else
                      dict(title=label), yaxis=dict(title="accuracy", tickformat=".0%", range=y_range),
                      legend=dict(orientation="h", yanchor="top", y=-0.22, x=0))
    export_size(fig, height=480)
    n = d.get("n_eval", "")
    return styled(fig, f"Accuracy vs tokens: {d.get('model', '')} on {task_label(d.get('task', ''))} "
                       f"(evaluation split, n={n}; 95% intervals)")


def dev_choice_figure(report: Any) -> go.Figure:
    """Every candidate setting of each method on the development split (accuracy vs tokens), the chosen
    one ringed, vanilla's development point for reference."""
    d = _data(report)
    cost = d.get("settings", {}).get("cost", "generated")
    key = "mean_generated_tokens" if cost == "generated" else "mean_tokens_with_probes"
    fig = go.Figure()
    for i, name in enumerate(("cusum", "deer", "dynasor")):
        c = d["choices"].get(name)
        if not c:
            continue
        rows = c["grid"]
        fig.add_trace(go.Scatter(
            x=[r[key] for r in rows], y=[r["accuracy"] for r in rows], mode="markers+lines", name=name,
            text=[str(r["setting"]) for r in rows], line=dict(color=PALETTE[i], width=1),
            marker=dict(size=[15 if j == c["chosen_index"] else 8 for j in range(len(rows))],
                        line=dict(width=[3 if j == c["chosen_index"] else 0 for j in range(len(rows))], color="black"),
                        color=PALETTE[i]),
            hovertemplate=f"{name} %{{text}}<br>%{{x:.1f}} tokens<br>accuracy %{{y:.1%}}<extra></extra>"))
    v = d.get("dev_vanilla")
    if v:
        fig.add_trace(go.Scatter(x=[v[key]], y=[v["accuracy"]], mode="markers", name="vanilla",
                                 marker=dict(size=12, symbol="square", color=PALETTE[7])))
    fig.update_layout(xaxis_title="mean generated tokens" if cost == "generated" else "mean tokens incl. probes",
                      yaxis=dict(title="accuracy", tickformat=".0%", rangemode="tozero"))
    return styled(fig, f"Settings tried on the development split (n={d.get('n_dev', '')}); ringed: chosen")


def voting_figure(report: Any) -> go.Figure:
    """Single-sample accuracy, majority (self-consistency) and CUSUM-weighted voting."""
    d = _data(report)
    names = ["single sample", "majority", "CUSUM-weighted"]
    values = [d["sample_accuracy"], d["majority_accuracy"], d["weighted_accuracy"]]
    intervals = d.get("intervals") or {}
    cis = [intervals.get(k) for k in ("single", "majority", "weighted")]
    error = None
    if all(cis):
        error = dict(type="data", symmetric=False, array=[c["high"] - c["estimate"] for c in cis],
                     arrayminus=[c["estimate"] - c["low"] for c in cis])
    fig = go.Figure(go.Bar(x=names, y=values, marker_color=[PALETTE[5], PALETTE[1], PALETTE[0]],
                           text=[f"{v:.0%}" for v in values], textposition="outside", error_y=error))
    fig.update_layout(yaxis_title="accuracy", yaxis_tickformat=".0%", yaxis_range=[0, 1.1])
    return styled(fig, f"Voting over {d.get('samples', '')} samples (evaluation split, n={d.get('n_eval', '')}; "
                       "95% intervals)")


def settling_figure(report: Any) -> go.Figure:
    """The organism: how many steps after the known settling step the CUSUM alarm went off (negative:
    a false alarm before the answer existed; "none": no alarm)."""
    d = _data(report)
    counts = {int(k): v for k, v in d["summary"]["delay_counts"].items()}
    xs = list(range(min([0, *counts]), max([d["bound"] + 1, *counts]) + 1))
    colours = [WRONG_COLOUR if x < 0 else CONFIDENT_COLOUR if x <= d["bound"] else UNCERTAIN_COLOUR for x in xs]
    fig = go.Figure(go.Bar(x=[str(x) for x in xs] + ["none"], y=[counts.get(x, 0) for x in xs] +
                           [d["summary"]["no_alarm"]], marker_color=colours + [NONE_COLOUR],
                           text=[counts.get(x, 0) for x in xs] + [d["summary"]["no_alarm"]], textposition="outside"))
    s = d["summary"]
    fig.update_layout(xaxis_title="alarm step - settling step", yaxis_title="traces",
                      xaxis=dict(type="category"))
    fig = styled(fig, f"CUSUM alarm vs settling step: {d.get('model', '')}")
    fig.update_layout(title_subtitle_text=f"evaluation split, n={s['n']}, h={d['threshold']:g} (chosen on dev); "
                                          f"{100 * s['within_bound']['estimate']:.0f}% within {d['bound']} steps")
    return fig


def pareto_table(data: Any) -> list[dict[str, Any]]:
    """One row per method: its setting, accuracy and tokens with their intervals, tests against vanilla."""
    d = _data(data)
    rows = []
    for m in d["methods"]:
        row = {"method": m["name"], "split": m.get("split", "evaluation"), "n": m["n"],
               "setting": ", ".join(f"{k}={v}" for k, v in m.get("params", {}).items() if k != "name"),
               "accuracy": m["accuracy"], "mean_generated_tokens": m["mean_generated_tokens"],
               "mean_tokens_with_probes": m["mean_tokens_with_probes"], "exit_rate": m["exit_rate"]}
        for key in ("accuracy_ci", "generated_tokens_ci", "tokens_with_probes_ci"):
            if m.get(key):
                row[f"{key[:-3]}_low"], row[f"{key[:-3]}_high"] = m[key]["low"], m[key]["high"]
        vs = m.get("vs_vanilla")
        if vs:
            row["mcnemar_p"], row["gained"], row["lost"] = (vs["accuracy"]["p_value"], vs["accuracy"]["gains"],
                                                            vs["accuracy"]["losses"])
            row["tokens_sign_p"] = vs["tokens"]["generated"][0]["p_value"]
        rows.append(row)
    return rows


def dev_choice_table(data: Any) -> list[dict[str, Any]]:
    """One row per (method, candidate setting) the figure plots: its development accuracy and costs, chosen or not
    (the density's bandwidth choice and the objective's score tuples stay in the JSON)."""
    d = _data(data)
    return [{"method": name, "split": "development", "setting": str(r["setting"]), "chosen": j == c["chosen_index"],
             **{k: v for k, v in r.items() if k not in ("setting", "score") and not isinstance(v, (dict, list))}}
            for name in ("cusum", "deer", "dynasor") if (c := d["choices"].get(name)) for j, r in enumerate(c["grid"])]


def settling_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    return [{"problem_id": r["problem_id"], "split": "evaluation", "settle_step": r["settle_step"],
             "alarm_step": r["alarm_step"], "delay": r["delay"], "n_steps": r["n_steps"]} for r in d.get("rows", [])]


def entropy_curve_table(data: Any) -> list[dict[str, Any]]:
    """One row per generated token: its entropy (raw and smoothed), whether a step ends after it, its phase."""
    d = _data(data)
    n = len(d["entropies"])
    _, exit_token = exit_at(d)
    ends = {int(b) for b, _ in d.get("step_ends", [])}
    texts, smoothed = d.get("token_texts") or [None] * n, d.get("smoothed_entropies") or [None] * n
    return [{"token": t + 1, "text": texts[t], "entropy": d["entropies"][t], "smoothed_entropy": smoothed[t],
             "step_end": t + 1 in ends,
             "phase": "uncertainty" if exit_token is None or t + 1 <= exit_token else "confidence"}
            for t in range(n)]


def cusum_table(data: Any) -> list[dict[str, Any]]:
    """One row per probed step: the tokens at the probe, Z = log f1/f0, the CUSUM statistic S, h, the alarm."""
    d = _data(data)
    alarm, _ = exit_at(d)
    probes = d.get("step_probe_tokens", [])
    return [{"step": i + 1, "probe_token": probes[i] if i < len(probes) else None, "log_ratio": z,
             "statistic": s, "threshold": d["threshold"], "alarm": i == alarm}
            for i, (z, s) in enumerate(zip(d["log_ratios"], d["statistic"]))]


def answer_strip_table(data: Any) -> list[dict[str, Any]]:
    """One row per probed step (point "probe") plus the trace's final answer (point "final")."""
    d = _data(data)
    alarm, _ = exit_at(d)
    rows = [{"point": "probe", "step": i + 1, "generated_tokens": x, "answer": a, "correct": c, "mean_entropy": h,
             "at_alarm": i == alarm, "target": d.get("target")}
            for i, (x, a, c, h) in enumerate(zip(d["step_probe_tokens"], d["step_probe_answers"],
                                                 d["step_probe_correct"], d["step_probe_entropies"]))]
    return rows + [{"point": "final", "step": None, "generated_tokens": len(d["entropies"]),
                    "answer": d.get("final_answer"), "correct": None, "mean_entropy": None, "at_alarm": False,
                    "target": d.get("target")}]


def calibration_table(data: Any) -> list[dict[str, Any]]:
    """One row per plotted point, long format by `series`: a histogram bar (x its centre, bin_low/bin_high its
    edges, count its steps) or a point of a fitted density or of log f1/f0 (a curve for a KDE, per bin for a
    histogram); y is a density in 1/nats, or the log-likelihood ratio for series "log ratio"."""
    d = _data(data)
    if "bin_edges" not in d:
        return []
    edges = d["bin_edges"]
    bins = list(zip(edges[:-1], edges[1:]))
    kde = d.get("density", "histogram") == "kde"
    rows = []

    def per_bin(series: str, ys: list[Any], counts: list[Any] | None) -> None:
        rows.extend({"series": series, "x": (lo + hi) / 2, "bin_low": lo, "bin_high": hi, "y": y,
                     "count": counts[i] if counts else None} for i, ((lo, hi), y) in enumerate(zip(bins, ys)))

    def curve(series: str, ys: list[Any]) -> None:
        rows.extend({"series": series, "x": x, "bin_low": None, "bin_high": None, "y": y, "count": None}
                    for x, y in zip(d["curve"]["x"], ys))

    for key in ("uncertain", "confident"):
        if kde:
            per_bin(f"histogram {key}", d[f"empirical_{key}"], d[f"counts_{key}"])
            curve(f"density {key}", d["curve"][f"density_{key}"])
        else:
            per_bin(f"density {key}", d[f"density_{key}"], d[f"counts_{key}"])
    if kde:
        curve("log ratio", d["curve"]["log_ratio"])
    else:
        per_bin("log ratio", d["log_ratio"], None)
    return rows


def voting_table(data: Any) -> list[dict[str, Any]]:
    """One row per vote (single sample, majority, CUSUM-weighted): accuracy and its 95% interval (the
    per-problem answers and weights are in the JSON)."""
    d = _data(data)
    intervals = d.get("intervals") or {}
    return [{"vote": label, "accuracy": d[key], "low": (intervals.get(name) or {}).get("low"),
             "high": (intervals.get(name) or {}).get("high"), "n_problems": d.get("n_eval"),
             "samples": d.get("samples"), "split": d.get("split", "evaluation")}
            for label, key, name in (("single sample", "sample_accuracy", "single"),
                                     ("majority", "majority_accuracy", "majority"),
                                     ("CUSUM-weighted", "weighted_accuracy", "weighted"))]


FIGURES: dict[str, Callable[..., go.Figure]] = {
    "cot_entropy_curve": entropy_curve_figure,
    "cot_cusum": cusum_figure,
    "cot_answer_strip": answer_strip_figure,
    "cot_calibration": calibration_figure,
    "cot_pareto": pareto_figure,
    "cot_dev_choice": dev_choice_figure,
    "cot_voting": voting_figure,
    "cot_settling": settling_figure,
}

TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "cot_entropy_curve": entropy_curve_table,
    "cot_cusum": cusum_table,
    "cot_answer_strip": answer_strip_table,
    "cot_calibration": calibration_table,
    "cot_pareto": pareto_table,
    "cot_dev_choice": dev_choice_table,
    "cot_voting": voting_table,
    "cot_settling": settling_table,
}
