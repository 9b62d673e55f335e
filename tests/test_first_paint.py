"""A figure's margins are set before the browser draws it (app/figures/margins.py), so plotly.js draws it
once instead of drawing, measuring what sticks out, and drawing again.

The unit tests check the estimate against numbers worked by hand from its constants; the browser test
draws the trace explorer's figures with plotly.js (the copy the plotly package ships) in Chromium and
checks that plotly kept the margins it was given: had its automargin needed more room, it would have
grown them, which is the second draw this module exists to avoid.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import plotly
import plotly.graph_objects as go
import pytest

from app.figures.margins import SLACK, TEXT_SCALE, estimated_margins, text_width
from app.figures.template import styled
from app.figures.trace import attention_figure, entropy_figure, logit_lens_figure, residual_norm_figure


def test_text_width_adds_helvetica_advances():
    # A 667 + n 556 + n 556 + a 556 = 2335 thousandths of an em, at 10 px, times the measured 4% allowance
    assert text_width("Anna", 10) == pytest.approx(23.35 * TEXT_SCALE)
    assert text_width("ab<br>W", 10) == pytest.approx(11.12 * TEXT_SCALE)  # the widest line: a 556 + b 556
    assert text_width("\u5b50", 10) == pytest.approx(10 * TEXT_SCALE)  # outside ASCII: a full em


def test_token_labels_widen_the_left_margin_by_hand():
    fig = styled(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])).update_layout(
        yaxis=dict(tickvals=[0, 1], ticktext=["WWWWWWWW", "a"], title="query token")))
    # tick 5 + pad 3 + eight W (944 each) at the template's 13 px, + standoff 8 + one title line (13 x 1.3),
    # + the slack; the x axis' "0.0".."1.0" and no title fit the template's 50 px below
    left = 5 + 3 + 8 * 944 * 13 / 1000 * TEXT_SCALE + 8 + 13 * 1.3 + SLACK
    assert dict(fig.layout.margin.to_plotly_json()) == {"l": math.ceil(left), "r": 20, "t": 50, "b": 50}
    assert fig.layout.margin.l == 146


def test_colour_bar_and_legend_widen_the_right_margin_by_hand():
    heat = styled(go.Figure(go.Heatmap(z=[[0, 1]], zmin=0, zmax=1, colorbar=dict(title="p"))))
    # x = 1.02 of a 1,200 px plot (24) + pads 2 x 10 + bar 30 + pad 3 + "0.0" (556 + 278 + 556 at 13 px) + slack
    right = 0.02 * 1200 + 20 + 30 + 3 + 1390 * 13 / 1000 * TEXT_SCALE + SLACK
    assert heat.layout.margin.r == math.ceil(right) == 106
    two = styled(go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name="a"), go.Scatter(x=[0, 1], y=[0, 1], name="bb")]))
    # 24 + symbol 40 + "bb" (2 x 556 at 13 px) + pad 10 + slack
    assert two.layout.margin.r == math.ceil(0.02 * 1200 + 40 + 1112 * 13 / 1000 * TEXT_SCALE + 10 + SLACK) == 100
    below = styled(go.Figure([go.Scatter(y=[0, 1], name="a"), go.Scatter(y=[1, 0], name="b")]).update_layout(
        height=450, legend=dict(orientation="h", y=-0.3)))
    # the legend's row (13 x 1.3 + 6, + pad 10) 0.3 plot heights below a plot of 450 - 50 - b: solved for b
    assert below.layout.margin.b == math.ceil((0.3 * 400 + 13 * 1.3 + 6 + 10) / 1.3 + SLACK)


def test_margins_a_builder_gives_are_kept_when_larger():
    fig = styled(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])).update_layout(margin=dict(l=200, b=120)))
    assert (fig.layout.margin.l, fig.layout.margin.b, fig.layout.margin.r) == (200, 120, 20)


def test_traces_without_axes_or_legends_keep_the_template_margins():
    assert estimated_margins(styled(go.Figure(go.Image(z=[[[0, 0, 0]]])))) == {"l": 60, "r": 20, "t": 50, "b": 50}
    assert estimated_margins(styled(go.Figure(go.Pie(values=[1, 2])))) == {"l": 60, "r": 20, "t": 50, "b": 50}


def trace_explorer_figures() -> dict[str, go.Figure]:
    """The trace explorer's four figures at their default sizes (30 layers, 32 lens and 48 attention
    positions), on made-up numbers and real-looking token labels."""
    words = ["<|im_start|>", "assistant", "\n", "Anna", " has", "\u2423", "1", "7", " shells", ".", " She", " wins",
             " more", ",", " so", " +", " =", " The", " answer", " is", "<|im_end|>"]
    tokens = [words[i % len(words)] for i in range(48)]
    layers, n = list(range(30)), 32
    records = [{"text": t, "token_id": i, "entropy": (i % 7) / 3, "logprob": -(i % 5) / 2} for i, t in enumerate(tokens)]
    lens = {"tokens": tokens[:n], "layers": layers, "positions": list(range(100, 100 + n)),
            "top_ids": [[1] * n for _ in layers], "top_tokens": [[tokens[(i + j) % 48] for j in range(n)] for i in layers],
            "top_probs": [[((i * j) % 10) / 10 for j in range(n)] for i in layers], "prompt_len": 110}
    weights = [[(1.0 / (q + 1) if k <= q else 0.0) for k in range(48)] for q in range(48)]
    attention = {"tokens": tokens, "positions": list(range(100, 148)), "weights": weights, "layer": 29, "head": 0,
                 "prompt_len": 110, "earlier": [0.1] * 48, "scale": "log"}
    norms = {"layers": layers, "tokens": tokens[:8], "norms": [[10.0 * (i + 1)] * 8 for i in layers]}
    return {"entropy": entropy_figure({"tokens": tokens[:33], "entropies": [r["entropy"] for r in records[:33]],
                                       "logprobs": [r["logprob"] for r in records[:33]]}),
            "logit_lens": logit_lens_figure(lens), "residual_norms": residual_norm_figure(norms),
            "attention": attention_figure(attention)}


@pytest.mark.browser
def test_trace_explorer_figures_are_drawn_once_with_the_margins_set(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.set_content("<div id='root'></div>")
        page.add_script_tag(path=str(Path(plotly.__file__).parent / "package_data" / "plotly.min.js"))
        for name, fig in trace_explorer_figures().items():
            spec = json.loads(fig.to_json())
            drawn = page.evaluate("""async (s) => {
                const d = document.createElement('div'); document.getElementById('root').appendChild(d);
                await Plotly.newPlot(d, s.data, Object.assign({}, s.layout, {width: 1100}));
                const z = d._fullLayout._size; const out = {l: z.l, r: z.r, t: z.t, b: z.b};
                Plotly.purge(d); d.remove(); return out; }""", spec)
            assert drawn == spec["layout"]["margin"], name  # plotly grew none of them: one draw
    finally:
        page.close()


# ----------------------------------------------------------------------------- the first figure first (app/first_paint.py)


def _exports(at) -> int:
    return sum(b.key.startswith("export-") for b in at.get("download_button"))


def _charts(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"].split(":")[0].split(",")[0]
            for c in at.get("plotly_chart")]


def test_a_visit_draws_its_first_figure_then_the_rest_once_the_browser_reports_it_painted():
    from streamlit.testing.v1 import AppTest

    from app import first_paint
    from tests.apptest_helpers import assert_clean, open_page

    made = open_page("trace_explorer", max_new_tokens=6)
    made.button(key="generate").click().run()  # no browser (AppTest): the whole page in one run
    every = ["Entropy per generated token", "Logit lens", "Residual stream norm per layer", "Attention pattern"]
    assert _charts(made) == every and _exports(made) == 4 * 5

    at = AppTest.from_string("from app.main import main\nmain(only='trace_explorer')\n", default_timeout=180)
    at.session_state["max_new_tokens"] = 6
    at.session_state[first_paint.ENABLED] = True  # what app.main sets when served by `streamlit run`
    at.run()  # a new session's first run: the finished generation's first figure, then the reporter, no more
    assert_clean(at)
    assert _charts(at) == every[:1] and not _exports(at)
    assert [e.proto.component_name for e in at.get("bidi_component")] == ["thoughtscope_first_paint"]
    assert at.session_state[first_paint.OPEN] is False
    at.session_state[first_paint.OPEN] = True  # the reporter's callback, once the browser has painted it
    at.run()
    assert_clean(at)
    assert _charts(at) == every and _exports(at) == 4 * 5 and not at.get("bidi_component")
    at.radio(key="colour_by").set_value("log-prob").run()  # a later run of the same visit: the whole page
    assert _charts(at) == every and not at.get("bidi_component")


def test_only_a_new_page_starts_a_new_visit():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string(
        "import streamlit as st\nfrom app import first_paint\n"
        "first_paint.begin_page(st.session_state.get('page', 'a'))\n"
        "st.text(str(st.session_state[first_paint.OPEN]))\n")
    at.run()
    assert at.text[0].value == "False"
    at.session_state["_ts_first_paint_open"] = True
    at.run()
    assert at.text[0].value == "True"  # the same page again: the visit goes on
    at.session_state["page"] = "b"
    at.run()
    assert at.text[0].value == "False"  # another page: a new visit, its first figure first again


def test_a_first_run_without_a_figure_opens_the_visit_so_a_later_figure_never_stops_a_run():
    """The steering page draws no figure until its stack has a term: the figure that a widget's rerun draws
    later must not stop that rerun (a slider moved then never drew its text in the browser)."""
    from streamlit.testing.v1 import AppTest

    from app import first_paint

    at = AppTest.from_string(
        "import streamlit as st\nimport plotly.graph_objects as go\nfrom app import first_paint\n"
        "from app.export import show_figure\nfirst_paint.begin_page('p')\n"
        "if st.session_state.get('draw'):\n"
        "    show_figure(go.Figure(go.Scatter(y=[0, 1])), {'y': [0, 1]}, 'f')\n"
        "st.text('after the figure')\nfirst_paint.end_page()\n", default_timeout=60)
    at.session_state[first_paint.ENABLED] = True
    at.run()  # the visit's first run: no figure, so it reaches the end and opens the gate
    assert at.text[0].value == "after the figure" and at.session_state[first_paint.OPEN] is True
    at.session_state["draw"] = True
    at.run()  # a later run draws a figure: the whole run, no reporter
    assert [t.value for t in at.text] == ["after the figure"] and not at.get("bidi_component")
    at.session_state["draw"] = True
    at.session_state[first_paint.OPEN] = False  # a new visit whose first run has a figure: it stops after it
    at.run()
    assert not [t.value for t in at.text] and [e.proto.component_name for e in at.get("bidi_component")] == [
        "thoughtscope_first_paint"]


@pytest.mark.browser
def test_a_new_tab_paints_the_first_figure_alone_then_every_figure(browser, tiny_app_url):
    """In Chromium, on a generation the app holds: when the first figure enters the page (its plot, or its static
    preview's image once the app has made one: app/figure_preview.py), no other figure is there yet; then the
    reporter's rerun draws all four charts with their export rows."""
    from app.bench import generate_in_a_tab
    from app.first_paint import PREVIEW
    from tests.test_browser import SLOW

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        generate_in_a_tab(context, tiny_app_url, SLOW)
        page = context.new_page()
        page.set_default_timeout(SLOW)
        # the figures in the page when the first is drawn: a chart, or a preview, or a preview with its chart below
        page.add_init_script("""(() => { window.__charts = null; new MutationObserver(() => {
            const drawn = '[data-testid="stPlotlyChart"] .main-svg, .PREVIEW img';
            if (window.__charts === null && document.querySelector(drawn))
              window.__charts = [...document.querySelectorAll('[data-testid="stElementContainer"]')].filter((c) =>
                c.querySelector('.PREVIEW') || (c.querySelector('[data-testid="stPlotlyChart"]') &&
                !(c.previousElementSibling && c.previousElementSibling.querySelector('.PREVIEW')))).length;
          }).observe(document, {subtree: true, childList: true}); })();""".replace("PREVIEW", PREVIEW))
        page.goto(f"{tiny_app_url}/trace_explorer")
        charts = page.locator('[data-testid="stPlotlyChart"]')
        charts.nth(3).locator(".main-svg").first.wait_for()
        assert page.evaluate("window.__charts") == 1  # the first figure was in the page alone when drawn
        assert charts.count() == 4
        page.locator('[data-testid="stDownloadButton"]').nth(19).wait_for()  # PNG..JSON under every figure
        assert page.locator('[class*="st-key-first-paint-report"]').count() == 0  # the reporter is gone after its rerun
    finally:
        context.close()


REPORTER_PAGE = """<!doctype html><html><body>
<nav><a data-testid="stSidebarNavLink" href="/">Home</a>
     <a data-testid="stSidebarNavLink" href="/trace_explorer">Trace explorer</a></nav>
<div data-testid="stElementContainer"><div data-testid="stPlotlyChart"><svg class="main-svg"></svg></div></div>
<div data-testid="stElementContainer"><div id="host"></div></div>
</body></html>"""


@pytest.mark.browser
@pytest.mark.parametrize("opened, clicked, moved_to, reports", [
    ("/trace_explorer", None, None, True),
    ("/trace_explorer", "Home", None, False),  # the page is being left
    ("/trace_explorer", "Trace explorer", None, True),  # the same page asked for again
    ("/", "Trace explorer", ["/steering"], True),  # the server moved on after the click (st.switch_page)
    ("/trace_explorer", "Home", ["/", "/trace_explorer"], True),  # Home shown, then the server came back here
])
def test_a_reporter_stays_silent_once_the_user_asked_for_another_page(browser, opened, clicked, moved_to, reports):
    """The reporter's own code in Chromium, on a page shaped like Streamlit's (a drawn figure, the reporter's
    element below it, the sidebar's page links): it reports the painted figure, unless a link to another page
    was clicked on its page first. Its report reruns the page the tab shows, and Streamlit folds a
    rerun asked for after a page link's into one for the page of the later request: the report of a page being
    left took the user back to it (the lost clicks of the browser tier on a loaded machine)."""
    from app.first_paint import FALLBACK_MS, PREVIEW, _JS

    code = (_JS % FALLBACK_MS).replace("export default function", "window.__reporter = function")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.route("http://ts.test/**", lambda route: route.fulfill(content_type="text/html", body=REPORTER_PAGE))
        page.goto(f"http://ts.test{opened}")
        page.evaluate("(e) => e.addEventListener('click', (ev) => ev.preventDefault())", page.locator("nav").element_handle())
        page.add_script_tag(content=code, type="module")
        page.wait_for_function("typeof window.__reporter === 'function'")
        if clicked:  # the user leaves (or reopens this page) before the first figure's report is sent
            page.locator("nav a", has_text=clicked).click()
        for path in moved_to or []:  # Streamlit shows the page a run is for in the address bar as the run starts
            page.evaluate("(path) => history.pushState({}, '', path)", path)
        page.evaluate("""() => { window.__sent = [];
            window.__reporter({setTriggerValue: (k, v) => window.__sent.push([k, v]),
                               parentElement: document.getElementById('host')}); }""")
        page.wait_for_timeout(500)  # a report is sent one frame after the figure is found: long since due
        assert page.evaluate("window.__sent") == ([["painted", "painted"]] if reports else [])
    finally:
        context.close()


PREVIEW_THEN_LOADING_CHART = """<!doctype html><html><body>
<div data-testid="stElementContainer"><div class="PREVIEW"><img src="data:image/svg+xml;base64,PHN2ZyB4bWxucz0naHR0cDovL3d3dy53My5vcmcvMjAwMC9zdmcnLz4="></div></div>
<div data-testid="stElementContainer"><div id="loading"></div></div>
<div data-testid="stElementContainer"><div id="host"></div></div>
</body></html>"""


@pytest.mark.browser
def test_a_reporter_below_a_chart_still_loading_waits_for_the_chart_not_the_preview_above_it(browser):
    """A new tab's first run draws the first figure's static preview, the chart below it and the reporter.
    While the tab loads plotly.js the chart's element is only a placeholder (no chart element yet): the
    reporter waits for the chart's plot, and does not take the preview above for its figure (an earlier
    reporter, which searched upwards for a figure, did so in 1 of 5 runs of the preview's browser test)."""
    from app.first_paint import FALLBACK_MS, PREVIEW, _JS

    code = (_JS % FALLBACK_MS).replace("export default function", "window.__reporter = function")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.route("http://ts.test/**", lambda route: route.fulfill(
            content_type="text/html", body=PREVIEW_THEN_LOADING_CHART.replace("PREVIEW", PREVIEW)))
        page.goto("http://ts.test/trace_explorer")
        page.add_script_tag(content=code, type="module")
        page.wait_for_function("typeof window.__reporter === 'function'")
        page.evaluate("""() => { window.__sent = [];
            window.__reporter({setTriggerValue: (k, v) => window.__sent.push([k, v]),
                               parentElement: document.getElementById('host')}); }""")
        page.wait_for_timeout(500)
        assert page.evaluate("window.__sent") == []  # the preview above is not this reporter's figure
        page.evaluate("""() => { document.getElementById('loading').innerHTML =
            '<div data-testid="stPlotlyChart"><svg class="main-svg"></svg></div>'; }""")  # plotly.js drew it
        page.wait_for_function("window.__sent.length > 0")
        assert page.evaluate("window.__sent") == [["painted", "painted"]]
    finally:
        context.close()
