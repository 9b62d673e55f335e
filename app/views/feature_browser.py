"""Feature browser: run any direction (an SAE latent, a neuron, a steering or concept vector) over a corpus and
see its top-activating contexts with the active tokens highlighted, its activation histogram, and the logits
it promotes and suppresses.

The corpus is indexed once, as a job (its activations at the site go into the cache, with progress, time
left and Stop); every browse after that reads the stored rows and answers in well under a second. On the
embedded model the page opens on a shipped index of the default corpus' first questions
(`thoughtscope ship feature-index`), and says so.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np
import streamlit as st

from analyses.feature_browser import CorpusIndex, IndexSettings, Neuron, VectorDirection, browse, sae_latent
from analyses.steering import diff_of_means_direction
from app.context import shows_errors
from app.export import plain, show_figure
from app.figures.feature_browser import contexts_html
from app.registry import PageSpec
from app.sections.feature_index import corpus_section, index_key, index_section
from app.sections.sae_latents import cached_sae, sae_choices, search_section
from probes.interventions import RESIDUAL_KINDS, load_vector_bytes

PAGE = PageSpec("Feature browser", ":material/manage_search:", 30, requires=("capture_batch", "readout"))

FROM_SAE, FROM_NEURON, FROM_FILE, FROM_PROMPTS = ("SAE latent", "neuron", "vector file (.safetensors)",
                                                  "difference of means of two prompt sets")
OTHER_FOLDER = "another folder\u2026"
SET_A = "I love this, it is wonderful.\nWhat a happy, joyful day!\nThis is great news, I am so glad."
SET_B = "I hate this, it is terrible.\nWhat a sad, miserable day.\nThis is awful news, I am so upset."


@st.cache_data(show_spinner=False, max_entries=16)
def prompt_direction(_ctx, model_key: str, set_a: str, set_b: str, site: str) -> np.ndarray:
    return diff_of_means_direction(_ctx.backend, set_a.splitlines(), set_b.splitlines(), site).numpy()


@st.cache_resource(show_spinner=False, max_entries=4)
def sae_direction(folder: str, latent: int, site: str):
    return sae_latent(folder, latent, site)


@st.cache_data(show_spinner=False, max_entries=64)
def browse_view(_index: CorpusIndex, _direction: Any, _ctx, key: str, k: int) -> dict:
    """One browse, kept: `key` names the index and the direction."""
    return plain(browse(_index, _direction, _ctx.backend, k=k))


def url_site(n_layers: int) -> tuple[str, int]:
    """The site a link opened (`?site=resid_post.3`), else the residual stream after the middle layer."""
    kind, _, layer = str(st.query_params.get("site", "")).partition(".")
    if kind in RESIDUAL_KINDS and layer.isascii() and layer.isdigit() and int(layer) < n_layers:  # not "²"
        return kind, int(layer)
    return "resid_post", n_layers // 2


MAX_LATENT = 10**7  # the latent box's upper end


def url_latent() -> int:
    """The latent a link opened (`?latent=J`, from a search hit or the trace explorer), else 0; a number past the
    box's range is dropped (handed to the box, it stopped the page; a latent past the SAE's width is said later)."""
    value = str(st.query_params.get("latent", "0"))
    return int(value) if value.isascii() and value.isdigit() and int(value) <= MAX_LATENT else 0


def direction_section(ctx, site: str, d_model: int, index: CorpusIndex, ikey: str) -> Any | None:
    kind = st.radio("Direction", [FROM_SAE, FROM_NEURON, FROM_FILE, FROM_PROMPTS], horizontal=True, key="fb_kind")
    if kind == FROM_NEURON:
        index = st.number_input(f"Neuron (coordinate of {site})", 0, d_model - 1, 0, key="fb_neuron")
        return Neuron(int(index), site)
    if kind == FROM_SAE:
        labels = {folder: label for folder, (label, _) in sae_choices(ctx, site).items()}
        left, right = st.columns([3, 1])
        folder = left.selectbox(f"SAE at {site} (saved by RISE runs of this model, or any SAELens folder)",
                                [*labels, OTHER_FOLDER], key="fb_sae_pick", format_func=lambda f: labels.get(f, f))
        if folder == OTHER_FOLDER:
            folder = left.text_input("SAE folder (cfg.json + sae_weights.safetensors)", key="fb_sae_folder").strip()
        latent = right.number_input("Latent", 0, MAX_LATENT, url_latent(), key="fb_latent")
        if not folder:
            st.info(f"No saved SAE at {site} yet: give a SAELens folder, or train one on the RISE page.")
            return None
        hit = None
        with shows_errors() as spot:
            hit = search_section(ctx, index, ikey, folder, cached_sae(folder), site)
        if spot.failed:  # the folder's error is shown; nothing to browse
            return None
        latent = latent if hit is None else hit  # a search match, while the box holds a query
        with shows_errors() as spot:
            direction = sae_direction(folder, int(latent), site)
            direction.check(d_model)
        return None if spot.failed else direction
    if kind == FROM_FILE:
        upload = st.file_uploader("Vector (one tensor of width d_model)", type=["safetensors"], key="fb_vector")
        if upload is None:
            st.info("Upload a .safetensors file holding the vector (a steering or concept vector).")
            return None
        with shows_errors() as spot:
            vector = load_vector_bytes(upload.getvalue())
        return None if spot.failed else VectorDirection(vector, site, upload.name)
    left, right = st.columns(2)
    set_a = left.text_area("Set A (one prompt a line)", SET_A, key="fb_set_a")
    set_b = right.text_area("Set B", SET_B, key="fb_set_b")
    with shows_errors() as spot, st.spinner("Tracing both prompt sets\u2026"):
        vector = prompt_direction(ctx, f"{ctx.server_url}|{ctx.model_id}", set_a, set_b, site)
    return None if spot.failed else VectorDirection(vector, site, "A - B (difference of means)", "steering vector")


def render(ctx) -> None:
    st.title("Feature browser")
    arch = ctx.backend.arch()
    st.subheader("1. Corpus and site")
    corpus = corpus_section()
    cols = st.columns(3)
    first_kind, first_layer = url_site(arch.n_layers)  # the first value only: a link's site, else the default
    kind = cols[0].selectbox("Site", RESIDUAL_KINDS, index=RESIDUAL_KINDS.index(first_kind), key="fb_site_kind")
    layer = cols[1].selectbox("Layer", range(arch.n_layers), index=first_layer, key="fb_layer")
    max_tokens = cols[2].select_slider("Tokens per context", [16, 32, 64, 128, 256], 64, key="fb_max_tokens")
    site = f"{kind}.{layer}"
    if corpus is None:
        return
    settings = IndexSettings(max_tokens=int(max_tokens))
    index = index_section(ctx, corpus, site, settings)
    if index is None:
        return
    st.subheader("2. Direction")
    direction = direction_section(ctx, site, arch.d_model, index, index_key(ctx, corpus, site, settings))
    if direction is None:
        return
    from analyses.steering_stack import from_feature_browser
    from app.steering_stack_ui import add_button

    add_button("fb_add_to_stack", lambda: from_feature_browser(direction, arch.d_model, strength=0.5))
    k = st.slider("Top contexts", 5, 50, 20, 5, key="fb_k")
    st.subheader("3. Where it fires")
    with shows_errors() as spot:
        started = time.perf_counter()
        key = json.dumps([index_key(ctx, corpus, site, settings), direction.describe()], sort_keys=True, default=str)
        view = browse_view(index, direction, ctx, hashlib.sha256(key.encode()).hexdigest(), int(k))
        took = time.perf_counter() - started
    if spot.failed:
        return
    cols = st.columns(4)
    cols[0].metric("Contexts", f"{view['n_contexts']:,}")
    cols[1].metric("Tokens", f"{view['n_tokens']:,}")
    cols[2].metric("Active on" if direction.kind == "sae" else "Positive on", f"{100 * view['density']:.2f}%")
    cols[3].metric("Max activation", f"{view['max_activation']:.3g}")
    st.caption(f"browsed in {took:.2f} s; the first token of each context (the attention sink) is not scored")
    if not view["contexts"]:
        st.warning("This direction never fires on the corpus (a dead latent here): try another latent or corpus.")
    else:
        st.html(contexts_html(view))
    record = ctx.provenance(prompt=None, data=corpus.name, split=corpus.split,
                            settings={"site": site, "index": index.describe(), "direction": direction.describe(),
                                      "top_k": int(k)})
    show_figure(None, view, "feature_contexts", provenance=record)
    left, right = st.columns(2)
    with left:
        show_figure(None, view, "feature_histogram", provenance=record)
    with right:
        show_figure(None, view, "feature_logits", provenance=record)
