"""Neuro-fuzzy concepts: readable IF-THEN rules over the hidden states of a target word, grounded in words and
samples, against semi-NMF (CoX-LMM), k-means and PCA on held-out samples (METHODS.md section 2).

The computation is one call, `analyses.fuzzy_concepts.run_study` (the same as `thoughtscope eval
fuzzy-concepts`); this page reads widgets, calls it, and draws: the metric table with baselines, one card
per rule, the firing of a chosen sample, the overlap heat map (`app.sections.fuzzy_concepts`), and steering
with a concept. Results are jobs' results (`app.jobs`), kept by everything they depend on, so moving between
layers already run is instant.

On a model with a shipped study (`thoughtscope ship fuzzy-concepts`: SmolLM2 at the page's defaults) the
page opens on it, labelled as stored; the harvest + fit and the steered generations run as jobs
(`app.jobs`: progress, time left, Stop, reattach from the URL).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st

from analyses.fuzzy_concepts import SOURCES_HELP, FuzzyOptions, run_study
from analyses.fuzzy_concepts.harvest import SOURCES, default_layer
from analyses.fuzzy_concepts.scenes import SceneSource
from analyses.fuzzy_concepts.ship import NAME, comparable, load_study
from analyses.steering import steered_comparison
from analyses.steering_stack import from_fuzzy_concept
from app.context import shows_errors
from app.jobs import one_step, run_job
from app.registry import PageSpec
from app.sections.fuzzy_concepts import metrics_section, overlap_section, rules_section, sample_section
from app.steering_stack_ui import add_button
from thoughtscope import shipped
from thoughtscope.provenance import provenance

PAGE = PageSpec("Neuro-fuzzy concepts", ":material/hub:", 45, requires=("generate", "capture_batch", "readout"))


# ----------------------------------------------------------------------------- 1. settings and the run


def settings_section(ctx) -> FuzzyOptions:
    st.subheader("1. Target word, samples and layer")
    n_layers = ctx.backend.arch().n_layers
    c1, c2, c3, c4 = st.columns(4)
    word = c1.text_input("Target word", "water", key="fz_word", help="the token whose hidden states are decomposed")
    vision = bool(ctx.backend.capabilities().get("vision"))
    sources = (*SOURCES, SceneSource.kind) if vision else SOURCES  # scenes need a vision-language model
    source = c2.selectbox("Samples", sources, key="fz_source",
                          help=SOURCES_HELP + ("; toy-vlm-scenes: toy scenes read where the model is about to "
                                               "answer, scored against the asked object's colour and shape"
                                               if vision else ""))
    if source == SceneSource.kind:
        word = "answer"
    layer = c3.selectbox("Layer", list(range(n_layers)), index=default_layer(n_layers), key="fz_layer",
                         help="residual stream after this layer (resid_post)")
    k = c4.number_input("Rules / concepts K", 1, 64, 6, key="fz_k", help="the paper's default is 20")
    c1, c2, c3, c4 = st.columns(4)
    n = c1.number_input("Samples", 8, 2000, 48, key="fz_n", help="texts to generate (or corpus texts to take)")
    seeds = c2.number_input("Seeds", 1, 10, 3, key="fz_seeds", help="fits per method; intervals are over seeds")
    where = c3.radio("Read the word", ["generated", "any"], horizontal=True, key="fz_where",
                     help="generated: only where the model itself wrote it; any: else its last occurrence in the prompt")
    steps = c4.number_input("Gradient steps", 10, 2000, 300, 10, key="fz_steps")
    texts: tuple[str, ...] = ()
    if source == "texts":
        raw = st.text_area("Texts, one per line (each should contain the word)", key="fz_texts")
        texts = tuple(line for line in raw.splitlines() if line.strip())
    return FuzzyOptions(word=word, source=source, n=int(n), texts=texts, where=where, layer=int(layer), k=int(k),
                        seeds=int(seeds), steps=int(steps), max_new_tokens=ctx.settings.max_new_tokens,
                        batch_size=16, seed=ctx.seed)


def run_section(ctx, options: FuzzyOptions) -> dict[str, Any] | None:
    """The study for these settings: a finished job's, else the shipped one when the settings are the ones it
    was made with; "Harvest + fit" runs the study as a job (progress, time left, Stop)."""
    key = ctx.result_key("fuzzy-study", options=options.to_dict(), texts=list(options.texts))
    stored = shipped_study(ctx, options)
    label = "Run again with these settings" if stored.get("study") else "Harvest + fit"
    run_now = st.button(label, type="primary", key="fz_run", icon=":material/play_arrow:")
    backend, info = ctx.backend, ctx.backend.info()

    def work(job) -> dict[str, Any]:
        study = run_study(backend, options, on_progress=job.progress)
        return {"study": study, "data": study.to_dict(), "key": key,
                "provenance": provenance(info, data=f"{options.source}:{options.word}", split="eval",
                                         seed=options.seed, settings=options.to_dict(), site=study.reps.site)}

    found = run_job(key, work, label=f"Harvesting {options.word!r} at layer {options.resolved_layer(n_layers(ctx))} "
                                     f"and fitting {options.k} rules", kind="fuzzy-study", page="fuzzy_concepts",
                    start=run_now, resumes="the samples read so far are kept in the activation store and read back "
                                           "(the rules are fitted again)")
    if found is not None:
        return found
    if stored.get("study") is not None:
        st.success(stored["label"] + " Press **Run again with these settings** to run it yourself.",
                   icon=":material/inventory_2:")
        return stored["study"]
    if stored.get("note"):
        (st.warning if stored.get("damaged") else st.info)(stored["note"])
    st.info("Press **Harvest + fit** to collect the word's hidden states, tune on development samples, and fit "
            "the fuzzy rules and the baselines (semi-NMF, k-means, PCA) over several seeds.")
    return None


def n_layers(ctx) -> int:
    return int(ctx.backend.arch().n_layers)


def shipped_study(ctx, options: FuzzyOptions) -> dict[str, Any]:
    """{"study": the shipped result as the page's `found`, "label"} when one ships for this model and these
    settings; else {"note": why not (other settings, another fingerprint, damaged), "damaged"}."""
    found = shipped.find(NAME, ctx.model_id, ctx.backend.info()["fingerprint"])
    if not found:
        if found.damaged or "other weights" in found.reason:
            return {"note": found.reason + " Press **Harvest + fit** to make it here.", "damaged": found.damaged}
        return {}
    if found.manifest.get("settings") != comparable(options, n_layers(ctx)):
        return {"note": f"A stored result ships for {ctx.model_id}, made with other settings (the page's defaults: "
                        f"`{found.command}`); with yours, press **Harvest + fit**."}
    return {"study": _shipped_found(str(found.folder), found.manifest["files"]["study.json"]), "label": found.label()}


@st.cache_resource(show_spinner=False, max_entries=4)
def _shipped_found(folder: str, digest: str) -> dict[str, Any]:
    """The verified shipped study as the page's `found`, read once per process (`digest`: study.json's sha256)."""
    stored = shipped.Shipped(Path(folder), json.loads((Path(folder) / shipped.MANIFEST).read_text()))
    return {"study": load_study(stored), "data": stored.json("study.json"), "key": f"shipped:{folder}:{digest}",
            "provenance": stored.provenance, "shipped": stored.label()}


def steering_section(ctx, found: dict[str, Any]) -> None:
    study = found["study"]
    st.subheader("6. Steer with a concept")
    st.caption("The concept's consequent (relative to the training mean) is added at the layer it came from, at "
               "every position, for the sidebar prompt; the unsteered text uses the same seed.")
    left, right = st.columns([1, 2])
    rule = left.selectbox("Rule", range(len(study.rules)), key="fz_steer_rule",
                          format_func=lambda r: f"rule {r + 1}: {', '.join(study.rules[r].words[:3])}")
    scale = right.slider("Scale", -8.0, 8.0, 0.0, 0.5, key="fz_steer_scale",
                         help="adds scale \u00d7 (u_r - mean) at every position")
    add_button("fz_add_to_stack", lambda: from_fuzzy_concept(study.fuzzy, int(rule), study.reps.site, strength=0.5))
    if not ctx.prompt.strip():
        st.info("Type a prompt in the sidebar.")
        return
    direction = study.fuzzy.directions_[int(rule)]
    s = ctx.settings
    key = ctx.result_key("fuzzy-steer", study=found["key"], rule=int(rule), scale=float(scale),
                         input=ctx.model_input(), settings=s.to_dict(), seed=ctx.seed)
    backend, model_input, site = ctx.backend, ctx.model_input(), study.reps.site

    work = one_step("generate with and without the concept", lambda: steered_comparison(
        backend, model_input, site, direction, float(scale), max_new_tokens=s.max_new_tokens, sampling=s.sampling(),
        seed=ctx.seed, chat=ctx.chat))
    start = st.button("Generate with and without the concept", key="fz_steer_run", icon=":material/play_arrow:")
    result = run_job(key, work, label=f"Generating with and without rule {int(rule) + 1}'s concept (scale {scale:g})",
                     kind="fuzzy-steer", page="fuzzy_concepts", start=start)
    if result is None:
        return
    left, right = st.columns(2)
    with left.container(border=True, key="fz-unsteered"):
        st.markdown("**Unsteered**")
        st.text(result.unsteered_text)
    with right.container(border=True, key="fz-steered"):
        st.markdown(f"**Steered** (rule {int(rule) + 1}, scale {scale:g}, |v| = {result.direction_norm:.3g})")
        st.text(result.steered_text)


# ----------------------------------------------------------------------------- the page


def render(ctx) -> None:
    st.title("Neuro-fuzzy concepts")
    st.caption("Hidden states of one word across many contexts, explained by K fuzzy rules: IF the projected "
               "features are near a rule's centres THEN the representation is that rule's concept, a point in the "
               "model's hidden space grounded in words (a reconstruction of the ICML 2026 neuro-fuzzy concept "
               "learner, compared with CoX-LMM's semi-NMF dictionary, k-means and PCA).")
    options = settings_section(ctx)
    found = run_section(ctx, options)
    if found is None:
        return
    for section in (metrics_section, rules_section, sample_section, overlap_section):
        with shows_errors():
            section(found)
    with shows_errors():
        steering_section(ctx, found)
