"""MoE router tails and Expert-Sample (Chen et al., arXiv 2602.02443, reconstructed; METHODS.md section 6).

A generation of N samples of the sidebar's prompt, under the model's own routing or under Expert-Sample
(keep the top k_h experts, sample the rest of the k from the next m at temperature T_e), with every MoE
layer's routing captured: one token's sorted router scores with the head/tail split (the k_h slider moves
it), the experts each token used (layer x token), and where the N samples' routing and tokens part. Then
pass@n curves with intervals, from an `eval expert-sample` JSON or a small run here, and greedy accuracy
as the active experts shrink. The computations live in `analyses.moe_router`; this page reads widgets,
calls them and draws.

It opens on the shipped result of the toy MoE (`thoughtscope ship moe-router`: a router profile, the
default generation's map and a small evaluation), labelled as stored; on a model without a router it
shows that toy's result, labelled as the toy's, with a button that switches to it. The profile, the
generation and the evaluation run as jobs (`app.jobs`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st

from analyses.moe_router.evaluate import ExpertSetting, evaluate_expert_sample
from analyses.moe_router.maps import RouterMap, divergence_data, generation_map, heatmap_data, profile_task, score_view
from analyses.moe_router.ship import (DEFAULT_MODEL, EVAL_SETTINGS, MAP_SETTINGS, NAME, PROFILE_N, default_setting,
                                      map_from_dict, task_prompt)
from app.context import FinishedGenerations, shows_errors
from app.export import show_figure
from app.jobs import run_job
from app.registry import PageSpec
from thoughtscope import shipped
from thoughtscope.errors import BadInputError

# "router" is checked in `render`, after the title: on a dense model the page still opens and says why it is empty
PAGE = PageSpec("MoE router & Expert-Sample", ":material/alt_route:", 65, requires=("generate",))

OWN = "the model's own top-k"
EXPERT_SAMPLE = "Expert-Sample"
TASK_PROMPT = "a problem of the model's task"
SIDEBAR_PROMPT = "the sidebar's prompt"
PAGE_NAME = "moe_router"


@st.cache_resource
def results() -> FinishedGenerations:
    """Router maps and evaluations of this process, newest 32 kept."""
    return FinishedGenerations(max_entries=32)


def stored_result(model_id: str, fingerprint: str | None) -> shipped.Shipped | shipped.Missing:
    """The shipped moe-router result of `model_id` (fingerprint None: of that model, whatever is loaded)."""
    return shipped.find(NAME, model_id, fingerprint)


def profile_section(ctx, store, stored: Any) -> None:
    st.subheader("0. Router profile over the model's task")
    key = ctx.result_key("moe-profile", n=PROFILE_N, seed=0)
    backend = ctx.backend

    def work(job):
        profile, task = profile_task(backend, "auto", PROFILE_N, max_new_tokens=48, seed=0, progress=job.progress)
        return {**profile.to_dict(), "task": task, "n_problems": PROFILE_N}

    start = st.button("Profile the router again" if stored else "Profile the router", key="moe_profile_run",
                      icon=":material/play_arrow:", help=f"{PROFILE_N} development problems, greedy answers read "
                                                         "teacher-forced at every MoE layer")
    data = store.get(key) or run_job(key, work, label=f"Router profile on {PROFILE_N} problems", kind="moe-profile",
                                     page=PAGE_NAME, start=start)
    if data is not None:
        store.put(key, data)
    elif stored:
        data = stored.json("profile.json")
    if data is None:
        st.info("Press **Profile the router** for the mean sorted router probabilities over the model's task.")
        return
    show_figure(None, data, "moe_profile", provenance=stored.provenance if stored and store.get(key) is None else
                ctx.provenance(settings={"n": PROFILE_N}, data=data.get("task")))
    st.caption(f"top-1 mean probability per layer: {', '.join(f'{v:.2f}' for v in data['top1'])}; mass of the "
               f"top-{data['k']}: {', '.join(f'{v:.2f}' for v in data['topk_mass'])}")


def generation_section(ctx, store, stored: Any) -> tuple[RouterMap, dict[str, Any]] | None:
    st.subheader("1. A generation, routed")
    arch = ctx.backend.arch()
    k, n_experts = int(arch.experts_top_k), int(arch.n_experts)
    c1, c2, c3 = st.columns(3)
    source = c1.radio("Prompt", [TASK_PROMPT, SIDEBAR_PROMPT], key="moe_prompt_source",
                      help="a development problem of the model's own task (toy-moe: chained arithmetic; other "
                           "models: arith), or the prompt typed in the sidebar")
    routing = c2.radio("Routing", [EXPERT_SAMPLE, OWN], key="moe_routing",
                       help="with greedy tokens and the model's own routing all N samples are the same; "
                            "Expert-Sample samples the tail experts, so the samples' routing (and text) can part")
    n_samples = c3.slider("Samples (N)", 1, 16, MAP_SETTINGS["n_samples"], key="moe_samples")
    setting = None
    if routing == EXPERT_SAMPLE:
        default = default_setting(k, n_experts)
        gates_options = ["displaced", "router", "uniform"]
        c1, c2, c3, c4 = st.columns(4)
        k_h = c1.number_input("Head k_h (kept)", 0, max(0, k - 1), default.k_h, key="moe_es_k_h")
        m = c2.number_input("Tail pool m", 1, max(1, n_experts - int(k_h)), min(n_experts - int(k_h), default.m),
                            key="moe_es_m")
        t_e = c3.number_input("Expert temperature T_e", 0.05, 10.0, default.t_e, 0.05, key="moe_es_t_e")
        gates = c4.selectbox("Tail gates", gates_options, key="moe_es_gates",
                             help="displaced: the drawn experts take the gates of the experts they replace; router: "
                                  "renormalised as the family does (small for tail experts, so swapping them changes "
                                  "little); uniform: equal shares")
        setting = ExpertSetting(int(k_h), int(m), float(t_e), gates)
    if source == TASK_PROMPT:
        with shows_errors() as spot:
            prompt, chat, answer = task_prompt(ctx.backend, 0, seed=0)
        if spot.failed:
            return None
        st.caption(f"prompt: {_prompt_text(prompt)} (answer {answer})")
    else:
        prompt, chat = ctx.model_input(), ctx.chat
    settings = {"prompt": MAP_SETTINGS["prompt"] if source == TASK_PROMPT else prompt, "n_samples": int(n_samples),
                "max_new_tokens": ctx.settings.max_new_tokens, "seed": ctx.seed,
                "sampling": "greedy" if ctx.settings.temperature == 0 else ctx.settings.to_dict(),
                "setting": setting.to_dict() if setting else None}
    key = ctx.result_key("moe-map", **settings, chat=chat)
    run = st.button("Generate", type="primary", key="moe_generate", icon=":material/play_arrow:")
    backend, sampling, seed, max_new = ctx.backend, ctx.settings.sampling(), ctx.seed, ctx.settings.max_new_tokens

    def work(job):
        job.progress("generate with the routing captured", 0, 1)
        rule = setting.check(k).rule(seed) if setting else None
        rmap = generation_map(backend, prompt, n_samples=int(n_samples), rule=rule, max_new_tokens=max_new,
                              sampling=sampling, seed=seed, chat=chat)
        job.progress("generate with the routing captured", 1, 1)
        return rmap, {"rule": rule, "setting": setting}

    found = store.get(key)
    if found is None:
        if run and setting is not None:
            with shows_errors() as spot:
                setting.check(k)  # a bad setting is said next to its widgets, before any job
            if spot.failed:
                return None
        found = run_job(key, work, label=f"Generating {n_samples} samples with the routing captured",
                        kind="moe-map", page=PAGE_NAME, start=run)
        if found is not None:
            store.put(key, found)
    if found is not None:
        return found
    if stored and stored.manifest.get("settings", {}).get("map") == _plain(settings):
        st.success(stored.label() + " Press **Generate** to run it again.", icon=":material/inventory_2:")
        d = stored.json("map.json")
        return map_from_dict(d), {"rule": None, "setting": setting, "provenance": stored.provenance,
                                  "rule_text": d.get("rule")}
    if stored:
        st.info("The stored generation was made with other settings (a problem of the task, N = 4, Expert-Sample "
                "at the defaults, greedy, 48 new tokens, seed 0); press **Generate** for yours.")
    else:
        st.info("Press **Generate** to route the prompt and capture every MoE layer's experts.")
    return None


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return " / ".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)


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
    if meta.get("provenance"):  # a shipped map: the record of the run that made it
        return {**meta["provenance"], "view": settings}
    rule = meta.get("rule")
    return ctx.provenance(interventions=[rule] if rule is not None else [], settings=settings)


def evaluation_section(ctx, store, stored: Any) -> None:
    st.subheader("3. pass@n: Expert-Sample against temperature sampling")
    path = st.text_input("An evaluation JSON (`thoughtscope eval expert-sample --json > es.json`)",
                         key="moe_eval_path").strip()
    report = None
    if path:
        with shows_errors():
            report = _read_json(path)
    e = EVAL_SETTINGS
    c1, c2, c3, c4 = st.columns(4)
    n = c1.number_input("Or run one here: evaluation problems", 1, 200, e["n"], key="moe_eval_n")
    n_samples = c2.number_input("Samples per problem", 1, 16, e["samples"], key="moe_eval_samples")
    grid_text = c3.text_input("Grid k_h:m:T_e (comma-separated; empty: the default grid)", e["grid"],
                              key="moe_eval_grid")
    c4.write("")
    settings = {"n": int(n), "n_dev": max(2, int(n) // 2), "samples": int(n_samples), "grid": grid_text.strip(),
                "max_new_tokens": ctx.settings.max_new_tokens, "seed": ctx.seed}
    matches = bool(stored) and stored.manifest.get("settings", {}).get("evaluation") == settings
    run = c4.button("Run the evaluation again" if matches else "Run evaluation", key="moe_eval_run",
                    icon=":material/play_arrow:")
    key = ctx.result_key("moe-eval", **settings)
    backend = ctx.backend

    def work(job):
        grid = [ExpertSetting.parse(x) for x in settings["grid"].replace(" ", "").split(",") if x] or None
        found = evaluate_expert_sample(backend, "auto", settings["n"], n_dev=settings["n_dev"],
                                       n_samples=settings["samples"], grid=grid,
                                       max_new_tokens=settings["max_new_tokens"], seed=settings["seed"],
                                       n_resamples=500, progress=job.progress)
        return found.to_dict()

    found = store.get(key)
    if found is None and not report:
        if run:
            with shows_errors() as spot:  # a bad grid is said here, before any job
                [ExpertSetting.parse(x) for x in settings["grid"].replace(" ", "").split(",") if x]
            run = run and not spot.failed
        found = run_job(key, work, label=f"Expert-Sample evaluation on {settings['n']} problems", kind="moe-eval",
                        page=PAGE_NAME, start=run)
        if found is not None:
            store.put(key, found)
    report = report or found
    if report is None and matches:
        st.success(stored.label(), icon=":material/inventory_2:")
        report = stored.json("evaluation.json")
    elif report is None and stored:
        st.info("The stored evaluation was made with other settings (12 problems, 4 samples, the default grid, "
                "48 new tokens, seed 0); press **Run evaluation** for yours.")
    if report is None:
        return
    _draw_evaluation(report)


def _draw_evaluation(report: dict[str, Any]) -> None:
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


def elsewhere_section(ctx) -> None:
    """On a model without a router: the toy MoE's shipped result, labelled as the toy's, and a switch to it."""
    stored = stored_result(DEFAULT_MODEL, None)
    if not stored:
        (st.warning if stored.damaged else st.caption)(stored.reason)
        return
    st.markdown(f"**Below: the stored result of `{DEFAULT_MODEL}`, not of `{ctx.model_id}`.** {stored.label()}")
    from app.switch import switch_button

    switch_button(DEFAULT_MODEL, key="moe_switch")
    st.subheader(f"Router profile of `{DEFAULT_MODEL}`")
    show_figure(None, stored.json("profile.json"), "moe_profile", provenance=stored.provenance)
    d = stored.json("map.json")
    rmap = map_from_dict(d)
    st.subheader(f"A generation of `{DEFAULT_MODEL}`, routed under Expert-Sample")
    st.caption(f"prompt: {_prompt_text(d['prompt'])} \u00b7 {d.get('rule')}")
    view = score_view(rmap, 0, 0, 0, int(d["setting"]["k_h"]), int(d["setting"]["m"]), 0.5)
    show_figure(None, view, "moe_scores", provenance=stored.provenance)
    show_figure(None, heatmap_data(rmap, 0), "moe_heatmap", provenance=stored.provenance)
    show_figure(None, divergence_data(rmap), "moe_divergence", provenance=stored.provenance)
    st.subheader(f"pass@n of `{DEFAULT_MODEL}`")
    _draw_evaluation(stored.json("evaluation.json"))


def render(ctx) -> None:
    st.title("MoE router & Expert-Sample")
    st.caption("Chen et al. 2026 (abstract only; our reconstruction): a fine-grained MoE router is certain about a "
               "few head experts and uncertain about its tail. Expert-Sample keeps the head and samples the rest "
               "of the k experts from the tail, for diverse answers with greedy tokens.")
    if not ctx.backend.capabilities().get("router"):
        st.info(f"`{ctx.model_id}` has no MoE router (a dense model, or a backend without router rules). Pick an "
                "MoE model in the sidebar: toy-moe, tiny-random:qwen3_moe, or an hf: Qwen3-MoE / OLMoE / Mixtral.")
        elsewhere_section(ctx)
        return
    store = results()
    stored = stored_result(ctx.model_id, ctx.backend.info()["fingerprint"])
    if not stored and (stored.damaged or "other weights" in stored.reason):
        st.warning(stored.reason + " Every section below can run its work here.")
    profile_section(ctx, store, stored)
    found = generation_section(ctx, store, stored)
    if found is not None:
        scores_section(ctx, *found)
    evaluation_section(ctx, store, stored)
    active_section()
