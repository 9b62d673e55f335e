"""Trace explorer: stream a generation live, then read its trace (entropy, logit lens, residual norms, attention)."""

from __future__ import annotations

import streamlit as st

from analyses.logit_lens import (attention_pattern, lens_readout, logit_lens, resid_sites, residual_norms,
                                 trace_with_completion)
from app.export import show_figure
from app.figures.trace import (attention_figure, entropy_figure, logit_lens_figure, records_data,
                               residual_norm_figure, tokens_html)
from app.registry import PageSpec
from app.sidebar import finished_generations
from thoughtscope.errors import BadInputError

PAGE = PageSpec("Trace explorer", ":material/timeline:", 10)


@st.cache_data(show_spinner=False, max_entries=32)
def lens_and_norms(_ctx, key: str, generated_ids: tuple[int, ...]):
    """Logit lens (None, with the reason, where the weights are not here) and residual norms of
    prompt + generation. `key` names model, prompt and settings; `_ctx` is not hashed."""
    n_layers = _ctx.backend.info()["arch"]["n_layers"]
    trace = trace_with_completion(_ctx.backend, _ctx.model_input(), generated_ids, resid_sites(n_layers), _ctx.chat)
    try:
        lens, note = logit_lens(trace, *lens_readout(_ctx.backend)), None
    except BadInputError as err:
        lens, note = None, str(err)
    return lens, residual_norms(trace), note


@st.cache_data(show_spinner=False, max_entries=64)
def attention(_ctx, key: str, generated_ids: tuple[int, ...], layer: int, head: int):
    trace = trace_with_completion(_ctx.backend, _ctx.model_input(), generated_ids, [f"attn_pattern.{layer}"],
                                  _ctx.chat)
    return attention_pattern(trace, layer, head)


def stream_generation(ctx, box, colour_by: str) -> list[dict]:
    """Generate, redrawing the coloured tokens after every new one."""
    records = []
    bar = st.progress(0.0, text="generating\u2026")
    for rec in ctx.generate():
        records.append(rec.to_dict())
        box.html(tokens_html(records, colour_by))
        bar.progress(min(1.0, len(records) / ctx.settings.max_new_tokens), text=f"{len(records)} tokens")
    bar.empty()
    return records


def render(ctx) -> None:
    st.title("Trace explorer")
    key = ctx.cache_key()
    store = finished_generations()
    records = store.get(key)
    left, right = st.columns([1, 3], vertical_alignment="center")
    run = left.button("Generate", type="primary", key="generate", icon=":material/play_arrow:")
    colour_by = right.radio("Colour tokens by", ["entropy", "log-prob"], horizontal=True, key="colour_by")
    box = st.empty()
    if run:
        records = stream_generation(ctx, box, colour_by)
        store.put(key, records)
    if not records:
        box.info("Press **Generate** to stream the model's answer to the sidebar's prompt.")
        return
    box.html(tokens_html(records, colour_by))
    data = records_data(records)
    show_figure(entropy_figure(data), data, "entropy")

    ids = tuple(r["token_id"] for r in records)
    with st.spinner("Tracing every layer\u2026"):
        lens, norms, note = lens_and_norms(ctx, key, ids)
    if lens is None:
        st.info(note)
    else:
        n = len(lens.tokens)
        start, stop = st.slider("Logit-lens positions", 0, n, (max(0, n - 32), n), key=f"lens_window_{n}")
        shown = lens.window(start, stop)
        show_figure(logit_lens_figure(shown), shown, "logit_lens")
    show_figure(residual_norm_figure(norms), norms, "residual_norms")

    arch = ctx.backend.info()["arch"]
    left, right = st.columns(2)
    layer = left.selectbox("Attention layer", range(arch["n_layers"]), index=arch["n_layers"] - 1, key="attn_layer")
    head = right.selectbox("Head", range(arch["n_heads"]), key="attn_head")
    with st.spinner("Reading attention\u2026"):
        pattern = attention(ctx, key, ids, layer, head)
    show_figure(attention_figure(pattern), pattern, "attention")
