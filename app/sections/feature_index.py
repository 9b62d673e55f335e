"""The feature browser's corpus and index parts: pick a corpus, open its stored (shipped) index or index it as a job.

Moved out of `app/views/feature_browser.py` (a page stays a short script); drawing and job plumbing
only, the index itself is `analyses.feature_browser.build_index`.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import streamlit as st

from analyses.feature_browser import CORPORA, Corpus, CorpusIndex, IndexSettings, build_index, load_corpus, text_corpus
from analyses.feature_browser import ship as fb_ship
from app import jobs
from app.context import FinishedGenerations, shows_errors
from thoughtscope import shipped

OWN_FILE = "your text file"


@st.cache_resource
def indexes() -> FinishedGenerations:
    """Indexed corpora held in memory by this process (the 2 newest; the cache on disk holds them all)."""
    return FinishedGenerations(max_entries=2)


@st.cache_data(show_spinner=False, max_entries=8)
def shipped_corpus(name: str, n: int | None) -> Corpus:
    return load_corpus(name, n=n)


def index_key(ctx, corpus: Corpus, site: str, settings: IndexSettings) -> str:
    return json.dumps([ctx.server_url, ctx.model_id, corpus.key, site, settings.key()])


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
