"""Figures of the RISE page (and of `thoughtscope export`): step timeline, decoder-column map,
silhouette per layer, feature dashboard, steering table and bars, SAE quality and latent AUROC.
Builders take the result dataclasses of `analyses.rise` or plain dicts (what the JSON export holds),
compute nothing, and return `styled` figures; titles name the split a figure's numbers come from.
`FIGURES` and `TABLES` register the dict-based builders for `thoughtscope export`.
"""

from __future__ import annotations

from collections.abc import Callable
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


AXIS_NAMES = {"umap": ("UMAP 1 (cosine)", "UMAP 2 (cosine)"), "pca": ("PC 1", "PC 2")}


def decoder_map(layer: Any, title: str | None = None, projection: str | None = None) -> go.Figure:
    """Decoder columns on the 2-D map (UMAP or PCA) of a `LayerAnalysis` or its dict (`site`, `coords`,
    `column_labels`, `silhouette`, `projection`), coloured by the label they were voted for."""
    if isinstance(layer, dict):
        site, coords, labels, silhouette = layer["site"], layer["coords"], layer["column_labels"], layer["silhouette"]
        projection = projection or layer.get("projection")
    else:
        site, coords, labels, silhouette = layer.site, layer.coords, layer.association.column_labels, layer.silhouette
    fig = go.Figure()
    for label in ("other", "backtracking", "reflection", None):
        idx = [i for i, lab in enumerate(labels) if lab == label]
        if not idx:
            continue
        fig.add_trace(go.Scattergl(
            x=[coords[i][0] for i in idx], y=[coords[i][1] for i in idx], mode="markers", name=label or "no votes",
            marker=dict(color=LABEL_COLOURS[label], size=5 if label is None else 9, opacity=0.5 if label is None else 0.9),
            text=[f"column {i}" for i in idx], hoverinfo="text",
        ))
    sil = "n/a" if silhouette is None else f"{silhouette:.3f}"
    x_name, y_name = AXIS_NAMES.get(projection or "", ("projection 1", "projection 2"))
    fig.update_layout(xaxis_title=x_name, yaxis_title=y_name)
    return styled(fig, title or f"Decoder columns at {site} (silhouette {sil}; labels from the training traces)")


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
    """Reflection, backtracking and all steps per trace against alpha, with 95% bootstrap intervals over
    problems when there is more than one; says so when no trace holds either behaviour."""
    d = result.to_dict() if hasattr(result, "to_dict") else result
    rows = d["rows"]
    x = [f"{r['alpha']:g}" for r in rows]
    fig = go.Figure()
    series = (("reflection", "mean_reflection_steps", "reflection", LABEL_COLOURS["reflection"]),
              ("backtracking", "mean_backtracking_steps", "backtracking", LABEL_COLOURS["backtracking"]),
              ("steps", "mean_steps", "all steps", LABEL_COLOURS["other"]))
    for key, mean_key, name, colour in series:
        ys = [r[mean_key] for r in rows]
        ivs = [(r.get("intervals") or {}).get(key) for r in rows]
        error = None
        if all(ivs) and all(r["n"] > 1 for r in rows):
            error = dict(type="data", symmetric=False, array=[iv["high"] - iv["estimate"] for iv in ivs],
                         arrayminus=[iv["estimate"] - iv["low"] for iv in ivs])
        fig.add_trace(go.Bar(x=x, y=ys, name=name, marker_color=colour, error_y=error,
                             text=[f"{y:.2g}" for y in ys], textposition="outside"))
    if all(r["mean_reflection_steps"] == 0 and r["mean_backtracking_steps"] == 0 for r in rows):
        fig.add_annotation(text="no reflection or backtracking step in any trace: this model does not show the "
                                "behaviour here, so there is nothing for the vector to move",
                           xref="paper", yref="paper", x=0.5, y=1.0, showarrow=False, yanchor="bottom",
                           font=dict(size=11, color="#666666"))
    mode = d.get("mode", "projection")
    xlabel = ("alpha (1 removes the component, -1 doubles it)" if mode == "projection" else "alpha (added)")
    fig.update_layout(barmode="group", xaxis_title=xlabel, yaxis_title="steps per trace")
    n = rows[0]["n"] if rows else 0
    split = f"{d['split']} split, " if d.get("split") else ""
    return styled(fig, f"Behaviour counts while steering {d['behaviour']} ({split}n={n} per alpha)")


def quality_figure(layers: Any) -> go.Figure:
    """Explained variance of each layer's SAE on its training steps and on held-out steps (SAELens' formula)."""
    rows = layers if isinstance(layers, list) else layers["layers"]
    sites = [r["site"] for r in rows]
    fig = go.Figure()
    for split, colour in (("train", PALETTE[5]), ("heldout", PALETTE[0])):
        ev = [(r.get("quality") or {}).get(split, {}).get("explained_variance") for r in rows]
        fig.add_trace(go.Bar(x=sites, y=ev, name="training steps" if split == "train" else "held-out steps",
                             marker_color=colour))
    fig.add_hline(y=0.5, line=dict(color=PALETTE[3], dash="dot"), annotation_text="poor below 0.5")
    fig.update_layout(barmode="group", yaxis=dict(title="explained variance", range=[min(0.0, *[
        (r.get("quality") or {}).get("heldout", {}).get("explained_variance") or 0 for r in rows]), 1.0]))
    return styled(fig, "SAE explained variance: training vs held-out steps")


def auroc_figure(layers: Any, key: str = "auroc") -> go.Figure:
    """Held-out AUROC of the best latent per label (chosen on training steps), per layer."""
    rows = layers if isinstance(layers, list) else layers["layers"]
    labels = sorted({label for r in rows for label in (r.get(key) or {})})
    fig = go.Figure()
    for i, label in enumerate(labels):
        fig.add_trace(go.Bar(x=[r["site"] for r in rows], y=[((r.get(key) or {}).get(label) or {}).get("heldout_auroc")
                                                              for r in rows],
                             name=label, marker_color=LABEL_COLOURS.get(label, PALETTE[(i + 4) % len(PALETTE)])))
    fig.add_hline(y=0.5, line=dict(color="#999999", dash="dot"), annotation_text="chance")
    fig.update_layout(barmode="group", yaxis=dict(title="AUROC on held-out steps", range=[0, 1.05]))
    return styled(fig, "Best latent per label: AUROC on held-out steps (chosen on training steps)")


def confidence_curve(result: Any) -> go.Figure:
    """Mean next-token entropy over the optimisation of the confidence coefficients."""
    fig = go.Figure(go.Scatter(y=result.entropy_history, mode="lines", line=dict(color=PALETTE[0])))
    fig.update_layout(xaxis_title="iteration", yaxis_title="mean entropy (nats)")
    return styled(fig, f"Confidence coefficients at {result.site}")


def steering_rows(data: Any) -> list[dict[str, Any]]:
    d = data.to_dict() if hasattr(data, "to_dict") else data
    out = []
    for r in d["rows"]:
        row = {"behaviour_vector": d["behaviour"], "site": d["site"], "mode": d["mode"], "split": d.get("split", ""),
               "alpha": r["alpha"], "n": r["n"], "reflection_per_trace": r["mean_reflection_steps"],
               "backtracking_per_trace": r["mean_backtracking_steps"], "steps_per_trace": r["mean_steps"],
               "tokens_per_trace": r["mean_tokens"], "accuracy": r["accuracy"]}
        for key, iv in (r.get("intervals") or {}).items():
            row[f"{key}_low"], row[f"{key}_high"] = iv["low"], iv["high"]
        out.append(row)
    return out


def quality_rows(data: Any) -> list[dict[str, Any]]:
    rows = data if isinstance(data, list) else data["layers"]
    return [{"site": r["site"], "split": split, **{k: v for k, v in (r.get("quality") or {}).get(split, {}).items()}}
            for r in rows for split in ("train", "heldout")]


def auroc_rows(data: Any) -> list[dict[str, Any]]:
    rows = data if isinstance(data, list) else data["layers"]
    return [{"site": r["site"], "label": label, **v} for r in rows for label, v in (r.get("auroc") or {}).items()]


def timeline_rows(data: Any) -> list[dict[str, Any]]:
    """One row per step of the trace: its span, label and closing token, and its top latents as top1, top2, ..."""
    trace, top = data["trace"], data.get("top_latents") or []
    k = max((len(t) for t in top), default=0)
    return [{"problem_id": trace["problem_id"], "correct": trace["correct"], "site": data.get("site"),
             "step": s["index"], "label": s["label"], "start": s["start"], "end": s["end"], "token": s["token"],
             "closed": s["closed"], "text": s["text"],
             **{f"top{j + 1}": (top[i][j] if i < len(top) and j < len(top[i]) else None) for j in range(k)}}
            for i, s in enumerate(trace["steps"])]


def decoder_map_rows(data: Any) -> list[dict[str, Any]]:
    """One row per decoder column: its position on the 2-D map and the label it was voted for."""
    return [{"site": data["site"], "projection": data.get("projection"), "column": i, "x": xy[0], "y": xy[1],
             "label": label, "silhouette": data["silhouette"]}
            for i, (xy, label) in enumerate(zip(data["coords"], data["column_labels"]))]


def silhouette_rows(data: Any) -> list[dict[str, Any]]:
    """One row per site (`{site: silhouette}`), in layer order: the cosine silhouette of its decoder columns."""
    return sorted(({"site": site, "layer": int(site.rsplit(".", 1)[1]), "silhouette": value}
                   for site, value in data.items() if site != "provenance"), key=lambda r: r["layer"])


def histogram_rows(data: Any) -> list[dict[str, Any]]:
    """One row per bin of the latent's activation histogram (the figure; top steps, tokens, labels stay in the JSON)."""
    edges = data["histogram_edges"]
    return [{"site": data["site"], "latent": data["latent"], "bin_low": edges[i], "bin_high": edges[i + 1],
             "count": count} for i, count in enumerate(data["histogram_counts"])]


def label_rows(data: Any) -> list[dict[str, Any]]:
    """One row per behaviour label (`{label: steps}`): the steps where the latent fires that carry it."""
    return [{"label": label, "steps": n} for label, n in data.items() if label != "provenance"]


def token_rows(data: Any) -> list[dict[str, Any]]:
    """One row per token, promoted then suppressed, with its rank and the logit effect of the decoder direction."""
    return [{"direction": direction, "rank": rank + 1, "token": token, "logit_effect": value}
            for direction in ("promoted", "suppressed") for rank, (token, value) in enumerate(data.get(direction, []))]


def confidence_rows(data: Any) -> list[dict[str, Any]]:
    """One row per optimisation iteration: the mean next-token entropy (nats)."""
    return [{"site": data["site"], "iteration": i, "entropy": h} for i, h in enumerate(data["entropy_history"])]


FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "rise_decoder_map": decoder_map,
    "rise_steering": steering_bars,
    "rise_quality": quality_figure,
    "rise_auroc": auroc_figure,
}

TABLES: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "rise_steering": steering_rows,
    "rise_quality": quality_rows,
    "rise_auroc": auroc_rows,
    "rise_timeline": timeline_rows,
    "rise_decoder_map": decoder_map_rows,
    "rise_silhouette": silhouette_rows,
    "rise_feature_histogram": histogram_rows,
    "rise_feature_labels": label_rows,
    "rise_feature_tokens": token_rows,
    "rise_confidence": confidence_rows,
}


def _wrap(text: str, width: int = 80) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) > width:
            lines.append(line)
            line = ""
        line += (" " if line else "") + w
    lines.append(line)
    return "<br>".join(lines)
