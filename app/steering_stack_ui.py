"""The steering stack in the app: kept in one place (this session's state, `session_stack`), filled by the
"Add to steering stack" buttons of the method pages (`add_button`), drawn and generated with on the
Steering page (`stack_section`): one slider per term, the global multiplier, the steered text, presets.

The stack itself (terms, compiling, presets) is `analyses.steering_stack`; this module only keeps it
between runs and pages and draws it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import streamlit as st

from analyses.steering_stack import (MAX_TERMS, StackTerm, SteeringStack, grid_key, preset_from_bytes,
                                     reference_norms, stack_generation, stack_grid, stack_token_kl, to_preset,
                                     token_divergence)
from app.context import compute, shows_errors
from app.jobs import one_step, registry, run_job
from app.export import show_figure
from app.figures.trace import display_text

STACK = "_ts_steering_stack"  # session key: {"stack": SteeringStack, "ids": [one id per term], "next": int}
EDITABLE = ["additive", "norm_scaled", "project_out"]  # methods a term's direction alone defines
MULTIPLIERS = [round(-2.0 + 0.25 * i, 2) + 0.0 for i in range(17)]


def _state() -> dict[str, Any]:
    return st.session_state.setdefault(STACK, {"stack": SteeringStack(), "ids": [], "next": 0})


def session_stack() -> SteeringStack:
    """The stack of this session (every page adds to the same one; the Steering page draws it)."""
    return _state()["stack"]


def set_stack(stack: SteeringStack) -> None:
    """Replace the whole stack (a preset loaded): every term gets a new slider id."""
    state = _state()
    n = len(stack.terms)
    state.update(stack=stack, ids=list(range(state["next"], state["next"] + n)), next=state["next"] + n)


def add_to_stack(term: StackTerm) -> SteeringStack:
    state = _state()
    state["stack"] = state["stack"].add(term)  # the bound and the term are checked before anything changes
    state["ids"].append(state["next"])
    state["next"] += 1
    return state["stack"]


def _remove(index: int) -> None:
    state = _state()
    state["stack"] = state["stack"].remove(index)
    state["ids"].pop(index)


def add_button(key: str, make_term: Callable[[], StackTerm], label: str = "Add to steering stack") -> bool:
    """A button that adds `make_term()` to the session's stack (the Steering page shows it); errors in place."""
    if not st.button(label, key=key, icon=":material/playlist_add:",
                     help=f"adds this direction as one more term of the Steering page's stack (at most {MAX_TERMS})"):
        return False
    with shows_errors() as spot:
        term = make_term()
        stack = add_to_stack(term)
    if not spot.failed:
        st.success(f"Added **{term.name}** at `{term.site}`: the steering stack has {len(stack.terms)} term(s); "
                   "open the Steering page to use it.", icon=":material/playlist_add_check:")
    return not spot.failed


def _term_row(i: int, term: StackTerm, slot: int, stops: list[float]) -> None:
    left, mid, right = st.columns([5, 2, 1], vertical_alignment="bottom")
    value = min(stops, key=lambda s: abs(s - term.strength))
    unit = "\u00d7 mean \u2016site\u2016" if term.uses_norm else term.method
    strength = left.select_slider(f"{i + 1}. {term.name} at `{term.site}` ({unit})", stops, value,
                                  format_func=lambda v: f"{v:g}", key=f"stack_strength_{slot}")
    methods = [*EDITABLE, *(["sae_clamp"] if term.source.get("kind") == "sae" else [])]
    methods += [] if term.method in methods else [term.method]  # a preset's projection cap keeps its own
    method = mid.selectbox("Edit", methods, methods.index(term.method), key=f"stack_method_{slot}",
                           help="additive: h + s v; norm_scaled: h + s |h| v/|v|; project_out: h - s (h.u) u; "
                                "sae_clamp: the SAE latent set to 0 (times s), its reconstruction error kept "
                                "(probes.edits)")
    span = "" if term.start is None and term.stop is None else f" {term.start or 0}..{term.stop or ''}"
    mid.caption(f"|v| = {float(term.direction.norm()):.3g}, {term.tokens} tokens{span}"
                + (", special tokens skipped" if term.skip_special else ""))
    if method != term.method:
        params = {"value": 0.0, **term.params} if method == "sae_clamp" else term.params
        stack = session_stack()
        _state()["stack"] = replace(stack, terms=[replace(t, method=method, params=params) if j == i else t
                                                   for j, t in enumerate(stack.terms)])
        st.rerun()
    if right.button("Remove", key=f"stack_remove_{slot}", icon=":material/delete:"):
        _remove(i)
        st.rerun()
    if float(strength) != value:  # moved (a preset's off-stop strength stays as given until then)
        _state()["stack"] = session_stack().with_strength(i, float(strength))
        _state()["moved"] = slot  # greedy: this term's stops are made in one batch (a job), later moves read it
        _state()["moved_now"] = True


def presets(ctx, stack: SteeringStack) -> None:
    left, right = st.columns(2)
    left.download_button("Save the stack as a preset (JSON)", json.dumps(to_preset(stack, model_id=ctx.model_id), indent=1),
                         file_name="steering_stack.json", mime="application/json", key="stack_save",
                         icon=":material/download:", disabled=not stack.terms)
    upload = right.file_uploader("Open a preset", type=["json"], key="stack_preset")
    if upload is not None and st.session_state.get("_ts_stack_preset_read") != upload.file_id:
        with shows_errors(right) as spot:
            loaded = preset_from_bytes(upload.getvalue(), ctx.backend.arch().d_model)
        st.session_state["_ts_stack_preset_read"] = upload.file_id  # read once: the upload stays in its box
        if not spot.failed:
            set_stack(loaded)
            st.rerun()


def stack_section(ctx, key: str, stops: list[float], unsteered: Any = None) -> None:
    """The whole stack: a slider per term, the global multiplier, the steered text beside the unsteered one."""
    st.subheader("Steering stack")
    stack = session_stack()
    st.caption(f"Several directions at once, each at its own site with its own strength (at most {MAX_TERMS}), "
               "times one global multiplier. Add terms with **Add to steering stack** here or on the RISE, fuzzy "
               "concepts and feature browser pages.")
    state = _state()
    for i, (term, slot) in enumerate(zip(list(stack.terms), list(state["ids"]))):
        _term_row(i, term, slot, stops)
    stack = session_stack()
    shown = min(MULTIPLIERS, key=lambda m: abs(m - stack.multiplier))
    multiplier = st.select_slider("Global multiplier (every term's strength \u00d7 this)", MULTIPLIERS, shown,
                                  format_func=lambda v: f"{v:g}", key="stack_multiplier")
    if float(multiplier) != shown:
        stack = state["stack"] = SteeringStack(stack.terms, float(multiplier))
    presets(ctx, stack)
    if not stack.terms:
        st.info("The stack is empty: add the direction above, or one from another page.")
        return
    s = ctx.settings
    prompt = ctx.model_input()
    can_freeze = bool(ctx.backend.capabilities().get("frozen_attention"))
    frozen = st.toggle("Also with frozen attention", False, key="stack_frozen", disabled=not can_freeze,
                       help="the same stack again, with every layer's attention probabilities those of the unsteered "
                            "model on the same tokens: the edits reach later positions only through the residual "
                            "stream (docs/steering.md)" + ("" if can_freeze else ". This model or server does not "
                                                                                 "offer it."))
    frozen = bool(frozen and can_freeze)

    def work():
        return stack_generation(ctx.backend, prompt, stack, max_new_tokens=s.max_new_tokens, seed=ctx.seed,
                                chat=ctx.chat, sampling=s.sampling(), unsteered=unsteered, frozen=frozen,
                                norms=reference_norms(ctx.backend, prompt, stack, ctx.chat))

    moved, start = state.get("moved"), state.pop("moved_now", False)
    index = state["ids"].index(moved) if moved in state["ids"] else None
    gkey = None if index is None else f"stack-grid|{key}|{grid_key(stack, index)}|{frozen}"
    if gkey and s.sampling().greedy and stack.terms[index].strength in stops and (start or registry().for_key(gkey)):
        def grid_work(job):
            return stack_grid(ctx.backend, prompt, stack, index, stops, max_new_tokens=s.max_new_tokens, seed=ctx.seed,
                              chat=ctx.chat, unsteered=unsteered, frozen=frozen, on_progress=job.progress,
                              norms=reference_norms(ctx.backend, prompt, stack, ctx.chat))

        grid = run_job(gkey, grid_work, kind="steering-stack", page="steering", start=start,
                       label=f"Term {index + 1} at all {len(stops)} stops of its slider in one batch (once; later "
                             "moves of this slider read it)")
        result = None if grid is None else grid.generation(stack.terms[index].strength)
    else:  # the first draw, the multiplier, sampled decoding: one generation with the whole stack
        result = compute(f"stack|{key}|{stack.key()}|{frozen}", work, start=True,
                         spinner="Steering with the stack\u2026", kind="steering-stack", page="steering")
    if result is None:
        return
    eos = ctx.backend.eos_ids()
    texts = [("Steered with the stack", result.steered, "stack-steered-text")]
    if result.frozen is not None:
        texts.append(("Steered, attention frozen", result.frozen, "stack-frozen-text"))
    for col, (title, part, box) in zip(st.columns(len(texts)), texts):
        differs = sum(token_divergence(result.unsteered, part))
        with col.container(border=True, key=box):
            st.markdown(f"**{title}** ({len(result.active)} active term(s), multiplier {stack.multiplier:g})")
            st.text(display_text(part.tokens, part.token_ids, eos))
            st.caption(f"{len(part.tokens)} tokens, {differs} differ from the unsteered text at their position")
    strip(result)
    record = ctx.provenance(interventions=result.interventions,
                            settings={"stack": to_preset(stack, model_id=ctx.model_id)})
    show_figure(None, result, "steering_stack", provenance=record)
    kl_section(ctx, prompt, stack, result, record, key)


def kl_section(ctx, prompt: Any, stack: SteeringStack, result: Any, record: Any, key: str) -> None:
    """On demand: per steered token, KL(steered || unsteered) of the next-token distributions
    (`stack_token_kl`: the steered generation made again capturing its logits, and one pass of the unsteered
    model over the same tokens)."""
    s = ctx.settings
    kl_key = f"stack-kl|{key}|{stack.key()}|{hash(tuple(result.steered.token_ids))}"
    start = st.button("Per-token KL to the unsteered model", key="stack_kl", icon=":material/query_stats:",
                      help="how far the stack moves the next-token distribution at each steered token, also where "
                           "the greedy token stays: KL(steered || unsteered) in nats, after the same prefix. Two "
                           "model calls.")
    work = one_step("the steered generation with its logits, then the unsteered model over it",
                    lambda: stack_token_kl(ctx.backend, prompt, stack, result, seed=ctx.seed, chat=ctx.chat,
                                           sampling=s.sampling()))
    found = run_job(kl_key, work, label="Per-token KL of the stack", kind="steering-stack-kl", page="steering",
                    start=start, keep_running_option=False)
    if found is not None:
        show_figure(None, found, "steering_stack_kl", provenance=record)


def strip(result: Any) -> None:
    """Per term: at how many steered tokens the engine recorded it acting, and the norm it added."""
    n = len(result.applied)
    with st.container(key="stack-strip"):
        lines = []
        for name in result.term_names:
            norms = [a[name] for a in result.applied if name in a]
            lines.append(f"{name}: acted at {len(norms)} of {n} tokens"
                         + (f", mean |added| {sum(norms) / len(norms):.4g}" if norms else "")
                         + ("" if name in result.active else " (strength 0: off)"))
        st.text("\n".join(lines))
    for name in result.never_acted():
        st.warning(f"**{name}** never acted on this generation: its token range or mask left out every "
                   "generated token (or every position was a special token).", icon=":material/warning:")
