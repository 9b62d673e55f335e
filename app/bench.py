"""The views' benchmarks (`thoughtscope bench views`): how long a researcher waits after acting.

- `page_first_figure_s`: in Chromium (Playwright, the system browser), from opening the trace
  explorer to its first figure painted, on a generation the app already holds: switching pages
  inside a session (from the click), a new tab of the same browser, and a first visit with nothing
  cached (from navigation start). Timed by the page's own clock (`PAINT_PROBE`); the driver's wall
  clock, which adds Playwright's round trips, is reported beside it. Goals: <= 2 s new tab, <= 1 s
  switch. A new tab may paint the first figure as its static preview (app/figure_preview.py): `seconds`
  counts the first figure painted either way, `interactive_s` the first plotly chart, and `previews` says
  which openings had a preview (the first new tab after a generation may come before its preview is made).
- `first_figure_first` (in `views`): new tabs of the trace explorer and two method pages with the first figure
  drawn before the rest of the page (app/first_paint.py), side by side with an app that draws each page in one
  run (`THOUGHTSCOPE_FIRST_FIGURE_FIRST=0`); ratio < 1: the first figure is painted sooner.
- `steer_slider_s`: from a slider move to the steered text on the Steering page (the page script
  rerun under `streamlit.testing`, no browser), on the embedded model with the one-shot prompt and
  48 new tokens. With greedy decoding the page's first draw of a direction generates all the slider's
  stops (20, measured: app.views.steering.GRID) in one batched generation (`steering_grid`), reported as `first_draw_s`, and a move reads it;
  beside them, one scale generated from scratch (`from_scratch_s`), and whether every grid row equals
  its single-row generation token for token. `bench_page_first_figure` adds the same move in Chromium:
  an arrow key on the slider -> the new steered text painted (`SLIDER_PROBE`). Goal <= 1.5 s.
- `feature_browse_s`: the top 20 contexts of one SAE latent (and of one vector) over a stored
  10,000-context corpus (generated arithmetic problems), its histogram and its logits. Goal <= 1 s.
  The corpus is indexed once into the cache first (with a progress bar; minutes on a laptop CPU,
  then seconds), at a quarter of the model's depth.

- `job_stop_s` (group `jobs`): Stop pressed on a running job -> the job's last model call ended, on a
  real job: the CoT entropy page's calibration (`analyses.cot_entropy.calibration.calibrate`, 12 + 12
  problems, 48 tokens) on the embedded model, its backend wrapped so every model call (a decoding step
  of a batched generation, a prefill, a probe's fork) stamps when it ended. Stop is pressed at a few
  points of one job's life (a new job each), during generation and during probing. Goal <= 2 s.
  `job_stop_one_step_s` beside it: a job of one long generation with no progress report inside (as
  the pages run a steered comparison or a compressed generation, `app.jobs.one_step`), Stop pressed at
  0.2, 0.4 and 0.6 of its length; Stop -> the job's thread ended, with the wait the
  old rule (Stop seen when the call returned) would have had. Goal <= 2 s.

- `page_first_result_s` (group `pages`): for every method page, a new tab on the embedded model to its
  first figure, from the shipped results (docs/shipped/), by the page's own clock from navigation
  start (`PAINT_PROBE`). The model is loaded before the first tab. Goal <= 2 s each. Beside them
  baselines: a new tab of Home to its first metric (the front end's boot and one script run, no figure),
  and the floor under every page (`bench_streamlit_floor`): a bare Streamlit app of one metric, and of one
  3-point plotly figure, served the same way (no model, no sidebar).

Absolute times on a shared machine are noisy: every row reports the machine's load with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm
import torch

from analyses.cot_entropy import ship as cot_ship
from analyses.cot_entropy.calibration import calibrate
from analyses.families import default_task, family_for
from analyses.feature_browser import SAELatent, VectorDirection, browse, build_index, load_corpus
from analyses.steering import diff_of_means_direction, generate_text, site_norm, steering_grid, steering_vector
from analyses.tasks import one_shot_messages
from app.cli import streamlit_command
from app.figure_preview import CLASS
from probes.backend import Backend
from probes.engine import Engine
from probes.interventions import AddVector
from saes.train import SAETrainSettings, train_sae

GOALS = {"page_first_figure_switch": 1.0, "page_first_figure_new_tab": 2.0, "steer_slider": 1.5, "feature_browse": 1.0,
         "job_stop": 2.0, "page_first_result": 2.0}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


@contextlib.contextmanager
def _model_env(model_id: str) -> Iterator[None]:
    """THOUGHTSCOPE_MODEL set to `model_id` for the pages an AppTest opens, restored afterwards."""
    before = os.environ.get("THOUGHTSCOPE_MODEL")
    os.environ["THOUGHTSCOPE_MODEL"] = model_id
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("THOUGHTSCOPE_MODEL", None)
        else:
            os.environ["THOUGHTSCOPE_MODEL"] = before


def _page_slider_moves(model_id: str, moves: tuple[float, ...], max_new_tokens: int) -> dict[str, Any]:
    """The Steering page under `streamlit.testing` (in this process): seconds of its first draw (direction,
    norm, the batched grid) and of the rerun after each slider move, with the steered text shown."""
    from streamlit.testing.v1 import AppTest

    with _model_env(model_id):
        at = AppTest.from_string("from app.main import main\nmain(only='steering')\n", default_timeout=1800)
        at.session_state["max_new_tokens"] = max_new_tokens
        started = time.perf_counter()
        at.run()
        first = time.perf_counter() - started
        runs, shown = [], []
        for scale in moves:
            started = time.perf_counter()
            at.select_slider(key="steer_scale").set_value(scale).run()  # the page's measured stops
            runs.append(time.perf_counter() - started)
            if at.exception or at.error:
                raise RuntimeError(f"the Steering page failed at scale {scale}: "
                                   f"{[e.value for e in [*at.exception, *at.error]]}")
            shown.append(at.text[1].value)
    return {"first_s": first, "runs_s": runs, "texts": shown}


def bench_steer_slider(backend: Backend, moves: tuple[float, ...] = (0.75, 1.0, -0.5, -1.0, 1.5, 0.25),
                       max_new_tokens: int = 48, page: bool = True) -> dict[str, Any]:
    """What the Steering page does (greedy): the first draw of a direction generates every slider stop in
    one batch; a move reads it. Timed: that batch, the page's rerun after each move (with `page`), and
    each moved-to scale generated from scratch on its own (the cost of a move without the grid)."""
    from app.sidebar import EXAMPLE_QUESTION
    from app.views.steering import GRID, SET_A, SET_B
    prompt = one_shot_messages(EXAMPLE_QUESTION)
    site = f"resid_post.{backend.arch().n_layers // 2}"
    direction = diff_of_means_direction(backend, SET_A.splitlines(), SET_B.splitlines(), site)
    norm = site_norm(backend, prompt, site, chat=True)
    # the page's first draw of the first direction: every stop, scale 0 (the unsteered text) one more row
    grid = steering_grid(backend, prompt, site, direction, GRID, max_new_tokens=max_new_tokens, chat=True,
                         unit="norm", reference_norm=norm)
    lookups, direct, equal = [], [], 0
    for scale in moves:
        started = time.perf_counter()
        looked_up = grid.comparison(grid.snap(scale))
        lookups.append(time.perf_counter() - started)
        started = time.perf_counter()
        alone = generate_text(backend, prompt, max_new_tokens=max_new_tokens, chat=True,
                              interventions=[AddVector(site, steering_vector(direction, "norm", norm), scale)])
        direct.append(time.perf_counter() - started)
        equal += alone.token_ids == looked_up.steered.token_ids
    plain = generate_text(backend, prompt, max_new_tokens=max_new_tokens, chat=True)
    row: dict[str, Any] = {
        "bench": "steer_slider_s", "target": 1.0, "goal_s": GOALS["steer_slider"], "moves": list(moves),
        "first_draw_s": round(grid.seconds, 3), "first_draw_rows": len(grid.scales),
        "from_scratch_s": _median(direct), "from_scratch_runs_s": [round(t, 3) for t in direct],
        "lookup_s": round(statistics.median(lookups), 6),
        "rows_equal_single": f"{equal + (plain.token_ids == grid.unsteered.token_ids)} of {len(moves) + 1}",
        "new_tokens": [len(grid.comparison(grid.snap(s)).steered.tokens) for s in moves], "site": site,
        "model": backend.info()["model_id"]}
    if page:
        moved = _page_slider_moves(backend.info()["model_id"], moves, max_new_tokens)
        row.update({"seconds": _median(moved["runs_s"]), "runs_s": [round(t, 3) for t in moved["runs_s"]],
                    "page_first_draw_s": round(moved["first_s"], 3),
                    "what": "page rerun after a slider move (streamlit.testing, no browser)"})
    else:
        row.update({"seconds": row["lookup_s"], "what": "grid lookup only (page=False)"})
    row["ratio"] = round(row["seconds"] / GOALS["steer_slider"], 3)
    row["speedup"] = round(row["from_scratch_s"] / row["seconds"], 1) if row["seconds"] else None
    row["load_avg_1m"] = _load()
    return row


def bench_stack_slider(model_id: str, moves: tuple[float, ...] = (0.75, -0.5, 1.0, 0.25), max_new_tokens: int = 48,
                       layers: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The Steering page's stack under `streamlit.testing`: the page's direction added at two layers (two
    terms), then the rerun after each move of the first term's slider timed. The first move makes that term's
    every stop in one batched generation (`first_move_s`); `seconds` is the median of the later moves."""
    from streamlit.testing.v1 import AppTest

    from app import jobs

    with _model_env(model_id):
        at = AppTest.from_string("from app.main import main\nmain(only='steering')\n", default_timeout=1800)
        at.session_state["max_new_tokens"] = max_new_tokens
        at.run()
        n_layers = len(at.selectbox(key="steer_layer").options)
        layers = layers or (n_layers // 3, (2 * n_layers) // 3)
        started = time.perf_counter()
        for layer in layers:
            at.selectbox(key="steer_layer").set_value(layer).run()
            at.button(key="steer_add_to_stack").click().run()
        first = time.perf_counter() - started
        runs, texts = [], []
        for strength in moves:
            started = time.perf_counter()
            at.select_slider(key="stack_strength_0").set_value(strength).run()
            if jobs.registry().running():  # the term's first move: its stops in one batch, as a job
                while jobs.registry().running():
                    time.sleep(0.05)
                at.run()
            runs.append(time.perf_counter() - started)
            if at.exception or at.error:
                raise RuntimeError(f"the stack failed at strength {strength}: "
                                   f"{[e.value for e in [*at.exception, *at.error]]}")
            texts.append(at.text[2].value)
    # greedy: the first move of a term makes all its stops in one batch; the later moves read it
    seconds = _median(runs[1:] or runs)
    return {"bench": "steer_slider_s", "page": "steering stack", "first_move_s": round(runs[0], 3), "terms": len(layers), "model": model_id,
            "moves": list(moves), "max_new_tokens": max_new_tokens, "seconds": seconds,
            "runs_s": [round(t, 3) for t in runs], "stack_first_draw_s": round(first, 3),
            "distinct_texts": len(set(texts)), "goal_s": GOALS["steer_slider"],
            "ratio": round(seconds / GOALS["steer_slider"], 3), "target": 1.0,
            "what": "page rerun after a stack slider move, the term's grid made by its first move (streamlit.testing, "
                    "no browser)", "load_avg_1m": _load()}


def bench_feature_browse(backend: Backend, n_contexts: int = 10_000, latents: int = 5, k: int = 20,
                         layer: int | None = None) -> list[dict[str, Any]]:
    """Index `n_contexts` generated problems once (cached), train a small SAE on a sample of the rows,
    then time browses of `latents` latents and of one vector. The site defaults to a quarter of the
    depth: a browse costs the same at any layer (rows x d_model), the one-time index less."""
    corpus = load_corpus("arith-problems", n=n_contexts)
    site = f"resid_post.{backend.arch().n_layers // 4 if layer is None else layer}"
    bar = tqdm(total=n_contexts, desc=f"indexing {corpus.name} at {site}", unit="context")

    def progress(done: int, total: int) -> None:
        bar.total, bar.n = total, done
        bar.refresh()

    started = time.perf_counter()
    index = build_index(backend, corpus, site, on_progress=progress)
    bar.close()
    index_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    sample = index.acts[torch.randperm(index.n_rows, generator=gen)[:8192]].float()
    sae, _ = train_sae(sample, SAETrainSettings.scaled(sample.shape[1], sample.shape[0], seed=0, progress=False))
    fires = (sae.encode(sample) > 0).float().mean(0)
    chosen = fires.argsort(descending=True)[:latents].tolist()  # latents that fire: every browse returns k contexts
    times = []
    for latent in chosen:
        started = time.perf_counter()
        view = browse(index, SAELatent(sae, int(latent), site), backend, k=k)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    browse(index, VectorDirection(torch.randn(sample.shape[1], generator=gen), site), backend, k=k)
    vector_s = time.perf_counter() - started
    common = {"model": backend.info()["model_id"], "site": site, "contexts": index.n_contexts, "tokens": index.n_rows,
              "index_bytes": index.nbytes, "index_s": round(index_s, 1), "load_avg_1m": _load()}
    return [{"bench": "feature_browse_s", "ratio": round(statistics.median(times) / GOALS["feature_browse"], 3),
             "target": 1.0, "seconds": _median(times), "runs_s": [round(t, 3) for t in times], "direction": "sae latent",
             "d_sae": int(sae.cfg.d_sae), "top_contexts": len(view.contexts), "vector_s": round(vector_s, 3), **common}]


def first_figure(page: Any) -> Any:
    """The trace explorer's first plotly figure (its SVG drawn), in a Playwright page."""
    return page.locator('[data-testid="stPlotlyChart"]').first.locator(".main-svg").first


# The page's own clock: when a figure enters the document, the frame after it is painted (a
# requestAnimationFrame callback runs before a paint, a task queued from it runs after). A figure is a
# plotly chart's SVG, or a new tab's static preview of it (app/figure_preview.py) once its image is
# decoded; `painted` is the first of either, `interactive` the first chart. Times are performance.now():
# ms since the tab's navigation started, and the last click is recorded too, so a page switch is timed
# from the click event the user makes. The test driver's own round trips (Playwright's actionability
# checks before a click, its polling after) are not part of what a user waits for; on this loaded 2-core
# machine they added 0.3-1 s to every opening.
PAINT_PROBE = """
(() => {
  if (window.__tsProbe) return;
  const probe = window.__tsProbe = {click: null, painted: null, interactive: null, preview: null};
  let first = false, chart = false;
  document.addEventListener('click', () => {
    probe.click = performance.now(); probe.painted = probe.interactive = probe.preview = null; first = chart = false;
  }, true);
  const stamp = (key) => requestAnimationFrame(() => setTimeout(() => { probe[key] = performance.now(); }, 0));
  new MutationObserver(() => {
    const drawn = document.querySelector('[data-testid="stPlotlyChart"] .main-svg');
    const img = document.querySelector('.PREVIEW img');
    if (!first && (drawn || (img && img.complete))) { first = true; probe.preview = !drawn; stamp('painted'); }
    if (!chart && drawn) { chart = true; stamp('interactive'); }
  }).observe(document, {subtree: true, childList: true, attributes: true});
})();
""".replace("PREVIEW", CLASS)


def _painted_s(page: Any, since_click: bool, which: str = "painted") -> float:
    page.wait_for_function(f"window.__tsProbe && window.__tsProbe.{which} !== null")
    probe = page.evaluate("window.__tsProbe")
    return (probe[which] - (probe["click"] if since_click else 0.0)) / 1000


def page_opening_times(page: Any, url: str, switches: int = 2) -> dict[str, Any]:
    """Open the trace explorer in `page` (a new session), then switch Home -> Trace explorer `switches`
    times; each opening to the first figure painted, by the page's clock (from navigation start, from
    the click) and by the driver's wall clock (from `goto`, from `click()`)."""
    page.add_init_script(PAINT_PROBE)
    started = time.perf_counter()
    page.goto(f"{url}/trace_explorer")  # a new session: generation and trace come from the app's caches
    first_figure(page).wait_for(state="visible")
    driver = time.perf_counter() - started
    out: dict[str, Any] = {"new_tab": _painted_s(page, False), "new_tab_driver": driver, "switch": [],
                           "switch_driver": [], "new_tab_interactive": _painted_s(page, False, "interactive"),
                           "new_tab_preview": page.evaluate("window.__tsProbe.preview")}
    nav = page.locator('[data-testid="stSidebarNav"] a')
    for _ in range(switches):
        # the page has finished opening (no first-paint reporter left: app/first_paint.py) before the user
        # leaves it, so the switch times one page's opening, not two runs interleaved
        page.wait_for_function("!document.querySelector('[class*=\"st-key-first-paint-report\"]')")
        nav.filter(has_text="Home").click()
        page.locator('[data-testid="stMetric"]').first.wait_for()
        time.sleep(0.5)  # Home has finished drawing: the switch does not wait for its run to stop
        started = time.perf_counter()
        nav.filter(has_text="Trace explorer").click()
        first_figure(page).wait_for(state="visible")
        out["switch_driver"].append(time.perf_counter() - started)
        out["switch"].append(_painted_s(page, True))
    return out


def time_page_opening(page: Any, url: str, switches: int = 2) -> tuple[float, list[float]]:
    """Seconds from opening the trace explorer in a new session to its first figure painted, then from
    each of `switches` page switches (Home -> Trace explorer) to it, by the page's clock (see
    `page_opening_times`). Shared by this benchmark and the browser test."""
    times = page_opening_times(page, url, switches)
    return times["new_tab"], times["switch"]


SLIDER_PROBE = """
(() => {
  if (window.__tsSlider) return;
  const probe = window.__tsSlider = {key: null, painted: null, pending: false, text: null};
  const box = () => document.querySelector('.st-key-steered-text');
  document.addEventListener('keydown', () => {
    probe.key = performance.now(); probe.painted = null; probe.text = box() ? box().innerText : null;
  }, true);
  new MutationObserver(() => {
    if (probe.key === null || probe.painted !== null || probe.pending || !box()) return;
    if (box().innerText === probe.text) return;
    probe.pending = true;
    requestAnimationFrame(() => setTimeout(() => { probe.painted = performance.now(); probe.pending = false; }, 0));
  }).observe(document, {subtree: true, childList: true, characterData: true});
})();
"""


def steering_slider_times(page: Any, url: str, moves: int = 6) -> dict[str, Any]:
    """The Steering page in Chromium: seconds from navigation start to the first steered text (the first
    draw of the default direction), then from each arrow-key press on the scale slider (one 0.25 stop,
    right `moves // 2` times, then left) to the new steered text painted, by the page's clock."""
    page.add_init_script(SLIDER_PROBE)
    page.goto(f"{url}/steering")
    steered = page.locator(".st-key-steered-text [data-testid='stText']")
    steered.wait_for()
    first = page.evaluate("performance.now()") / 1000
    slider = page.locator(".st-key-steer_scale input[type='range']").first
    runs, labels = [], []
    for i in range(moves):
        slider.focus()
        page.keyboard.press("ArrowRight" if i < moves // 2 else "ArrowLeft")
        page.wait_for_function("window.__tsSlider && window.__tsSlider.painted !== null")
        probe = page.evaluate("window.__tsSlider")
        runs.append((probe["painted"] - probe["key"]) / 1000)
        labels.append(page.locator(".st-key-steered-text").inner_text().split("\n")[0])
    return {"first_draw_s": first, "runs_s": runs, "boxes": labels}


def generate_in_a_tab(context: Any, url: str, timeout_ms: int) -> None:
    """A generation on the trace explorer in a tab of `context`, waited for until its fourth figure is drawn,
    and the tab closed: the app then holds a result, so a new tab's first run has figures to draw."""
    tab = context.new_page()
    tab.set_default_timeout(timeout_ms)
    tab.goto(f"{url}/trace_explorer")
    tab.locator(".st-key-generate button").first.click()
    tab.locator('[data-testid="stPlotlyChart"]').nth(3).locator(".main-svg").first.wait_for()
    tab.close()


def _browser_path() -> str | None:
    """The system Chromium for the browser benchmarks, or None when it or playwright is missing."""
    from app.export import chromium_path

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None
    return chromium_path()


def bench_page_first_figure(model_id: str, rounds: int = 3) -> list[dict[str, Any]]:
    """New tab and page switch to the trace explorer's first figure, in the system Chromium."""
    browser_path = _browser_path()
    if browser_path is None:
        return [{"bench": "page_first_figure_s", "ratio": float("nan"), "skipped": "needs Chromium and playwright"}]
    from playwright.sync_api import sync_playwright

    slow = 600_000
    with _app(model_id) as url:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])

            context = browser.new_context()  # one browser profile: its tabs share the HTTP cache
            generate_in_a_tab(context, url, slow)
            tab, switch, cold = [], [], []
            for _ in range(rounds):
                page = context.new_page()  # a new tab of the same browser
                page.set_default_timeout(slow)
                tab.append(page_opening_times(page, url))
                page.close()
                fresh = browser.new_context()  # a first visit: nothing cached
                page = fresh.new_page()
                page.set_default_timeout(slow)
                cold.append(page_opening_times(page, url, switches=0))
                fresh.close()
            switch = [t for times in tab for t in zip(times["switch"], times["switch_driver"])]
            page = context.new_page()
            page.set_default_timeout(slow)
            slider = steering_slider_times(page, url)
            browser.close()
    common = {"model": model_id, "page": "trace_explorer", "load_avg_1m": _load(),
              "clock": "the page's own: navigation start or click event -> the first figure painted (a chart, or "
                       "its static preview in a new tab: app/figure_preview.py); interactive_s: -> the first chart"}

    def row(opening: str, pairs: list[tuple[float, float]], goal: str, extra: dict | None = None) -> dict[str, Any]:
        page_s, driver_s = [p for p, _ in pairs], [d for _, d in pairs]
        return {"bench": "page_first_figure_s", "opening": opening, "seconds": _median(page_s),
                "ratio": round(statistics.median(page_s) / GOALS[goal], 3), "target": 1.0,
                "runs_s": [round(t, 3) for t in page_s], "driver_s": _median(driver_s),
                "driver_runs_s": [round(t, 3) for t in driver_s], **(extra or {}), **common}

    def charts(openings: list[dict[str, Any]]) -> dict[str, Any]:
        """When the first interactive chart came, and which openings painted a static preview first."""
        chart_s = [t["new_tab_interactive"] for t in openings]
        return {"interactive_s": _median(chart_s), "interactive_runs_s": [round(t, 3) for t in chart_s],
                "previews": [bool(t["new_tab_preview"]) for t in openings]}

    return [row("page switch", switch, "page_first_figure_switch"),
            row("new tab", [(t["new_tab"], t["new_tab_driver"]) for t in tab], "page_first_figure_new_tab", charts(tab)),
            row("first visit (cold cache)", [(t["new_tab"], t["new_tab_driver"]) for t in cold],
                "page_first_figure_new_tab", charts(cold)),
            {**common, "bench": "steer_slider_s", "page": "steering",
             "clock": "the page's own: key press -> the new steered text painted",
             "opening": "Chromium: arrow key on the scale slider (one 0.25 stop)",
             "seconds": _median(slider["runs_s"]),
             "ratio": round(statistics.median(slider["runs_s"]) / GOALS["steer_slider"], 3), "target": 1.0,
             "runs_s": [round(t, 3) for t in slider["runs_s"]], "page_first_draw_s": round(slider["first_draw_s"], 3),
             "boxes": slider["boxes"]}]


def bench_first_figure_first(model_id: str = "smollm2-135m", rounds: int = 4,
                             pages: tuple[str, ...] = ("trace_explorer", "cot_entropy", "rise")) -> list[dict[str, Any]]:
    """New tabs to each page's first figure with the first figure drawn first (app/first_paint.py) and, side by
    side in the same run, from an app serving every page in one run (`THOUGHTSCOPE_FIRST_FIGURE_FIRST=0`):
    two apps, one browser profile each, the tabs alternating between them. `ratio` is first-figure-first over
    one-run (< 1: sooner). Also timed: every figure of the trace explorer drawn (`all_figures_s`)."""
    browser_path = _browser_path()
    if browser_path is None:
        return [{"bench": "first_figure_first", "ratio": float("nan"), "skipped": "needs Chromium and playwright"}]
    from playwright.sync_api import sync_playwright

    from app.first_paint import SWITCH

    load_before = _load()
    arms = {"first figure first": {}, "one run": {SWITCH: "0"}}
    times: dict[tuple[str, str], list[float]] = {(arm, p): [] for arm in arms for p in (*pages, "all_figures")}
    with contextlib.ExitStack() as stack, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        urls, contexts = {}, {}
        for arm, env in arms.items():
            urls[arm] = stack.enter_context(_app(model_id, env))
            contexts[arm] = browser.new_context(viewport={"width": 1400, "height": 1000})
            warm = contexts[arm].new_page()
            warm.set_default_timeout(900_000)
            warm.goto(f"{urls[arm]}/trace_explorer")  # the generation every later tab of this app shows
            warm.locator(".st-key-generate button").first.click()
            warm.locator('[data-testid="stPlotlyChart"]').nth(3).locator(".main-svg").first.wait_for()
            for name in pages[1:]:  # each page's stored files read once (a page's first opening in the process)
                warm.goto(f"{urls[arm]}/{name}")
                warm.locator(FIGURE).first.wait_for()
            warm.close()
        for _ in range(rounds):
            for name in pages:
                for arm in arms:
                    page = contexts[arm].new_page()
                    page.set_default_timeout(600_000)
                    page.add_init_script(PAINT_PROBE)
                    page.goto(f"{urls[arm]}/{name}")
                    page.locator(FIGURE).first.wait_for(state="visible")
                    times[(arm, name)].append(_painted_s(page, False))
                    if name == "trace_explorer":
                        page.locator('[data-testid="stPlotlyChart"]').nth(3).locator(".main-svg").first.wait_for()
                        times[(arm, "all_figures")].append(page.evaluate("performance.now()") / 1000)
                    page.close()
        browser.close()
    rows = []
    for name in (*pages, "all_figures"):
        first, one = times[("first figure first", name)], times[("one run", name)]
        rows.append({"bench": "first_figure_first", "page": name if name != "all_figures" else
                     "trace_explorer (every figure drawn)", "seconds": _median(first), "one_run_s": _median(one),
                     "ratio": round(statistics.median(first) / statistics.median(one), 3),
                     "runs_s": [round(t, 3) for t in first], "one_run_runs_s": [round(t, 3) for t in one],
                     "model": model_id, "load_avg_1m_before": load_before, "load_avg_1m": _load(),
                     "clock": "the page's own: navigation start of a new tab -> the first figure painted"
                              + (" (-> the fourth figure in the document)" if name == "all_figures" else "")})
    return rows


def run_views(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    """Every views benchmark on `model_id` (ratios are seconds / goal: <= 1 meets the goal)."""
    engine = Engine.from_id(model_id)
    rows = [bench_steer_slider(engine), *bench_feature_browse(engine)]
    del engine
    return [*rows, bench_stack_slider(model_id), *bench_page_first_figure(model_id), *bench_first_figure_first(model_id)]


class _StampedBackend:
    """A backend whose model calls stamp when they ended (`last_call_end`, perf_counter seconds)."""

    def __init__(self, backend: Backend):
        self._backend, self.last_call_end, self.calls = backend, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _stamp(self) -> None:
        self.last_call_end, self.calls = time.perf_counter(), self.calls + 1

    def generate(self, *args: Any, **kwargs: Any):
        stream = self._backend.generate(*args, **kwargs)
        try:
            for record in stream:
                self._stamp()
                yield record
        finally:  # closed here, in the job's thread: an engine stream left to the garbage collector keeps its lock
            stream.close()

    def prefill(self, *args: Any, **kwargs: Any) -> Any:
        out = self._backend.prefill(*args, **kwargs)
        self._stamp()
        return out

    def fork(self, *args: Any, **kwargs: Any) -> Any:
        out = self._backend.fork(*args, **kwargs)
        self._stamp()
        return out


def bench_job_stop(backend: Backend, stop_after_s: tuple[float, ...] = (3.0, 8.0, 15.0, 25.0)) -> dict[str, Any]:
    """Start the CoT calibration as a job (`app.jobs.JobRegistry`), press Stop `stop_after_s` seconds in
    (a fresh job each time), and time Stop -> the job's last model call ended, and -> its thread ended."""
    from app.jobs import STOPPED, JobRegistry

    model_id = backend.info()["model_id"]
    registry = JobRegistry(costs_path=Path(tempfile.mkdtemp()) / "costs.json")
    settings = {k: v for k, v in cot_ship.DEFAULTS.items()}
    call_s, thread_s, stages = [], [], []
    for i, after in enumerate(stop_after_s):
        stamped = _StampedBackend(backend)

        def work(job: Any) -> Any:
            return calibrate(stamped, default_task(model_id), family_for(model_id), on_progress=job.progress,
                             **settings)

        job = registry.start(f"bench-stop-{i}", work, label="calibration", kind="bench-cot-calibration")
        time.sleep(after)
        if job.status != "running":
            raise RuntimeError(f"the calibration ended before Stop at {after} s; stop earlier")
        pressed = time.perf_counter()
        job.stop()
        job.thread.join(120)
        ended = time.perf_counter()
        if job.status != STOPPED:
            raise RuntimeError(f"the job ended {job.status}, not stopped")
        call_s.append(max(0.0, stamped.last_call_end - pressed))
        thread_s.append(ended - pressed)
        stages.append(f"{job.stage} {job.done}/{job.total}")
    return {"bench": "job_stop_s", "job": "CoT entropy calibration (12 + 12 problems, 48 tokens)", "model": model_id,
            "seconds": round(max(call_s), 3), "ratio": round(max(call_s) / GOALS["job_stop"], 3), "target": 1.0,
            "clock": "Stop pressed -> the job's last model call ended (worst of the runs)",
            "runs_s": [round(t, 3) for t in call_s], "thread_end_s": [round(t, 3) for t in thread_s],
            "stop_after_s": list(stop_after_s), "stopped_at": stages, "load": _load()}


def bench_one_step_stop(backend: Backend, max_new_tokens: int = 192, fractions: tuple[float, ...] = (0.2, 0.4, 0.6),
                        prompt: str = "Once upon a time, in a small village by the sea,") -> dict[str, Any]:
    """A job of one long model call with no progress report inside (`app.jobs.one_step`, as the pages run a
    steered comparison or a compressed generation): one greedy generation of `max_new_tokens`. It runs once
    to its end (its length: what a Stop waited for before `probes.cancel`), then Stop is pressed at each
    `fractions` of that length in a fresh job; timed: Stop -> the job's thread ended. Beside it, what the
    same Stop would have waited under the old rule (the run's remaining time)."""
    from app.jobs import DONE, STOPPED, JobRegistry, one_step

    model_id = backend.info()["model_id"]
    registry = JobRegistry(costs_path=Path(tempfile.mkdtemp()) / "costs.json")

    def job_of(i: int) -> Any:
        work = one_step("generate", lambda: list(backend.generate(prompt, max_new_tokens=max_new_tokens, stop=[])))
        return registry.start(f"bench-one-step-{i}", work, label="one generation", kind="bench-one-step")

    warm = job_of(-1)  # the first generation of a process is slower (allocations): not the one to time
    warm.thread.join(600)
    started = time.perf_counter()
    full = job_of(0)
    full.thread.join(600)
    full_s = time.perf_counter() - started
    if full.status != DONE:
        raise RuntimeError(f"the uninterrupted generation ended {full.status}: {full.error}")
    n_tokens = len(full.result)
    stop_s, waited_before_s = [], []
    for i, fraction in enumerate(fractions, start=1):
        job = job_of(i)
        time.sleep(fraction * full_s)
        if job.status != "running":
            raise RuntimeError(f"the generation ended before Stop at {fraction:g} of its length")
        pressed = time.perf_counter()
        job.stop()
        job.thread.join(600)
        stop_s.append(time.perf_counter() - pressed)
        if job.status != STOPPED:
            raise RuntimeError(f"the job ended {job.status}, not stopped")
        waited_before_s.append((1 - fraction) * full_s)
    return {"bench": "job_stop_one_step_s", "job": f"one greedy generation of {n_tokens} tokens as one job step",
            "model": model_id, "seconds": round(max(stop_s), 3), "ratio": round(max(stop_s) / GOALS["job_stop"], 3),
            "target": 1.0, "clock": "Stop pressed -> the job's thread ended (worst of the runs)",
            "runs_s": [round(t, 3) for t in stop_s], "full_run_s": round(full_s, 2),
            "old_rule_wait_s": [round(t, 2) for t in waited_before_s], "stop_at_fraction": list(fractions),
            "load": _load()}


def run_jobs(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    """The jobs benchmark on `model_id`: how soon Stop ends a real job's model work."""
    torch.set_num_threads(1)
    engine = Engine.from_id(model_id)
    return [bench_job_stop(engine), bench_one_step_stop(engine)]


# ----------------------------------------------------------------------------- pages (issue 20)

# The method pages, each opening on a shipped result (docs/shipped/; RLKV: docs/rlkv_run and its evaluation)
FIRST_RESULT_PAGES = ("cot_entropy", "rise", "fuzzy_concepts", "moe_router", "visual_attribution", "rlkv",
                      "feature_browser")


@contextlib.contextmanager
def _streamlit(command: Callable[[int], list[str]], env: dict[str, str] | None = None,
               start_s: float = 120.0) -> Iterator[str]:
    """`command(port)` (a `streamlit run`) on a free loopback port until it is healthy; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(command(port), cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + start_s
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("streamlit did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _app(model_id: str, env: dict[str, str] | None = None,
         start_s: float = 120.0) -> contextlib.AbstractContextManager[str]:
    """`streamlit run` of the workbench on a free loopback port, on `model_id`; yields its URL."""
    return _streamlit(lambda port: streamlit_command(port, "127.0.0.1", model=model_id),
                      {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, start_s)


FIGURE = '[data-testid="stPlotlyChart"] .main-svg'
METRIC = '[data-testid="stMetric"]'  # Home's first element: the baseline (front end booted, one script run)


class TabTimes(NamedTuple):
    """One new tab to its first figure: seconds by the page's own clock (`PAINT_PROBE`, from navigation start;
    a chart or its static preview), by the driver's (from `goto`), to the first interactive chart, and whether
    a preview was what painted first."""

    painted: float
    driver: float
    interactive: float
    preview: bool


def page_first_result_times(context: Any, url: str, page_name: str, timeout_ms: int = 600_000,
                            selector: str = FIGURE) -> TabTimes:
    """A new tab of `context` opening `page_name` by its URL -> the page's first figure (`selector`) painted."""
    page = context.new_page()
    page.set_default_timeout(timeout_ms)
    page.add_init_script(PAINT_PROBE.replace(FIGURE, selector))
    started = time.perf_counter()
    page.goto(f"{url}/{page_name}" if page_name != "home" else url)
    page.locator(selector).first.wait_for(state="visible")
    driver = time.perf_counter() - started
    painted, interactive = _painted_s(page, False), _painted_s(page, False, "interactive")
    preview = bool(page.evaluate("window.__tsProbe.preview"))
    page.close()
    return TabTimes(painted, driver, interactive, preview)


def bench_page_first_result(model_id: str = "smollm2-135m", rounds: int = 3,
                            pages: tuple[str, ...] = FIRST_RESULT_PAGES) -> list[dict[str, Any]]:
    """`page_first_result_s` (issue 20): for every method page, a new tab on `model_id` to its first figure,
    from shipped results, in the system Chromium. The model is loaded first (Home in a warm-up tab: its load
    is not a page's); then each page is opened `rounds` times, each in a new tab of one browser profile (the
    HTTP cache shared, as a user's tabs share it). The first opening of a page in the app process also reads
    its stored files (`first_s`); the median of the later ones (`seconds`) is the figure the goal is for."""
    browser_path = _browser_path()
    if browser_path is None:
        return [{"bench": "page_first_result_s", "ratio": float("nan"), "skipped": "needs Chromium and playwright"}]
    from playwright.sync_api import sync_playwright

    times: dict[str, list[TabTimes]] = {name: [] for name in pages}
    load_before = _load()
    with _app(model_id) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        warm = context.new_page()
        warm.set_default_timeout(900_000)
        warm.goto(url)  # Home: loads the model (SmolLM2's first load in an empty cache dequantizes, ~15 s)
        warm.locator('[data-testid="stMetric"]').first.wait_for()
        warm.close()
        home = []
        for _ in range(rounds):
            for name in pages:
                times[name].append(page_first_result_times(context, url, name))
            home.append(page_first_result_times(context, url, "home", selector=METRIC))
        browser.close()
    common = {"model": model_id, "load_avg_1m_before": load_before, "load_avg_1m": _load(),
              "clock": "the page's own: navigation start of a new tab -> the first figure painted (a chart, or its "
                       "static preview); interactive_s: -> the first chart"}
    rows = []
    for name, runs in times.items():
        page_s, driver_s, chart_s = [r.painted for r in runs], [r.driver for r in runs], [r.interactive for r in runs]
        later = page_s[1:] or page_s
        rows.append({"bench": "page_first_result_s", "page": name, "seconds": _median(later),
                     "ratio": round(statistics.median(later) / GOALS["page_first_result"], 3), "target": 1.0,
                     "goal_s": GOALS["page_first_result"], "first_s": round(page_s[0], 3),
                     "runs_s": [round(t, 3) for t in page_s], "driver_runs_s": [round(t, 3) for t in driver_s],
                     "interactive_s": _median(chart_s[1:] or chart_s),
                     "interactive_runs_s": [round(t, 3) for t in chart_s], **common})
    home_s = [r.painted for r in home]
    rows.append({"bench": "page_first_result_s", "page": "home (baseline: no figure, its first metric)",
                 "seconds": _median(home_s[1:] or home_s), "ratio": round(statistics.median(home_s[1:] or home_s)
                                                                          / GOALS["page_first_result"], 3),
                 "target": 1.0, "goal_s": GOALS["page_first_result"], "first_s": round(home_s[0], 3),
                 "runs_s": [round(t, 3) for t in home_s], "driver_runs_s": [round(r.driver, 3) for r in home], **common})
    return rows


# The floor under every page's new tab: Streamlit alone, no model, no sidebar (issue 28: is 2 s reachable?)
FLOOR_APPS = {
    "one metric": "import streamlit as st\nst.metric('Layers', 30)\n",
    "one plotly figure": ("import plotly.graph_objects as go\nimport streamlit as st\n"
                          "st.plotly_chart(go.Figure(go.Scatter(y=[1, 3, 2])), theme=None)\n"),
}


@contextlib.contextmanager
def _bare_app(source: str, start_s: float = 120.0) -> Iterator[str]:
    """`streamlit run` of a one-file app (`source`), served like the workbench (app.cli, pinned front end)."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "floor.py"
        script.write_text(source)

        def command(port: int) -> list[str]:
            cmd = streamlit_command(port, "127.0.0.1")
            cmd[cmd.index(str(Path(__file__).resolve().parent / "main.py"))] = str(script)
            return cmd

        with _streamlit(command, None, start_s) as url:
            yield url


def bench_streamlit_floor(rounds: int = 5) -> list[dict[str, Any]]:
    """A new tab of a bare Streamlit app (one metric; one 3-point plotly figure) to its element painted, by
    the page's clock: what the front end's boot, one script run and (for the figure) plotly.js cost before
    any page of ours draws. Median of `rounds` tabs of one browser profile after a warm-up tab."""
    browser_path = _browser_path()
    if browser_path is None:
        return [{"bench": "page_first_result_s", "ratio": float("nan"), "skipped": "needs Chromium and playwright"}]
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for what, source in FLOOR_APPS.items():
            selector = FIGURE if "figure" in what else METRIC
            load_before = _load()
            with _bare_app(source) as url:
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page_first_result_times(context, url, "home", selector=selector)  # warm-up: the HTTP cache filled
                runs = [page_first_result_times(context, url, "home", selector=selector) for _ in range(rounds)]
                context.close()
            rows.append(floor_row(what, runs, load_before))
        browser.close()
    return rows


def floor_row(what: str, runs: list[TabTimes], load_before: float) -> dict[str, Any]:
    """`bench_streamlit_floor`'s row for one bare app: the median of its tabs' painted times against the goal."""
    page_s = [r.painted for r in runs]
    return {"bench": "page_first_result_s", "page": f"bare Streamlit app: {what} (the floor)",
            "seconds": _median(page_s), "ratio": round(statistics.median(page_s) / GOALS["page_first_result"], 3),
            "target": 1.0, "goal_s": GOALS["page_first_result"], "runs_s": [round(t, 3) for t in page_s],
            "driver_runs_s": [round(r.driver, 3) for r in runs], "load_avg_1m_before": load_before,
            "load_avg_1m": _load(), "clock": "the page's own: navigation start of a new tab -> painted"}


def bench_first_tab_after_restart(model_id: str = "smollm2-135m", restarts: int = 2,
                                  pages: tuple[str, ...] = FIRST_RESULT_PAGES) -> list[dict[str, Any]]:
    """`first_tab_after_restart_s`: the first new tab of each method page in a fresh app process, with no
    figure previews on disk (a new cache folder, the repository's shipped previews switched off: the app has
    never drawn the page) and then after each of `restarts` restarts of the app on the same cache folder, where
    the previews the earlier process made wait on disk (app/figure_preview.py); last, as a fresh clone opens
    it: a new cache folder with the shipped previews (`fresh_clone_s`, app/ship_previews.py). Each process:
    Home in a warm-up tab (the model's load is not a page's), then each page once in a new tab of one browser
    profile; times by the page's own clock."""
    browser_path = _browser_path()
    if browser_path is None:
        return [{"bench": "first_tab_after_restart_s", "ratio": float("nan"), "skipped": "needs Chromium and playwright"}]
    from playwright.sync_api import sync_playwright

    from app import figure_preview
    from probes.paths import user_cache_dir

    load_before = _load()
    runs: list[dict[str, TabTimes]] = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as clone_cache, \
            sync_playwright() as pw:
        own_only = {"THOUGHTSCOPE_CACHE_DIR": cache, figure_preview.SHIPPED_SWITCH: "0"}
        fresh_clone = {"THOUGHTSCOPE_CACHE_DIR": clone_cache, figure_preview.SHIPPED_SWITCH: "1"}
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for env in [own_only] * (restarts + 1) + [fresh_clone]:
            with _app(model_id, env) as url:
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                warm = context.new_page()
                warm.set_default_timeout(900_000)
                warm.goto(url)
                warm.locator(METRIC).first.wait_for()
                warm.close()
                runs.append({name: page_first_result_times(context, url, name) for name in pages})
                # the previews of this process' first figures, made in its background, on disk before it stops
                kept = Path(env["THOUGHTSCOPE_CACHE_DIR"]) / figure_preview.folder().relative_to(user_cache_dir())
                deadline = time.time() + (120 if env is own_only else 0)  # the fresh clone's come from the repository
                while len(list(kept.glob("*.png"))) < len(pages) and time.time() < deadline:
                    time.sleep(1.0)
                context.close()
        browser.close()
    rows = []
    for name in pages:
        cold, *later, clone = (run[name] for run in runs)
        after = statistics.median(r.painted for r in later)
        rows.append({"bench": "first_tab_after_restart_s", "page": name, "model": model_id,
                     "never_drawn_s": round(cold.painted, 3), "never_drawn_interactive_s": round(cold.interactive, 3),
                     "never_drawn_preview": cold.preview, "after_restart_s": round(after, 3),
                     "after_restart_runs_s": [round(r.painted, 3) for r in later],
                     "after_restart_previews": [r.preview for r in later],
                     "after_restart_interactive_s": round(statistics.median(r.interactive for r in later), 3),
                     "fresh_clone_s": round(clone.painted, 3), "fresh_clone_preview": clone.preview,
                     "fresh_clone_interactive_s": round(clone.interactive, 3),
                     "ratio": round(after / GOALS["page_first_result"], 3), "target": 1.0,
                     "goal_s": GOALS["page_first_result"], "load_avg_1m_before": load_before, "load_avg_1m": _load(),
                     "clock": "the page's own: navigation start of the first new tab of a page in an app process "
                              "-> its first figure painted (a chart, or its static preview)"})
    return rows


def run_pages(model_id: str = "smollm2-135m") -> Iterator[dict[str, Any]]:
    """The pages benchmark: every method page's first stored result in a new tab, the first tab of each page
    after a restart of the app (previews on disk), and the bare-Streamlit floor; each part's rows as soon as
    that part is measured (a later part's failure keeps the earlier rows printed)."""
    yield from bench_page_first_result(model_id)
    yield from bench_first_tab_after_restart(model_id)
    yield from bench_streamlit_floor()


BENCHMARKS = {"views": run_views, "jobs": run_jobs, "pages": run_pages}
