"""What the visual attribution page draws: the faithfulness study (a job, or the stored one), the stored study's
first scene span by span, on a model without vision the toy VLM's stored result with a switch to it, and
a generation streamed span by span, and afterwards one span's heat map with its exhaustive effects on demand (a job)."""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from analyses.visual_attribution import cell_map, exhaustive_effects
from analyses.visual_attribution.evaluate import run_study
from analyses.visual_attribution.ship import DEFAULT_MODEL, EPOCHS, NAME, STUDY_SETTINGS
from analyses.visual_attribution.stream import stream_attribution
from app.export import show_figure
from app.figures.visual_attribution import faithfulness_figure, heatmap_figure
from app.jobs import one_step, run_job
from app.switch import stored_elsewhere
from probes.toys import vlm
from probes.vision import expand

PAGE_NAME = "visual_attribution"


def faithfulness_section(ctx, stored: Any) -> None:
    """The study of `thoughtscope eval vis-attr` at a small n, plotted with intervals (toy-vlm only): the shipped
    one at the page's defaults, else run here as a job."""
    st.subheader("Faithfulness on held-out scenes")
    c1, c2, c3, c5, c4 = st.columns(5)
    d = STUDY_SETTINGS
    n_train = int(c1.number_input("Training scenes", 2, 200, d["n_train"], key="va_ntrain"))
    n_eval = int(c2.number_input("Held-out scenes", 2, 200, d["n_eval"], key="va_neval"))
    subsets = int(c3.number_input("LDS cell sets per scene", 0, 32, d["subsets"], key="va_lds"))
    kind = c5.radio("Study regions", ["grid", "objects"], key="va_study_regions",
                    help="grid: the scene's 9 cells; objects: each object's true box and the background (the same table)")
    settings = {"n_train": n_train, "n_eval": n_eval, "subsets": subsets, "seed": ctx.seed}
    if kind != "grid":  # the shipped study is over the grid (its settings carry no regions key)
        settings["regions"] = kind
    matches = bool(stored) and stored.manifest.get("settings") == settings
    c4.write("")
    start = c4.button("Run the study again" if matches else "Run the study", key="va_study")
    backend = ctx.backend

    def work(job):
        return run_study(backend, n_train=n_train, n_eval=n_eval, seed=settings["seed"], epochs=EPOCHS,
                         n_subsets=subsets, progress=job.progress, regions=kind).to_dict()

    result = run_job(ctx.result_key("vis_attr_study", **settings), work, label=f"Faithfulness study ({n_train} + "
                     f"{n_eval} scenes)", kind="va-study", page=PAGE_NAME, start=start)
    provenance = None
    if result is None and matches:
        st.success(stored.label(), icon=":material/inventory_2:")
        result, provenance = stored.json("study.json"), stored.provenance
    elif result is None:
        st.info("The stored study was made with other settings (10 + 10 scenes, 8 LDS sets, seed 0); press **Run the "
                "study** for yours." if stored else "Press **Run the study** to score every method against "
                "exhaustive ablation on held-out scenes.")
        return
    draw_study(ctx, result, provenance)


def draw_study(ctx, result: dict[str, Any], provenance: dict[str, Any] | None) -> None:
    data = {"metrics": result["metrics"]}
    show_figure(faithfulness_figure(data), data, "vis_attr_faithfulness",
                provenance=provenance or ctx.provenance(settings=result["settings"], data="probes.toys.vlm scenes",
                                                        split="train (estimator) / eval (scores)", prompt=None))
    r2 = result["metrics"]["amortized_r2_all_pairs"]
    speedup = result["costs"]["speedup_exhaustive_over_amortized"]
    st.caption(f"amortized R^2 over all (span, region) pairs: {r2:.3f}; "
               f"exhaustive / amortized cost per span: {speedup:.1f}")


def stored_scene(stored: Any, grid: int, key: str = "va_stored") -> None:
    """The study's first held-out scene (the page's scene seed 0): each span of its reference description with
    its amortized, attention and exhaustive scores per cell, from the stored study."""
    study = stored.json("study.json")
    ex = vlm.examples("eval", 1, seed=STUDY_SETTINGS["seed"])[0]
    example = study["example"]
    names = [ex.trace[s.start:s.end] for s in ex.spans]
    st.subheader("Where the reference description's spans look (stored study, scene 0)")
    c1, c2 = st.columns(2)
    pick = c1.selectbox("Span", list(range(len(names))), format_func=lambda i: f"{i}: {names[i]}", key=f"{key}_span")
    method = c2.radio("Scores", ["amortized", "attention", "exhaustive"], horizontal=True, key=f"{key}_method")
    unit = {"amortized": "nats", "attention": "attention", "exhaustive": "nats"}[method]
    scores = {"amortized": example["amortized"], "attention": example["attention"], "exhaustive": example["effects"]}
    data = heatmap_data(ex.image, grid, np.asarray(scores[method][pick]), method, unit,
                 f"stored: span {pick} {names[pick]!r} (true cell {example['true_cells'][pick]}), {method}")
    show_figure(heatmap_figure(data), data, "vis_attr_stored_heatmap", provenance=stored.provenance,
                figure="vis_attr_heatmap")


def elsewhere_section(ctx) -> None:
    """On a model without vision: the toy VLM's shipped result, labelled as the toy's, and a switch to it."""
    stored = stored_elsewhere(NAME, DEFAULT_MODEL, ctx.model_id, key="va_switch")
    if stored is None:
        return
    stored_scene(stored, vlm.GRID)
    st.subheader(f"Faithfulness of `{DEFAULT_MODEL}` on held-out scenes")  # code: ":small" is a directive in Markdown
    draw_study(ctx, stored.json("study.json"), stored.provenance)


def heatmap_data(image: np.ndarray, grid: int, scores: np.ndarray, method: str, unit: str, title: str,
                 spec: Any = None, regions: Any = None) -> dict[str, Any]:
    """The heat map's data: `scores` per visual token ([grid * grid], reading order) or, with `spec` and
    `regions`, one score per region painted on its tokens (a token in no region draws nothing, one in
    several their mean) with each region's box as drawn outlined."""
    step_y, step_x = max(1, image.shape[0] // 96), max(1, image.shape[1] // 96)
    small = image[::step_y, ::step_x]
    out: dict[str, Any] = {"image": small.tolist(), "method": method, "unit": unit, "title": title}
    if regions is None:
        out["scores"] = np.asarray(scores).reshape(grid, grid).round(6).tolist()
        return out
    painted = cell_map(spec, regions, np.asarray(scores, dtype=float), empty=np.nan).round(6)
    out["scores"] = [[None if np.isnan(v) else float(v) for v in row] for row in painted]
    out["boxes"] = [{"name": r.name, "box": [r.box[0] / step_x, r.box[1] / step_y, r.box[2] / step_x,
                                             r.box[3] / step_y]} for r in regions if r.box is not None]
    return out


def live_generation(ctx, prompt: str, image: np.ndarray, regions: Any, est: Any, spec: Any, answer: Any,
                    live: Any) -> dict[str, Any]:
    """Generate, streaming the answer into `answer` and each span's heat map into `live` as soon as the span ends
    (the estimator's predicted effects when there is one, else raw attention). Returns the run: token ids,
    image, spans and text."""
    ids, _ = expand(spec, ctx.backend.encode(prompt), 1)
    text, spans, generated = "", [], []
    for event in stream_attribution(ctx.backend, prompt, image, regions, est,
                                    max_new_tokens=ctx.settings.max_new_tokens):
        text += event.record.text
        generated.append(event.record.token_id)
        answer.markdown("**Answer:** " + text)
        if event.span is not None:  # the heat map of the span that just ended
            s = event.span
            spans.append(s)
            method = "amortized" if s.predicted is not None else "raw attention"
            scores = s.predicted if s.predicted is not None else s.attention
            live.plotly_chart(heatmap_figure(heatmap_data(image, spec.grid, scores, method, "",
                                                          f"live: span {s.index} {s.text!r}, {method}", spec,
                                                          regions)),
                              theme=None, config={"displaylogo": False})
    return {"ids": ids + generated, "image": image, "spans": spans, "text": text}


def span_section(ctx, run: dict[str, Any], spec: Any, regions: Any) -> None:
    """The finished generation's spans: one span's raw attention (or predicted effects) over the image, and its
    exhaustive effects (attention to each visual token masked in every layer) on demand, as a job."""
    spans = run["spans"]
    labels = [f"{s.index}: {s.text}" for s in spans]
    pick = st.selectbox("Span", list(range(len(spans))), format_func=lambda i: labels[i], key="va_span")
    span = spans[pick]
    methods = ["raw attention"] + (["amortized"] if span.predicted is not None else [])
    method = st.radio("Scores", methods, horizontal=True, key="va_method")
    scores, unit = (span.attention, "attention") if method == "raw attention" else (span.predicted, "nats")
    data = heatmap_data(run["image"], spec.grid, scores, method, unit, f"span {labels[pick]!r}: {method}", spec,
                        regions)
    show_figure(heatmap_figure(data), data, "vis_attr_heatmap")
    start = st.button("Exhaustive effects for this span", key="va_exhaustive")
    backend, ids, picture = ctx.backend, run["ids"], run["image"]

    work = one_step("exhaustive effects", lambda: exhaustive_effects(backend, ids, picture, [(span.start, span.end)],
                                                                     regions)[0])
    key = ctx.result_key("va-exhaustive", ids=list(map(int, ids)), span=[span.start, span.end],
                         image=hash(np.asarray(picture).tobytes()), regions=[list(r.cells) for r in regions])
    eff = run_job(key, work, label=f"Exhaustive effects of span {labels[pick]!r}", kind="va-exhaustive",
                  page=PAGE_NAME, start=start)
    if eff is not None:  # only for the span it was computed for
        done = heatmap_data(run["image"], spec.grid, eff, "exhaustive effect", "nats",
                            f"span {labels[pick]!r}: log-prob drop, each region masked", spec, regions)
        show_figure(heatmap_figure(done), done, "vis_attr_exhaustive", figure="vis_attr_heatmap")
