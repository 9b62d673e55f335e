"""MoE router tails and Expert-Sample (Chen et al., arXiv 2602.02443, reconstructed; METHODS.md section 6).

A generation of N samples of the sidebar's prompt, under the model's own routing or under Expert-Sample
(keep the top k_h experts, sample the rest of the k from the next m at temperature T_e), with every MoE
layer's routing captured: one token's sorted router scores with the head/tail split (the k_h slider moves
it), the experts each token used (layer x token), and where the N samples' routing and tokens part. Then
pass@n curves with intervals, from an `eval expert-sample` JSON or a small run here, and greedy accuracy
as the active experts shrink. The computations live in `analyses.moe_router`; this page reads widgets,
calls them and draws (`app.sections.moe_router` draws the reports and the stored result elsewhere).

The task (for the profile, the task prompt and the evaluation) is the model's own; on a model other than a
toy it can be a built-in task or the user's own problem file (`app.sections.tasks.task_picker`).

It opens on the shipped result of the toy MoE (`thoughtscope ship moe-router`: a router profile, the
default generation's map and a small evaluation), labelled as stored; on a model without a router it
shows that toy's result, labelled as the toy's, with a button that switches to it. The profile, the
generation and the evaluation run as jobs (`app.jobs.run_job`).
"""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from analyses.moe_router.evaluate import ExpertSetting, evaluate_expert_sample
from analyses.moe_router.maps import RouterMap, generation_map
from analyses.moe_router.problems import TOY_TASKS, resolve_task
from analyses.moe_router.ship import (EVAL_SETTINGS, MAP_SETTINGS, NAME, PROFILE_N, map_from_dict, router_profile,
                                      task_prompt)
from app.context import drawing_report, read_report, shows_errors
from app.export import show_figure
from app.jobs import run_job
from app.registry import PageSpec
from app.sections.tasks import task_picker
from app.sections.moe_router import (active_section, draw_evaluation, elsewhere_section, expert_setting_widgets,
                                     prompt_text, scores_section, stored_evaluation)
from thoughtscope import shipped

# "router" is checked in `render`, after the title: on a dense model the page still opens and says why it is empty
PAGE = PageSpec("MoE router & Expert-Sample", ":material/alt_route:", 65, requires=("generate",))

OWN = "the model's own top-k"
EXPERT_SAMPLE = "Expert-Sample"
TASK_PROMPT = "a problem of the task"
SIDEBAR_PROMPT = "the sidebar's prompt"
PAGE_NAME = "moe_router"


def task_section(ctx) -> tuple[str, str]:
    """(the task the sections run on, the model's own task). A toy reads only its own task (its tokenizer and
    context hold nothing else); any other MoE model also takes the built-in tasks and the user's problems."""
    own = resolve_task("auto", ctx.backend)
    if own in TOY_TASKS:
        st.caption(f"Task: **{own}**, the toy's own problems (its tokenizer reads no other task).")
        return own, own
    return task_picker(st, "Task (the profile, the task prompt and the evaluation)", own, "moe_task"), own


def profile_section(ctx, stored: Any, task: str) -> None:
    st.subheader("0. Router profile over the task")
    backend = ctx.backend
    start = st.button("Profile the router again" if stored else "Profile the router", key="moe_profile_run",
                      icon=":material/play_arrow:", help=f"{PROFILE_N} development problems (or all a problem file's "
                                                         "development half holds), greedy answers read "
                                                         "teacher-forced at every MoE layer")
    data = run_job(ctx.result_key("moe-profile", n=PROFILE_N, seed=0, task=task),
                   lambda job: router_profile(backend, progress=job.progress, task=task),
                   label=f"Router profile on {PROFILE_N} problems", kind="moe-profile", page=PAGE_NAME, start=start)
    provenance = None if data is None else ctx.provenance(settings={"n": data.get("n_problems", PROFILE_N)},
                                                          data=data.get("task"))
    if data is None and stored:
        data, provenance = stored.json("profile.json"), stored.provenance
    if data is None:
        st.info("Press **Profile the router** for the mean sorted router probabilities over the task.")
        return
    show_figure(None, data, "moe_profile", provenance=provenance)
    st.caption(f"top-1 mean probability per layer: {', '.join(f'{v:.2f}' for v in data['top1'])}; mass of the "
               f"top-{data['k']}: {', '.join(f'{v:.2f}' for v in data['topk_mass'])}")


def generation_section(ctx, stored: Any, task: str) -> tuple[RouterMap, dict[str, Any]] | None:
    st.subheader("1. A generation, routed")
    arch = ctx.backend.arch()
    k, n_experts = int(arch.experts_top_k), int(arch.n_experts)
    c1, c2, c3 = st.columns(3)
    source = c1.radio("Prompt", [TASK_PROMPT, SIDEBAR_PROMPT], key="moe_prompt_source",
                      help="the first development problem of the task chosen above (toy-moe: chained "
                           "arithmetic), or the prompt typed in the sidebar")
    routing = c2.radio("Routing", [EXPERT_SAMPLE, OWN], key="moe_routing",
                       help="with greedy tokens and the model's own routing all N samples are the same; "
                            "Expert-Sample samples the tail experts, so the samples' routing (and text) can part")
    n_samples = int(c3.slider("Samples (N)", 1, 16, MAP_SETTINGS["n_samples"], key="moe_samples"))
    setting = expert_setting_widgets(k, n_experts) if routing == EXPERT_SAMPLE else None
    if source == TASK_PROMPT:
        with shows_errors() as spot:
            prompt, chat, answer = task_prompt(ctx.backend, 0, seed=0, task=task)
        if spot.failed:
            return None
        st.caption(f"prompt: {prompt_text(prompt)} (answer {answer})")
    else:
        prompt, chat = ctx.model_input(), ctx.chat
    settings = {"prompt": MAP_SETTINGS["prompt"] if source == TASK_PROMPT else prompt, "n_samples": n_samples,
                "max_new_tokens": ctx.settings.max_new_tokens, "seed": ctx.seed,
                "sampling": "greedy" if ctx.settings.temperature == 0 else ctx.settings.to_dict(),
                "setting": setting.to_dict() if setting else None}
    run = st.button("Generate", type="primary", key="moe_generate", icon=":material/play_arrow:")
    if run and setting is not None:
        with shows_errors() as spot:
            setting.check_for(arch)  # a bad setting is said next to its widgets, before any job
        run = not spot.failed
    backend, sampling, seed, max_new = ctx.backend, ctx.settings.sampling(), ctx.seed, ctx.settings.max_new_tokens

    def work(job):
        job.progress("generate with the routing captured", 0, 1)
        rule = setting.check(k).rule(seed) if setting else None
        rmap = generation_map(backend, prompt, n_samples=n_samples, rule=rule, max_new_tokens=max_new,
                              sampling=sampling, seed=seed, chat=chat)
        job.progress("generate with the routing captured", 1, 1)
        return rmap, {"rule": rule, "setting": setting}

    found = run_job(ctx.result_key("moe-map", **settings, chat=chat, task=task), work, label=f"Generating {n_samples} samples "
                    "with the routing captured", kind="moe-map", page=PAGE_NAME, start=run)
    if found is not None:
        return found
    if stored and stored.manifest.get("settings", {}).get("map") == json.loads(json.dumps(settings, default=str)):
        st.success(stored.label() + " Press **Generate** to run it again.", icon=":material/inventory_2:")
        d = stored.json("map.json")
        return map_from_dict(d), {"rule": None, "setting": setting, "provenance": stored.provenance,
                                  "rule_text": d.get("rule")}
    st.info("The stored generation was made with other settings (a problem of the task, N = 4, Expert-Sample at the "
            "defaults, greedy, 48 new tokens, seed 0); press **Generate** for yours." if stored else
            "Press **Generate** to route the prompt and capture every MoE layer's experts.")
    return None


def evaluation_section(ctx, stored: Any, task: str) -> None:
    st.subheader("3. pass@n: Expert-Sample against temperature sampling")
    path = st.text_input("An evaluation JSON (`thoughtscope eval expert-sample --json > es.json`)",
                         key="moe_eval_path").strip()
    report = None
    with shows_errors():
        report = read_report(path, "an Expert-Sample evaluation report", {"methods": list, "choices": dict},
                             "thoughtscope eval expert-sample --json > es.json") if path else None
    from_file = report is not None
    e = EVAL_SETTINGS
    c1, c2, c3, c4 = st.columns(4)
    n = int(c1.number_input("Or run one here: evaluation problems", 1, 200, e["n"], key="moe_eval_n"))
    n_samples = int(c2.number_input("Samples per problem", 1, 16, e["samples"], key="moe_eval_samples"))
    grid_text = c3.text_input("Grid k_h:m:T_e (comma-separated; empty: the default grid)", e["grid"],
                              key="moe_eval_grid").strip()
    c4.write("")
    settings = {"n": n, "n_dev": max(2, n // 2), "samples": n_samples, "grid": grid_text,
                "max_new_tokens": ctx.settings.max_new_tokens, "seed": ctx.seed}
    matches = bool(stored) and stored.manifest.get("settings", {}).get("evaluation") == settings
    run = c4.button("Run the evaluation again" if matches else "Run evaluation", key="moe_eval_run",
                    icon=":material/play_arrow:")
    if run:
        with shows_errors() as spot:  # a bad grid, or a setting this router cannot run, is said here, before any job
            for setting in _grid(grid_text):
                setting.check_for(ctx.backend.arch())
        run = not spot.failed
    backend = ctx.backend

    def work(job):
        grid = _grid(grid_text) or None
        return evaluate_expert_sample(backend, task, n, n_dev=settings["n_dev"], n_samples=n_samples, grid=grid,
                                      max_new_tokens=settings["max_new_tokens"], seed=settings["seed"],
                                      n_resamples=500, progress=job.progress).to_dict()

    if report is None:
        report = run_job(ctx.result_key("moe-eval", **settings, task=task), work, label=f"Expert-Sample evaluation on {n} "
                         "problems", kind="moe-eval", page=PAGE_NAME, start=run)
    if report is None and matches:
        st.success(stored.label(), icon=":material/inventory_2:")
        report = stored_evaluation(stored)
    elif report is None and stored:
        st.info("The stored evaluation was made with other settings (12 problems, 4 samples, the default grid, "
                "48 new tokens, seed 0); press **Run evaluation** for yours.")
    if report is not None:
        with shows_errors(), drawing_report(path if from_file else "the stored evaluation",
                                            "an Expert-Sample evaluation report"):
            draw_evaluation(report)


def _grid(text: str) -> list[ExpertSetting]:
    return [ExpertSetting.parse(x) for x in text.replace(" ", "").split(",") if x]


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
    stored = shipped.find(NAME, ctx.model_id, ctx.backend.info()["fingerprint"])
    if not stored and (stored.damaged or "other weights" in stored.reason):
        st.warning(stored.reason + " Every section below can run its work here.")
    task, own = task_section(ctx)
    stored = stored if task == own else None  # the shipped result is of the model's own task
    profile_section(ctx, stored, task)
    found = generation_section(ctx, stored, task)
    if found is not None:
        scores_section(ctx, *found)
    evaluation_section(ctx, stored, task)
    active_section()
