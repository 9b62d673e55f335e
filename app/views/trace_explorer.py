"""Trace explorer: stream a generation live, then read its trace (entropy, logit lens, residual norms, attention,
and an SAE's latents: the top ones of the whole trace and those active at each token).

After a generation, one teacher-forced pass records what every view needs (the residual stream at
every layer and, while they fit in memory, every layer's attention); moving a window, a layer or a
head only slices that pass. The logit lens decodes just the positions shown.
"""

from __future__ import annotations

import streamlit as st

from analyses.logit_lens import (ATTENTION_BUDGET_BYTES, CompletionTrace, attention_pattern, logit_lens, residual_norms,
                                 trace_completion)
from app.badge import show_badge
from app.context import shows_errors
from app.export import plain, show_figure
from app.figures.trace import records_data, tokens_html
from app.registry import PageSpec
from app.sections.sae_latents import trace_latents_section
from app.sidebar import finished_generations

PAGE = PageSpec("Trace explorer", ":material/timeline:", 10)

LENS_VIEWS = {"top token": "logit_lens", "next token: probability and rank": "logit_lens_next"}
SCALES = {"log": "log", "linear (sink-aware)": "linear"}
ALL_HEADS = "all heads"
LENS_WIDTH, ATTENTION_WIDTH = 32, 48  # default windows: the positions shown at first
PROMPT_SHOWN = 8  # prompt tokens the default attention window keeps before the generation


SERVER_ATTENTION_BUDGET = 32 * 2**20  # through a server, larger sets of patterns are fetched a layer at a time


@st.cache_resource(show_spinner=False, max_entries=4)
def completion_trace(_ctx, key: str, generated_ids: tuple[int, ...]) -> CompletionTrace:
    """The one pass over prompt + generation that every view reads (kept for the 4 newest generations;
    `key` names model, prompt and settings, `_ctx` is not hashed). Every layer's attention comes with
    it while it fits the budget: 256 MiB in this process, 32 MiB over HTTP from a model server."""
    budget = SERVER_ATTENTION_BUDGET if _ctx.server_url else ATTENTION_BUDGET_BYTES
    return trace_completion(_ctx.backend, _ctx.model_input(), generated_ids, _ctx.chat, attention_budget=budget)


@st.cache_data(show_spinner=False, max_entries=64)
def lens_window(_ctx, key: str, generated_ids: tuple[int, ...], start: int, stop: int) -> dict:
    done = completion_trace(_ctx, key, generated_ids)
    return plain(logit_lens(done.trace, _ctx.backend, start, stop, prompt_len=done.prompt_len))


@st.cache_data(show_spinner=False, max_entries=64)
def norms_of(_ctx, key: str, generated_ids: tuple[int, ...]) -> dict:
    return plain(residual_norms(completion_trace(_ctx, key, generated_ids).trace))


@st.cache_data(show_spinner=False, max_entries=128)
def attention_window(_ctx, key: str, generated_ids: tuple[int, ...], layer: int, head: int | None, start: int,
                     stop: int) -> dict:
    done = completion_trace(_ctx, key, generated_ids)
    trace = done.pattern_of(_ctx.backend, layer)
    return plain(attention_pattern(trace, layer, head, start, stop, prompt_len=done.prompt_len))


@st.cache_data(show_spinner=False, max_entries=256)
def special_ids(_ctx, model_key: str, ids: tuple[int, ...]) -> list[int]:
    """The ids among `ids` that are special tokens (end of turn...): decoding drops them."""
    backend = _ctx.backend
    return sorted(i for i in set(ids) if backend.decode([i]) and not backend.decode([i], skip_special_tokens=True))


def stream_generation(ctx, box, colour_by: str) -> list[dict]:
    """Generate, redrawing the coloured tokens after every new one."""
    records = []
    eos = ctx.backend.eos_ids()
    bar = st.progress(0.0, text="generating\u2026")
    for rec in ctx.generate():
        records.append(rec.to_dict())
        box.html(tokens_html(records, colour_by, eos))
        bar.progress(min(1.0, len(records) / ctx.settings.max_new_tokens), text=f"{len(records)} tokens")
    bar.empty()
    return records


def _window_slider(label: str, n: int, width: int, key: str, first: int | None = None) -> tuple[int, int]:
    """Positions [start, stop) to show: by default the last `width`, or `width` from `first`."""
    if n <= 1:
        return 0, n
    start = max(0, n - width) if first is None else max(0, min(first, n - width))
    start, stop = st.slider(label, 0, n, (start, min(n, start + width)), key=f"{key}_{n}")
    return (start, stop) if stop > start else (max(0, stop - 1), max(stop, 1))


def lens_section(ctx, key: str, ids: tuple[int, ...], done: CompletionTrace) -> None:
    st.subheader("Logit lens")
    if not ctx.backend.capabilities().get("readout"):
        st.info("the logit lens needs the model's unembedding, which this backend lacks")
        return
    left, right = st.columns([1, 2])
    view = left.radio("Show", list(LENS_VIEWS), key="lens_view", horizontal=True,
                      help="the top token at each layer, or how likely (colour) and how highly ranked (text) the "
                           "token that actually comes next is")
    with right:
        # by default the end of the prompt and the start of the generation: the boundary stays in view
        start, stop = _window_slider("Logit-lens positions", len(done.trace.tokens), LENS_WIDTH, "lens_window",
                                     first=done.prompt_len - PROMPT_SHOWN)
    with shows_errors():
        with st.spinner("Decoding the positions shown\u2026"):
            lens = lens_window(ctx, key, ids, start, stop)
        show_figure(None, lens, LENS_VIEWS[view])
    st.caption("Each layer's residual stream read through the model's own final norm and unembedding. "
               "No tuned lens: that needs a trained translator per layer, and this project trains none, so early "
               "layers read out worse than they compute. The dashed line separates prompt and generation.")


def attention_section(ctx, key: str, ids: tuple[int, ...], done: CompletionTrace) -> None:
    st.subheader("Attention")
    arch = ctx.backend.arch()
    cols = st.columns([1, 1, 1, 2])
    layer = cols[0].selectbox("Attention layer", range(arch.n_layers), index=arch.n_layers - 1,
                              key="attn_layer")
    head = cols[1].selectbox("Head", [ALL_HEADS, *range(arch.n_heads)], index=1, key="attn_head")
    scale = cols[2].radio("Colour", list(SCALES), key="attn_scale",
                          help="log: every order of magnitude visible; linear: the range ends at the largest weight "
                               "on any token but the first (the attention sink), which saturates")
    with cols[3]:
        # by default the end of the prompt and the generation: the boundary and what crosses it
        start, stop = _window_slider("Attention positions", len(done.trace.tokens), ATTENTION_WIDTH, "attn_window",
                                     first=done.prompt_len - PROMPT_SHOWN)
    with shows_errors():
        pattern = attention_window(ctx, key, ids, int(layer), None if head == ALL_HEADS else int(head), start, stop)
        # the export says which pattern it holds: layer, head (or every head) and the positions shown
        shown = {"attention": {"layer": int(layer), "head": "all" if head == ALL_HEADS else int(head),
                               "positions": [int(start), int(stop)], "scale": SCALES[scale]}}
        show_figure(None, {**pattern, "scale": SCALES[scale]}, "attention_heads" if head == ALL_HEADS else "attention",
                    provenance=ctx.provenance(page="trace_explorer", settings=shown))
    held = len(done.attention_layers)
    st.caption(f"Rows: query tokens; columns: the tokens they attend to (\u00abearlier\u00bb: the weight on tokens "
               f"before the window). Patterns of {held} of {done.n_layers} layers were kept from the one pass "
               "over this generation; any other layer is read once, when first shown.")


def render(ctx) -> None:
    st.title("Trace explorer")
    left, right = st.columns([1, 3], vertical_alignment="center")
    run = left.button("Generate", type="primary", key="generate", icon=":material/play_arrow:")
    colour_by = right.radio("Colour tokens by", ["entropy", "log-prob"], horizontal=True, key="colour_by")
    errors = st.container()  # a mistake shows right under the button that met it
    box = st.empty()
    with shows_errors(errors) as spot:
        key = ctx.cache_key()
    if spot.failed:
        return
    store = finished_generations()
    records = store.get(key)
    if run:
        with shows_errors(errors) as spot:
            records = stream_generation(ctx, box, colour_by)
            store.put(key, records)
        if spot.failed:
            return
    if not records:
        box.info("Press **Generate** to stream the model's answer to the sidebar's prompt.")
        return
    ids = tuple(r["token_id"] for r in records)
    special = special_ids(ctx, f"{ctx.server_url}|{ctx.model_id}", ids)
    box.html(tokens_html(records, colour_by, special))
    show_figure(None, records_data(records, special), "entropy")
    show_badge(ctx)  # after the first figure: a validation it starts runs in the background

    with shows_errors() as spot:
        with st.spinner("Reading every layer of the generation (one pass)\u2026"):
            done = completion_trace(ctx, key, ids)
    if spot.failed:
        return
    lens_section(ctx, key, ids, done)
    st.subheader("Residual stream")
    show_figure(None, norms_of(ctx, key, ids), "residual_norms")
    attention_section(ctx, key, ids, done)
    trace_latents_section(ctx, key, done)  # pick an SAE: the trace's top latents, and a token's
