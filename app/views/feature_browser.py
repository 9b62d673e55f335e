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
from dataclasses import asdict
from typing import Any

import numpy as np
import streamlit as st

from analyses.feature_browser import (CORPORA, Corpus, CorpusIndex, IndexSettings, Neuron, VectorDirection, browse,
                                      build_index, load_corpus, sae_latent, text_corpus)
from analyses.feature_browser import ship as fb_ship
from analyses.rise import saved_saes
from analyses.rise import ship as rise_ship
from analyses.steering import diff_of_means_direction
from app import jobs
from app.context import FinishedGenerations, shows_errors
from app.export import plain, show_figure
from app.figures.feature_browser import contexts_html
from app.registry import PageSpec
from probes.interventions import RESIDUAL_KINDS, load_vector_bytes
from thoughtscope import shipped

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
    default_n = {"arith-problems": 2000, fb_ship.CORPUS: fb_ship.N_TEXTS}.get(name, 0)
    n = right.number_input("Texts (0 = all)", 0, 100_000, default_n, step=10, key="fb_n",
                           help=f"{fb_ship.CORPUS} opens on its first {fb_ship.N_TEXTS} questions (their index ships "
                                "with the app for the embedded model); 0 indexes all 1,319 as a job")
    with shows_errors() as spot:
        corpus = shipped_corpus(name, int(n) or None)
    return None if spot.failed else corpus


def shipped_index(ctx, corpus: Corpus, site: str, settings: IndexSettings) -> tuple[CorpusIndex | None, str | None]:
    """(the stored index when it is of this corpus, site and settings, the stored result's label or a reason)."""
    found = shipped.find(fb_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if not found:
        return None, found.reason if found.damaged else None
    meta = found.json("index.json")
    if (meta["corpus"].get("key"), meta["site"], meta["settings"]) != (corpus.key, site, asdict(settings)):
        return None, (f"A stored index ships for {ctx.model_id}: the first {meta['corpus']['n_texts']} texts of "
                      f"{meta['corpus']['name']} at {meta['site']} ({meta['settings']['max_tokens']} tokens per "
                      "context); these settings need their own.")
    key = f"shipped-index-{found.manifest['files']['index.safetensors']}"
    index = indexes().get(key)
    if index is None:
        index = fb_ship.load(found)
        indexes().put(key, index)
    return index, found.label()


def index_section(ctx, corpus: Corpus, site: str, settings: IndexSettings) -> CorpusIndex | None:
    key = index_key(ctx, corpus, site, settings)
    left, right = st.columns([1, 3], vertical_alignment="center")
    right.caption(f"{corpus.name}: {len(corpus.texts):,} texts ({corpus.source}). Indexing runs the model once over "
                  f"them (up to {site}) and stores the activations in the cache; a stored corpus loads in seconds.")
    stored, note = shipped_index(ctx, corpus, site, settings)
    own = indexes().get(key) or jobs.registry().finished(key)
    held = own or (None if jobs.registry().for_key(key) else stored)
    on_stored = held is not None and held is stored
    run = left.button("Index the corpus" if held is None else "Index again here" if on_stored else "Indexed",
                      key="fb_index", icon=":material/database:", disabled=held is not None and not on_stored,
                      type="primary" if held is None else "secondary",
                      help="runs as a job: progress, time left, Stop (an interrupted index resumes from the cache)")
    if run and on_stored:
        held = None  # the user's own run, as a job
    if on_stored and held is not None:
        st.caption(f"{note} It covers this {len(corpus.texts)}-question subset of GSM8K only; set **Texts** to 0 to "
                   "index the whole corpus (a job).")
        return stored
    if note and stored is None and held is None:  # why the stored index is not used here
        (st.warning if "damaged" in note else st.info)(note)
    if held is None:
        backend = ctx.backend

        def work(job: jobs.Job) -> CorpusIndex:
            return build_index(backend, corpus, site, settings, on_progress=job.progress)

        held = jobs.run_job(key, work, label=f"Indexing {corpus.name} ({len(corpus.texts):,} texts) at {site}",
                            kind="feature-index", page="feature_browser", start=run)
        if held is not None:
            indexes().put(key, held)
    if held is None and jobs.registry().for_key(key) is None:
        st.info("Press **Index the corpus** (once: it is kept in the cache).")
    return held


def shipped_saes(ctx, site: str) -> dict[str, str]:
    """{folder: label} of the RISE SAE shipped for this model at `site` (a SAELens folder in the user cache)."""
    found = shipped.find(rise_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if not found or site not in rise_ship.shipped_sites(found):
        return {}
    cfg = found.json(f"sae.{site}.cfg.json")
    return {str(rise_ship.sae_folder(found, site)): f"{ctx.model_id} {site} d_sae={cfg.get('d_sae')} "
                                                    "(the RISE page's stored SAE)"}


def direction_section(ctx, site: str, d_model: int) -> Any | None:
    kind = st.radio("Direction", [FROM_SAE, FROM_NEURON, FROM_FILE, FROM_PROMPTS], horizontal=True, key="fb_kind")
    if kind == FROM_NEURON:
        index = st.number_input(f"Neuron (coordinate of {site})", 0, d_model - 1, 0, key="fb_neuron")
        return Neuron(int(index), site)
    if kind == FROM_SAE:
        labels = {s.folder: s.label for s in saved_saes(ctx.model_id, site)}
        labels.update(shipped_saes(ctx, site))
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
    arch = ctx.backend.arch()
    st.subheader("1. Corpus and site")
    corpus = corpus_section()
    cols = st.columns(3)
    kind = cols[0].selectbox("Site", RESIDUAL_KINDS, index=RESIDUAL_KINDS.index("resid_post"), key="fb_site_kind")
    layer = cols[1].selectbox("Layer", range(arch.n_layers), index=arch.n_layers // 2, key="fb_layer")
    max_tokens = cols[2].select_slider("Tokens per context", [16, 32, 64, 128, 256], 64, key="fb_max_tokens")
    site = f"{kind}.{layer}"
    if corpus is None:
        return
    settings = IndexSettings(max_tokens=int(max_tokens))
    index = index_section(ctx, corpus, site, settings)
    if index is None:
        return
    st.subheader("2. Direction")
    direction = direction_section(ctx, site, arch.d_model)
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
