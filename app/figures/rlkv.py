"""Figure builders of the RLKV page (Du et al. 2025, which KV heads matter for reasoning).

Each builder takes a plain dict (what the JSON export holds) and returns `styled(fig)`:

- `head_map_figure`: layer x KV-head heat map of the gates (learned) or of the attention-statistics
  score, with the heads a sparsity makes local crossed out;
- `memory_figure`: KV bytes against sequence length for the full cache and the binarised map;
- `accuracy_figure`: accuracy against sparsity for RLKV and every baseline, 95% intervals, the full
  cache as a band;
- `training_figure`: mean reward, mean gate and sparsity per GRPO step;
- `generation_figure`: KV bytes per generated token under compression and with the full cache, the
  generation's error-mode tag in the title.

`FIGURES` maps names to builders for `thoughtscope export`, `TABLES` to tidy tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.template import CELL_SCALE, PALETTE, export_size, styled

METHOD_COLOURS = {"rlkv": PALETTE[0], "attention": PALETTE[2], "random": PALETTE[7], "streaming": PALETTE[1],
                  "snapkv": PALETTE[4], "knorm": PALETTE[5], "rlkv-inverse": PALETTE[3], "full cache": "#777777"}
METHOD_NAMES = {"rlkv": "RLKV (learned gates)", "attention": "attention statistics", "random": "random heads",
                "streaming": "StreamingLLM (uniform window)", "snapkv": "SnapKV", "knorm": "Knorm",
                "rlkv-inverse": "RLKV inverted (highest gates local; control)",
                "full cache": "full cache"}


def _data(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def head_map_figure(data: Any) -> go.Figure:
    """data: scores [layers][kv_heads], kind ('learned' | 'attention'), optional full_heads (bool, same shape)
    and sparsity: local heads get an x."""
    d = _data(data)
    scores = np.asarray(d["scores"], dtype=float)
    layers, heads = scores.shape
    label = "gate α" if d.get("kind", "learned") == "learned" else "attention mass outside the window"
    fig = go.Figure(go.Heatmap(z=scores.T, x=list(range(layers)), y=[f"KV {h}" for h in range(heads)],
                               colorscale=CELL_SCALE, colorbar=dict(title=label),
                               hovertemplate="layer %{x}, %{y}<br>" + label + " %{z:.3f}<extra></extra>"))
    full = d.get("full_heads")
    if full is not None:
        full = np.asarray(full, dtype=bool)
        ls, hs = np.nonzero(~full)
        fig.add_trace(go.Scatter(x=ls.tolist(), y=[f"KV {h}" for h in hs], mode="markers", name="local (sink + recent)",
                                 marker=dict(symbol="x-thin", size=9, line=dict(width=2, color=PALETTE[3]))))
    fig.update_layout(xaxis_title="layer", yaxis_title="KV head", legend=dict(orientation="h", y=-0.35))
    title = "Learned head gates" if d.get("kind", "learned") == "learned" else "Head score from attention statistics"
    if d.get("sparsity") is not None:
        title += f" (sparsity {d['sparsity']:g}: x = local)"
    return export_size(styled(fig, title), height=max(280, 120 + 40 * heads))


def _memory_curve(d: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens in the cache, full-cache bytes, bytes kept with the map) at 64 lengths up to max_length: full
    heads keep every token, local heads sink + recent."""
    full = np.asarray(d["full_heads"], dtype=bool)
    window = int(d["sink"]) + int(d["recent"])
    lengths = np.unique(np.linspace(1, int(d.get("max_length", 2048)), 64).astype(int))
    per = float(d.get("bytes_per_entry", 1))
    full_bytes = full.size * lengths * per
    kept = (full.sum() * lengths + (~full).sum() * np.minimum(lengths, window)) * per
    return lengths, full_bytes, kept


def memory_figure(data: Any) -> go.Figure:
    """data: full_heads (bool [layers][kv_heads]), sink, recent, bytes_per_entry, max_length."""
    d = _data(data)
    full = np.asarray(d["full_heads"], dtype=bool)
    lengths, full_bytes, kept = _memory_curve(d)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=lengths, y=full_bytes / 2**20, name="full cache", line=dict(color="#777777", width=2)))
    fig.add_trace(go.Scatter(x=lengths, y=kept / 2**20, name=f"{int(full.sum())}/{full.size} heads full",
                             line=dict(color=PALETTE[0], width=3)))
    fig.update_layout(xaxis_title="tokens in the cache", yaxis_title="KV cache (MiB per sequence)",
                      hovermode="x unified")
    return styled(fig, f"KV memory: {kept[-1] / full_bytes[-1]:.0%} of the full cache at {lengths[-1]} tokens")


def accuracy_figure(data: Any) -> go.Figure:
    """data: an `eval rlkv` report dict (its `curves`)."""
    d = _data(data)
    curves = d["curves"]
    fig = go.Figure()
    full = curves.get("full cache", [None])[0]
    xs = sorted({p["sparsity"] for name, pts in curves.items() if name != "full cache" for p in pts})
    if full is not None and xs:
        fig.add_hrect(y0=full["low"], y1=full["high"], fillcolor="#999999", opacity=0.15, line_width=0)
        fig.add_hline(y=full["accuracy"], line=dict(color="#777777", dash="dash"),
                      annotation_text=f"full cache {full['accuracy']:.0%}", annotation_position="top right")
    for i, (name, pts) in enumerate((k, v) for k, v in curves.items() if k != "full cache"):
        pts = sorted(pts, key=lambda p: p["sparsity"])
        offset = (i - 2.5) * 0.006  # dodge the error bars
        fig.add_trace(go.Scatter(
            x=[p["sparsity"] + offset for p in pts], y=[p["accuracy"] for p in pts], mode="lines+markers",
            name=METHOD_NAMES.get(name, name) + (f" (mean of {pts[0]['runs']})" if pts[0].get("runs", 1) > 1 else ""),
            line=dict(color=METHOD_COLOURS.get(name, PALETTE[6]), width=3 if name == "rlkv" else 1.5),
            error_y=dict(type="data", symmetric=False, array=[p["high"] - p["accuracy"] for p in pts],
                         arrayminus=[p["accuracy"] - p["low"] for p in pts], thickness=1),
            customdata=[[p["kv_fraction"]] for p in pts],
            hovertemplate="sparsity %{x:.2f}<br>accuracy %{y:.1%}<br>KV %{customdata[0]:.2f} of full<extra></extra>"))
    n = d.get("settings", {}).get("n")
    fig.update_layout(xaxis_title="sparsity (fraction of KV heads made local)", yaxis_title="accuracy",
                      yaxis_tickformat=".0%", legend=dict(orientation="h", y=-0.3))
    title = "Accuracy vs sparsity, 95% intervals" + (f" (evaluation split, n = {n})" if n else "")
    return export_size(styled(fig, title), height=480)


def training_figure(data: Any) -> go.Figure:
    """data: log (rows with step, reward, mean_alpha, sparsity)."""
    d = _data(data)
    log = d.get("log", [])
    steps = [r["step"] for r in log]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean reward", "gates"))
    fig.add_trace(go.Scatter(x=steps, y=[r["reward"] for r in log], mode="lines+markers", name="mean reward",
                             line=dict(color=PALETTE[2])), row=1, col=1)
    fig.add_trace(go.Scatter(x=steps, y=[r["mean_alpha"] for r in log], mode="lines+markers", name="mean gate α",
                             line=dict(color=PALETTE[0])), row=1, col=2)
    fig.add_trace(go.Scatter(x=steps, y=[r.get("min_alpha") for r in log], mode="lines", name="min gate α",
                             line=dict(color=PALETTE[0], dash="dot")), row=1, col=2)
    fig.add_trace(go.Scatter(x=steps, y=[r["sparsity"] for r in log], mode="lines+markers", name="share of gates < 0.5",
                             line=dict(color=PALETTE[3])), row=1, col=2)
    fig.update_xaxes(title_text="GRPO step")
    fig.update_yaxes(range=[0, 1.02])
    return export_size(styled(fig, "Gate training"), width=900)


def generation_figure(data: Any) -> go.Figure:
    """data: kv_bytes (per generated token, compressed), full_kv_bytes (same, full cache), mode, policy."""
    d = _data(data)
    fig = go.Figure()
    for key, name, colour in (("full_kv_bytes", "full cache", "#777777"), ("kv_bytes", "compressed", PALETTE[0])):
        values = d.get(key) or []
        fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=[v / 1024 for v in values], name=name,
                                 mode="lines", line=dict(color=colour, width=2)))
    fig.update_layout(xaxis_title="generated token", yaxis_title="KV cache (KiB)", hovermode="x unified")
    return styled(fig, f"Generation under compression: {d.get('mode', '?')}")


def accuracy_table(data: Any) -> list[dict[str, Any]]:
    d = _data(data)
    out = []
    for row in d["rows"]:
        acc, vs = row["accuracy"], row.get("vs_full") or {}
        out.append({"method": row["method"], "sparsity": row["sparsity"], "seed": row["setting"].get("seed"),
                    "accuracy": acc["estimate"], "low": acc["low"], "high": acc["high"],
                    "mcnemar_p": vs.get("p_value"), "kv_fraction": row["kv_fraction"],
                    "tokens_per_s_ratio": row["tps_ratio"], **row["error_modes"]})
    return out


def training_table(data: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "problems"} for r in _data(data).get("log", [])]


def head_map_table(data: Any) -> list[dict[str, Any]]:
    """One row per (layer, KV head): its score (gate, or attention mass outside the window) and, with a
    sparsity, whether the map keeps it full."""
    d = _data(data)
    full = d.get("full_heads")
    tiebreak = d.get("tiebreak")
    return [{"layer": layer, "kv_head": head, "score": score, "kind": d.get("kind", "learned"),
             **({"tiebreak": tiebreak[layer][head]} if tiebreak is not None else {}),
             **({"full": bool(full[layer][head]), "sparsity": d.get("sparsity")} if full is not None else {})}
            for layer, row in enumerate(d["scores"]) for head, score in enumerate(row)]


def memory_table(data: Any) -> list[dict[str, Any]]:
    """One row per cache length the figure plots: the full cache's and the compressed cache's bytes per
    sequence."""
    lengths, full_bytes, kept = _memory_curve(_data(data))
    return [{"tokens": int(n), "full_bytes": float(f), "kept_bytes": float(k), "kept_fraction": float(k / f)}
            for n, f, k in zip(lengths, full_bytes, kept)]


def generation_table(data: Any) -> list[dict[str, Any]]:
    """One row per generated token: KV bytes of the compressed and of the full cache."""
    d = _data(data)
    kv, full = d.get("kv_bytes") or [], d.get("full_kv_bytes") or []
    return [{"token": t + 1, "kv_bytes": kv[t] if t < len(kv) else None,
             "full_kv_bytes": full[t] if t < len(full) else None, "mode": d.get("mode")}
            for t in range(max(len(kv), len(full)))]


FIGURES = {"rlkv_head_map": head_map_figure, "rlkv_memory": memory_figure, "rlkv_accuracy": accuracy_figure,
           "rlkv_training": training_figure, "rlkv_generation": generation_figure}
TABLES = {"rlkv_accuracy": accuracy_table, "rlkv_training": training_table, "rlkv_head_map": head_map_table,
          "rlkv_memory": memory_table, "rlkv_generation": generation_table}


def page_tables(data: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The page's two tables of an evaluation: accuracy, test and costs per run; error modes per run. Two
    tables, each narrower than the page: in one table of 13 columns the last ones (the error modes) lay past
    the box's right edge, so the page ended in a box of empty-looking cells (issue 20)."""
    rows = _data(data)["rows"]
    run_of = [{"method": r["method"], "sparsity": r["sparsity"], "seed": r["setting"].get("seed")} for r in rows]
    accuracy = [{**run, "accuracy": r["accuracy"]["estimate"], "95% low": r["accuracy"]["low"],
                 "95% high": r["accuracy"]["high"], "McNemar p": (r.get("vs_full") or {}).get("p_value"),
                 "KV / full": r["kv_fraction"], "tokens/s / full": r["tps_ratio"]} for run, r in zip(run_of, rows)]
    return accuracy, [{**run, **r["error_modes"]} for run, r in zip(run_of, rows)]
