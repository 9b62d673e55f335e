"""The correctness badge: green/amber/red next to a trace, the validation's numbers on hover.

The badge is `backend.info()["validation"]` (probes.validate: cached per model fingerprint, dtype,
device and attention implementation), so an in-process engine and a model server show the same one.
When no validation is cached yet and the model is in this process, it starts in a background thread
after the page's first figure is drawn, and the badge polls for it: a figure never waits for it.
"""

from __future__ import annotations

from typing import Any

from probes.backend import Backend
from probes.engine import Engine
from probes.validate import background_error, badge
from thoughtscope.errors import ThoughtscopeError

COLOURS = {"pass": "green", "warn": "orange", "fail": "red"}
ICONS = {"pass": "verified", "warn": "warning", "fail": "error"}
LABELS = {"pass": "numbers checked", "warn": "numbers: check the warnings", "fail": "numbers differ from the model"}
POLL_SECONDS = 3.0


def badge_markdown(summary: dict[str, Any]) -> str:
    """`:green-badge[...]`: the verdict as a Streamlit badge."""
    verdict = summary.get("verdict", "warn")
    return f":{COLOURS.get(verdict, 'gray')}-badge[:material/{ICONS.get(verdict, 'help')}: {LABELS.get(verdict, verdict)}]"


def badge_tooltip(summary: dict[str, Any]) -> str:
    """The numbers behind the badge, in a few lines (the hover text)."""
    lines = [f"{summary['sites_pass']} of {summary['sites']} sites pass, {summary['sites_warn']} warn, "
             f"{summary['sites_fail']} fail, against {', '.join(summary['readers']) or 'no reader'}"
             + (f" ({', '.join(summary['skipped_readers'])} skipped for some sites)" if summary.get("skipped_readers")
                else "") + "."]
    w = summary.get("worst")
    if w:
        rel = "inf" if w["max_rel"] is None else f"{w['max_rel']:.3g}"
        lines.append(f"Worst: {w['site']} vs {w['reader']}, max relative error {rel}, min cosine {w['cosine']:.7f}.")
    if summary.get("not_passing"):
        lines.append("Not passing: " + ", ".join(summary["not_passing"]) + ".")
    if summary.get("logits_tv") is not None:
        lines.append(f"Logits vs a float32 copy: top-1 agreement {summary['logits_top1']:.4f}, "
                     f"max total variation {summary['logits_tv']:.3g}.")
    if summary.get("generation_verdict"):
        lines.append(f"Streamed records vs a teacher-forced forward: {summary['generation_verdict']}.")
    lines.append(f"{summary['model_id']} ({summary['fingerprint']}), {summary['dtype']} on {summary['device']}, "
                 f"{summary['attn_implementation']} attention. The Correctness page has the whole table.")
    return "\n\n".join(lines)


def in_process_engine(backend: Backend) -> Any | None:
    """The backend when it is an engine of this process with local weights (it can validate itself)."""
    return backend if isinstance(backend, Engine) and not backend.handle.remote else None


def current_badge(backend: Backend, start: bool = True) -> dict[str, Any] | None:
    """The cached badge, or None; with `start`, an in-process model without one begins validating in the background."""
    try:
        summary = backend.info().get("validation")
    except ThoughtscopeError:  # a model server out of reach: the page says so elsewhere; no badge, no crash
        return None
    engine = in_process_engine(backend)
    if summary is None and start and engine is not None:
        summary = badge(engine, background=True)
    return summary


def badge_state(backend: Backend) -> tuple[dict[str, Any] | None, bool, str | None]:
    """(the cached badge or None, whether a background validation is pending, why it failed or None). An
    in-process model without a badge starts validating in the background, once: after a failure it is not
    started again on every page run (it would fail again, and the badge would poll for ever); the
    Correctness page runs it again on request."""
    engine = in_process_engine(backend)
    failed = background_error(engine) if engine is not None else None
    summary = current_badge(backend, start=failed is None)
    return summary, summary is None and engine is not None and failed is None, failed


def show_badge(ctx: Any) -> None:
    """Draw the badge (call it after the page's first figure): it polls while a background validation runs."""
    import streamlit as st


    summary, pending, _ = badge_state(ctx.backend)
    engine = in_process_engine(ctx.backend)

    def draw() -> None:
        now = current_badge(ctx.backend, start=False)
        failed = background_error(engine) if engine is not None and now is None else None
        if pending and (now is not None or failed):
            # the validation is done or has failed: draw the page once more, so that the badge is drawn without
            # the poll. A polling fragment redraws the badge every POLL_SECONDS for as long as the page stays
            # open, and each redraw closed its hover tip within seconds (a browser test's tip never stayed open
            # for 2 minutes). After a failure the page's run does not start it again (`badge_state`)
            st.rerun()
        if now is not None:
            st.markdown(badge_markdown(now), help=badge_tooltip(now))
        elif failed:
            st.markdown(":gray-badge[:material/error: numbers could not be checked]",
                        help=f"the validation stopped: {failed}. The Correctness page runs it again.")
        elif pending:
            st.markdown(":gray-badge[:material/hourglass_top: checking the numbers against HF, nnsight and "
                        "TransformerLens\u2026]",
                        help="a one-off validation of this model as loaded runs in the background (Correctness page)")
        else:
            st.markdown(":gray-badge[:material/help: numbers not validated]",
                        help="the model server has no validation of its model cached: run `thoughtscope validate "
                             "--model ...` where the server runs")

    st.fragment(draw, run_every=POLL_SECONDS if pending else None)()
