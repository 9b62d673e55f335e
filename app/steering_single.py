"""The Steering page's single direction: where it comes from (prompt sets, a file, an SAE feature), its greedy
slider grid made in one batched generation and kept per process, sampled scales generated alone from the
seed, and the sweep of several scales with each text's perplexity under the unsteered model.

The page (`app.views.steering`) draws these; the measured defaults (`analyses.steering_defaults`,
docs/steering_default.json) are read here once, with the former defaults as the fallback the page reports.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import streamlit as st

from analyses.rise import saved_saes
from analyses.steering_defaults import SteeringDefaults, load_defaults
from analyses.steering import (GeneratedText, SteeringComparison, SteeringGrid, SteeringSweep, add_perplexities,
                               continuation_perplexity, diff_of_means_direction, generate_text, sae_feature_direction,
                               scale_grid, site_norm, steered_comparison, steering_grid, steering_vector)
from app.context import FinishedGenerations, shows_errors
from app.export import show_figure
from app.figures.trace import display_text
from probes.interventions import AddVector, load_vector_bytes
from thoughtscope.errors import BadInputError

FROM_PROMPTS = "two prompt sets (difference of means)"
FROM_FILE = "a .safetensors vector"
FROM_SAE = "a saved SAE feature"
# used only when docs/steering_default.json is missing or damaged (the page says so): the former defaults
FALLBACK = SteeringDefaults(
    "smollm2-135m", "sentiment",
    ("I love this, it is wonderful.", "What a happy, joyful day!", "This is great news, I am so glad."),
    ("I hate this, it is terrible.", "What a sad, miserable day.", "This is awful news, I am so upset."),
    15, 0.5, tuple(scale_grid(-2.0, 2.0, 0.25)), "Write one sentence about your morning.", ())
try:
    DEFAULTS, DEFAULTS_PROBLEM = load_defaults(), None
except BadInputError as exc:
    DEFAULTS, DEFAULTS_PROBLEM = FALLBACK, str(exc)
SET_A = "\n".join(DEFAULTS.set_a)
SET_B = "\n".join(DEFAULTS.set_b)
PROMPT = DEFAULTS.prompt  # the page's own prompt (chat: one user turn, no worked example)
GRID = list(DEFAULTS.stops)  # the slider's stops: every one is a row of one batched generation
SCALE_RANGE = (GRID[0], GRID[-1])
DEFAULT_SCALE = DEFAULTS.scale
SWEEP_GRID = [s for s in GRID if s != 0.0]  # the sweep offers the slider's scales: it reads the same grid
# the sweep opens on one scale towards B, every other stop up to the default, and two stops beyond it
SWEEP_DEFAULT = sorted({-0.5, *[s for s in SWEEP_GRID if 0 < s < DEFAULT_SCALE][1::2], DEFAULT_SCALE,
                        *[s for s in SWEEP_GRID if s > DEFAULT_SCALE][:2]} & set(SWEEP_GRID))
MAX_SCALES_KEPT = 64  # sampled steered generations kept per (prompt, site, direction)
# session key: {(prompt key, site, direction) slot: the scales this session pressed Run sweep for}. The
# perplexities are kept per process (a second session's Run reads them), but whether a sweep is drawn is this
# session's own: another session's Run must not add a sweep to a page nobody here asked for.
SWEEPS_RUN = "_ts_steer_sweeps_run"


@st.cache_resource
def steered_store() -> FinishedGenerations:
    """Steered generations of this process: (prompt key, site, direction) -> {scale: comparison}."""
    return FinishedGenerations(max_entries=16)


@st.cache_data(show_spinner=False, max_entries=32)
def prompt_direction(_ctx, model_key: str, set_a: str, set_b: str, site: str, reduce: str) -> np.ndarray:
    return diff_of_means_direction(_ctx.backend, set_a.splitlines(), set_b.splitlines(), site, reduce).numpy()


@st.cache_data(show_spinner=False, max_entries=32)
def unsteered(_ctx, key: str) -> GeneratedText:
    s = _ctx.settings
    return generate_text(_ctx.backend, _ctx.model_input(), max_new_tokens=s.max_new_tokens, sampling=s.sampling(),
                         seed=_ctx.seed, chat=_ctx.chat)


@st.cache_data(show_spinner=False, max_entries=32)
def unsteered_perplexity(_ctx, key: str) -> float | None:
    return continuation_perplexity(_ctx.backend, _ctx.model_input(), unsteered(_ctx, key).token_ids, _ctx.chat)


@st.cache_data(show_spinner=False, max_entries=64)
def reference_norm(_ctx, key: str, site: str) -> float:
    """Mean activation norm at `site` over the prompt (the first token excluded): the scale's unit."""
    return site_norm(_ctx.backend, _ctx.model_input(), site, _ctx.chat)


@st.cache_data(show_spinner=False, max_entries=32)
def sae_direction(folder: str, feature: int, d_model: int, site: str) -> np.ndarray:
    return sae_feature_direction(folder, feature, d_model, site).numpy()


@st.cache_data(show_spinner=False, max_entries=256)
def special_ids(_ctx, model_key: str, ids: tuple[int, ...]) -> list[int]:
    backend = _ctx.backend
    return sorted(i for i in set(ids) if backend.decode([i]) and not backend.decode([i], skip_special_tokens=True))


def _slot(*parts: Any) -> str:
    return json.dumps(list(parts))


def grid_for(ctx, key: str, site: str, direction_key: str, direction: np.ndarray, norm: float,
             shown: float | None = None, slots: tuple[Any, Any] | None = None) -> SteeringGrid:
    """Every slider scale of this direction (greedy decoding), made once in one batched generation and
    kept per process; the unsteered text is kept per prompt and settings, shared by every direction.
    While the batch runs, a progress bar and the text at scale `shown` fill `slots` (two `st.empty()`
    the page makes on every run, so the elements after them keep their places from run to run)."""
    store = steered_store()
    grid = store.get(_slot(key, site, direction_key, "grid"))
    if grid is not None:
        return grid
    base = store.get(_slot(key, "unsteered"))  # without it, scale 0 is one more row of the batch
    rows = len(GRID) - (base is not None)
    bar_slot, preview = slots if slots is not None else (st.empty(), st.empty())
    bar = bar_slot.progress(0.0, text=f"Steering at all {rows} scales of the slider in one batch (once per "
                                      "direction)\u2026")
    eos = ctx.backend.eos_ids()  # the end-of-turn token is not printed as text
    s = ctx.settings
    grid = steering_grid(ctx.backend, ctx.model_input(), site, direction, GRID, max_new_tokens=s.max_new_tokens,
                         seed=ctx.seed, chat=ctx.chat, unit="norm", reference_norm=norm, unsteered=base,
                         on_progress=lambda done, total: bar.progress(
                             done / total, text=f"token {done} of {total}, {rows} scales at once"),
                         watch=shown, on_watched=lambda part: preview.text(
                             f"scale {shown:g}: {display_text(part.tokens, part.token_ids, eos)}"))
    bar.empty()
    preview.empty()
    store.put(_slot(key, site, direction_key, "grid"), grid)
    if base is None:
        store.put(_slot(key, "unsteered"), grid.unsteered)
    return grid


def sampled_comparison(ctx, key: str, site: str, direction_key: str, direction: np.ndarray, scale: float,
                       norm: float, quality: bool = False) -> SteeringComparison:
    """Sampled decoding: the steered generation at `scale`, alone from the seed (kept per process);
    `quality` adds the perplexity under the unsteered model."""
    store = steered_store()
    slot = _slot(key, site, direction_key)
    known: dict[float, SteeringComparison] = store.get(slot) or {}
    result = known.get(scale)
    if result is None:
        s = ctx.settings
        result = steered_comparison(ctx.backend, ctx.model_input(), site, direction, scale,
                                    max_new_tokens=s.max_new_tokens, sampling=s.sampling(), seed=ctx.seed, chat=ctx.chat,
                                    unsteered=unsteered(ctx, key), unit="norm", reference_norm=norm, quality=quality)
    elif quality and result.perplexity is None:
        result.perplexity = continuation_perplexity(ctx.backend, ctx.model_input(), result.steered.token_ids, ctx.chat)
    else:
        return result
    known = {**known, scale: result}
    if len(known) > MAX_SCALES_KEPT:
        known.pop(next(iter(known)))
    store.put(slot, known)
    return result


def how_made(result: SteeringComparison, grid: SteeringGrid | None) -> str:
    if result.scale == 0:
        return "scale 0 is the unsteered text"
    if grid is not None:
        return (f"one of the {len(grid.texts)} scales generated together in one batch ({grid.seconds:.1f} s, when "
                "this direction was first drawn)")
    return "sampled: generated alone from the seed"


def pick_direction(ctx, site: str) -> tuple[np.ndarray, dict[str, Any]] | None:
    """The direction and what it was made from (for the provenance record), or None until one is given."""
    source = st.radio("Direction from", [FROM_PROMPTS, FROM_FILE, FROM_SAE], horizontal=True, key="steer_source")
    if source == FROM_SAE:
        left, right = st.columns([3, 1])
        saved = {s.label: s.folder for s in saved_saes(ctx.model_id, site)}  # trained on the RISE page
        other = "another folder\u2026"
        choice = left.selectbox("SAE", [*saved, other], key="steer_sae_saved",
                                help="SAEs the RISE page saved for this model at this site, or any SAELens folder")
        if choice == other:
            folder = left.text_input("SAE folder (SAELens format: cfg.json + sae_weights.safetensors)",
                                     key="steer_sae")
        else:
            folder = str(saved[choice])
        feature = right.number_input("Feature", 0, 10**7, 0, key="steer_feature")
        if not folder.strip():
            st.info("Give the folder of an SAE trained on this model's activations at the chosen site.")
            return None
        d_model = ctx.backend.arch().d_model
        with shows_errors() as spot:
            vector = sae_direction(folder.strip(), int(feature), d_model, site)
        return None if spot.failed else (vector, {"source": "sae", "folder": folder.strip(), "feature": int(feature)})
    if source == FROM_PROMPTS:
        left, right = st.columns(2)
        set_a = left.text_area("Set A: steer towards (one prompt a line)", SET_A, key="steer_set_a")
        set_b = right.text_area("Set B: steer away from", SET_B, key="steer_set_b")
        reduce = st.radio("Per prompt, take", ["mean", "last"], horizontal=True, key="steer_reduce",
                          help="the mean over all positions, or the last position only")
        with shows_errors() as spot, st.spinner("Tracing both prompt sets\u2026"):
            vector = prompt_direction(ctx, f"{ctx.server_url}|{ctx.model_id}", set_a, set_b, site, reduce)
        if spot.failed:
            return None
        return vector, {"source": "difference of means", "set_a": set_a.splitlines(), "set_b": set_b.splitlines(),
                        "reduce": reduce}
    upload = st.file_uploader("Steering vector", type=["safetensors"], key="steer_upload",
                              help="one tensor of width d_model, saved with safetensors.torch.save_file")
    name = st.text_input("Tensor name (only if the file holds several)", key="steer_tensor").strip() or None
    if upload is None:
        st.info("Upload a .safetensors file holding the vector.")
        return None
    with shows_errors() as spot:
        vector = load_vector_bytes(upload.getvalue(), name).numpy()
    return None if spot.failed else (vector, {"source": "file", "file": upload.name, "tensor": name})


def _text_box(ctx, title: str, part: GeneratedText, key: str, note: str = "") -> None:
    with st.container(border=True, key=key):
        st.markdown(title)
        special = special_ids(ctx, f"{ctx.server_url}|{ctx.model_id}", tuple(part.token_ids))
        st.text(display_text(part.tokens, part.token_ids, special))
        if note:
            st.caption(note)


def sweep_section(ctx, key: str, site: str, direction_key: str, direction: np.ndarray, norm: float,
                  made_from: dict[str, Any], grid: SteeringGrid | None) -> None:
    st.subheader("Sweep")
    left, right = st.columns([4, 1], vertical_alignment="bottom")
    scales = left.multiselect(f"Scales (\u00d7 mean \u2016{site}\u2016)", SWEEP_GRID, default=SWEEP_DEFAULT,
                              key="steer_sweep_scales", help="the slider's scales: greedy texts come from its grid")
    run = right.button("Run sweep", key="steer_sweep_run", icon=":material/stacked_line_chart:")
    chosen = sorted({float(s) for s in scales})
    slot = _slot(key, site, direction_key)
    ran: dict[str, frozenset[float]] = st.session_state.setdefault(SWEEPS_RUN, {})
    if grid is not None:  # greedy: the texts are the slider's; a sweep adds one perplexity pass per text
        if run:
            with shows_errors() as spot:
                bar = st.progress(0.0, text="perplexity under the unsteered model\u2026")
                add_perplexities(ctx.backend, ctx.model_input(), grid, chosen, chat=ctx.chat,
                                 on_progress=lambda done, total: bar.progress(done / total,
                                                                              text=f"text {done} of {total}"))
                bar.empty()
            if spot.failed:
                return
            ran[slot] = ran.get(slot, frozenset()) | set(chosen)
        if not chosen or not ran.get(slot, frozenset()).issuperset(chosen) or any(
                s not in grid.perplexities for s in chosen):
            st.info("Press **Run sweep** for each text's perplexity under the unsteered model (the texts are the "
                    "slider's, made in one batch).")
            return
        sweep = grid.sweep(chosen)
    else:
        known: dict[float, SteeringComparison] = steered_store().get(slot) or {}
        if run:
            with shows_errors() as spot:
                todo = [s for s in chosen if s not in known or known[s].perplexity is None]
                bar = st.progress(0.0, text="steering\u2026")
                for i, scale in enumerate(todo):
                    sampled_comparison(ctx, key, site, direction_key, direction, scale, norm, quality=True)
                    bar.progress((i + 1) / len(todo), text=f"scale {scale:g} ({i + 1} of {len(todo)})")
                bar.empty()
            if spot.failed:
                return
            ran[slot] = ran.get(slot, frozenset()) | set(chosen)
            known = steered_store().get(slot) or {}
        rows = [known[s] for s in chosen if s in known and known[s].perplexity is not None]
        if not rows or len(rows) < len(chosen) or not ran.get(slot, frozenset()).issuperset(chosen):
            st.info("Press **Run sweep** to generate every scale (sampled: each alone from the seed).")
            return
        sweep = SteeringSweep(site, "norm", norm, float(np.linalg.norm(direction)), unsteered(ctx, key),
                              unsteered_perplexity(ctx, key), rows)
    rows = sweep.rows
    per_row = 3
    for lo in range(0, len(rows), per_row):
        cols = st.columns(per_row)
        for col, r in zip(cols, rows[lo:lo + per_row]):
            with col:
                _text_box(ctx, f"**scale {r.scale:g}** (adds |v| = {r.added_norm:.3g})", r.steered,
                          f"sweep-text-{lo}-{rows.index(r)}",
                          f"perplexity {r.perplexity:.3g} under the unsteered model" if r.perplexity else "")
    record = ctx.provenance(interventions=[AddVector(site, steering_vector(direction, "norm", norm), r.scale).describe()
                                           for r in rows],
                            settings={"site": site, "unit": "norm", "reference_norm": norm, "direction": made_from,
                                      "made": _how_recorded(grid)})
    show_figure(None, sweep, "steering_sweep", provenance=record)


def _how_recorded(grid: SteeringGrid | None) -> str:
    if grid is None:
        return "sampled: each scale generated alone from the seed"
    return (f"greedy: scales {', '.join(f'{s:g}' for s in grid.scales)} in one batched generation, one row per "
            "scale (each row equals the single-row steered generation)")
