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

A tab that has not loaded plotly.js yet (a new tab, a reload) draws the first figure's static preview above
its chart when the app has one (app/figure_preview.py), in the same first run: the preview is painted with
the page's text while the tab loads plotly.js for the chart below it, which hides the preview once drawn; the
chart's report opens the gate as in any first run. (Measured on the trace explorer, new tab, median of 3 on
the 2-core machine, 2026-12-04: a preview drawn alone first, its report then starting the run that drew the
chart, put the interactive chart at 3.0-3.8 s against 2.4 s without previews; drawn together, 2.6 s, and the
preview at 1.5 s.)

Only for sessions served by `streamlit run app/main.py` (`enable`), which always have a browser: a page
run without one (`streamlit.testing`, a script) has nobody to report a paint and draws everything in
one run. `THOUGHTSCOPE_FIRST_FIGURE_FIRST=0` in the app's environment draws every page in one run too
(the benchmark's side-by-side baseline, `app.bench.bench_first_figure_first`).
"""

from __future__ import annotations

import os
from typing import Any

import streamlit as st

from app import figure_preview

SWITCH = "THOUGHTSCOPE_FIRST_FIGURE_FIRST"

VISIT = "_ts_first_paint_visit"  # the page whose visit the gate below belongs to
OPEN = "_ts_first_paint_open"  # True once the browser has painted that visit's first figure
ENABLED = "_ts_first_paint_enabled"
SEEN = "_ts_first_paint_seen"  # True once this session's browser has reported a painted figure (charts follow)
FIRST = "_ts_first_paint_first"  # True until the running page draws its first figure
REPORTS = "_ts_first_paint_reports"  # reporters mounted in this session (each gated run has its own)
FALLBACK_MS = 8000
PREVIEW = figure_preview.CLASS

# The component's code runs in the app's page (isolate_styles=False: no shadow root). It looks for the
# figure drawn just before it (the element container above its own), waits until plotly's SVG is in it, then
# reports after the next frame is painted (a requestAnimationFrame callback runs before a paint, a
# task queued from it after: the same clock as app.bench.PAINT_PROBE).
_JS = """
const NAV = 'a[data-testid="stSidebarNavLink"], a[data-testid="stTopNavLink"], [data-testid="stPageLink"] a';
const pageOf = (href) => new URL(href, location.href).pathname.replace(/[/]+$/, "").split("/").pop();
// The page the user last asked for in this tab and the page they asked from (a link to a page clicked: the
// tab's address then; the browser's Back: the page of the last reporter mounted), recorded once per tab from
// the first reporter on, for every reporter after it.
if (!window.__tsAskedFor) {
  const asked = window.__tsAskedFor = {page: null, from: null, shown: null};
  document.addEventListener("click", (e) => {
    const a = e.target.closest && e.target.closest(NAV);
    if (a && a.href) Object.assign(asked, {page: pageOf(a.href), from: pageOf(location.href)});
  }, true);
  window.addEventListener("popstate", () => Object.assign(asked, {page: pageOf(location.href), from: asked.shown}));
  // Streamlit writes the page a run is for into the address bar as the run starts: once it shows the page
  // asked for, that request is served, and no later reporter is silenced by it (the server may move on).
  for (const name of ["pushState", "replaceState"]) {
    const write = history[name].bind(history);
    history[name] = (...args) => {
      const out = write(...args);
      if (asked.page !== null && pageOf(location.href) === asked.page) asked.page = null;
      return out;
    };
  }
}
export default function(component) {
  const { setTriggerValue, parentElement } = component;
  let sent = false;
  // A report reruns the page this tab shows, so one sent after the user asked for another page would take
  // them back here: Streamlit folds the two reruns into one, for the page of the later request. A reporter
  // mounted on the page the user last asked to leave (its page: the tab's address when it mounted, which
  // Streamlit updates as a page's run starts) stays silent; the page asked for opens its own gate. A page the
  // server moved to after the click (st.switch_page) is not the one left, so its reporter still reports.
  const here = pageOf(location.href);
  const asked = window.__tsAskedFor;
  asked.shown = here;
  const left = () => asked.page !== null && asked.page !== here && asked.from === here;
  const report = (why) => {
    if (sent || left()) return;
    sent = true;
    requestAnimationFrame(() => setTimeout(() => { if (!left()) setTriggerValue("painted", why); }, 0));
  };
  // The figure is the element right above this one (show_figure mounts the reporter right after it). Only
  // that element is looked in: a chart whose plotly.js is still loading has no chart element yet, and a
  // search further up would find the static preview above it (app/figure_preview.py) and report it.
  const figureAbove = () => {
    const box = parentElement.closest('[data-testid="stElementContainer"]');
    let el = box ? box.previousElementSibling : null;
    while (el && !el.matches('[data-testid="stElementContainer"]')) el = el.previousElementSibling;
    return el ? el.querySelector('[data-testid="stPlotlyChart"] .main-svg') : null;
  };
  const found = figureAbove();
  if (found) { report("painted"); return; }
  const watch = new MutationObserver(() => { if (figureAbove()) { watch.disconnect(); report("painted"); } });
  watch.observe(document.body, {subtree: true, childList: true});
  const fallback = setTimeout(() => { watch.disconnect(); report("timeout"); }, %d);
  return () => { watch.disconnect(); clearTimeout(fallback); };
}
"""


_component = None


def _reporter():
    global _component
    if _component is None:  # registered once per process, on the first page that needs it
        js = _JS % FALLBACK_MS
        _component = st.components.v2.component("thoughtscope_first_paint", js=js, isolate_styles=False)
    return _component


def enable() -> None:
    """This session has a browser (called by app.main when served by `streamlit run`)."""
    st.session_state[ENABLED] = os.environ.get(SWITCH, "1") != "0"


def load_preview_renderer() -> None:
    """At the very start of a run in a tab that may be shown a preview (app/figure_preview.py): a style-only
    `st.html` (it takes no space), so that the tab starts loading Streamlit's lazily loaded HTML element now.

    Why (measured in Chromium, new tabs of the visual attribution, RLKV and CoT pages, 2026-12-05): the preview
    is an `st.html` element, whose code the front end loads only when the first such element arrives. Arriving
    together with the chart, the preview waited for that code, then for React's 300 ms throttle on revealing a
    suspended element, and in 1 of 12 tabs for plotly.js' 0.7 s evaluation, which had started meanwhile: it
    painted 0.12-1.1 s (median 0.26 s) after the page's first text. With this element first, the code had loaded
    before the page's first text in 16 of 16 tabs and the preview painted 0.11-0.62 s (median 0.18 s) after it,
    always before plotly.js' evaluation."""
    if st.session_state.get(ENABLED) and not st.session_state.get(SEEN) and figure_preview.enabled():
        st.html(f"<style>{figure_preview.HIDE_WHEN_DRAWN}</style>")


def begin_page(name: str) -> None:
    """At the start of a page's run: a run of another page than the last one starts a new visit (the gate
    closed until the browser reports this visit's first figure painted)."""
    st.session_state[FIRST] = True
    if st.session_state.get(VISIT) != name:
        st.session_state[VISIT] = name
        st.session_state[OPEN] = False


def end_page() -> None:
    """At the end of a page's run that was not stopped: the visit's first run drew no figure (the steering
    page before its stack has one), so nothing waits on a paint and every later run draws the whole page. Left
    closed, the first figure to appear later (drawn by a widget's rerun) stopped that rerun and the ones after
    it until the browser's report came, and a slider moved meanwhile never drew its text."""
    st.session_state[OPEN] = True


def after_report(state: Any) -> None:
    """The browser painted the visit's first figure (`state`: the session state): the gate opens, and the tab
    has plotly.js from now on (no more previews)."""
    state[OPEN] = True
    state[SEEN] = True


def _opened() -> None:
    after_report(st.session_state)


def preview_for(fig: Any, render: Any, warm_up: Any = None) -> str | None:
    """For a figure about to be drawn: its static preview's HTML, to draw just above the chart, or None.

    Only the running page's first figure, in the visit's first run in a tab that has not loaded plotly.js
    (a session with a browser, `enable`, that has not reported a painted figure yet), has a preview; the
    chart below it hides it once drawn (app/figure_preview.py says why). A figure without a preview yet gets
    one made in the background for the next new tab by `render` (figure JSON, height) -> PNG; `warm_up`
    starts what it renders with, once per process (both from app.export, which draws the figures)."""
    if not st.session_state.get(ENABLED) or not st.session_state.get(FIRST) or not figure_preview.enabled():
        return None
    st.session_state[FIRST] = False
    spec = fig.to_json()
    key, height = figure_preview.figure_key(spec), figure_preview.figure_height(fig)
    store = preview_store(render, warm_up)
    image = store.get(key)
    if image is None:
        store.request(str(st.session_state.get(VISIT)), key, spec, height)
        return None
    if st.session_state.get(OPEN, True) or st.session_state.get(SEEN):
        return None  # a later run of the visit, or a tab that draws charts already
    return figure_preview.preview_html(image, height)


@st.cache_resource
def preview_store(_render: Any, _warm_up: Any = None) -> figure_preview.PreviewStore:
    """The app process' previews, shared by every session. What renders them starts in the background with
    the first preview to make (started cold by the first render instead, it took the CPU in the middle of a
    tab's first seconds); a tab whose previews are all on disk starts nothing."""
    return figure_preview.PreviewStore(render=_render, disk=figure_preview.folder(), warm_up=_warm_up,
                                       shipped=figure_preview.shipped_folder())


def after_figure() -> None:
    """After a figure is drawn: in the first run of a visit, stop here until the browser has painted it
    (the reporter's rerun draws the whole page); otherwise nothing."""
    if not st.session_state.get(ENABLED) or st.session_state.get(OPEN, True):
        return
    # A fresh reporter for every gated run: Streamlit keeps an element with the same key from one run to the
    # next, and an instance that has reported never reports again, so a run gated a second time (a click
    # before the first report's rerun) could wait for a report that never came.
    n = st.session_state[REPORTS] = st.session_state.get(REPORTS, 0) + 1
    _reporter()(key=f"first-paint-report-{n}", on_painted_change=_opened)
    st.stop()
