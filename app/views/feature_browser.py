"""Feature browser: run any direction (an SAE latent, a neuron, a steering or concept vector) over a corpus and
see its top-activating contexts with the active tokens highlighted, its activation histogram, and the logits
it promotes and suppresses.

The corpus is indexed once (its activations at the site go into the cache, with a progress bar);
every browse after that reads the stored rows and answers in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np
import streamlit as st

from analyses.feature_browser import (CORPORA, Corpus, CorpusIndex, IndexSettings, Neuron, VectorDirection, browse,
                                      build_index, load_corpus, sae_latent, text_corpus)
from analyses.rise import saved_saes
from analyses.steering import diff_of_means_direction
from app.context import FinishedGenerations, shows_errors
from app.export import plain, show_figure
from app.figures.feature_browser import contexts_html
from app.registry import PageSpec
from probes.interventions import RESIDUAL_KINDS, load_vector_bytes

PAGE = PageSpec("Feature browser", ":material/manage_search:", 30, requires=("capture_batch", "readout"))

OWN_FILE = "your text file"
FROM_SAE, FROM_NEURON, FROM_FILE, FROM_PROMPTS = ("SAE latent", "neuron", "vector file (.safetensors)",
                                                  "difference of means of two prompt sets")
OTHER_FOLDER = "another folder\u2026"
SET_A = "I love this, it is wonderful.\nWhat a happy, joyful day!\nThis is great news, I am so glad."
SET_B = "I hate this, it is terrible.\nWhat a sad, miserable day.\nThis is awful news, I am so upset."


@st.cache_resource
def indexes() -> FinishedGenerations:
    """Indexed corpora held in memory by this process (the 2 newest; the cache on disk holds them all)."""
    return FinishedGenerations(max_entries=2)


@st.cache_data(show_spinner=False, max_entries=8)
def shipped_corpus(name: str, n: int | None) -> Corpus:
    return load_corpus(name, n=n)


@st.cache_data(show_spinner=False, max_entries=16)
def prompt_direction(_ctx, model_key: str, set_a: str, set_b: str, site: str) -> np.ndarray:
    return diff_of_means_direction(_ctx.backend, set_a.splitlines(), set_b.splitlines(), site).numpy()


@st.cache_resource(show_spinner=False, max_entries=4)
def sae_direction(folder: str, latent: int, site: str):
    return sae_latent(folder, latent, site)


def index_key(ctx, corpus: Corpus, site: str, settings: IndexSettings) -> str:
    return json.dumps([ctx.server_url, ctx.model_id, corpus.key, site, settings.key()])


@st.cache_data(show_spinner=False, max_entries=64)
def browse_view(_index: CorpusIndex, _direction: Any, _ctx, key: str, k: int) -> dict:
    """One browse, kept: `key` names the index and the direction."""
    return plain(browse(_index, _direction, _ctx.backend, k=k))


def corpus_section() -> Corpus | None:
    left, right = st.columns([2, 1])
    name = left.selectbox("Corpus", [*CORPORA, OWN_FILE], key="fb_corpus",
                          help="GSM8K test questions, reference solutions or both cut into sentences (shipped); "
                               "generated arithmetic problems; or a UTF-8 text file of yours")
    if name == OWN_FILE:
        upload = st.file_uploader("Text file (UTF-8)", type=["txt", "md"], key="fb_file")
        unit = right.radio("One context per", ["paragraph", "line"], key="fb_unit", horizontal=True)
        if upload is None:
            st.info("Upload a text file: each paragraph (or line) becomes a context; long ones are cut into windows.")
            return None
        with shows_errors() as spot:
            corpus = text_corpus(upload.getvalue().decode("utf-8", errors="replace"), upload.name, unit)
        return None if spot.failed else corpus
    n = right.number_input("Texts (0 = all)", 0, 100_000, 0 if name != "arith-problems" else 2000, step=100,
                           key="fb_n")
    with shows_errors() as spot:
        corpus = shipped_corpus(name, int(n) or None)
    return None if spot.failed else corpus


def index_section(ctx, corpus: Corpus, site: str, settings: IndexSettings) -> CorpusIndex | None:
    key = index_key(ctx, corpus, site, settings)
    held = indexes().get(key)
    left, right = st.columns([1, 3], vertical_alignment="center")
    run = left.button("Index the corpus" if held is None else "Indexed", key="fb_index", icon=":material/database:",
                      disabled=held is not None, type="primary" if held is None else "secondary")
    right.caption(f"{corpus.name}: {len(corpus.texts):,} texts ({corpus.source}). Indexing runs the model once over "
                  f"them (up to {site}) and stores the activations in the cache; a stored corpus loads in seconds.")
    if run and held is None:
        bar = st.progress(0.0, text="indexing\u2026")
        started = time.perf_counter()

        def progress(done: int, total: int) -> None:
            bar.progress(done / max(1, total), text=f"{done:,} of {total:,} contexts")

        with shows_errors() as spot:
            held = build_index(ctx.backend, corpus, site, settings, on_progress=progress)
            indexes().put(key, held)
        bar.empty()
        if spot.failed:
            return None
        st.caption(f"indexed {held.n_contexts:,} contexts, {held.n_rows:,} tokens in {time.perf_counter() - started:.1f} s")
    if held is None:
        st.info("Press **Index the corpus** (once: it is kept in the cache).")
    return held


def direction_section(ctx, site: str, d_model: int) -> Any | None:
    kind = st.radio("Direction", [FROM_SAE, FROM_NEURON, FROM_FILE, FROM_PROMPTS], horizontal=True, key="fb_kind")
    if kind == FROM_NEURON:
        index = st.number_input(f"Neuron (coordinate of {site})", 0, d_model - 1, 0, key="fb_neuron")
        return Neuron(int(index), site)
    if kind == FROM_SAE:
        labels = {s.folder: s.label for s in saved_saes(ctx.model_id, site)}
        left, right = st.columns([3, 1])
        folder = left.selectbox(f"SAE at {site} (saved by RISE runs of this model, or any SAELens folder)",
                                [*labels, OTHER_FOLDER], key="fb_sae_pick", format_func=lambda f: labels.get(f, f))
        if folder == OTHER_FOLDER:
            folder = left.text_input("SAE folder (cfg.json + sae_weights.safetensors)", key="fb_sae_folder").strip()
        latent = right.number_input("Latent", 0, 10**7, 0, key="fb_latent")
        if not folder:
            st.info(f"No saved SAE at {site} yet: give a SAELens folder, or train one on the RISE page.")
            return None
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
    arch = ctx.backend.info()["arch"]
    st.subheader("1. Corpus and site")
    corpus = corpus_section()
    cols = st.columns(3)
    kind = cols[0].selectbox("Site", RESIDUAL_KINDS, index=RESIDUAL_KINDS.index("resid_post"), key="fb_site_kind")
    layer = cols[1].selectbox("Layer", range(arch["n_layers"]), index=arch["n_layers"] // 2, key="fb_layer")
    max_tokens = cols[2].select_slider("Tokens per context", [16, 32, 64, 128, 256], 64, key="fb_max_tokens")
    site = f"{kind}.{layer}"
    if corpus is None:
        return
    settings = IndexSettings(max_tokens=int(max_tokens))
    index = index_section(ctx, corpus, site, settings)
    if index is None:
        return
    st.subheader("2. Direction")
    direction = direction_section(ctx, site, arch["d_model"])
    if direction is None:
        return
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
