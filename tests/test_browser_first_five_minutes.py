"""The first five minutes (issue 20), in a real browser: a fresh app on the embedded model with an empty
model cache opens every method page on its shipped result (docs/shipped/, thoughtscope/shipped.py)
without a click, and long work is a job a reloaded tab reattaches to, that Stop ends, and that stops
on its own once no tab has watched it for the grace period (`THOUGHTSCOPE_JOB_GRACE_S`, short here).

Run with `pytest -m browser tests/test_browser_first_five_minutes.py` (SmolLM2's first load in an
empty cache dequantizes the GGUF, ~15 s; a calibration job on it takes minutes on two cores).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import expect

from app.jobs import GRACE_ENV, grace_from_env
from thoughtscope.errors import BadInputError

from tests.test_browser import SLOW, app_log, serve  # the `browser` fixture: the session's Chromium (conftest)

MODEL = "smollm2-135m"
GRACE_S = 20  # short for the test; long enough that a reload (a whole page rerun) never misses it
FIRST = 10 * 60_000  # ms: the first page also loads SmolLM2 and warms an empty cache, on a shared 2-core machine
STORED = "A stored result, made on"  # Shipped.label()
# Every method page, with what says on it that it shows a stored result. The RLKV page's shipped run is
# docs/rlkv_run + docs/rlkv_results_n120.json (app/views/rlkv.py SHIPPED), not a Shipped folder, so it
# says so in its own words.
METHOD_PAGES = {"cot_entropy": STORED, "rise": STORED, "fuzzy_concepts": STORED, "moe_router": STORED,
                "visual_attribution": STORED, "rlkv": "These are the settings of the shipped run",
                "feature_browser": STORED}
SWITCHES = {"moe_router": ("moe_switch", "toy-moe"), "visual_attribution": ("va_switch", "toy-vlm")}


@contextlib.contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def fresh_app(tmp_path_factory):
    """`thoughtscope app --model smollm2-135m` with a new, empty cache folder and a short job grace. Empty but
    for `models`, the run's (built weights, content-addressed): a newcomer's first start also dequantises
    SmolLM2's GGUF (~15-25 s; tests/test_model_files.py rebuilds it from the GGUF), which told this test
    nothing more about the pages."""
    from probes.paths import user_cache_dir

    cache = tmp_path_factory.mktemp("empty-cache")
    models = user_cache_dir() / "models"  # the run's cache folder (tests/conftest.py), or the one the caller named
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models, target_is_directory=True)
    with env(THOUGHTSCOPE_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             OMP_NUM_THREADS="1", **{GRACE_ENV: str(GRACE_S)}):
        with serve(MODEL) as url:
            yield url, cache


def first_figure(p):
    return p.locator('[data-testid="stPlotlyChart"]').first.locator(".main-svg").first


def job_id(p) -> str | None:
    return (parse_qs(urlsplit(p.url).query).get("job") or [None])[0]


def job_box(p, jid: str):
    """The job's progress container (`st.container(key=f"job-{id}")`; the class keeps the id's raw part)."""
    return p.locator(f'[class*="st-key-job-{jid.partition(".")[0]}"]')


def gone(p, jid: str) -> None:
    """The stopped job's progress box and its `?job=` leave the page. Streamlit keeps the previous run's
    elements (faded) until the rerun that draws the Stop message has finished, so this waits for that run's
    end rather than reading the page the moment the message appears (CI once read it in between)."""
    expect(job_box(p, jid)).to_have_count(0, timeout=60_000)
    p.wait_for_function("!new URLSearchParams(location.search).get('job')", timeout=60_000)
    assert job_id(p) is None


def test_the_grace_period_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(GRACE_ENV, raising=False)
    assert grace_from_env() == 30.0
    monkeypatch.setenv(GRACE_ENV, "2.5")
    assert grace_from_env() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(GRACE_ENV, bad)
        with pytest.raises(BadInputError, match=GRACE_ENV):
            grace_from_env()


@pytest.mark.browser
@pytest.mark.model
def test_a_fresh_app_opens_every_method_page_on_its_stored_result(browser, fresh_app):  # noqa: F811
    url, cache = fresh_app
    # nothing cached before the first page but the app's patched static files (app/streamlit-static-*) and
    # the built weights (models)
    assert {f.name for f in cache.iterdir()} <= {"app", "models"}
    shown, missing = {}, {}
    for i, (name, says) in enumerate(METHOD_PAGES.items()):
        context = browser.new_context(viewport={"width": 1400, "height": 1000})  # a new tab, a new session
        p = context.new_page()
        p.set_default_timeout(FIRST if i == 0 else 4 * SLOW)
        clicks = []
        p.expose_function("__tsClicked", lambda: clicks.append(1))
        p.add_init_script("document.addEventListener('click', () => window.__tsClicked(), true)")
        p.goto(f"{url}/{name}")
        try:
            first_figure(p).wait_for()
            p.get_by_text(says).first.wait_for()
            shown[name] = p.get_by_text(says).first.inner_text()
            if name in SWITCHES:
                key, target = SWITCHES[name]
                assert p.locator(f".st-key-{key} button").inner_text().strip().endswith(f"Switch to {target}")
        except Exception as err:  # noqa: BLE001  (every page is tried; the failures are listed together)
            missing[name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            p.screenshot(path=f"test-artifacts/first_five_minutes_{name}.png", full_page=True)
        assert clicks == []  # opened by URL alone
        context.close()
    assert missing == {}, missing
    assert set(shown) == set(METHOD_PAGES)
    assert all(says in shown[name] for name, says in METHOD_PAGES.items())
    assert f"on {MODEL}" in shown["cot_entropy"] and "on toy-moe " in shown["moe_router"]
    assert "on toy-vlm " in shown["visual_attribution"]


@pytest.mark.browser
@pytest.mark.model
def test_a_long_job_reattaches_stops_and_stops_unwatched(browser, fresh_app):  # noqa: F811
    """The CoT entropy page's calibration with the stored settings, run again here (12 + 12 problems at the
    sidebar's tokens on SmolLM2: minutes on two cores)."""
    url, _ = fresh_app
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(FIRST)
    p.goto(f"{url}/cot_entropy")
    first_figure(p).wait_for()
    p.locator(".st-key-cot_calibrate_again button").first.click()  # "Run again" beside the stored result's label
    p.wait_for_function("new URLSearchParams(location.search).get('job')")
    first = job_id(p)
    job_box(p, first).wait_for()

    p.reload()  # the URL holds ?job=...: the new session shows the same job
    job_box(p, first).wait_for()
    assert job_id(p) == first
    assert p.locator('[class*="st-key-job-"]').count() == 1

    p.locator(f'[class*="st-key-stop-{first.partition(".")[0]}"] button').first.click()
    p.get_by_text("stopped by the user").first.wait_for()  # drawn once the job's thread has ended
    gone(p, first)

    p.locator(".st-key-cot_calibrate button").first.click()  # the same work again: a new job
    p.wait_for_function("new URLSearchParams(location.search).get('job')")
    second = job_id(p)
    job_box(p, second).wait_for()
    assert second != first
    job_url = p.url
    context.close()  # every tab of the app closed: nobody watches the job

    # the reaper stops it after GRACE_S unwatched and says so in the app's terminal (app/jobs.py); opening
    # the page before that would watch it again
    said = f"thoughtscope: job {second.partition('.')[0]} ("
    deadline = time.monotonic() + GRACE_S + 120  # a hang detector, not a timing
    while said not in app_log(MODEL).read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the reaper never stopped job {second} (see {app_log(MODEL)})"
        time.sleep(0.5)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(FIRST)
    p.goto(job_url)
    p.get_by_text(f"stopped: no open page watched it for {GRACE_S} s").first.wait_for()
    gone(p, second)
    context.close()
