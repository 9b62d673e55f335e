"""What the MoE router page draws beside its own sections: the Expert-Sample widgets, a routed generation's
scores, heat map and divergence (with view sliders), an evaluation report, a report from a file, and on a model
without a router the toy MoE's stored result with a switch to it."""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from analyses.moe_router.evaluate import ExpertSetting
from analyses.moe_router.maps import RouterMap, divergence_data, heatmap_data, score_view
from analyses.moe_router.ship import DEFAULT_MODEL, NAME, default_setting, map_from_dict
from app.context import drawing_report, read_report, shows_errors
from app.export import show_figure
from app.switch import stored_elsewhere

GATES = ["displaced", "router", "uniform"]


def expert_setting_widgets(k: int, n_experts: int) -> ExpertSetting:
    """k_h, m, T_e and the tail gates, defaulting to the model's measured setting (`default_setting`)."""
    default = default_setting(k, n_experts)
    c1, c2, c3, c4 = st.columns(4)
    k_h = c1.number_input("Head k_h (kept)", 0, max(0, k - 1), default.k_h, key="moe_es_k_h")
    m = c2.number_input("Tail pool m", 1, max(1, n_experts - int(k_h)), min(n_experts - int(k_h), default.m),
                        key="moe_es_m")
    t_e = c3.number_input("Expert temperature T_e", 0.05, 10.0, default.t_e, 0.05, key="moe_es_t_e")
    gates = c4.selectbox("Tail gates", GATES, key="moe_es_gates",
                         help="displaced: the drawn experts take the gates of the experts they replace; router: "
                              "renormalised as the family does (small for tail experts, so swapping them changes "
                              "little); uniform: equal shares")
    return ExpertSetting(int(k_h), int(m), float(t_e), gates)


def prompt_text(prompt: Any) -> str:
    """A prompt (text or chat messages) on one line."""
    if isinstance(prompt, list):
        return " / ".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)


def stored_evaluation(stored: Any) -> dict[str, Any]:
    """The shipped evaluation report, its provenance naming the command that rebuilds it (the report's own
    record, written by `evaluate_expert_sample`, names none)."""
    report = stored.json("evaluation.json")
    record = report.get("provenance") or {}
    return report if record.get("command") else {**report, "provenance": {**record, "command": stored.command}}


def draw_evaluation(report: dict[str, Any]) -> None:
    """pass@n curves, the development choice of Expert-Sample's setting and its grid, the report's notes."""
    show_figure(None, report, "moe_pass_at", provenance=report.get("provenance"))
    choice = report["choices"]["expert_sample"]
    st.caption(f"Expert-Sample setting chosen on {report['n_dev']} development problems by {choice['objective']}: "
               f"{choice['chosen']}")
    st.dataframe([{"setting": json.dumps(row["setting"]), **{k: v for k, v in row.items() if k not in ("setting", "score")}}
                  for row in choice["grid"]], hide_index=True, key="moe_eval_grid_table")
    for line in report.get("notes", []):
        st.caption(line)


def active_section() -> None:
    path = st.text_input("Greedy accuracy vs active experts: a JSON from `thoughtscope eval active-experts --json`",
                         key="moe_active_path").strip()
    if not path:
        return
    with shows_errors(), drawing_report(path, "an active-experts report"):
        report = read_report(path, "an active-experts report", {"rows": list},
                             "thoughtscope eval active-experts --json > active.json")
        show_figure(None, report, "moe_active_experts", provenance=report.get("provenance"))


def elsewhere_section(ctx) -> None:
    """On a model without a router: the toy MoE's shipped result, labelled as the toy's, and a switch to it."""
    stored = stored_elsewhere(NAME, DEFAULT_MODEL, ctx.model_id, key="moe_switch")
    if stored is None:
        return
    st.subheader(f"Router profile of `{DEFAULT_MODEL}`")
    show_figure(None, stored.json("profile.json"), "moe_profile", provenance=stored.provenance)
    d = stored.json("map.json")
    rmap = map_from_dict(d)
    st.subheader(f"A generation of `{DEFAULT_MODEL}`, routed under Expert-Sample")
    st.caption(f"prompt: {prompt_text(d['prompt'])} \u00b7 {d.get('rule')}")
    view = score_view(rmap, 0, 0, 0, int(d["setting"]["k_h"]), int(d["setting"]["m"]), 0.5)
    show_figure(None, view, "moe_scores", provenance=stored.provenance)
    show_figure(None, heatmap_data(rmap, 0), "moe_heatmap", provenance=stored.provenance)
    show_figure(None, divergence_data(rmap), "moe_divergence", provenance=stored.provenance)
    st.subheader(f"pass@n of `{DEFAULT_MODEL}`")
    draw_evaluation(stored_evaluation(stored))


def scores_section(ctx, rmap: RouterMap, meta: dict[str, Any]) -> None:
    st.subheader("2. Sorted router scores: certain head, uncertain tail")
    c1, c2, c3 = st.columns(3)
    sample = int(c1.number_input("Sample", 0, rmap.n_samples - 1, 0, key="moe_view_sample"))
    n_tokens = len(rmap.tokens[sample])
    if n_tokens == 0:
        st.info("This sample generated no token.")
        return
    step = c2.slider("Token", 0, max(0, n_tokens - 1), 0, key="moe_view_step") if n_tokens > 1 else 0
    layer = c3.selectbox("Layer", rmap.layers, key="moe_view_layer")
    c1, c2, c3 = st.columns(3)
    setting = meta.get("setting")
    k_h = c1.slider("Head k_h", 0, rmap.k, setting.k_h if setting else max(1, rmap.k // 2), key="moe_view_k_h")
    m = c2.slider("Tail pool m", 1, max(1, rmap.n_experts - k_h), min(rmap.n_experts - k_h, setting.m if setting
                                                                       else 2 * rmap.k), key="moe_view_m")
    p = c3.slider("Cumulative rule: mass p", 0.05, 1.0, 0.5, 0.05, key="moe_view_p")
    with shows_errors() as spot:
        view = score_view(rmap, sample, int(step), rmap.layers.index(layer), int(k_h), int(m), float(p))
    if spot.failed:
        return
    show_figure(None, view, "moe_scores", provenance=_provenance(ctx, meta, {"k_h": k_h, "m": m, "p": p}))
    show_figure(None, heatmap_data(rmap, sample), "moe_heatmap", provenance=_provenance(ctx, meta, {"sample": sample}))
    if rmap.n_samples > 1:
        show_figure(None, divergence_data(rmap), "moe_divergence", provenance=_provenance(ctx, meta, {}))
    with st.expander("Texts of the samples"):
        for b, text in enumerate(rmap.texts()):
            st.text(f"{b}: {text}")


def _provenance(ctx, meta: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    if meta.get("provenance"):  # a shipped map: the record of the run that made it
        return {**meta["provenance"], "view": settings}
    rule = meta.get("rule")
    return ctx.provenance(interventions=[rule] if rule is not None else [], settings=settings)
