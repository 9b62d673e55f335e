"""Visual attribution: which image regions each span of a vision-language model's answer draws on.

Compose a toy-vlm scene (or use a seeded random image for other VLMs), generate, then pick a span of
the answer: its raw attention to every visual token is drawn over the image at once, and the
exhaustive causal effect (attention to each token masked in every layer; the drop of the span's
log-prob) on demand. Everything goes through the Backend (`analyses.visual_attribution`).

Not built yet: the live, span-by-span heat map during streaming and the amortized estimator on this
page (it needs a fitted estimator: `thoughtscope eval vis-attr` fits one); see docs/visual_attribution.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from analyses.visual_attribution import attention_features, exhaustive_effects, grid_regions, raw_attention
from app.context import shows_errors
from app.export import show_figure
from app.figures.visual_attribution import heatmap_figure
from app.registry import PageSpec

PAGE = PageSpec("Visual attribution", ":material/image_search:", 60, requires=("vision", "trace", "interventions"))


def _is_toy(ctx) -> bool:
    return str(ctx.model_id).startswith("toy-vlm")


def _scene(ctx, spec) -> tuple[np.ndarray, str, Any]:
    """(image, prompt with <image>, toy example or None) from the widgets."""
    c1, c2 = st.columns(2)
    seed = int(c1.number_input("Scene seed", 0, 10_000, 0, key="va_seed"))
    if _is_toy(ctx):
        from probes.toys import vlm

        ex = vlm.examples("eval", 1, seed=seed)[0]
        question = c2.text_input("Question", ex.question, key=f"va_q{seed}")
        return ex.image, vlm.prompt_text(question), ex
    side = spec.image_size
    image = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    prompt = c2.text_input("Prompt (put <image> where the image goes)", "Describe <image> in a few words:", key="va_p")
    return image, prompt, None


def _spans(tokens: list[str], start: int) -> list[tuple[int, int]]:
    """Spans of the generated text: runs of tokens ended by ',' '.' ':' or the end (at least one token)."""
    spans, lo = [], start
    for i, t in enumerate(tokens[start:], start):
        if t.strip() in (",", ".", ":") or t.strip().endswith((",", ".", ":")):
            if i > lo:
                spans.append((lo, i))
            lo = i + 1
    if lo < len(tokens):
        spans.append((lo, len(tokens)))
    return spans


def render(ctx) -> None:
    from probes.vision import spec_of

    st.title("Visual attribution")
    spec = spec_of(ctx.backend)
    image, prompt, _ = _scene(ctx, spec)
    st.caption(f"{spec.family} token grid {spec.grid} x {spec.grid}: one region per visual token")
    if st.button("Generate", key="va_generate"):
        with shows_errors():
            records = list(ctx.backend.generate(prompt, images=[image], max_new_tokens=ctx.settings.max_new_tokens))
            ids = [r.token_id for r in records]
            text = prompt + " " + ctx.backend.decode(ids) if _is_toy(ctx) else prompt + ctx.backend.decode(ids)
            n_layers = ctx.backend.info()["arch"]["n_layers"]
            trace = ctx.backend.trace(text, images=[image], capture=[f"attn_pattern.{i}" for i in range(n_layers)])
            st.session_state["va_run"] = {"text": text, "image": image, "trace": trace,
                                          "start": len(trace.token_ids) - len(ids)}
    run = st.session_state.get("va_run")
    if not run:
        st.info("Generate to see the answer's spans and where each one looks.")
        return
    trace = run["trace"]
    tokens = ctx.backend.token_texts(trace.token_ids)  # pieces that concatenate to the text
    spans = _spans(tokens, run["start"])
    st.markdown("**Answer:** " + "".join(tokens[run["start"]:]))
    if not spans:
        st.warning("the answer holds no span to attribute")
        return
    labels = [f"{i}: {''.join(tokens[s:e]).strip()}" for i, (s, e) in enumerate(spans)]
    pick = st.selectbox("Span", list(range(len(spans))), format_func=lambda i: labels[i], key="va_span")
    regions = grid_regions(spec, spec.grid, spec.grid)
    with shows_errors() as spot:
        feats = attention_features(ctx.backend, run["text"], run["image"], [spans[pick]], regions, trace=trace)
    if spot.failed:
        return
    scores = raw_attention(feats)[0]
    small = run["image"][:: max(1, run["image"].shape[0] // 96), :: max(1, run["image"].shape[1] // 96)]
    data = {"image": small.tolist(), "scores": scores.reshape(spec.grid, spec.grid).round(6).tolist(),
            "method": "raw attention", "unit": "attention", "title": f"span {labels[pick]!r}: raw attention"}
    show_figure(heatmap_figure(data), data, "vis_attr_heatmap")
    if st.button("Exhaustive effects for this span", key="va_exhaustive"):
        with shows_errors():
            eff = exhaustive_effects(ctx.backend, run["text"], run["image"], [spans[pick]], regions)[0]
            data = {**data, "scores": eff.reshape(spec.grid, spec.grid).round(6).tolist(),
                    "method": "exhaustive effect", "unit": "nats",
                    "title": f"span {labels[pick]!r}: log-prob drop with each token masked (nats)"}
            st.session_state["va_exh"] = (run["text"], pick, data)
    done = st.session_state.get("va_exh")
    if done and done[:2] == (run["text"], pick):  # only for the span it was computed for
        show_figure(heatmap_figure(done[2]), done[2], "vis_attr_exhaustive", figure="vis_attr_heatmap")
