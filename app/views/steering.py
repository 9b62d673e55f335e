"""Steering: add a direction at one layer, its scale in units of the site's mean activation norm; the steered
text beside the unsteered one, and a sweep of several scales side by side with how far each moves the text.

The page opens on defaults chosen by a measurement (`analyses.steering_defaults`, shipped in
docs/steering_default.json): the prompt-set pair, layer, scale and prompt where the steered text moves
towards the pair's concept words most while it stays fluent, on development prompts; the page has its
own prompt (the sidebar's is a word problem for other pages; a toggle uses it instead). The slider snaps
to the measured stops: fine where the text changes, coarse where it breaks. With greedy decoding the first draw
of a direction generates every grid scale in ONE batched generation (`analyses.steering.steering_grid`:
the prompt repeated, one row per scale), so a moved slider is a lookup; the sweep reads the same grid
and adds each text's perplexity under the unsteered model. Sampled decoding generates each scale
alone from the seed (a batch would give each row other random numbers than the unsteered text).

Below it, the steering stack (`app.steering_stack_ui`, `analyses.steering_stack`): every direction added
here or on the RISE, fuzzy concepts and feature browser pages, a slider per term and a global multiplier,
the stack's text with the engine's record of which terms acted at each token, the same stack with frozen
attention where the backend offers it, and presets saved and opened as JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import numpy as np
import streamlit as st

from analyses.steering_stack import StackTerm, from_sae_latent
from app.context import shows_errors
from app.export import show_figure
from app.registry import PageSpec
from app.steering_single import (DEFAULT_SCALE, DEFAULTS, DEFAULTS_PROBLEM, GRID, PROMPT, SET_A, SET_B,  # noqa: F401
                                 SWEEP_DEFAULT, SWEEP_GRID, _how_recorded, _text_box, grid_for, how_made,
                                 pick_direction, reference_norm, sampled_comparison, sweep_section)
from app.steering_stack_ui import add_button, stack_section
from analyses.steering import steering_vector
from probes.interventions import RESIDUAL_KINDS, AddVector

PAGE = PageSpec("Steering", ":material/tune:", 20)


def page_context(ctx):
    """The context this page generates with: its own prompt (chat: one user turn, no worked example), or
    the sidebar's when the toggle asks for it."""
    left, right = st.columns([4, 1], vertical_alignment="center")
    use_sidebar = right.toggle("Use the sidebar's prompt", False, key="steer_use_sidebar",
                               help="the sidebar's prompt (with its worked example in chat mode) instead of this one")
    prompt = left.text_area("Prompt (this page's own, chosen with the defaults)", PROMPT, key="steer_prompt",
                            height=68, disabled=use_sidebar,
                            help="the development prompt on which the default direction's steered text showed "
                                 "the most concept words while staying fluent (docs/steering_default.json)")
    return ctx if use_sidebar else dataclasses.replace(ctx, prompt=prompt, one_shot=False,
                                                      prompt_box="this page's prompt box")


def default_layer(ctx, n_layers: int) -> int:
    """The measured layer on the model it was measured on; the middle layer elsewhere."""
    measured = DEFAULTS.model in (ctx.model_id, ctx.backend.info().get("model_id"))
    return DEFAULTS.layer if measured and DEFAULTS.layer < n_layers else n_layers // 2


def _stops_text() -> str:
    fine = min(b - a for a, b in zip(GRID, GRID[1:]))
    upto = max(s for s, t in zip(GRID, GRID[1:]) if s >= 0 and round(t - s, 6) == round(fine, 6)) + fine
    return (f"snaps to the {len(GRID)} stops {GRID[0]:g}, {GRID[1]:g}, \u2026, {GRID[-1]:g} "
            f"(every {fine:g} from 0 to {upto:g})")


def _as_term(ctx, site: str, direction: np.ndarray, made_from: dict, scale: float) -> StackTerm:
    """The page's direction as a stack term at the slider's scale (an SAE feature kept by reference)."""
    if made_from["source"] == "sae":
        return from_sae_latent(made_from["folder"], made_from["feature"], site, ctx.backend.arch().d_model,
                               strength=float(scale))
    kinds = {"difference of means": "diff_of_means", "file": "upload"}
    source = {"kind": kinds.get(made_from["source"], made_from["source"]),
              **{k: v for k, v in made_from.items() if k != "source"}}
    label = {"diff_of_means": "difference of means"}.get(source["kind"], made_from.get("file") or "vector")
    return StackTerm(site, direction, float(scale), label=label, source=source)


def render(ctx) -> None:
    st.title("Steering")
    if DEFAULTS_PROBLEM:
        st.warning(f"{DEFAULTS_PROBLEM}. The page opens on its former defaults instead.")
    else:
        st.markdown(f":gray[Opens on the \u00ab{DEFAULTS.pair}\u00bb pair at layer {DEFAULTS.layer}, scale "
                    f"{DEFAULTS.scale:g}: chosen on {DEFAULTS.model} by a measurement (target-word log-probability "
                    "shift under a fluency bound; `docs/steering_default.json`, docs/app.md).]")
    ctx = page_context(ctx)
    with shows_errors() as spot:
        key = ctx.cache_key()
    if spot.failed:
        return
    unsteered = direction_section(ctx, key)
    stack_section(ctx, key, GRID, unsteered)


def direction_section(ctx, key: str):
    """One direction with its scale slider, the steered text beside the unsteered one, the sweep; returns the
    unsteered text (shared with the stack) or None while no direction is given."""
    n_layers = ctx.backend.arch().n_layers
    left, right = st.columns(2)
    kind = left.selectbox("Site", RESIDUAL_KINDS, index=RESIDUAL_KINDS.index("resid_post"), key="steer_kind")
    layer = right.selectbox("Layer", range(n_layers), index=default_layer(ctx, n_layers), key="steer_layer")
    site = f"{kind}.{layer}"
    picked = pick_direction(ctx, site)
    if picked is None:
        return None
    direction, made_from = picked
    with shows_errors() as spot:
        norm = reference_norm(ctx, key, site)
    if spot.failed:
        return None
    st.caption(f"direction at `{site}`: |v| = {float(np.linalg.norm(direction)):.3g}; mean activation norm at "
               f"`{site}` over this prompt (first token excluded) = {norm:.3g}")
    scale = st.select_slider(f"Scale (\u00d7 mean \u2016{site}\u2016 = {norm:.3g}); {_stops_text()}", GRID,
                             DEFAULT_SCALE, format_func=lambda v: f"{v:g}", key="steer_scale",
                             help=f"adds scale \u00d7 {norm:.3g} \u00d7 v/|v| at every position: 0.5 adds half a "
                                  "typical activation, whatever the length of v. The stops are fine where the "
                                  "measured text changes, coarse where it breaks. With greedy decoding every stop is "
                                  "generated once, in one batch, when the direction is first drawn; moving the "
                                  "slider then reads it.")
    direction_key = hashlib.sha256(direction.tobytes()).hexdigest()[:16]
    greedy = ctx.settings.sampling().greedy
    grid = None
    slots = (st.empty(), st.empty())  # the first draw's progress and preview; empty on every other run
    with shows_errors() as spot:
        started = time.perf_counter()
        if greedy:
            grid = grid_for(ctx, key, site, direction_key, direction, norm, shown=float(scale), slots=slots)
            result = grid.comparison(grid.snap(scale))
        else:
            with st.spinner("Steering (sampled: this scale alone, from the seed)\u2026"):
                result = sampled_comparison(ctx, key, site, direction_key, direction, round(float(scale), 4), norm)
        took = time.perf_counter() - started
    if spot.failed:
        return None
    left, right = st.columns(2)
    with left:
        _text_box(ctx, "**Unsteered**", result.unsteered, "unsteered-text",
                  f"{len(result.unsteered.tokens)} tokens")
    with right:
        ppl = f", perplexity {result.perplexity:.3g} under the unsteered model" if result.perplexity else ""
        _text_box(ctx, f"**Steered** (scale {result.scale:g}, adds |v| = {result.added_norm:.3g})", result.steered,
                  "steered-text", f"{len(result.steered.tokens)} tokens{ppl}; {how_made(result, grid)}; "
                                  + (f"answered in {took * 1000:.0f} ms" if took < 1 else f"answered in {took:.1f} s"))
    steer = AddVector(site, steering_vector(direction, "norm", norm), result.scale)
    record = ctx.provenance(interventions=[steer.describe()],
                            settings={"site": site, "unit": "norm", "reference_norm": norm, "direction": made_from,
                                      "made": _how_recorded(grid)})
    show_figure(None, result, "steering", provenance=record)
    add_button("steer_add_to_stack", lambda: _as_term(ctx, site, direction, made_from, result.scale),
               "Add this direction to the steering stack")
    sweep_section(ctx, key, site, direction_key, direction, norm, made_from, grid)
    return result.unsteered
