"""The RISE page's harvest options, and what it draws from a finished harvest + SAEs: the quality of each
layer's SAE (held-out explained variance, L0, AUROC), a trace's step timeline, the decoder-column geometry,
one latent's feature dashboard, a steered pair of traces, and the confidence vectors (a job)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from analyses.families import default_task
from analyses.rise import BEHAVIOURS, RiseOptions, confidence_vectors, feature_dashboard, quality_warning, saved_saes
from analyses.rise import ship as rise_ship
from app import jobs
from app.export import show_figure
from app.figures.rise import (confidence_curve, feature_histogram, feature_labels, feature_tokens, silhouette_curve,
                              step_timeline)
from app.sections.tasks import at_most_held, task_picker


def options_widgets(ctx) -> RiseOptions:
    """The harvest + SAE options, defaulting to what the page opens on for this model (`rise_ship.page_options`)."""
    n_layers = ctx.backend.arch().n_layers
    own = default_task(ctx.model_id)
    defaults = rise_ship.page_options(ctx.model_id, n_layers, ctx.settings.max_new_tokens, ctx.seed)
    c1, c2, c3 = st.columns(3)
    task = task_picker(c1, "Task", own, "rise_task")
    n = c2.number_input("Problems", 2, 2000, defaults.n, key="rise_n",
                        help="the paper uses hundreds; a dozen keeps a CPU quick")
    n = at_most_held(c2, task, int(n))
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
    return RiseOptions(task=task, n=int(n), seed=ctx.seed, layers=tuple(sorted(layers)),
                          max_new_tokens=ctx.settings.max_new_tokens, batch_size=max(1, min(16, int(n))),
                          augment="templated" if augment else "none", sae_steps=int(sae_steps), projection=projection,
                          d_sae=int(d_sae) or None, l1=float(l1) or None, heldout=float(heldout),
                          temperature=float(temperature))


def draw_harvest(found: dict[str, Any], model_id: str) -> None:
    """Counts of the harvest, the held-out quality of the SAEs per layer and where they were saved."""
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
        st.dataframe([{"folder": s.folder, "site": s.site, "d_sae": s.d_sae,
                       "held-out EV": None if s.heldout_explained_variance is None else
                       round(s.heldout_explained_variance, 3)} for s in saved_saes(model_id)],
                     hide_index=True, key="rise_saved")


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


def draw_steering(result: Any, alpha: float, name: str, mode: str) -> None:
    """The vanilla and the steered trace side by side, with their step counts; the reflection curve."""
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
    show_figure(None, result.to_dict(), "rise_steering")


def confidence_section(ctx, found: dict[str, Any], site: str, pipeline_key: str) -> None:
    with st.expander("6. Confidence vectors (minimise next-token entropy over decoder-column coefficients)"):
        left, mid, right = st.columns(3)
        iterations = int(left.number_input("Iterations", 1, 1000, 10, key="rise_conf_iters",
                                           help="the paper runs ~1000 at batch 256 on a GPU"))
        batch = int(mid.number_input("Batch (traces)", 1, 64, 4, key="rise_conf_batch"))
        right.write("")
        run_now = right.button("Fit confidence vectors", key="rise_conf_run", icon=":material/bolt:")
        key = ctx.result_key("rise-confidence", pipeline=pipeline_key, site=site, iterations=iterations,
                             batch=batch, seed=ctx.seed)
        backend, harvest, sae, seed = ctx.backend, found["harvest"], found["saes"][site], ctx.seed
        result = jobs.run_job(key, lambda job: confidence_vectors(backend, harvest, sae, site, iterations=iterations,
                                                                  batch_size=batch, seed=seed,
                                                                  on_progress=job.progress),
                              label=f"Fitting {iterations} iterations at {site}", kind="rise-confidence", page="rise",
                              start=run_now)
        if result is None and jobs.registry().for_key(key) is not None:
            return
        if result is None:
            st.info(f"Press **Fit confidence vectors** to learn coefficients over the decoder columns at {site}.")
            return
        show_figure(confidence_curve(result), result, "rise_confidence")
        st.dataframe([{"column": c, "coefficient": float(result.coefficients[c])} for c in result.top_columns],
                     hide_index=True, key="rise_conf_top")
