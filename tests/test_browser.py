"""The workbench in a real browser: `streamlit run` on a loopback port, driven by Playwright in the
system Chromium (never a downloaded browser). Screenshots go to test-artifacts/; one is copied to
docs/screenshot.png for the README.

Run with `pytest -m browser tests/test_browser.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "tiny-random:llama"
SLOW = 120_000  # ms: the first page load also loads the model, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_log(model: str) -> Path:
    """Where `serve(model)` writes the app's terminal output (`make test` runs two workers, each its own app)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return ARTIFACTS / f"streamlit-{model.replace(':', '-')}{'-' + worker if worker else ''}.log"


@contextlib.contextmanager
def serve(model: str):
    """`thoughtscope app --model MODEL --headless` on a free loopback port; yields its URL."""
    from app.cli import streamlit_command

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BROWSER_PATH": CHROMIUM}
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = app_log(model)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(streamlit_command(port, "127.0.0.1", model=model), cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 90
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"streamlit did not start; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def app_url(tiny_app_url):
    """The session's app on MODEL (tests/conftest.py, shared with the settings and badge tests); `browser`
    is the session's Chromium (tests/conftest.py)."""
    return tiny_app_url


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    p = context.new_page()
    p.set_default_timeout(SLOW)
    yield p
    context.close()


@pytest.fixture(scope="module")
def generated(browser, app_url):
    """A finished generation for the default prompt, kept by the app for every later session."""
    context = browser.new_context()
    p = context.new_page()
    p.set_default_timeout(SLOW)
    p.goto(f"{app_url}/trace_explorer")
    p.locator(".st-key-generate button").first.click()
    figure(p, 3).wait_for()
    context.close()


def download(page, key: str) -> bytes:
    """The file a download button gives. Its bytes are made on click (app/export.py), from a handle of the run
    that drew the button: a click while another run redraws the page can give nothing (a two-worker run waited
    120 s for a JSON export after three downloads had come). So the click waits for a quiet page, and a click
    that brought no file in 30 s is made once more on a quiet page."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(2):
        page.locator('[data-testid="stStatusWidget"]').wait_for(state="detached", timeout=4 * SLOW)
        try:
            with page.expect_download(timeout=30_000 if attempt == 0 else SLOW) as info:
                page.locator(f".st-key-{key} button").first.click()
            return Path(info.value.path()).read_bytes()
        except PlaywrightTimeout:
            if attempt:
                raise
    raise AssertionError("unreachable")


def figure(page, index: int = 0):
    """The drawn plot of the index-th figure on the page (plotly draws it into .main-svg layers)."""
    return page.locator('[data-testid="stPlotlyChart"]').nth(index).locator(".main-svg").first


def first_figure(page):
    return figure(page, 0)


def test_generate_streams_tokens_then_figures_export_as_svg_and_pdf(page, app_url):
    page.goto(f"{app_url}/trace_explorer")
    page.locator(".st-key-generate button").first.click()
    page.locator(".ts-tok").first.wait_for()
    assert page.locator(".ts-tok").count() >= 1
    first_figure(page).wait_for()
    assert page.locator(".ts-tok").count() == 48  # the default max new tokens; tiny models never stop early
    token = page.locator(".ts-tok").nth(3)
    tip = token.locator(".ts-tip")
    assert not tip.is_visible() and token.get_attribute("title") is None
    token.hover()
    tip.wait_for(state="visible")  # a real tooltip box, styled, not the browser's title text
    assert "top alternatives" in tip.inner_text() and tip.bounding_box()["height"] > 30
    figure(page, 3).wait_for()
    page.screenshot(path=str(ARTIFACTS / "trace_explorer.png"), full_page=True)

    svg = download(page, "export-entropy-svg")
    assert ET.fromstring(svg).tag.endswith("svg")
    (ARTIFACTS / "entropy.svg").write_bytes(svg)
    pdf = download(page, "export-logit_lens-pdf")
    assert pdf.startswith(b"%PDF")
    rows = download(page, "export-logit_lens-csv").decode().splitlines()
    assert rows[0].startswith("layer,position,input_token,top_token")  # tidy: one row per (layer, position)
    for name in ("entropy", "logit_lens", "residual_norms", "attention"):
        payload = json.loads(download(page, f"export-{name}-json"))
        prov = payload["provenance"]  # every JSON export says what made it
        assert prov["model"] == MODEL and prov["fingerprint"] and prov["seed"] == 0 and prov["version"]
        assert prov["settings"]["generation"]["max_new_tokens"] == 48 and prov["prompt"]


def test_the_lens_and_attention_carry_their_labels(page, app_url, generated):
    page.goto(f"{app_url}/trace_explorer")
    figure(page, 3).wait_for()
    lens = page.locator('[data-testid="stPlotlyChart"]').nth(1)
    cells = lens.locator("g.heatmaplayer text, .textpoint text")
    assert cells.count() >= 2 * 32  # a token in every cell of the default 32-position window
    size = float(cells.first.evaluate("e => parseFloat(getComputedStyle(e).fontSize)"))
    assert size >= 10
    ticks = lens.locator(".xtick text")
    texts = ticks.evaluate_all("els => els.map(e => e.textContent)")  # SVG text has no innerText
    assert len(texts) == 32 and all(t.strip() for t in texts)  # an input token under every column
    box_title = lens.locator(".g-xtitle").bounding_box()
    lowest_tick = max(b["y"] + b["height"] for b in (t.bounding_box() for t in ticks.all()))
    assert box_title["y"] >= lowest_tick - 1  # the axis title sits below the rotated ticks, not on them
    attention = page.locator('[data-testid="stPlotlyChart"]').nth(3)
    labels = attention.locator(".xtick text").evaluate_all("els => els.map(e => e.textContent)")
    assert len(labels) >= 48 and "\u00abearlier\u00bb" in labels  # token labels and the earlier-keys column
    assert attention.locator("path.shape, .shapelayer path").count() >= 2  # the prompt | generation marker


def test_a_page_with_a_cached_trace_shows_its_first_figure_quickly(browser, app_url, generated):
    """Reported, not asserted (the issue's target is 1 s; this machine is shared and noisy).

    Two openings: switching to the page inside a running app session (the usual case), and a new
    browser tab, which also pays for booting Streamlit's front end and parsing plotly.js.
    """
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(SLOW)
    from app.bench import time_page_opening  # the same measurement `thoughtscope bench views` makes

    fresh, switch = [], []
    for _ in range(3):
        opened, switched = time_page_opening(p, app_url)
        fresh.append(opened)
        switch.extend(switched)
    context.close()

    def median(xs):
        return round(sorted(xs)[len(xs) // 2], 3)

    print(json.dumps({"bench": "page_first_figure_s", "page": "trace_explorer", "model": MODEL,
                      "switch_median_s": median(switch), "new_tab_median_s": median(fresh),
                      "switch_runs": [round(t, 3) for t in switch], "new_tab_runs": [round(t, 3) for t in fresh],
                      "target_s": 1.0, "load_avg_1m": round(os.getloadavg()[0], 2)}))
    assert len(switch) == 6


def page_names() -> list[str]:
    from app.registry import discover_pages

    return [module.__name__.rsplit(".", 1)[-1] for _, module in discover_pages()]


def test_no_page_load_asks_anything_of_another_host(browser, app_url, generated):
    """Offline by construction: every request a page makes goes to the app itself, and none fails
    (opening a page by its URL once asked for /<page>/_stcore/health and got 404s)."""
    context = browser.new_context()
    outside, failed = [], []

    def guard(route):
        if route.request.url.startswith(app_url + "/") or route.request.url == app_url:
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", guard)
    p = context.new_page()
    p.set_default_timeout(SLOW)
    p.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    for name in page_names():
        p.goto(f"{app_url}/{name}")
        p.locator('[data-testid="stSidebarNav"]').wait_for()
        p.locator("h1").first.wait_for()
        p.wait_for_timeout(1500)  # favicons, fonts and health checks come after the first paint
    p.locator('[data-testid="stSidebarNav"] a').filter(has_text="Steering").click()
    p.locator("h1").filter(has_text="Steering").wait_for()
    p.wait_for_timeout(1000)
    context.close()
    assert outside == [], f"requests to other hosts: {outside}"
    assert failed == [], f"failed requests: {failed}"


def test_the_feature_browser_shows_top_contexts(page, app_url):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{app_url}/feature_browser")
    page.locator(".st-key-fb_n input").fill("40")
    page.locator(".st-key-fb_n input").press("Enter")
    page.locator(".st-key-fb_index button").first.click()  # the first: the help tooltip is a button too
    page.locator(".st-key-fb_kind").get_by_text("neuron", exact=True).click()
    rows = page.locator(".fb-row")
    rows.first.wait_for()
    assert rows.count() == 20 and page.locator(".fb-top").count() == 20
    page.locator('[data-testid="stPlotlyChart"]').nth(2).locator(".main-svg").first.wait_for()  # the whole page
    token = rows.first.locator(".fb-tok:not(.fb-first)").first
    for _ in range(20):  # a rerun that redraws the rows after the hover (a fresh-clone run) leaves the new row
        page.mouse.move(0, 0)  # unhovered until the mouse moves again, as a reader's would
        token.hover()
        try:
            token.locator(".fb-tip").wait_for(state="visible", timeout=3000)
            break
        except PlaywrightTimeout:
            continue
    assert token.locator(".fb-tip").is_visible() and token.locator(".fb-tip").inner_text()  # the token's value
    page.screenshot(path=str(ARTIFACTS / "feature_browser.png"), full_page=True)
    prov = json.loads(download(page, "export-feature_contexts-json"))["provenance"]
    assert prov["data"] == "gsm8k-questions" and prov["split"] == "test" and prov["settings"]["direction"]["kind"] == "neuron"


@pytest.mark.model
def test_screenshot_of_the_embedded_model_for_the_readme(browser):
    """docs/screenshot.png: the trace explorer on the embedded SmolLM2 (tiny-random models are for tests only)."""
    from thoughtscope.errors import ThoughtscopeError
    from probes.zoo import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ThoughtscopeError as err:
        pytest.fail(str(err))
    with serve("smollm2-135m") as url:
        context = browser.new_context(viewport={"width": 1400, "height": 1400})
        p = context.new_page()
        p.set_default_timeout(4 * SLOW)
        p.goto(f"{url}/trace_explorer")
        p.locator(".st-key-generate button").first.click()
        figure(p, 3).wait_for()
        # the correctness badge, finished: the test run's cache is private (tests/conftest.py), so SmolLM2 is
        # validated afresh beside the generation (about 12 s on one core), as on a newcomer's first page
        p.get_by_text("numbers checked").first.wait_for()
        p.wait_for_timeout(1000)  # let plotly finish its layout
        shot = ARTIFACTS / "readme_trace_explorer.png"
        p.screenshot(path=str(shot))
        p.screenshot(path=str(ARTIFACTS / "trace_explorer_smollm2_full.png"), full_page=True)
        context.close()
    (ROOT / "docs").mkdir(exist_ok=True)
    shutil.copyfile(shot, ROOT / "docs" / "screenshot.png")
