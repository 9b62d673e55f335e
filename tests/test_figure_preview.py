"""A new tab's first figure as a static preview (app/figure_preview.py, app/first_paint.py): the store that
makes previews in the background, the gate's stages after a preview, and a page drawn at each stage."""

from __future__ import annotations

import base64
import json
import os
import threading

import plotly.graph_objects as go
import pytest

from app import figure_preview, first_paint
from app.figure_preview import CLASS, HIDE_WHEN_DRAWN, PreviewStore, figure_height, figure_key, preview_html


def _spec(y: list[float]) -> str:
    return go.Figure(go.Scatter(y=y)).to_json()


class Renders:
    """A stand-in for the Chromium render: records what it was asked, answers bytes naming the figure."""

    def __init__(self, fail: bool = False):
        self.asked: list[str] = []
        self.fail = fail

    def __call__(self, spec: str, height: int) -> bytes:
        self.asked.append(spec)
        if self.fail:
            raise RuntimeError("no Chromium")
        return f"PNG of {figure_key(spec)} at height {height}".encode()


def test_a_request_is_rendered_once_in_the_background_and_found_by_the_figures_json():
    renders = Renders()
    store = PreviewStore(render=renders, delay_s=0.0)
    spec = _spec([0, 1, 2])
    store.request("trace_explorer", figure_key(spec), spec, 300)
    assert store.wait_idle(10)
    assert store.get(figure_key(spec)) == renders(spec, 300)
    store.request("trace_explorer", figure_key(spec), spec, 300)  # made already: no second render
    assert store.wait_idle(10) and store.rendered == 1
    assert store.get(figure_key(_spec([0, 1, 3]))) is None  # another figure has no preview


def test_requests_waiting_in_one_slot_render_only_the_last_figure():
    renders = Renders()
    store = PreviewStore(render=renders, delay_s=0.3)  # a slider moved three times within the delay
    specs = [_spec([0, 1, k]) for k in range(3)]
    for spec in specs:
        store.request("steering", figure_key(spec), spec, 450)
    other = _spec([5, 5])
    store.request("rise", figure_key(other), other, 450)
    assert store.wait_idle(10)
    assert sorted(renders.asked) == sorted([specs[-1], other]) and store.rendered == 2
    assert store.get(figure_key(specs[0])) is None and store.get(figure_key(specs[-1])) is not None


def test_a_failed_render_leaves_no_preview_and_the_store_keeps_working():
    store = PreviewStore(render=Renders(fail=True), delay_s=0.0)
    spec = _spec([1, 2])
    store.request("p", figure_key(spec), spec, 450)
    assert store.wait_idle(10) and store.get(figure_key(spec)) is None and store.rendered == 0


def test_the_least_recently_used_preview_goes_first(monkeypatch):
    monkeypatch.setattr("app.figure_preview.MAX_PREVIEWS", 2)
    store = PreviewStore(render=Renders(), delay_s=0.0)
    specs = [_spec([k]) for k in range(3)]
    for i, spec in enumerate(specs):
        store.request(f"page{i}", figure_key(spec), spec, 450)
        assert store.wait_idle(10)
        if i == 1:
            assert store.get(figure_key(specs[0])) is not None  # used: the oldest is now specs[1]
    assert [store.get(figure_key(s)) is not None for s in specs] == [True, False, True]


class PngRenders(Renders):
    """Renders answering bytes with the PNG signature (what the disk layer keeps), naming the figure."""

    def __call__(self, spec: str, height: int) -> bytes:
        return b"\x89PNG\r\n\x1a\n" + super().__call__(spec, height)


def test_a_preview_outlives_the_app_process_on_disk_and_is_not_rendered_again(tmp_path):
    """The first new tab after a restart finds the preview an earlier app process made (read from disk,
    nothing rendered); a file that is not a PNG is ignored and made again."""
    spec, other = _spec([3, 1, 2]), _spec([9])
    first = PreviewStore(render=PngRenders(), delay_s=0.0, disk=tmp_path)
    first.request("p", figure_key(spec), spec, 300)
    assert first.wait_idle(10) and first.rendered == 1
    made = first.get(figure_key(spec))
    assert (tmp_path / f"{figure_key(spec)}.png").read_bytes() == made
    assert list(tmp_path.glob("*.part")) == []  # written aside, then renamed: no partial file left

    renders = PngRenders()
    later = PreviewStore(render=renders, delay_s=0.0, disk=tmp_path)  # a new app process
    assert later.get(figure_key(spec)) == made and renders.asked == []
    later.request("p", figure_key(spec), spec, 300)
    assert later.wait_idle(10) and renders.asked == [] and later.rendered == 0

    (tmp_path / f"{figure_key(other)}.png").write_bytes(b"<html>not an image</html>")
    assert later.get(figure_key(other)) is None
    later.request("p", figure_key(other), other, 450)
    assert later.wait_idle(10) and renders.asked == [other]
    assert (tmp_path / f"{figure_key(other)}.png").read_bytes().startswith(b"\x89PNG")


def test_the_renderer_is_warmed_up_with_the_first_preview_to_make_not_for_previews_on_disk(tmp_path):
    spec, other = _spec([5, 4]), _spec([6])
    earlier = PreviewStore(render=PngRenders(), delay_s=0.0, disk=tmp_path)  # an earlier app process
    earlier.request("p", figure_key(spec), spec, 300)
    assert earlier.wait_idle(10)
    started = threading.Event()
    store = PreviewStore(render=PngRenders(), delay_s=0.0, disk=tmp_path, warm_up=started.set)
    store.request("p", figure_key(spec), spec, 300)
    assert store.get(figure_key(spec)) is not None and not started.wait(0.3)  # all on disk: nothing started
    store.request("p", figure_key(other), other, 300)
    assert started.wait(10) and store.wait_idle(10) and store.rendered == 1


def test_previews_on_disk_are_bounded_oldest_first_and_a_refusing_disk_costs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("app.figure_preview.MAX_PREVIEWS", 2)
    store = PreviewStore(render=PngRenders(), delay_s=0.0, disk=tmp_path)
    specs = [_spec([k, k]) for k in range(3)]
    for i, spec in enumerate(specs):
        store.request("p", figure_key(spec), spec, 450)
        assert store.wait_idle(10)
        os.utime(tmp_path / f"{figure_key(spec)}.png", (1e9 + i, 1e9 + i))  # distinct ages, oldest first
    assert sorted(f.stem for f in tmp_path.glob("*.png")) == sorted(figure_key(s) for s in specs[1:])
    blocked = tmp_path / "a-file-where-the-folder-should-be"
    blocked.write_text("")
    refused = PreviewStore(render=PngRenders(), delay_s=0.0, disk=blocked)
    refused.request("p", figure_key(specs[0]), specs[0], 450)
    assert refused.wait_idle(10) and refused.get(figure_key(specs[0])) is not None  # kept in memory


def test_the_worker_thread_ends_when_idle_and_a_later_request_starts_another():
    store = PreviewStore(render=Renders(), delay_s=0.0, idle_s=0.05)
    spec = _spec([1])
    store.request("p", figure_key(spec), spec, 450)
    assert store.wait_idle(10)
    threading.Event().wait(0.5)
    assert store._thread is None  # no thread left waiting
    later = _spec([2])
    store.request("p", figure_key(later), later, 450)
    assert store.wait_idle(10) and store.get(figure_key(later)) is not None


def test_the_preview_element_is_the_png_as_an_image_in_a_box_of_the_figures_height():
    png = b"\x89PNG\r\n\x1a\n the image plotly.js drew"
    html = preview_html(png, 360)
    assert f'class="{CLASS}" style="height:360px;max-width:1000px"' in html
    data = html.split("data:image/png;base64,")[1].split('"')[0]
    assert base64.b64decode(data) == png  # the PNG plotly.js drew, unchanged
    assert "<svg" not in html  # an image: nothing a selector reads as a drawn chart's SVG
    assert f"<style>{HIDE_WHEN_DRAWN}</style>" in html  # hidden once the chart after it is drawn
    assert figure_height(go.Figure().update_layout(height=360)) == 360 and figure_height(go.Figure()) == 450


def test_a_report_opens_the_gate_and_the_tab_draws_charts_from_then_on():
    state = {first_paint.OPEN: False}
    first_paint.after_report(state)  # the first chart painted (with its preview above it, or not)
    assert state[first_paint.OPEN] is True and state[first_paint.SEEN] is True


def _styles(at) -> list[str]:
    """The bodies of the style-only `st.html` elements of a run (Streamlit sends them to its event container)."""
    return [node.proto.body for node in at.get("html") if node.proto.body.startswith("<style>")]


def test_a_new_tab_loads_the_previews_element_first_and_a_tab_that_draws_charts_does_not(monkeypatch):
    """The first runs of a tab that may be shown a preview start with a style-only `st.html`: the browser
    loads the HTML element's code while the page draws, before the preview (an `st.html`) arrives."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.delenv("THOUGHTSCOPE_FIGURE_PREVIEWS", raising=False)
    script = "from app import first_paint\nfirst_paint.load_preview_renderer()\n"
    at = AppTest.from_string(script, default_timeout=60)
    at.session_state[first_paint.ENABLED] = True  # served by `streamlit run`, no figure painted yet
    at.run()
    assert _styles(at) == [f"<style>{HIDE_WHEN_DRAWN}</style>"]
    first_paint.after_report(at.session_state)  # the tab painted a chart: it has plotly.js, no more previews
    at.run()
    assert _styles(at) == []
    bare = AppTest.from_string(script, default_timeout=60).run()  # no browser (AppTest alone): nothing
    assert _styles(bare) == []
    monkeypatch.setenv("THOUGHTSCOPE_FIGURE_PREVIEWS", "0")  # previews off: nothing to load
    off = AppTest.from_string(script, default_timeout=60)
    off.session_state[first_paint.ENABLED] = True
    off.run()
    assert _styles(off) == []


SCRIPT = """
import streamlit as st
import plotly.graph_objects as go
from app import first_paint
from app.export import show_figure
first_paint.begin_page('p')
show_figure(go.Figure(go.Scatter(y=[0, 2, 1])).update_layout(height=300), {'y': [0, 2, 1]}, 'first')
show_figure(go.Figure(go.Scatter(y=[1, 1])), {'y': [1, 1]}, 'second')
first_paint.end_page()
"""


def _drawn(at) -> list[str]:
    """The page's elements in order: 'preview', 'chart:<trace y>', 'reporter'."""
    out = []
    for node in at.main:
        kind = getattr(node, "type", "")
        if kind == "html" and CLASS in node.proto.body:
            out.append("preview")
        elif kind == "plotly_chart":
            out.append("chart:" + str(json.loads(node.proto.spec)["data"][0]["y"]))
        elif kind == "bidi_component":
            out.append("reporter")
    return out


def _reporter_ids(at) -> list[str]:
    return [e.proto.id for e in at.get("bidi_component")]


@pytest.fixture
def previews(monkeypatch):
    monkeypatch.delenv("THOUGHTSCOPE_FIGURE_PREVIEWS", raising=False)  # the default: on
    store = PreviewStore(render=Renders(), delay_s=0.0)
    monkeypatch.setattr(first_paint, "preview_store", lambda *args: store)
    return store


def test_a_new_tab_draws_the_preview_above_the_first_chart_then_the_page(previews):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string(SCRIPT, default_timeout=60)
    at.session_state[first_paint.ENABLED] = True  # served by `streamlit run`: a browser reports paints
    at.run()  # the app has no preview yet: the chart, the reporter, and a preview asked for
    assert _drawn(at) == ["chart:[0, 2, 1]", "reporter"]
    assert previews.wait_idle(10) and previews.rendered == 1
    first_paint.after_report(at.session_state)  # that tab's chart painted: its visit opens
    at.run()
    assert _drawn(at) == ["chart:[0, 2, 1]", "chart:[1, 1]"]

    tab = AppTest.from_string(SCRIPT, default_timeout=60)  # a new tab: a new session, plotly.js not loaded
    tab.session_state[first_paint.ENABLED] = True
    tab.run()  # the preview above the first chart (CSS hides it once the chart is drawn), the rest after its report
    assert _drawn(tab) == ["preview", "chart:[0, 2, 1]", "reporter"]
    first = _reporter_ids(tab)
    tab.run()  # a run gated again (a click before the report): a fresh reporter, the first may have reported
    assert _drawn(tab) == ["preview", "chart:[0, 2, 1]", "reporter"] and _reporter_ids(tab) != first
    first_paint.after_report(tab.session_state)  # the chart painted: the visit opens
    tab.run()  # the whole page, without the preview
    assert _drawn(tab) == ["chart:[0, 2, 1]", "chart:[1, 1]"]
    tab.run()  # any later run: charts only
    assert _drawn(tab) == ["chart:[0, 2, 1]", "chart:[1, 1]"]
    assert previews.rendered == 1  # the first figure only, once


def test_without_a_browser_or_with_previews_off_nothing_is_previewed_or_rendered(previews, monkeypatch):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string(SCRIPT, default_timeout=60).run()  # AppTest alone: no browser, no gate
    assert _drawn(at) == ["chart:[0, 2, 1]", "chart:[1, 1]"]
    monkeypatch.setenv("THOUGHTSCOPE_FIGURE_PREVIEWS", "0")  # turned off
    off = AppTest.from_string(SCRIPT, default_timeout=60)
    off.session_state[first_paint.ENABLED] = True
    off.run()
    assert _drawn(off) == ["chart:[0, 2, 1]", "reporter"]
    assert previews.wait_idle(5) and previews.rendered == 0


# In the page: the order in which the first figure arrives as a preview (its image in the document) and as a
# chart, and when the preview's image is decoded (painted in the next frame). The test asserts the order the
# app sends (the preview before any chart, hidden with its chart); when the browser decodes the image is its
# own business and, on a loaded machine, can come after the chart (then the benchmark's figure, not a test).
ORDER_PROBE = """(() => {
  const o = window.__order = {preview: null, chart: null, chartsAtPreview: null, previewShownWithChart: null,
                              decoded: null};
  new MutationObserver(() => {
    const img = document.querySelector('.%s img');
    if (img && !img.__watched) {
      img.__watched = true;
      o.preview = performance.now();
      o.chartsAtPreview = document.querySelectorAll('[data-testid="stPlotlyChart"] .main-svg').length;
      img.decode().then(() => { o.decoded = performance.now(); }).catch((e) => { o.decoded = String(e); });
    }
    // the chart of the same figure: the element right after the preview's (the first chart without one)
    const box = img ? img.closest('[data-testid="stElementContainer"]') : null;
    const next = box ? box.nextElementSibling : null;
    const chart = next ? next.querySelector('[data-testid="stPlotlyChart"] .main-svg')
                       : document.querySelector('[data-testid="stPlotlyChart"] .main-svg');
    if (o.chart === null && chart) {
      o.chart = performance.now();
      o.previewShownWithChart = box ? getComputedStyle(box).display !== 'none' : null;
    }
  }).observe(document, {subtree: true, childList: true, attributes: true});
})();""" % CLASS


@pytest.mark.browser
def test_a_new_tab_paints_the_figures_preview_before_plotly_then_the_chart_in_its_place(browser, monkeypatch):
    """In Chromium: after a generation the app makes its first figure's preview in the background (plotly.js
    in the export Chromium); a new tab then gets that preview before any chart, the chart takes its place
    (hidden the moment the chart is drawn), and the whole page follows. (When the browser paints the preview
    depends on its load: bench_page_first_figure measures it.)"""
    from tests.test_browser import SLOW, serve

    monkeypatch.setenv("THOUGHTSCOPE_FIGURE_PREVIEWS", "1")  # an app of its own, with previews (the default)
    with serve("tiny-random:llama") as tiny_app_url:
        _new_tab_with_a_preview(browser, tiny_app_url, SLOW)


def _new_tab_with_a_preview(browser, tiny_app_url: str, SLOW: int) -> None:
    import time

    from app.bench import generate_in_a_tab

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        generate_in_a_tab(context, tiny_app_url, SLOW)  # its run asks for the entropy figure's preview
        deadline = time.monotonic() + 180  # the export Chromium's first start, on a loaded machine
        while True:  # new tabs until one finds the preview made
            page = context.new_page()
            page.set_default_timeout(SLOW)
            page.add_init_script(ORDER_PROBE)
            page.goto(f"{tiny_app_url}/trace_explorer")
            charts = page.locator('[data-testid="stPlotlyChart"]')
            charts.nth(3).locator(".main-svg").first.wait_for()  # every figure, in any case
            order = page.evaluate("window.__order")
            if order["preview"] is not None or time.monotonic() > deadline:
                break
            page.close()
            time.sleep(2)
        assert order["preview"] is not None, "no new tab painted a preview"
        assert order["chartsAtPreview"] == 0 and order["preview"] < order["chart"]  # sent before any chart
        assert order["previewShownWithChart"] is False, order  # hidden at once: no blank, never both
        hidden = page.locator(f".{CLASS}").evaluate_all(
            "els => els.map(e => getComputedStyle(e.closest('[data-testid=\"stElementContainer\"]')).display)")
        assert hidden in ([], ["none"])  # hidden, or gone once the whole page is drawn
        page.locator('[data-testid="stDownloadButton"]').nth(19).wait_for()  # PNG..JSON under every figure
        page.wait_for_function("window.__order.decoded !== null")
        assert isinstance(page.evaluate("window.__order.decoded"), (int, float))  # the preview is a valid image
        assert page.locator('[class*="st-key-first-paint-report"]').count() == 0  # the reporter is gone
        page.close()
    finally:
        context.close()


def test_a_shipped_preview_is_read_after_the_users_and_never_written(tmp_path):
    """The previews the repository ships (app/ship_previews.py) serve a fresh clone's first tab; the user's
    own folder goes first, a shipped file that is not a PNG is ignored, and nothing is written there."""
    disk, ship = tmp_path / "user", tmp_path / "shipped"
    ship.mkdir()
    shipped_png = figure_preview.PNG_SIGNATURE + b"shipped"
    (ship / "a.png").write_bytes(shipped_png)
    (ship / "b.png").write_bytes(b"<svg/>")
    store = figure_preview.PreviewStore(render=lambda spec, h: figure_preview.PNG_SIGNATURE + b"made", disk=disk,
                                        shipped=ship, delay_s=0.0)
    assert store.get("a") == shipped_png
    assert store.get("b") is None
    disk.mkdir()
    (disk / "c.png").write_bytes(figure_preview.PNG_SIGNATURE + b"user")
    (ship / "c.png").write_bytes(shipped_png)
    assert store.get("c") == figure_preview.PNG_SIGNATURE + b"user"
    store.request("page", "b", "{}", 100)
    assert store.wait_idle(30)
    assert store.get("b") == figure_preview.PNG_SIGNATURE + b"made"
    assert (disk / "b.png").read_bytes() == figure_preview.PNG_SIGNATURE + b"made"
    assert (ship / "b.png").read_bytes() == b"<svg/>"  # the shipped folder is never written


def test_the_shipped_previews_are_what_their_record_says(monkeypatch):
    """Every shipped preview is a PNG whose sha256 its record lists, made by the rebuild command; with
    THOUGHTSCOPE_SHIPPED_PREVIEWS=0 (the rebuild's own setting) the app reads none."""
    import hashlib
    import json

    from app import ship_previews

    folders = [p for p in figure_preview.SHIPPED_ROOT.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders  # one plotly version and size at a time
    record = json.loads((folders[0] / ship_previews.MANIFEST).read_text())
    pngs = sorted(folders[0].glob("*.png"))
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in pngs} == record["files"]
    assert all(p.read_bytes().startswith(figure_preview.PNG_SIGNATURE) for p in pngs)
    assert len(pngs) == len(record["pages"]) and record["command"].startswith(ship_previews.COMMAND)
    monkeypatch.setenv(figure_preview.SHIPPED_SWITCH, "0")
    assert figure_preview.shipped_folder() is None
    monkeypatch.delenv(figure_preview.SHIPPED_SWITCH)
    assert figure_preview.shipped_folder().parent == figure_preview.SHIPPED_ROOT


@pytest.mark.model
def test_every_method_pages_first_figure_on_smollm2_has_its_shipped_preview(monkeypatch, tmp_path):
    """A fresh clone's first tab of each method page paints the shipped preview of its first figure only while
    that figure's JSON is the one the preview was made from: a change to a page's first figure (a title, a
    margin, a number in its stored result) without `python -m app.ship_previews` silently costs a newcomer
    1-2 s on that page (found 2026-12-07: RISE and the feature browser had drifted; `bench pages` gave 3.0 and
    2.8 s in a fresh clone against 1.1-1.7 s on the other pages). Each page is opened as AppTest draws it with
    the sidebar's defaults, which is the figure the browser draws (the keys were checked equal)."""
    from app import bench, jobs
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    monkeypatch.setattr("cache.store.default_root", lambda: tmp_path / "store")
    shipped = figure_preview.shipped_folder()
    assert shipped is not None
    first: dict[str, str] = {}
    opening = {"page": ""}

    def record(fig, render, warm_up=None):
        first.setdefault(opening["page"], figure_key(fig.to_json()))
        return None

    monkeypatch.setattr(first_paint, "preview_for", record)
    jobs.registry.clear()  # no page result of an earlier test in this process
    try:
        for name in bench.FIRST_RESULT_PAGES:
            opening["page"] = name
            helpers.assert_clean(helpers.open_page(name, None), no_errors=False)
    finally:
        for job in jobs.registry().running():  # the RISE page starts its steering job on opening
            job.stop("the test is over")
            job.thread.join(120)  # a thread still in torch when the process exits aborts it
        jobs.registry.clear()
    assert set(first) == set(bench.FIRST_RESULT_PAGES)
    missing = {name: key for name, key in first.items() if not (shipped / f"{key}.png").is_file()}
    assert missing == {}, f"rebuild the shipped previews (python -m app.ship_previews): {missing}"
