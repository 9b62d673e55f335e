"""RISE reasoning vectors: harvest step vectors, train step-level SAEs, look at their decoder geometry and
feature dashboards, and steer reflection/backtracking with an alpha slider (METHODS.md section 1).

A share of the harvested traces never trains the SAEs: their steps measure them (explained variance
and L0 as SAELens computes them, best-latent AUROC), and the page warns when the held-out explained
variance is poor. The SAEs are saved as SAELens folders (`analyses.rise.saved_saes` lists them for
the Steering page's "saved SAE feature" option).

The computations live in `analyses.rise` (chained by `RisePipeline`, as the CLI does); this page reads widgets,
calls them and draws. Results (harvest + SAEs + analysis, steered generations, confidence fits) are
kept per process in `results()`, keyed by everything they depend on, so moving a slider back or
reopening the page never recomputes anything.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from analyses.families import default_task
from analyses.organism import is_organism
from analyses.rise import (BEHAVIOURS, HarvestSettings, RiseOptions, RisePipeline, confidence_vectors,
                           feature_dashboard, quality_warning, saved_saes, steer)
from analyses.rise import ship as rise_ship
from analyses.tasks import TASK_NAMES, Problem, load_task
from app import jobs
from app.context import FinishedGenerations
from app.export import show_figure
from app.figures.rise import (confidence_curve, feature_histogram, feature_labels, feature_tokens, silhouette_curve,
                              step_timeline)
from app.registry import PageSpec
from thoughtscope import shipped
from thoughtscope.errors import ThoughtscopeError

PAGE = PageSpec("RISE reasoning vectors", ":material/psychology_alt:", 40,
                requires=("generate", "capture_batch", "readout", "grad"))

FROM_SIDEBAR = "the sidebar prompt"
FROM_TASK = "a held-out task problem"
FROM_BEHAVIOUR = "behaviour vector"
FROM_LATENT = "a latent's decoder column"
N_HELDOUT = 8


@st.cache_resource
def results() -> FinishedGenerations:
    """Pipelines, steered generations and confidence fits of this process, newest 32 kept."""
    return FinishedGenerations(max_entries=32)


# ----------------------------------------------------------------------------- 1. harvest + train


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
    digest = found.manifest["files"]["acts.safetensors"]
    cached = results().get(f"shipped-rise-{digest}")
    if cached is None:
        cached = {**rise_ship.load(found), "source": found.label()}
        results().put(f"shipped-rise-{digest}", cached)
    return cached, None, False



def harvest_section(ctx, store) -> tuple[dict[str, Any] | None, HarvestSettings | None, str, int]:
    st.subheader("1. Harvest step vectors and train the SAEs")
    n_layers = ctx.backend.arch().n_layers
    own = default_task(ctx.model_id)
    defaults = rise_ship.page_options(ctx.model_id, n_layers, ctx.settings.max_new_tokens, ctx.seed)
    c1, c2, c3 = st.columns(3)
    task = c1.selectbox("Task", [own] + [t for t in TASK_NAMES if t != own], key="rise_task")
    n = c2.number_input("Problems", 2, 2000, defaults.n, key="rise_n",
                        help="the paper uses hundreds; a dozen keeps a CPU quick")
    sae_steps = c3.number_input("SAE training steps", 10, 5000, 300, 10, key="rise_sae_steps")
    c1, c2, c3 = st.columns(3)
    d_sae = c1.number_input("Dictionary size d_sae (0: scaled to the data)", 0, 16384, 0, 16, key="rise_d_sae",
                            help="0 picks 4/3 of the model width, at most a quarter of the training steps")
    l1 = c2.number_input("L1 coefficient (0: scaled to the width)", 0.0, 1000.0, 0.0, 0.5, key="rise_l1",
                         help="larger: sparser latents (lower L0), worse reconstruction")
    heldout = c3.slider("Held-out traces (measure the SAE)", 0.0, 0.5, 0.25, 0.05, key="rise_heldout")
    c1, c2, c3, c4 = st.columns(4)
    layers = c1.multiselect("Layers", list(range(n_layers)), default=list(defaults.layers), key="rise_layers")
    projection = c2.radio("Decoder map", ["umap", "pca"], horizontal=True, key="rise_projection",
                          help="UMAP (cosine) as in the paper, or PCA (fast)")
    temperature = c3.number_input("Trace temperature (0: greedy)", 0.0, 2.0, defaults.temperature, 0.1,
                                  key="rise_temperature",
                                  help="greedy traces never show a behaviour the model does less than half the time; "
                                       "the organism backtracks only when it samples a wrong step")
    augment = c4.checkbox("Splice templated reflection/backtracking steps",
                          value=defaults.augment == "templated", key="rise_augment",
                          help="small models rarely reflect; this gives the labeller something to find [recon]")
    options = RiseOptions(task=task, n=int(n), seed=ctx.seed, layers=tuple(sorted(layers)),
                          max_new_tokens=ctx.settings.max_new_tokens, batch_size=max(1, min(16, int(n))),
                          augment="templated" if augment else "none", sae_steps=int(sae_steps), projection=projection,
                          d_sae=int(d_sae) or None, l1=float(l1) or None, heldout=float(heldout),
                          temperature=float(temperature))
    key = ctx.result_key("rise-pipeline", options=options.to_dict())
    left, right = st.columns([1, 3])
    run_now = left.button("Harvest + train", type="primary", key="rise_run", icon=":material/play_arrow:",
                          help="runs as a job: progress, time left, Stop")
    run_now = run_now or bool(st.session_state.get("rise_run_again"))
    if run_now and not layers:
        st.error("Choose at least one layer.")
        return None, None, task, int(n)
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

        def work(job: jobs.Job) -> dict[str, Any]:
            pipeline = RisePipeline(backend, options, on_progress=job.progress)
            result = pipeline.run()
            result["heldout_traces"] = len({result["harvest"].step_rows[r][0]
                                            for r in pipeline.heldout_rows(result["harvest"])})
            return {**result, "key": key, "analysis_projection": projection, "source": ""}

        found = jobs.run_job(key, work, label=f"Harvesting {int(n)} {task} problems at layers "
                                              f"{list(options.layers)} and training the SAEs",
                             kind="rise-pipeline", page="rise", start=run_now)
    if found is None:
        if jobs.registry().for_key(key) is None:
            st.info("Press **Harvest + train** to generate traces, cut them into steps, read one residual vector "
                    "per step and train one SAE per layer.")
        return None, None, task, int(n)
    h = found["harvest"]
    counts = h.label_counts()
    cols = st.columns(3)
    cols[0].metric("Traces", len(h.traces))
    cols[1].metric("Steps", len(h.step_rows))
    cols[2].metric("Reflection / backtracking steps", f"{counts['reflection']} / {counts['backtracking']}")
    n_held = found.get("heldout_traces", 0)
    # inline code: a regex such as [.!?](?=\s) would otherwise render as a Markdown link
    st.caption(f"Step delimiter `{h.delimiter}` · labels by the `{h.settings.labeller}` labeller · SAEs trained on "
               f"the steps of {len(h.traces) - n_held} traces; quality measured on the {n_held} held-out traces")
    analysis = found["analysis"]
    best = analysis.best_site
    held = analysis.layer(best).quality["heldout"]
    cols = st.columns(3)
    cols[0].metric("Explained variance (held-out)", f"{held['explained_variance']:.3f}",
                   help=f"SAE at {best}, SAELens' formula, on steps of traces it was not trained on")
    cols[1].metric("L0 (held-out)", f"{held['l0']:.2f}", help=f"mean active latents per held-out step, SAE at {best}")
    cols[2].metric("Dead latents", found["stats"][best].dead_latents, help=f"SAE at {best}, on the held-out steps")
    for la in analysis.layers:
        warning = quality_warning(la.quality["heldout"]["explained_variance"])
        if warning:
            st.warning(f"{la.site}: {warning}")
    rows = [{"site": la.site, "EV train": round(la.quality["train"]["explained_variance"], 4),
             "EV held-out": round(la.quality["heldout"]["explained_variance"], 4),
             "L0 held-out": round(la.quality["heldout"]["l0"], 2), "d_sae": found["stats"][la.site].d_sae,
             "dead latents": found["stats"][la.site].dead_latents,
             "held-out silhouette": None if la.heldout_silhouette is None else round(la.heldout_silhouette, 3),
             **{f"AUROC {k}": None if (v := la.auroc.get(k, {}).get("heldout_auroc")) is None else round(v, 3)
                for k in BEHAVIOURS}} for la in analysis.layers]
    st.dataframe(rows, hide_index=True, key="rise_sae_stats")
    layer_dicts = [la.to_dict() for la in analysis.layers]
    left, right = st.columns(2)
    with left:
        show_figure(None, {"layers": layer_dicts}, "rise_quality")  # drawn from its JSON
    with right:
        show_figure(None, {"layers": layer_dicts}, "rise_auroc")
    with st.expander("Saved SAEs (SAELens folders: load them elsewhere, or steer with them on the Steering page)"):
        st.code("\n".join(f"{found['folder']}/{site}" for site in found["saes"]), language=None)
        saved = saved_saes(ctx.model_id)
        st.dataframe([{"folder": s.folder, "site": s.site, "d_sae": s.d_sae,
                       "held-out EV": None if s.heldout_explained_variance is None else
                       round(s.heldout_explained_variance, 3)} for s in saved], hide_index=True, key="rise_saved")
    return found, h.settings, task, int(n)


# ----------------------------------------------------------------------------- 2. step timeline


def timeline_section(found: dict[str, Any]) -> None:
    st.subheader("2. Step timeline")
    h, analysis = found["harvest"], found["analysis"]
    sites = [la.site for la in analysis.layers]
    left, right = st.columns([3, 1])
    t = left.selectbox("Trace", range(len(h.traces)), key="rise_trace",
                       format_func=lambda i: f"{h.traces[i].problem.id}: {h.traces[i].problem.question[:80]}")
    site = right.selectbox("Top latents from the SAE at", sites, index=sites.index(analysis.best_site),
                           key="rise_timeline_site")
    trace = h.traces[t]
    top = analysis.layer(site).top_latents
    by_step = {s: top[r].tolist() for r, (tt, s) in enumerate(h.step_rows) if tt == t}
    per_step = [by_step.get(i, []) for i in range(len(trace.steps))]
    data = {"trace": trace.to_dict(), "top_latents": per_step, "site": site}
    show_figure(step_timeline(trace, per_step), data, "rise_timeline")
    st.dataframe([{"step": s.index, "label": s.label, "top latents": ", ".join(map(str, per_step[i])),
                   "text": s.text} for i, s in enumerate(trace.steps)], hide_index=True, key="rise_steps")


# ----------------------------------------------------------------------------- 3. geometry


def geometry_section(found: dict[str, Any]) -> str:
    st.subheader("3. Decoder-column geometry")
    analysis = found["analysis"]
    sites = [la.site for la in analysis.layers]
    site = st.selectbox("Layer", sites, index=sites.index(analysis.best_site), key="rise_geometry_site")
    layer = analysis.layer(site)
    left, right = st.columns(2)
    with left:
        data = {"site": site, "coords": layer.coords.tolist(), "column_labels": layer.association.column_labels,
                "silhouette": layer.silhouette, "projection": found["analysis_projection"]}
        show_figure(None, data, "rise_decoder_map")
    with right:
        show_figure(silhouette_curve(analysis), analysis.to_dict()["silhouette_per_layer"], "rise_silhouette")
    st.caption("Columns are coloured by the label of the steps whose strongest latent they are; behaviour vectors "
               f"at {site}: {', '.join(sorted(layer.vectors)) or 'none (too few labelled steps)'}.")
    return site


# ----------------------------------------------------------------------------- 4. feature dashboard


def dashboard_section(ctx, found: dict[str, Any], site: str) -> None:
    st.subheader("4. Feature dashboard")
    h, sae = found["harvest"], found["saes"][site]
    layer = found["analysis"].layer(site)
    default = int(layer.top_latents[0, 0]) if len(layer.top_latents) else 0
    latent = st.number_input(f"Latent of the SAE at {site}", 0, sae.cfg.d_sae - 1, default, key="rise_latent")
    board = feature_dashboard(h, sae, site, int(latent), ctx.backend)
    cols = st.columns(2)
    cols[0].metric("Fires on", f"{100 * board.density:.1f}% of steps")
    cols[1].metric("Max activation", f"{board.max_activation:.3g}")
    st.dataframe([{k: s[k] for k in ("activation", "label", "problem_id", "text")} for s in board.top_steps],
                 hide_index=True, key="rise_top_steps")
    left, right = st.columns(2)
    with left:
        show_figure(feature_histogram(board), board, "rise_feature_histogram")
    with right:
        show_figure(feature_labels(board), board.label_frequency, "rise_feature_labels")
    show_figure(feature_tokens(board), {"promoted": board.promoted_tokens, "suppressed": board.suppressed_tokens},
                "rise_feature_tokens")


# ----------------------------------------------------------------------------- 5. steering


ALPHA_STEP = 0.25
ALPHA_STOPS = tuple(round(-1.5 + ALPHA_STEP * i, 2) for i in range(13))  # -1.5 .. 1.5, the slider's stops


def steering_section(ctx, store, found: dict[str, Any], site: str, settings: HarvestSettings, task: str,
                     n: int) -> None:
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

    result = store.get(key) or jobs.run_job(key, work, label=f"Steering: generating {what}", kind="rise-steer",
                                            page="rise", start=True, keep_running_option=False)
    if result is None:
        return
    store.put(key, result)
    vanilla, steered = result.traces[0.0][0], result.traces[float(alpha)][0]
    rows = {r.alpha: r for r in result.rows}
    left, right = st.columns(2)
    for box, title, trace, row, k in ((left, "**Vanilla** (alpha 0)", vanilla, rows[0.0], "rise-vanilla-text"),
                                      (right, f"**Steered** ({name}, {mode}, alpha {alpha:g})", steered,
                                       rows[float(alpha)], "rise-steered-text")):
        with box.container(border=True, key=k):
            st.markdown(title)
            st.text(trace.text)
            st.caption(f"{trace.n_tokens} tokens, {len(trace.steps)} steps, "
                       f"{row.mean_reflection_steps:g} reflection, {row.mean_backtracking_steps:g} backtracking")
    data = result.to_dict()
    show_figure(None, data, "rise_steering")


# ----------------------------------------------------------------------------- 6. confidence


def confidence_section(ctx, store, found: dict[str, Any], site: str, pipeline_key: str) -> None:
    with st.expander("6. Confidence vectors (minimise next-token entropy over decoder-column coefficients)"):
        left, mid, right = st.columns(3)
        iterations = left.number_input("Iterations", 1, 1000, 10, key="rise_conf_iters",
                                       help="the paper runs ~1000 at batch 256 on a GPU")
        batch = mid.number_input("Batch (traces)", 1, 64, 4, key="rise_conf_batch")
        right.write("")
        run_now = right.button("Fit confidence vectors", key="rise_conf_run", icon=":material/bolt:")
        key = ctx.result_key("rise-confidence", pipeline=pipeline_key, site=site, iterations=int(iterations),
                             batch=int(batch), seed=ctx.seed)
        backend, harvest, sae = ctx.backend, found["harvest"], found["saes"][site]

        def work(job: jobs.Job):
            return confidence_vectors(backend, harvest, sae, site, iterations=int(iterations),
                                      batch_size=int(batch), seed=ctx.seed, on_progress=job.progress)

        result = jobs.run_job(key, work, label=f"Fitting {int(iterations)} iterations at {site}",
                              kind="rise-confidence", page="rise", start=run_now)
        if result is None and jobs.registry().for_key(key) is not None:
            return
        if result is None:
            st.info(f"Press **Fit confidence vectors** to learn coefficients over the decoder columns at {site}.")
            return
        show_figure(confidence_curve(result), result, "rise_confidence")
        st.dataframe([{"column": c, "coefficient": float(result.coefficients[c])} for c in result.top_columns],
                     hide_index=True, key="rise_conf_top")


# ----------------------------------------------------------------------------- the page


def render(ctx) -> None:
    st.title("RISE reasoning vectors")
    st.caption("Zhang et al.: cut chain-of-thought traces into steps, train a sparse autoencoder on one residual "
               "vector per step (no labels), and find decoder columns for reflection and backtracking that steer "
               "the behaviour.")
    store = results()
    found, settings, task, n = harvest_section(ctx, store)
    if found is None:
        return
    try:
        timeline_section(found)
    except ThoughtscopeError as err:
        st.error(str(err))
    site = geometry_section(found)
    try:
        dashboard_section(ctx, found, site)
    except ThoughtscopeError as err:
        st.error(str(err))
    try:
        steering_section(ctx, store, found, site, settings, task, n)
    except ThoughtscopeError as err:
        st.error(str(err))
    try:
        confidence_section(ctx, store, found, site, found["key"])
    except ThoughtscopeError as err:
        st.error(str(err))
