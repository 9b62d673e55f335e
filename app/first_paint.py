"""The first figure first: a page opened in the browser draws up to its first figure, and the rest once the
browser has painted that figure.

Why (issue 28, measured in Chromium on the trace explorer): a page's whole script run reaches the browser
within a few milliseconds, so React mounts every element of the page in one go. The figures all wait on
the one lazily loaded plotly.js chunk (4.7 MB, 0.5-1.2 s to evaluate on this CPU) and, once it has
loaded, are drawn together in one task; the elements after them (a data frame and its own 1.2 MB of
chunks, widgets, export rows) are rendered in the same pass. Nothing is painted until all of it is done,
so the first figure waited on the three after it.

So the first run of each visit to a page (a new tab, a page switch) stops right after the page's first
figure (`after_figure`, called by `app.export.show_figure`) and mounts a small inline component
(`st.components.v2`, no iframe) that reports back once that figure's plot is in the document and the
frame after it has painted; its report reruns the page, which this time draws everything. Later runs of
the same visit (a widget moved, a button pressed) draw the whole page at once, as before. A report that
never comes (the figure failed to draw) is replaced by one after `FALLBACK_MS`, so a page never stays
half drawn.

Only for sessions served by `streamlit run app/main.py` (`enable`), which always have a browser: a page
run without one (`streamlit.testing`, a script) has nobody to report a paint and draws everything in
one run. `THOUGHTSCOPE_FIRST_FIGURE_FIRST=0` in the app's environment draws every page in one run too
(the benchmark's side-by-side baseline, `app.bench.bench_first_figure_first`).
"""

from __future__ import annotations

import os

import streamlit as st

SWITCH = "THOUGHTSCOPE_FIRST_FIGURE_FIRST"

VISIT = "_ts_first_paint_visit"  # the page whose visit the gate below belongs to
OPEN = "_ts_first_paint_open"  # True once the browser has painted that visit's first figure
ENABLED = "_ts_first_paint_enabled"
FALLBACK_MS = 8000

# The component's code runs in the app's page (isolate_styles=False: no shadow root). It looks for the
# figure drawn just before it (the element container above its own), waits until plotly's SVG is in it,
# then reports after the next frame is painted (a requestAnimationFrame callback runs before a paint, a
# task queued from it after: the same clock as app.bench.PAINT_PROBE).
_JS = """
export default function(component) {
  const { setTriggerValue, parentElement } = component;
  let sent = false;
  const report = (why) => {
    if (sent) return;
    sent = true;
    requestAnimationFrame(() => setTimeout(() => setTriggerValue("painted", why), 0));
  };
  const figureAbove = () => {
    const box = parentElement.closest('[data-testid="stElementContainer"]');
    let el = box ? box.previousElementSibling : null;
    while (el && !el.querySelector('[data-testid="stPlotlyChart"]')) el = el.previousElementSibling;
    return el ? el.querySelector('[data-testid="stPlotlyChart"] .main-svg') : null;
  };
  if (figureAbove()) { report("painted"); return; }
  const watch = new MutationObserver(() => { if (figureAbove()) { watch.disconnect(); report("painted"); } });
  watch.observe(document.body, {subtree: true, childList: true});
  const fallback = setTimeout(() => { watch.disconnect(); report("timeout"); }, %d);
  return () => { watch.disconnect(); clearTimeout(fallback); };
}
""" % FALLBACK_MS

_component = None


def _reporter():
    global _component
    if _component is None:  # registered once per process, on the first page that needs it
        _component = st.components.v2.component("thoughtscope_first_paint", js=_JS, isolate_styles=False)
    return _component


def enable() -> None:
    """This session has a browser (called by app.main when served by `streamlit run`)."""
    st.session_state[ENABLED] = os.environ.get(SWITCH, "1") != "0"


def begin_page(name: str) -> None:
    """At the start of a page's run: a run of another page than the last one starts a new visit (the gate
    closed until the browser reports this visit's first figure painted)."""
    if st.session_state.get(VISIT) != name:
        st.session_state[VISIT] = name
        st.session_state[OPEN] = False


def end_page() -> None:
    """At the end of a page's run that was not stopped: the visit's first run drew no figure (the steering
    page before its stack has one), so nothing waits on a paint and every later run draws the whole page. Left
    closed, the first figure to appear later (drawn by a widget's rerun) stopped that rerun and the ones after
    it until the browser's report came, and a slider moved meanwhile never drew its text."""
    st.session_state[OPEN] = True


def _opened() -> None:
    st.session_state[OPEN] = True


def after_figure() -> None:
    """After a figure is drawn: in the first run of a visit, stop here until the browser has painted it
    (the reporter's rerun draws the whole page); otherwise nothing."""
    if not st.session_state.get(ENABLED) or st.session_state.get(OPEN, True):
        return
    _reporter()(key="first-paint-report", on_painted_change=_opened)
    st.stop()
