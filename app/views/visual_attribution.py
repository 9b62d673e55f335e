"""Visual attribution: which image regions each span of a vision-language model's answer draws on.

Compose a toy-vlm scene (a seeded random image for other VLMs) or upload an image, and generate.
The answer streams, and each span, as soon as it ends, gets a heat map laid over the image (one cell per
visual token) from the attention rows the generation already computed: raw attention, or the amortized estimator's
predicted effects once there is one (toy-vlm: "Fit the estimator" fits it on training scenes with
exhaustive effects as targets; any VLM: load one saved by `thoughtscope eval vis-attr --save`).
Afterwards pick any span; its exhaustive effects (attention to each region masked in every
layer: the drop of the span's log-prob) are computed on demand. Regions are every visual token, the
composed toy scene's objects, boxes dragged on the image or typed, or an uploaded regions JSON (boxes
and masks in pixels of the image as given; probes.image_regions maps them to each family's tokens). Everything goes through the Backend
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

from analyses.visual_attribution import grid_regions, object_regions, regions_from_json
from analyses.visual_attribution.estimator import AmortizedAttribution
from analyses.visual_attribution.evaluate import fit_estimator
from analyses.visual_attribution.ship import EPOCHS, NAME, STUDY_SETTINGS, load_estimator as _load_shipped
from app.context import shows_errors
from app.jobs import run_job
from app.registry import PageSpec
from app.sections.visual_attribution import (elsewhere_section, faithfulness_section, live_generation, span_section,
                                             stored_scene)
from probes.arch import ArchInfo
from probes.toys import vlm
from probes.vision import load_image, spec_of
from thoughtscope import shipped
from thoughtscope.errors import BadInputError

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
    return None if data is None else np.asarray(load_image(bytes(data)))


def _scene(ctx, spec) -> tuple[np.ndarray, str, Any]:
    """(image, prompt with <image>, the composed toy scene or None) from the widgets: a composed toy scene or
    a seeded random image, unless an image is uploaded."""
    c1, c2 = st.columns(2)
    seed = int(c1.number_input("Scene seed", 0, 10_000, 0, key="va_seed"))
    upload = st.file_uploader("Or upload an image (PNG or JPEG; resized to the model's input)",
                              type=["png", "jpg", "jpeg"], key="va_upload")
    image = None
    with shows_errors():
        image = uploaded_image(upload.getvalue() if upload is not None else None)
    if _is_toy(ctx):
        ex = vlm.examples("eval", 1, seed=seed)[0]
        question = c2.text_input("Question", ex.question, key=f"va_q{seed}")
        return (ex.image if image is None else image), vlm.prompt_text(question), (ex if image is None else None)
    if image is None:
        side = spec.image_size
        image = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    prompt = c2.text_input(f"Prompt (put {spec.placeholder} where the image goes)",
                           f"Describe {spec.placeholder} in a few words:", key="va_p")
    return image, prompt, None


REGION_CHOICES = ("visual tokens", "scene objects", "boxes", "regions JSON")
BOXES_HELP = "one box per line: name x0 y0 x1 y1 (pixels of the image as given, exclusive ends)"


def parse_boxes(text: str) -> list[dict[str, Any]]:
    """The boxes text area's lines ("name x0 y0 x1 y1"; the name may hold spaces) as regions-JSON entries."""
    out = []
    for n, line in enumerate(ln for ln in text.splitlines() if ln.strip()):
        parts = line.split()
        try:
            if len(parts) < 4:
                raise ValueError(line)
            box = [float(v) for v in parts[-4:]]
        except ValueError as err:
            raise BadInputError(f"boxes line {n + 1} {line.strip()!r}: {BOXES_HELP}") from err
        out.append({"name": " ".join(parts[:-4]) or f"box {n}", "box": box})
    if not out:
        raise BadInputError(f"type at least one box ({BOXES_HELP})")
    return out


def drawn_box(selection: Any, size: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """The last box dragged on `draw_figure` (Streamlit's plotly selection state: `box` entries with `x` and
    `y` ranges in axis units, where pixel i is centred at i) as whole pixels (x0, y0, x1, y1) of the image,
    clipped to it; None when nothing (or nothing of positive area) was drawn."""
    boxes = ((selection or {}).get("selection") or {}).get("box") or []
    if not boxes:
        return None
    xs, ys = boxes[-1].get("x") or [], boxes[-1].get("y") or []
    if len(xs) != 2 or len(ys) != 2:
        return None
    w, h = size
    x0, x1 = (min(max(round(v + 0.5), 0), w) for v in sorted(xs))
    y0, y1 = (min(max(round(v + 0.5), 0), h) for v in sorted(ys))
    return (x0, y0, x1, y1) if x0 < x1 and y0 < y1 else None


def _take_drawn_box(size: tuple[int, int]) -> None:
    """Before the boxes text area draws: its default, and a newly drawn box appended as a line (the user's
    own action; the same selection is taken once)."""
    if "va_boxes" not in st.session_state:
        w, h = size
        st.session_state["va_boxes"] = f"left half 0 0 {w // 2} {h}\nright half {w // 2} 0 {w} {h}"
    box = drawn_box(st.session_state.get("va_draw"), size)
    if box is not None and st.session_state.get("va_drawn_last") != box:
        st.session_state["va_drawn_last"] = box
        n = sum(1 for ln in st.session_state["va_boxes"].splitlines() if ln.strip())
        st.session_state["va_boxes"] = st.session_state["va_boxes"].rstrip() + f"\ndrawn {n} " + " ".join(map(str, box))


def draw_figure(image: np.ndarray) -> Any:
    """The image to drag boxes on, in the image's own pixel coordinates (at most 96 pixels a side drawn; a
    transparent grid of points makes plotly's box selection report the box)."""
    import plotly.graph_objects as go

    h, w = image.shape[:2]
    sy, sx = max(1, h // 96), max(1, w // 96)
    small = image[::sy, ::sx]
    fig = go.Figure(go.Image(z=small, x0=(sx - 1) / 2, dx=sx, y0=(sy - 1) / 2, dy=sy, hoverinfo="skip"))
    gx, gy = np.meshgrid(np.linspace(0, w - 1, 24), np.linspace(0, h - 1, 24))
    fig.add_trace(go.Scatter(x=gx.ravel(), y=gy.ravel(), mode="markers", marker=dict(opacity=0), hoverinfo="skip",
                             showlegend=False))
    fig.update_xaxes(range=[-0.5, w - 0.5], showgrid=False, zeroline=False)
    fig.update_yaxes(range=[h - 0.5, -0.5], showgrid=False, zeroline=False, scaleanchor="x")
    fig.update_layout(dragmode="select", height=360, width=420, margin=dict(l=30, r=10, t=30, b=30),
                      title="drag a box on the image")
    return fig


def _regions(spec, image: np.ndarray, scene: Any) -> list[Any]:
    """The regions the page attributes to: every visual token, the composed toy scene's objects (and the
    background), boxes typed in, or an uploaded regions JSON (analyses.visual_attribution.regions_from_json);
    a bad region is shown as an error and the page falls back to the visual tokens."""
    choices = [c for c in REGION_CHOICES if c != "scene objects" or scene is not None]
    kind = st.radio("Regions", choices, horizontal=True, key="va_regions")
    size = (int(image.shape[1]), int(image.shape[0]))
    tokens = grid_regions(spec, spec.grid, spec.grid)
    regions = None
    with shows_errors():
        if kind == "scene objects":
            regions = object_regions(spec, scene)
        elif kind == "boxes":
            _take_drawn_box(size)  # a box drawn on the image below joins the typed ones
            text = st.text_area(f"Boxes on the {size[0]}x{size[1]} image ({BOXES_HELP}); or drag a box on the "
                                "image below", key="va_boxes")
            st.plotly_chart(draw_figure(image), key="va_draw", on_select="rerun", selection_mode="box", theme=None,
                            config={"displaylogo": False})
            regions = regions_from_json(spec, {"regions": parse_boxes(text)}, size)
        elif kind == "regions JSON":
            upload = st.file_uploader('Regions JSON: {"regions": [{"name": ..., "box": [x0, y0, x1, y1]} or '
                                      '{"name": ..., "mask": [[0/1, ...], ...]}]} in pixels of the image as given',
                                      type=["json"], key="va_regions_json")
            if upload is None:
                st.caption("no regions file yet: every visual token is a region")
            else:
                regions = regions_from_json(spec, upload.getvalue(), size)
    return regions if regions is not None else tokens


@st.cache_resource(show_spinner=False, max_entries=4)
def _shipped_estimator(folder: str, digest: str) -> Any:
    """The verified shipped estimator, read once per process (`digest`: its weights' sha256)."""
    return _load_shipped(shipped.Shipped(Path(folder), json.loads((Path(folder) / shipped.MANIFEST).read_text())))


def _estimator(ctx, stored: Any) -> Any:
    """The estimator the heat maps use: one fitted or loaded here, else the shipped one (toy-vlm), or None.
    "Fit the estimator" runs as a job (toy-vlm scenes, exhaustive effects as targets)."""
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
    est = AmortizedAttribution.load(path)
    want = arch.n_layers * arch.n_heads
    if est.n_features_in_ != want:
        raise BadInputError(f"{path} was fitted on {est.n_features_in_} attention features; this model has "
                            f"{arch.n_layers} layers x {arch.n_heads} heads = {want}: fit one on this model")
    return est


def render(ctx) -> None:
    st.title("Visual attribution")
    have = ctx.backend.capabilities()
    missing = [n for n in NEEDS if not have.get(n)]
    if missing:
        st.info(f"`{ctx.model_id}` cannot do {', '.join(missing)} here: this page needs a vision-language model "
                "with local weights. Pick toy-vlm (trained here), tiny-random:llava or an hf: LLaVA, SmolVLM or "
                "Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder in the sidebar.")
        elsewhere_section(ctx)
        return
    spec = spec_of(ctx.backend)
    stored = shipped.find(NAME, ctx.model_id, ctx.backend.info()["fingerprint"]) if _is_toy(ctx) else None
    if stored is not None and not stored and (stored.damaged or "other weights" in stored.reason):
        st.warning(stored.reason + " Fit the estimator and run the study here.")
    stored = stored or None
    image, prompt, scene = _scene(ctx, spec)
    est = _estimator(ctx, stored)
    regions = _regions(spec, image, scene)
    st.caption(f"{spec.family} token grid {spec.grid} x {spec.grid}, {len(regions)} regions: "
               + ", ".join(f"{r.name} ({len(r.cells)} tokens)" for r in regions[:6]) + (" ..." if len(regions) > 6 else ""))
    if stored is not None and st.session_state.get("va_seed", 0) == STUDY_SETTINGS["seed"] and \
            st.session_state.get("va_upload") is None:
        stored_scene(stored, spec.grid)
    if _is_toy(ctx):
        faithfulness_section(ctx, stored)
    answer, live = st.empty(), st.empty()  # the streamed answer, then the finished one
    if st.button("Generate", key="va_generate"):
        with shows_errors():  # the session's last generation: the spans below are picked from it
            st.session_state["va_run"] = live_generation(ctx, prompt, image, regions, est, spec, answer, live)
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
    span_section(ctx, run, spec, regions)
