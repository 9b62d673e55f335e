"""Figures of the neuro-fuzzy concepts page (and of `thoughtscope export`): the metric table with baselines,
the normalised firing of one sample, the overlap of grounded words between concepts, and the development
search. Each builder takes a plain dict (the slices of `FuzzyStudy.to_dict()` the page exports), computes
nothing, and returns a `styled` figure; `FIGURES` maps names to builders for export, `TABLES` to tidy CSV rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import PALETTE, SEQUENTIAL, styled

METHOD_COLOURS = {"fuzzy": PALETTE[0], "semi-NMF": PALETTE[1], "k-means": PALETTE[2], "PCA": PALETTE[4]}
METRIC_TITLES = {"reconstruction_error": "reconstruction error (FVU, lower better)",
                 "active_concepts": "active concepts per sample (lower = sparser)",
                 "word_overlap": "overlap of grounded words (lower = more disentangled)",
                 "stability": "stability across seeds (matched cosine)"}


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _metric_names(rows: list[dict[str, Any]]) -> list[str]:
    """The metrics the figure draws, in its panel order: the four of `METRIC_TITLES`, then the AMIs."""
    return [m for m in METRIC_TITLES if m in rows[0]] + sorted(k for k in rows[0] if k.startswith("ami_")
                                                               and not k.endswith(("_low", "_high")))


def metrics_figure(data: Any) -> go.Figure:
    """One panel per metric: each method's mean over seeds with its 95% interval.

    `data["metric_table"]`: rows with `method`, `<metric>`, `<metric>_low`, `<metric>_high`."""
    rows = _data(data)["metric_table"]
    names = _metric_names(rows)
    cols = 2
    fig = make_subplots(rows=(len(names) + cols - 1) // cols, cols=cols, vertical_spacing=0.18, horizontal_spacing=0.1,
                        subplot_titles=[METRIC_TITLES.get(n, f"AMI with {n[4:]} labels (higher better)") for n in names])
    for i, name in enumerate(names):
        r, c = i // cols + 1, i % cols + 1
        means = [row[name] for row in rows]
        fig.add_trace(go.Bar(
            x=[row["method"] for row in rows], y=means, showlegend=False,
            marker_color=[METHOD_COLOURS.get(row["method"], PALETTE[5]) for row in rows],
            error_y=dict(type="data", symmetric=False,
                         array=[(row[f"{name}_high"] - row[name]) if row[name] is not None else 0 for row in rows],
                         arrayminus=[(row[name] - row[f"{name}_low"]) if row[name] is not None else 0 for row in rows]),
            hovertemplate="%{x}: %{y:.3f}<extra></extra>"), row=r, col=c)
    fig.update_layout(height=300 * ((len(names) + cols - 1) // cols), margin=dict(t=70))
    fig.update_annotations(font_size=12)
    n_seeds = _data(data).get("seeds")
    return styled(fig, "Fuzzy rules vs baselines on held-out samples" + (f" ({n_seeds} seeds, 95% intervals)"
                                                                          if n_seeds else " (95% intervals over seeds)"))


def firing_figure(data: Any) -> go.Figure:
    """Normalised firing wbar of each rule for one sample; the rules of its explanation chain in colour.

    `data`: `firing` [K], optional `chain` (rows with `rule`), `rule_labels` [K], `snippet`."""
    d = _data(data)
    firing = d["firing"]
    labels = d.get("rule_labels") or [f"rule {r + 1}" for r in range(len(firing))]
    chain = {link["rule"] for link in d.get("chain", [])}
    fig = go.Figure(go.Bar(
        x=labels, y=firing, marker_color=[PALETTE[0] if r in chain else "#bbbbbb" for r in range(len(firing))],
        customdata=d.get("memberships", [None] * len(firing)),
        hovertemplate="%{x}<br>normalised firing %{y:.3f}<br>membership %{customdata:.2e}<extra></extra>"))
    fig.update_layout(xaxis_title="rule", yaxis_title="normalised firing", yaxis_range=[0, 1.02])
    snippet = d.get("snippet")
    return styled(fig, "Rule firing" + (f" for {snippet[:70]}" if snippet else ""))


def overlap_figure(data: Any) -> go.Figure:
    """|T_k & T_l| / |T_k| for every pair of concepts of one method (row k, column l)."""
    d = _data(data)
    matrix = d["overlap_matrix"]
    labels = d.get("labels") or [f"{r + 1}" for r in range(len(matrix))]
    fig = go.Figure(go.Heatmap(z=matrix, x=labels, y=labels, colorscale=SEQUENTIAL, zmin=0, zmax=1,
                               colorbar=dict(title="overlap"),
                               hovertemplate="concept %{y} vs %{x}: %{z:.2f}<extra></extra>"))
    fig.update_layout(xaxis_title="concept l", yaxis_title="concept k", yaxis_autorange="reversed",
                      height=440)
    mean = d.get("mean")
    return styled(fig, f"Grounded-word overlap between concepts ({d.get('method', 'fuzzy')}"
                       + (f", mean {mean:.3f})" if mean is not None else ")"))


def tuning_figure(data: Any) -> go.Figure:
    """The development search: every candidate's reconstruction error against its active concepts; the
    chosen one ringed. `data`: an `evaluation.Choice.to_dict()` (grid rows with the two measurements)."""
    d = _data(data)
    grid = d["grid"]
    text = [", ".join(f"{k}={v}" for k, v in row["setting"].items()) for row in grid]
    fig = go.Figure(go.Scatter(
        x=[row["dev_active_concepts"] for row in grid], y=[row["dev_reconstruction_error"] for row in grid],
        mode="markers", text=text, marker=dict(size=9, color=PALETTE[0], opacity=0.7), name="candidates",
        hovertemplate="%{text}<br>active %{x:.2f}<br>FVU %{y:.3f}<extra></extra>"))
    chosen = grid[d["chosen_index"]]
    fig.add_trace(go.Scatter(x=[chosen["dev_active_concepts"]], y=[chosen["dev_reconstruction_error"]], mode="markers",
                             marker=dict(size=18, color="rgba(0,0,0,0)", line=dict(color=PALETTE[3], width=3)),
                             name="chosen", hoverinfo="skip"))
    fig.update_layout(xaxis_title="active concepts per development sample", yaxis_title="development FVU")
    return styled(fig, f"Development choice: {d.get('name', 'settings')}")


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "fuzzy_metrics": metrics_figure,
    "fuzzy_firing": firing_figure,
    "fuzzy_overlap": overlap_figure,
    "fuzzy_tuning": tuning_figure,
}


def metrics_rows(data: Any) -> list[dict[str, Any]]:
    """One row per (method, metric): the mean over seeds (estimate) and its 95% interval (low, high)."""
    d = _data(data)
    rows = d["metric_table"]
    return [{"method": row["method"], "metric": name, "estimate": row[name], "low": row.get(f"{name}_low"),
             "high": row.get(f"{name}_high"), "seeds": d.get("seeds")}
            for row in rows for name in (_metric_names(rows) if rows else [])]


def tuning_rows(data: Any) -> list[dict[str, Any]]:
    """One row per candidate setting of the development search: its settings, dev FVU, dev active concepts."""
    d = _data(data)
    return [{"candidate": i, **row["setting"], "dev_reconstruction_error": row["dev_reconstruction_error"],
             "dev_active_concepts": row["dev_active_concepts"], "steps_run": row.get("steps_run"),
             "chosen": i == d["chosen_index"]} for i, row in enumerate(d["grid"])]


def firing_rows(data: Any) -> list[dict[str, Any]]:
    """One row per rule: its normalised firing and membership for the sample, and its place in the chain (or none)."""
    d = _data(data)
    firing, memberships = d["firing"], d.get("memberships") or [None] * len(d["firing"])
    labels = d.get("rule_labels") or [f"rule {r + 1}" for r in range(len(firing))]
    chain = {link["rule"]: i + 1 for i, link in enumerate(d.get("chain", []))}
    return [{"rule": r + 1, "label": labels[r], "firing": firing[r], "membership": memberships[r],
             "chain_rank": chain.get(r), "snippet": d.get("snippet")} for r in range(len(firing))]


def overlap_rows(data: Any) -> list[dict[str, Any]]:
    """One row per (concept k, concept l) cell of the heatmap: |T_k & T_l| / |T_k| for one method."""
    d = _data(data)
    matrix = d["overlap_matrix"]
    return [{"method": d.get("method", "fuzzy"), "concept_k": k + 1, "concept_l": col + 1, "overlap": value}
            for k, row in enumerate(matrix) for col, value in enumerate(row)]


TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "fuzzy_metrics": metrics_rows,
    "fuzzy_firing": firing_rows,
    "fuzzy_overlap": overlap_rows,
    "fuzzy_tuning": tuning_rows,
}
