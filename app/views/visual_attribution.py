"""Visual attribution: which image regions each span of a vision-language model's answer draws on.

Compose a toy-vlm scene (a seeded random image for other VLMs) or upload an image, and generate.
The answer streams, and each span, as soon as it ends, gets a heat map laid over the image (one cell per
visual token) from the attention rows the generation already computed: raw attention, or the amortized estimator's
predicted effects once there is one (toy-vlm: "Fit the estimator" fits it on training scenes with
exhaustive effects as targets; any VLM: load one saved by `thoughtscope eval vis-attr --save`).
Afterwards pick any span; its exhaustive effects (attention to each visual token masked in every
layer: the drop of the span's log-prob) are computed on demand. Everything goes through the Backend
(`analyses.visual_attribution`); every figure exports.

An uploaded image replaces the composed scene (toy-vlm was trained on its own scenes only). For
toy-vlm, "Faithfulness" runs the study of `thoughtscope eval vis-attr` at a small n and plots each
method's scores with their intervals; see docs/visual_attribution.md.

On the toy VLM the page opens on its shipped result (`thoughtscope ship visual-attribution`, toy-vlm:small:
the fitted estimator, the default study and the default scene's span maps), labelled as stored; on a model
without vision it shows that toy's result, labelled as the toy's, with a button that switches to it.
Fitting the estimator, the study and a span's exhaustive effects run as jobs (`app.jobs`); the generation
streams its spans' heat maps as it goes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st

from analyses.visual_attribution import exhaustive_effects, grid_regions
from analyses.visual_attribution.ship import DEFAULT_MODEL, EPOCHS, NAME, STUDY_SETTINGS, load_estimator as _load_shipped
from app.context import shows_errors
from app.export import show_figure
from app.figures.visual_attribution import faithfulness_figure, heatmap_figure
from app.jobs import run_job
from app.registry import PageSpec
from probes.arch import ArchInfo
from thoughtscope import shipped

# Only what every local backend has: the page opens with its title on a text-only model and says why it
# is empty (the browser tests wait for every page's h1).
PAGE = PageSpec("Visual attribution", ":material/image_search:", 60, requires=("generate", "trace"))
NEEDS = ("vision", "interventions", "attention")
N_FIT_SCENES = STUDY_SETTINGS["n_train"]
PAGE_NAME = "visual_attribution"


def _is_toy(ctx) -> bool:
    return str(ctx.model_id).startswith("toy-vlm")


def uploaded_image(data: bytes | None) -> np.ndarray | None:
    """An uploaded file's bytes as an RGB uint8 array (checked by probes.vision), or None."""
    from probes.vision import load_image

    return None if data is None else np.asarray(load_image(bytes(data)))


def _scene(ctx, spec) -> tuple[np.ndarray, str]:
    """(image, prompt with <image>) from the widgets: a composed toy scene or a seeded random image,
    unless an image is uploaded."""
    c1, c2 = st.columns(2)
    seed = int(c1.number_input("Scene seed", 0, 10_000, 0, key="va_seed"))
    upload = st.file_uploader("Or upload an image (PNG or JPEG; resized to the model's input)",
                              type=["png", "jpg", "jpeg"], key="va_upload")
    image = None
    with shows_errors():
        image = uploaded_image(upload.getvalue() if upload is not None else None)
    if _is_toy(ctx):
        from probes.toys import vlm

        ex = vlm.examples("eval", 1, seed=seed)[0]
        question = c2.text_input("Question", ex.question, key=f"va_q{seed}")
        return (ex.image if image is None else image), vlm.prompt_text(question)
    if image is None:
        side = spec.image_size
        image = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    prompt = c2.text_input(f"Prompt (put {spec.placeholder} where the image goes)",
                           f"Describe {spec.placeholder} in a few words:", key="va_p")
    return image, prompt


@st.cache_resource(show_spinner=False, max_entries=4)
def _shipped_estimator(folder: str, digest: str) -> Any:
    """The verified shipped estimator, read once per process (`digest`: its weights' sha256)."""
    return _load_shipped(shipped.Shipped(Path(folder), json.loads((Path(folder) / shipped.MANIFEST).read_text())))


def _estimator(ctx, stored: Any) -> Any:
    """The estimator the heat maps use: one fitted or loaded here, else the shipped one (toy-vlm), or None.
    "Fit the estimator" runs as a job (toy-vlm scenes, exhaustive effects as targets)."""
    from analyses.visual_attribution.evaluate import fit_estimator

    key = f"va_est::{ctx.model_id}"
    if _is_toy(ctx):
        label = (f"Fit the estimator again ({N_FIT_SCENES} training scenes)" if stored else
                 f"Fit the estimator ({N_FIT_SCENES} training scenes)")
        start = st.button(label, key="va_fit")
        backend, seed = ctx.backend, ctx.seed
        fitted = run_job(ctx.result_key("va-estimator", n=N_FIT_SCENES, seed=seed, epochs=EPOCHS),
                         lambda job: fit_estimator(backend, N_FIT_SCENES, seed=seed, epochs=EPOCHS, progress=job.progress),
                         label=f"Fitting the estimator on {N_FIT_SCENES} training scenes", kind="va-estimator",
                         page=PAGE_NAME, start=start)
        if fitted is not None and st.session_state.get(f"{key}::fitted") is not fitted:  # a new fit, taken once
            st.session_state[key] = st.session_state[f"{key}::fitted"] = fitted
    c1, c2 = st.columns([3, 1])
    path = c1.text_input("Or a saved estimator (PATH of `thoughtscope eval vis-attr --save PATH`)", key="va_path")
    if c2.button("Load", key="va_load") and path.strip():
        with shows_errors():
            st.session_state[key] = load_estimator(path.strip(), ctx.backend.arch())
    est = st.session_state.get(key)
    where = "ready" if est is not None else ""
    if est is None and stored:
        est = _shipped_estimator(str(stored.folder), stored.manifest["files"]["estimator.safetensors"])
        where = f"the shipped one ({N_FIT_SCENES} training scenes, seed {STUDY_SETTINGS['seed']})"
    st.caption("amortized estimator: " + (where if est is not None else
                                          "none yet (raw attention only)" + ("" if _is_toy(ctx) else
                                                                             ": fitting here needs toy-vlm scenes")))
    return est


def load_estimator(path: str, arch: ArchInfo) -> Any:
    """A saved `AmortizedAttribution`, checked against this model: one feature per layer and head."""
    from analyses.visual_attribution.estimator import AmortizedAttribution
    from thoughtscope.errors import BadInputError

    est = AmortizedAttribution.load(path)
    want = arch.n_layers * arch.n_heads
    if est.n_features_in_ != want:
        raise BadInputError(f"{path} was fitted on {est.n_features_in_} attention features; this model has "
                            f"{arch.n_layers} layers x {arch.n_heads} heads = {want}: fit one on this model")
    return est


def _faithfulness(ctx, stored: Any) -> None:
    """The study of `thoughtscope eval vis-attr` at a small n, plotted with intervals (toy-vlm only): the shipped
    one at the page's defaults, else run here as a job."""
    from analyses.visual_attribution.evaluate import run_study

    st.subheader("Faithfulness on held-out scenes")
    c1, c2, c3, c4 = st.columns(4)
    d = STUDY_SETTINGS
    n_train = int(c1.number_input("Training scenes", 2, 200, d["n_train"], key="va_ntrain"))
    n_eval = int(c2.number_input("Held-out scenes", 2, 200, d["n_eval"], key="va_neval"))
    subsets = int(c3.number_input("LDS cell sets per scene", 0, 32, d["subsets"], key="va_lds"))
    settings = {"n_train": n_train, "n_eval": n_eval, "subsets": subsets, "seed": ctx.seed}
    matches = bool(stored) and stored.manifest.get("settings") == settings
    c4.write("")
    start = c4.button("Run the study again" if matches else "Run the study", key="va_study")
    backend = ctx.backend

    def work(job):
        return run_study(backend, n_train=n_train, n_eval=n_eval, seed=settings["seed"], epochs=EPOCHS,
                         n_subsets=subsets, progress=job.progress).to_dict()

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
    _draw_study(ctx, result, provenance)


def _draw_study(ctx, result: dict[str, Any], provenance: dict[str, Any] | None) -> None:
    data = {"metrics": result["metrics"]}
    show_figure(faithfulness_figure(data), data, "vis_attr_faithfulness",
                provenance=provenance or ctx.provenance(settings=result["settings"], data="probes.toys.vlm scenes",
                                                        split="train (estimator) / eval (scores)", prompt=None))
    r2 = result["metrics"]["amortized_r2_all_pairs"]
    speedup = result["costs"]["speedup_exhaustive_over_amortized"]
    st.caption(f"amortized R^2 over all (span, region) pairs: {r2:.3f}; "
               f"exhaustive / amortized cost per span: {speedup:.1f}")


def _stored_scene(stored: Any, grid: int, key: str = "va_stored") -> None:
    """The study's first held-out scene (the page's scene seed 0): each span of its reference description with
    its amortized, attention and exhaustive scores per cell, from the stored study."""
    from probes.toys import vlm

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
    data = _data(ex.image, grid, np.asarray(scores[method][pick]), method, unit,
                 f"stored: span {pick} {names[pick]!r} (true cell {example['true_cells'][pick]}), {method}")
    show_figure(heatmap_figure(data), data, "vis_attr_stored_heatmap", provenance=stored.provenance,
                figure="vis_attr_heatmap")


def elsewhere_section(ctx) -> None:
    """On a model without vision: the toy VLM's shipped result, labelled as the toy's, and a switch to it."""
    from app.switch import switch_button
    from probes.toys import vlm

    stored = shipped.find(NAME, DEFAULT_MODEL, None)
    if not stored:
        (st.warning if stored.damaged else st.caption)(stored.reason)
        return
    st.markdown(f"**Below: the stored result of `{DEFAULT_MODEL}`, not of `{ctx.model_id}`.** {stored.label()}")
    switch_button(DEFAULT_MODEL, key="va_switch")
    _stored_scene(stored, vlm.GRID)
    st.subheader(f"Faithfulness of `{DEFAULT_MODEL}` on held-out scenes")  # code: ":small" is a directive in Markdown
    _draw_study(ctx, stored.json("study.json"), stored.provenance)


def _data(image: np.ndarray, grid: int, scores: np.ndarray, method: str, unit: str, title: str) -> dict[str, Any]:
    small = image[:: max(1, image.shape[0] // 96), :: max(1, image.shape[1] // 96)]
    return {"image": small.tolist(), "scores": np.asarray(scores).reshape(grid, grid).round(6).tolist(),
            "method": method, "unit": unit, "title": title}


def render(ctx) -> None:
    from analyses.visual_attribution.stream import stream_attribution
    from probes.vision import expand, spec_of

    st.title("Visual attribution")
    have = ctx.backend.capabilities()
    missing = [n for n in NEEDS if not have.get(n)]
    if missing:
        st.info(f"`{ctx.model_id}` cannot do {', '.join(missing)} here: this page needs a vision-language model "
                "with local weights. Pick toy-vlm (trained here), tiny-random:llava or an hf: LLaVA / SmolVLM folder "
                "in the sidebar.")
        elsewhere_section(ctx)
        return
    spec = spec_of(ctx.backend)
    stored = shipped.find(NAME, ctx.model_id, ctx.backend.info()["fingerprint"]) if _is_toy(ctx) else None
    if stored is not None and not stored and (stored.damaged or "other weights" in stored.reason):
        st.warning(stored.reason + " Fit the estimator and run the study here.")
    stored = stored or None
    image, prompt = _scene(ctx, spec)
    est = _estimator(ctx, stored)
    regions = grid_regions(spec, spec.grid, spec.grid)
    st.caption(f"{spec.family} token grid {spec.grid} x {spec.grid}: one region per visual token")
    if stored is not None and st.session_state.get("va_seed", 0) == STUDY_SETTINGS["seed"] and \
            st.session_state.get("va_upload") is None:
        _stored_scene(stored, spec.grid)
    if _is_toy(ctx):
        _faithfulness(ctx, stored)
    answer, live = st.empty(), st.empty()  # the streamed answer, then the finished one
    if st.button("Generate", key="va_generate"):
        with shows_errors():
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
                    live.plotly_chart(heatmap_figure(_data(image, spec.grid, scores, method, "",
                                                           f"live: span {s.index} {s.text!r}, {method}")),
                                      theme=None, config={"displaylogo": False})
            st.session_state["va_run"] = {"ids": ids + generated, "image": image, "spans": spans, "text": text}
    run = st.session_state.get("va_run")
    live.empty()  # the pickable figures below replace the live one
    if not run:
        st.info("Generate to see the answer's spans and where each one looks.")
        return
    answer.markdown("**Answer:** " + run["text"])
    spans = run["spans"]
    if not spans:
        st.warning("the answer holds no span to attribute")
        return
    labels = [f"{s.index}: {s.text}" for s in spans]
    pick = st.selectbox("Span", list(range(len(spans))), format_func=lambda i: labels[i], key="va_span")
    span = spans[pick]
    methods = ["raw attention"] + (["amortized"] if span.predicted is not None else [])
    method = st.radio("Scores", methods, horizontal=True, key="va_method")
    scores, unit = (span.attention, "attention") if method == "raw attention" else (span.predicted, "nats")
    data = _data(run["image"], spec.grid, scores, method, unit, f"span {labels[pick]!r}: {method}")
    show_figure(heatmap_figure(data), data, "vis_attr_heatmap")
    start = st.button("Exhaustive effects for this span", key="va_exhaustive")
    backend, ids, picture = ctx.backend, run["ids"], run["image"]

    def work(job):
        job.progress("exhaustive effects", 0, 1)
        eff = exhaustive_effects(backend, ids, picture, [(span.start, span.end)], regions)[0]
        job.progress("exhaustive effects", 1, 1)
        return eff

    key = ctx.result_key("va-exhaustive", ids=list(map(int, ids)), span=[span.start, span.end],
                         image=hash(np.asarray(picture).tobytes()))
    eff = run_job(key, work, label=f"Exhaustive effects of span {labels[pick]!r}", kind="va-exhaustive",
                  page=PAGE_NAME, start=start)
    if eff is not None:  # only for the span it was computed for
        done = _data(run["image"], spec.grid, eff, "exhaustive effect", "nats",
                     f"span {labels[pick]!r}: log-prob drop, each token masked")
        show_figure(heatmap_figure(done), done, "vis_attr_exhaustive", figure="vis_attr_heatmap")
