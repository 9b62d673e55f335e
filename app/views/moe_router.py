"""MoE router tails and Expert-Sample (Chen et al., arXiv 2602.02443, reconstructed; METHODS.md section 6).

A generation of N samples of the sidebar's prompt, under the model's own routing or under Expert-Sample
(keep the top k_h experts, sample the rest of the k from the next m at temperature T_e), with every MoE
layer's routing captured: one token's sorted router scores with the head/tail split (the k_h slider moves
it), the experts each token used (layer x token), and where the N samples' routing and tokens part. Then
pass@n curves with intervals, from an `eval expert-sample` JSON or a small run here, and greedy accuracy
as the active experts shrink. The computations live in `analyses.moe_router`; this page reads widgets,
calls them and draws.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st

from analyses.moe_router.evaluate import ExpertSetting, evaluate_expert_sample
from analyses.moe_router.maps import RouterMap, divergence_data, generation_map, heatmap_data, score_view
from app.context import FinishedGenerations, shows_errors
from app.export import show_figure
from app.registry import PageSpec
from thoughtscope.errors import BadInputError

# "router" is checked in `render`, after the title: on a dense model the page still opens and says why it is empty
PAGE = PageSpec("MoE router & Expert-Sample", ":material/alt_route:", 65, requires=("generate",))

OWN = "the model's own top-k"
EXPERT_SAMPLE = "Expert-Sample"


@st.cache_resource
def results() -> FinishedGenerations:
    """Router maps and evaluations of this process, newest 32 kept."""
    return FinishedGenerations(max_entries=32)


def generation_section(ctx, store) -> tuple[RouterMap, dict[str, Any]] | None:
    st.subheader("1. A generation, routed")
    arch = ctx.backend.info()["arch"]
    k, n_experts = int(arch["experts_top_k"]), int(arch["n_experts"])
    c1, c2 = st.columns(2)
    routing = c1.radio("Routing", [OWN, EXPERT_SAMPLE], horizontal=True, key="moe_routing")
    n_samples = c2.slider("Samples (N)", 1, 16, 4, key="moe_samples")
    setting = None
    if routing == EXPERT_SAMPLE:
        c1, c2, c3, c4 = st.columns(4)
        k_h = c1.number_input("Head k_h (kept)", 0, max(0, k - 1), max(0, k // 2), key="moe_es_k_h")
        m = c2.number_input("Tail pool m", 1, max(1, n_experts - int(k_h)), min(n_experts - int(k_h), 2 * k),
                            key="moe_es_m")
        t_e = c3.number_input("Expert temperature T_e", 0.05, 10.0, 1.0, 0.05, key="moe_es_t_e")
        gates = c4.selectbox("Tail gates", ["router", "displaced", "uniform"], key="moe_es_gates",
                             help="router: renormalised as the family does; displaced: the gates of the experts "
                                  "they replace; uniform: equal shares")
        setting = ExpertSetting(int(k_h), int(m), float(t_e), gates)
    run = st.button("Generate", type="primary", key="moe_generate", icon=":material/play_arrow:")
    key = ctx.cache_key(kind="moe-map", n=n_samples, setting=setting.to_dict() if setting else None)
    found = store.get(key)
    if run:
        with shows_errors() as spot, st.spinner(f"Generating {n_samples} samples with the routing captured\u2026"):
            rule = setting.check(k).rule(ctx.seed) if setting else None
            rmap = generation_map(ctx.backend, ctx.model_input(), n_samples=n_samples, rule=rule,
                                  max_new_tokens=ctx.settings.max_new_tokens, sampling=ctx.settings.sampling(),
                                  seed=ctx.seed, chat=ctx.chat)
            found = (rmap, {"rule": rule, "setting": setting})
            store.put(key, found)
        if spot.failed:
            return None
    if found is None:
        st.info("Press **Generate** to route the sidebar's prompt and capture every MoE layer's experts.")
    return found


def scores_section(ctx, rmap: RouterMap, meta: dict[str, Any]) -> None:
    st.subheader("2. Sorted router scores: certain head, uncertain tail")
    c1, c2, c3 = st.columns(3)
    sample = c1.number_input("Sample", 0, rmap.n_samples - 1, 0, key="moe_view_sample")
    n_tokens = len(rmap.tokens[int(sample)])
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
        view = score_view(rmap, int(sample), int(step), rmap.layers.index(layer), int(k_h), int(m), float(p))
    if spot.failed:
        return
    show_figure(None, view, "moe_scores", provenance=_provenance(ctx, meta, {"k_h": k_h, "m": m, "p": p}))
    heat = heatmap_data(rmap, int(sample))
    show_figure(None, heat, "moe_heatmap", provenance=_provenance(ctx, meta, {"sample": int(sample)}))
    if rmap.n_samples > 1:
        show_figure(None, divergence_data(rmap), "moe_divergence", provenance=_provenance(ctx, meta, {}))
    with st.expander("Texts of the samples"):
        for b, text in enumerate(rmap.texts()):
            st.text(f"{b}: {text}")


def _provenance(ctx, meta: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    rule = meta.get("rule")
    return ctx.provenance(interventions=[rule] if rule is not None else [], settings=settings)


def evaluation_section(ctx, store) -> None:
    st.subheader("3. pass@n: Expert-Sample against temperature sampling")
    path = st.text_input("An evaluation JSON (`thoughtscope eval expert-sample --json > es.json`)",
                         key="moe_eval_path").strip()
    report = None
    if path:
        with shows_errors():
            report = _read_json(path)
    c1, c2, c3, c4 = st.columns(4)
    n = c1.number_input("Or run one here: evaluation problems", 1, 200, 4, key="moe_eval_n")
    n_samples = c2.number_input("Samples per problem", 1, 16, 4, key="moe_eval_samples")
    grid_text = c3.text_input("Grid k_h:m:T_e (comma-separated; empty: the default grid)", "", key="moe_eval_grid")
    c4.write("")
    run = c4.button("Run evaluation", key="moe_eval_run", icon=":material/play_arrow:")
    key = ctx.result_key("moe-eval", n=int(n), samples=int(n_samples), grid=grid_text, seed=ctx.seed,
                         tokens=ctx.settings.max_new_tokens)
    if run:
        with shows_errors(), st.status(f"Evaluating on {n} problems\u2026", expanded=True) as status:
            grid = [ExpertSetting.parse(s) for s in grid_text.replace(" ", "").split(",") if s] or None
            bar = st.progress(0.0)
            found = evaluate_expert_sample(ctx.backend, "auto", int(n), n_dev=max(2, int(n) // 2),
                                           n_samples=int(n_samples), grid=grid, max_new_tokens=ctx.settings.max_new_tokens,
                                           seed=ctx.seed, n_resamples=500,
                                           progress=lambda stage, done, total: bar.progress(done / total, text=stage))
            store.put(key, found.to_dict())
            status.update(label="Evaluated", state="complete", expanded=False)
    report = report or store.get(key)
    if report is None:
        return
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
    with shows_errors():
        report = _read_json(path)
        show_figure(None, report, "moe_active_experts", provenance=report.get("provenance"))


def _read_json(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BadInputError(f"cannot read {path}: {err}") from err


def render(ctx) -> None:
    st.title("MoE router & Expert-Sample")
    st.caption("Chen et al. 2026 (abstract only; our reconstruction): a fine-grained MoE router is certain about a "
               "few head experts and uncertain about its tail. Expert-Sample keeps the head and samples the rest "
               "of the k experts from the tail, for diverse answers with greedy tokens.")
    if not ctx.backend.capabilities().get("router"):
        st.info(f"`{ctx.model_id}` has no MoE router (a dense model, or a backend without router rules). Pick an "
                "MoE model in the sidebar: toy-moe, tiny-random:qwen3_moe, or an hf: Qwen3-MoE / OLMoE / Mixtral.")
        return
    store = results()
    found = generation_section(ctx, store)
    if found is not None:
        scores_section(ctx, *found)
    evaluation_section(ctx, store)
    active_section()
