"""RISE reasoning vectors: harvest step vectors, train step-level SAEs, look at their decoder geometry and
feature dashboards, and steer reflection/backtracking with an alpha slider (METHODS.md section 1).

A share of the harvested traces never trains the SAEs: their steps measure them (explained variance
and L0 as SAELens computes them, best-latent AUROC), and the page warns when the held-out explained
variance is poor. The SAEs are saved as SAELens folders (`analyses.rise.saved_saes` lists them for
the Steering page's "saved SAE feature" option).

The computations live in `analyses.rise` (chained by `RisePipeline`, as the CLI does); this page reads widgets,
calls them and draws (`app.sections.rise` draws a finished run). Results (harvest + SAEs + analysis, steered
generations, confidence fits) are jobs' results (`app.jobs`), kept by everything they depend on, so moving a
slider back or reopening the page never recomputes anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st

from analyses.organism import is_organism
from analyses.rise import BEHAVIOURS, HarvestSettings, RiseOptions, RisePipeline, steer
from analyses.rise import ship as rise_ship
from analyses.steering_stack import StackTerm
from analyses.tasks import Problem, load_task
from app import jobs
from app.context import shows_errors
from app.export import current_provenance, page_provenance, run_summary
from app.registry import PageSpec
from app.sections.rise import (confidence_section, dashboard_section, draw_harvest, draw_steering, geometry_section,
                               options_widgets, timeline_section)
from app.steering_stack_ui import add_button
from thoughtscope import shipped

PAGE = PageSpec("RISE reasoning vectors", ":material/psychology_alt:", 40,
                requires=("generate", "capture_batch", "readout", "grad"))

FROM_SIDEBAR = "the sidebar prompt"
FROM_TASK = "a held-out task problem"
FROM_BEHAVIOUR = "behaviour vector"
FROM_LATENT = "a latent's decoder column"
N_HELDOUT = 8


@st.cache_resource(show_spinner=False, max_entries=4)
def _stored_run(folder: str, digest: str) -> dict[str, Any]:
    """A verified shipped run as the page's result, read once per process (`digest`: its activations' sha256)."""
    stored = shipped.Shipped(Path(folder), json.loads((Path(folder) / shipped.MANIFEST).read_text()))
    return {**rise_ship.load(stored), "source": stored.label(), "provenance": stored.provenance}


def shipped_run(ctx, options: RiseOptions) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(the stored run when it was made with `options`, a note for the page, damaged?)."""
    found = shipped.find(rise_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if not found:
        return None, (found.reason if found.damaged else None), found.damaged
    made_with = found.json("harvest.json")["options"]
    wanted = rise_ship.comparable(options)
    if made_with != wanted:
        other = ", ".join(f"{k} {made_with.get(k)!r}" for k in wanted if made_with.get(k) != wanted[k])
        return None, (f"A stored RISE run ships for {ctx.model_id}, made with other settings ({other}); press "
                      "**Harvest + train** to run one with yours."), False
    return _stored_run(str(found.folder), found.manifest["files"]["acts.safetensors"]), None, False


def harvest_section(ctx) -> tuple[dict[str, Any] | None, HarvestSettings | None, str, int]:
    st.subheader("1. Harvest step vectors and train the SAEs")
    options = options_widgets(ctx)
    task, n, layers, projection = options.task, options.n, options.layers, options.projection
    key = ctx.result_key("rise-pipeline", options=options.to_dict())
    left, right = st.columns([1, 3])
    run_now = left.button("Harvest + train", type="primary", key="rise_run", icon=":material/play_arrow:",
                          help="runs as a job: progress, time left, Stop")
    run_now = run_now or bool(st.session_state.get("rise_run_again"))
    if run_now and not layers:
        st.error("Choose at least one layer.")
        return None, None, task, int(n)
    # the first visit in an app process reads the stored run's files (3-6 s through a model server, measured
    # 2026-12-05): said while it lasts, instead of a form with nothing under it
    with st.spinner("Reading the stored RISE run (once per app process)..."):
        stored, note, damaged = shipped_run(ctx, options)
    if damaged:
        st.warning(f"{note} Press **Harvest + train** to rebuild it here.", icon=":material/broken_image:")
    found = None
    if stored is not None and not run_now and jobs.registry().for_key(key) is None:
        found = {**stored, "key": key}
        right.caption(found["source"])
        right.button("Run again", key="rise_run_again", icon=":material/refresh:",
                     help="harvest and train with these settings here, as a job (the stored result stays on disk)")
    else:
        if note and not damaged and jobs.registry().for_key(key) is None:
            st.info(note, icon=":material/info:")
        backend = ctx.backend
        record = ctx.provenance(settings={"rise": options.to_dict()}, data=task, split="harvest")

        def work(job: jobs.Job) -> dict[str, Any]:
            result = RisePipeline(backend, options, on_progress=job.progress).run()
            return {**result, "key": key, "analysis_projection": projection, "source": "", "provenance": record}

        found = jobs.run_job(key, work, label=f"Harvesting {int(n)} {task} problems at layers "
                                              f"{list(options.layers)} and training the SAEs",
                             kind="rise-pipeline", page="rise", start=run_now,
                             resumes="each harvested batch of traces is kept in the activation store and read back")
    if found is None:
        if jobs.registry().for_key(key) is None:
            st.info("Press **Harvest + train** to generate traces, cut them into steps, read one residual vector "
                    "per step and train one SAE per layer.")
        return None, None, task, int(n)
    with page_provenance(found.get("provenance") or current_provenance()):
        draw_harvest(found, ctx.model_id)
    return found, found["harvest"].settings, task, int(n)


ALPHA_STEP = 0.25
ALPHA_STOPS = tuple(round(-1.5 + ALPHA_STEP * i, 2) for i in range(13))  # -1.5 .. 1.5, the slider's stops


def steering_section(ctx, found: dict[str, Any], site: str, settings: HarvestSettings, task: str, n: int) -> None:
    st.subheader("5. Steering")
    layer, sae = found["analysis"].layer(site), found["saes"][site]
    c1, c2, c3 = st.columns(3)
    source = c1.radio("Direction", [FROM_BEHAVIOUR, FROM_LATENT], horizontal=True, key="rise_steer_source")
    mode = c2.radio("Mode", ["projection", "add"], horizontal=True, key="rise_steer_mode",
                    help="projection: h - alpha w (w.h) (1 removes the component, -1 doubles it); add: h + alpha s w "
                         "with s the mean norm of the harvested step vectors at this layer, so alpha is a fraction "
                         "of the residual norm")
    if source == FROM_BEHAVIOUR:
        behaviour = c3.selectbox("Behaviour", BEHAVIOURS, key="rise_steer_behaviour")
        if behaviour not in layer.vectors:
            st.warning(f"No {behaviour} vector at {site}: too few {behaviour} steps have their own SAE columns. "
                       "Harvest more problems, splice templated steps, or steer with a latent's column.")
            return
        vector, name = layer.vectors[behaviour], behaviour
    else:
        latent = c3.number_input("Latent", 0, sae.cfg.d_sae - 1, int(st.session_state.get("rise_latent", 0)),
                                 key="rise_steer_latent")
        vector, name = sae.W_dec[int(latent)].detach().float(), f"latent {int(latent)}"
    add_button("rise_add_to_stack", lambda: StackTerm(  # projection: strength 1 removes the component, as alpha 1
        site, vector, 0.5 if mode == "add" else 1.0, "additive" if mode == "add" else "project_out",
        label=f"RISE {name}", source={"kind": "rise", "direction": name, "site": site}))
    alpha = st.slider("alpha (stops of 0.25)", ALPHA_STOPS[0], ALPHA_STOPS[-1], 0.0, ALPHA_STEP, key="rise_alpha",
                      help="Greedy traces: the first draw of a direction generates every stop in one batched "
                           "generation, so moving the slider afterwards is a lookup")
    where = st.radio("Generate for", [FROM_SIDEBAR, FROM_TASK], horizontal=True, key="rise_steer_input")
    if where == FROM_TASK:
        heldout = (load_task(task, N_HELDOUT, seed=ctx.seed, split="eval") if is_organism(task)
                   else load_task(task, n + N_HELDOUT, seed=ctx.seed)[n:])
        problem = st.selectbox("Problem", heldout, key="rise_steer_problem",
                               format_func=lambda p: f"{p.id}: {p.question[:90]}")
    else:
        problem = Problem(id="sidebar", question=ctx.prompt, answer="", source="sidebar", steps=0)
        if not ctx.prompt.strip():
            st.info("Type a question in the sidebar.")
            return
        ctx.model_input()  # the long-prompt guard (app/context.py): a long prompt waits for its confirmation
    # greedy traces: all stops at once (one batched generation; rows equal one generation per alpha); sampled
    # traces depend on their batch row, so those generate alpha 0 and the chosen alpha only
    grid = settings.temperature == 0
    alphas = ALPHA_STOPS if grid else ((0.0,) if alpha == 0 else (0.0, float(alpha)))
    key = ctx.result_key("rise-steer", pipeline=found["key"], site=site, direction=name, mode=mode,
                         alphas=list(alphas), problem=problem.to_dict(), seed=ctx.seed)
    what = f"all {len(alphas)} alpha stops in one batch" if grid else f"alpha 0 and {alpha:g}"
    # add mode: alpha in units of the mean step-vector norm (a unit vector alone barely moves a residual
    # stream whose norm is in the hundreds)
    scale = float(found["harvest"].acts[site].norm(dim=1).mean()) if mode == "add" else 1.0
    direction = vector / max(float(vector.norm()), 1e-8) * scale if mode == "add" else vector
    backend = ctx.backend

    def work(job: jobs.Job):
        return steer(backend, [problem], direction, site, alphas=alphas, mode=mode, settings=settings,
                     behaviour=name, batch_alphas=grid, on_progress=job.progress)

    result = jobs.run_job(key, work, label=f"Steering: generating {what}", kind="rise-steer", page="rise",
                          start=True, keep_running_option=False)
    if result is not None:
        draw_steering(result, alpha, name, mode)


# ----------------------------------------------------------------------------- the page


def render(ctx) -> None:
    st.title("RISE reasoning vectors")
    st.caption("Zhang et al.: cut chain-of-thought traces into steps, train a sparse autoencoder on one residual "
               "vector per step (no labels), and find decoder columns for reflection and backtracking that steer "
               "the behaviour.")
    found, settings, task, n = harvest_section(ctx)
    if found is None:
        return
    # the harvest's, the SAEs' and their analysis' figures export the record of the run that made them (the stored
    # run's, or this page's job with its RISE settings); steering and confidence below are the page's own work
    record = found.get("provenance") or current_provenance()
    with page_provenance(record), shows_errors():
        timeline_section(found)
    with page_provenance(record):
        site = geometry_section(found)
    with page_provenance(record), shows_errors():
        dashboard_section(ctx, found, site)
    # steering and confidence: the page's record (model, seed, the sidebar's prompt), naming the run whose SAEs they use
    with page_provenance(ctx.provenance(sae_run=run_summary(record))):
        with shows_errors():
            steering_section(ctx, found, site, settings, task, n)
        with shows_errors():
            confidence_section(ctx, found, site, found["key"])
