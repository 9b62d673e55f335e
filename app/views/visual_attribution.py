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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from analyses.visual_attribution import exhaustive_effects, grid_regions
from app.context import shows_errors
from app.export import show_figure
from app.figures.visual_attribution import faithfulness_figure, heatmap_figure
from app.registry import PageSpec

# Only what every local backend has: the page opens with its title on a text-only model and says why it
# is empty (the browser tests wait for every page's h1).
PAGE = PageSpec("Visual attribution", ":material/image_search:", 60, requires=("generate", "trace"))
NEEDS = ("vision", "interventions", "attention")
N_FIT_SCENES = 10


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


def _estimator(ctx) -> Any:
    """The fitted estimator of this model (toy-vlm: fitted here on demand), or None."""
    key = f"va_est::{ctx.model_id}"
    if _is_toy(ctx) and st.button(f"Fit the estimator ({N_FIT_SCENES} training scenes)", key="va_fit"):
        from analyses.visual_attribution.estimator import AmortizedAttribution
        from analyses.visual_attribution.evaluate import toy_scene
        from probes.toys import vlm

        with shows_errors(), st.spinner("exhaustive effects on training scenes..."):
            scenes = [toy_scene(ctx.backend, ex) for ex in vlm.examples("train", N_FIT_SCENES, seed=ctx.seed)]
            groups, offset = [], 0
            for s in scenes:
                groups.append(np.repeat(offset + np.arange(s.effects.shape[0]), s.effects.shape[1]))
                offset += s.effects.shape[0]
            st.session_state[key] = AmortizedAttribution(seed=ctx.seed).fit(
                np.concatenate([s.features.reshape(-1, s.features.shape[-1]) for s in scenes]),
                np.concatenate([s.effects.reshape(-1) for s in scenes]), np.concatenate(groups))
    c1, c2 = st.columns([3, 1])
    path = c1.text_input("Or a saved estimator (PATH of `thoughtscope eval vis-attr --save PATH`)", key="va_path")
    if c2.button("Load", key="va_load") and path.strip():
        with shows_errors():
            st.session_state[key] = load_estimator(path.strip(), ctx.backend.info()["arch"])
    est = st.session_state.get(key)
    st.caption("amortized estimator: " + ("ready" if est is not None else
                                          "none yet (raw attention only)" + ("" if _is_toy(ctx) else
                                                                             ": fitting here needs toy-vlm scenes")))
    return est


def load_estimator(path: str, arch: dict[str, Any]) -> Any:
    """A saved `AmortizedAttribution`, checked against this model: one feature per layer and head."""
    from analyses.visual_attribution.estimator import AmortizedAttribution
    from thoughtscope.errors import BadInputError

    est = AmortizedAttribution.load(path)
    want = arch["n_layers"] * arch["n_heads"]
    if est.n_features_in_ != want:
        raise BadInputError(f"{path} was fitted on {est.n_features_in_} attention features; this model has "
                            f"{arch['n_layers']} layers x {arch['n_heads']} heads = {want}: fit one on this model")
    return est


def _faithfulness(ctx) -> None:
    """The study of `thoughtscope eval vis-attr` at a small n, plotted with intervals (toy-vlm only)."""
    from analyses.visual_attribution.evaluate import run_study

    with st.expander("Faithfulness on held-out scenes"):
        c1, c2, c3 = st.columns(3)
        n_train = int(c1.number_input("Training scenes", 2, 200, 10, key="va_ntrain"))
        n_eval = int(c2.number_input("Held-out scenes", 2, 200, 10, key="va_neval"))
        subsets = int(c3.number_input("LDS cell sets per scene", 0, 32, 8, key="va_lds"))
        key = ctx.result_key("vis_attr_study", n_train=n_train, n_eval=n_eval, subsets=subsets, seed=ctx.seed)
        if st.button("Run the study", key="va_study"):
            with shows_errors(), st.spinner("exhaustive effects, gradients and masked sets..."):
                st.session_state[key] = run_study(ctx.backend, n_train=n_train, n_eval=n_eval, seed=ctx.seed,
                                                  n_subsets=subsets).to_dict()
        result = st.session_state.get(key)
        if result is not None:
            data = {"metrics": result["metrics"]}
            show_figure(faithfulness_figure(data), data, "vis_attr_faithfulness",
                        provenance=ctx.provenance(settings=result["settings"], data="probes.toys.vlm scenes",
                                                  split="train (estimator) / eval (scores)", prompt=None))
            r2 = result["metrics"]["amortized_r2_all_pairs"]
            speedup = result["costs"]["speedup_exhaustive_over_amortized"]
            st.caption(f"amortized R^2 over all (span, region) pairs: {r2:.3f}; "
                       f"exhaustive / amortized cost per span: {speedup:.1f}")


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
        return
    spec = spec_of(ctx.backend)
    image, prompt = _scene(ctx, spec)
    est = _estimator(ctx)
    regions = grid_regions(spec, spec.grid, spec.grid)
    st.caption(f"{spec.family} token grid {spec.grid} x {spec.grid}: one region per visual token")
    if _is_toy(ctx):
        _faithfulness(ctx)
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
            st.session_state.pop("va_exh", None)
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
    if st.button("Exhaustive effects for this span", key="va_exhaustive"):
        with shows_errors():
            eff = exhaustive_effects(ctx.backend, run["ids"], run["image"], [(span.start, span.end)], regions)[0]
            st.session_state["va_exh"] = (pick, _data(run["image"], spec.grid, eff, "exhaustive effect", "nats",
                                                      f"span {labels[pick]!r}: log-prob drop, each token masked"))
    done = st.session_state.get("va_exh")
    if done and done[0] == pick:  # only for the span it was computed for
        show_figure(heatmap_figure(done[1]), done[1], "vis_attr_exhaustive", figure="vis_attr_heatmap")
