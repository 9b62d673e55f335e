"""Static previews: a new tab paints its first figure as an image before plotly.js has loaded.

Why (issue 28, a new tab to its first figure <= 2 s; measured in Chromium on the 2-core development CPU):
a new tab cannot draw any plotly figure before it has evaluated Streamlit's lazily loaded plotly.js chunk
(4.7 MB), one task of 0.7-0.75 s on the main thread that starts only once the first figure's element
arrives; a bare Streamlit app with one 3-point figure paints it at 1.6-1.7 s, the trace explorer at
2.0-2.7 s. The same figure as an image needs no plotly.js: it is painted with the page's text.

So each page's first figure gets a preview: the PNG that plotly.js itself draws for that figure in the
export Chromium (`app.export.figure_bytes`, kaleido; at twice the CSS size, sharp on a high-density
screen: 60-70 kB for a heat map or a line chart), made in the background a few seconds after a
run drew the figure (by then the page that drew it has painted), and kept in this app process, keyed
by the figure's JSON, so a preview is always of exactly the figure that would be drawn. In the first run
of a visit in a tab that has not loaded plotly.js yet (the session's first report of a painted figure
has not come: a new tab, a reload), `show_figure` draws the preview just above the chart when one exists:
the preview is painted with the page's text while the tab loads plotly.js for the chart, and CSS hides
the preview once the chart is drawn; the first-paint gate (app/first_paint.py) then draws the rest of the
page. Without a preview (the figure not seen before, no Chromium) the chart is drawn as before.

A PNG, not the SVG plotly.js draws (2026-12-05): Chromium lays out and draws an SVG image on the page's main
thread, and a tab's main thread is what plotly.js' evaluation holds; of 8 new tabs of the visual attribution
and RLKV pages, 2 painted their SVG preview 0.8 and 1.06 s after it had arrived, while a PNG preview was
complete when it arrived in 12 of 12. The tab also loads the code of the preview's element (`st.html`) before
the preview arrives (`app.first_paint.load_preview_renderer` says why).

Previews are also kept on disk (`folder()`: the cache folder's `figure-previews`, by plotly version and
drawing size; at most `MAX_PREVIEWS` files, the oldest dropped first), so the first new tab after the app
restarts paints the preview of a figure an earlier run of the app drew: the method pages open on stored
results, whose figures are the same from one run to the next (a figure drawn in this process goes first,
then one on disk; a file that is not a PNG is ignored and made again). Measured 2026-12-06
(`app.bench.bench_first_tab_after_restart`, SmolLM2, 2-core machine, load 0.5 before): the first tab of each
method page in a restarted app painted its preview from disk at 1.16-2.50 s (RISE the slowest: its first visit
imported SAELens, now done in the background by app/warm.py: 1.11-1.83 s), against 2.55-4.10 s for a page the
app had never drawn. The previews of the method pages' first figures on the embedded model also ship in the
repository (`shipped_folder()`, read after the user's folder, never written; app/ship_previews.py rebuilds
them), so a fresh clone's first tab paints one too: 1.02-1.83 s on the seven method pages (2026-12-06).

On by default; `THOUGHTSCOPE_FIGURE_PREVIEWS=0` in the app's environment turns them off. Measured on the
2-core machine (2026-12-04, SmolLM2, `app.bench.bench_page_first_figure`, on and off in one process, 5 new
tabs each, load 2.8-3.6): a new tab paints the trace explorer's first figure at 1.35 s with previews against
2.52 s without, and its interactive chart comes at 2.59 s against 2.52 s. Two earlier designs cost more:
the preview drawn alone, its report then starting the run that drew the chart (interactive at 5.39 s
against 3.45 s at load 3.5, as that run drew every figure of the page together), and the export Chromium at
idle priority (SCHED_IDLE; the browser test tier took 11:09 against 8:26-9:05, a test timing out). The cost
that remains: the export Chromium runs in the app process from the first page view (about 200 MB), and a
page's first figure, each time it is new, is rendered once in it in the background (a slider moved ten
times renders the last figure only).

A page-link click right after a new tab had opened was sometimes lost with previews on (5 of 23 runs of
tests/test_browser.py's new-tab test); the cause was the first-paint reporter, previews or not (a report sent
after the click reran the page being left; app/first_paint.py says how it is kept from it now), reproduced in
3 of 6 loaded runs without previews and gone after the fix.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SWITCH = "THOUGHTSCOPE_FIGURE_PREVIEWS"
CLASS = "ts-figure-preview"  # the element a preview is drawn in (the reporter and the benchmarks look for it)
WIDTH = 1000  # px: about the main column of the wide layout; narrower columns scale the drawing down
SCALE = 2  # device pixels per CSS pixel: sharp on a high-density screen, scaled down on others
DEFAULT_HEIGHT = 450  # plotly.js' height for a figure without one
DELAY_S = 2.5  # after the run that drew a figure: that page's own drawing goes first on a small machine
MAX_PREVIEWS = 64
MAX_BYTES = 48 * 2**20


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


SHIPPED_SWITCH = "THOUGHTSCOPE_SHIPPED_PREVIEWS"  # "0": ignore the previews the repository ships (their rebuild)
SHIPPED_ROOT = Path(__file__).resolve().parents[1] / "docs" / "shipped" / "figure-previews"


def folder() -> Path:
    """Where previews outlive the app process: one folder per plotly version and drawing size (a preview is
    of exactly the figure its JSON names, drawn by that plotly.js at that size)."""
    from probes.paths import user_cache_dir

    return user_cache_dir() / "figure-previews" / subfolder()


def shipped_folder() -> Path | None:
    """The previews the repository ships for the pages' first figures on the embedded model (made by
    `python -m app.ship_previews`, read only), for this plotly version and drawing size; None when switched off.
    A preview is found by its figure's JSON, so one whose figure differs here (another plotly, another result)
    is simply never used."""
    return None if os.environ.get(SHIPPED_SWITCH, "1") == "0" else SHIPPED_ROOT / subfolder()


def subfolder() -> str:
    import plotly

    return f"plotly-{plotly.__version__}-{WIDTH}px-x{SCALE}"


def figure_key(spec: str) -> str:
    return hashlib.sha256(spec.encode()).hexdigest()


def figure_height(fig: Any) -> int:
    return int(fig.layout.height or DEFAULT_HEIGHT)


def preview_html(png: bytes, height: int) -> str:
    """The preview element: the PNG as an image filling a box of the figure's height (no jump when the chart
    takes its place), scaled down in a narrower column, never stretched."""
    data = base64.b64encode(png).decode()
    return (f'<style>{HIDE_WHEN_DRAWN}</style><div class="{CLASS}" style="height:{height}px;max-width:{WIDTH}px">'
            f'<img src="data:image/png;base64,{data}" alt="the figure (a static preview: the interactive '
            f'figure takes its place in a moment)" style="width:100%;height:100%;object-fit:contain;'
            f'object-position:left top"></div>')


# The preview's element disappears once the chart drawn right after it (the report's rerun) has its SVG: the
# preview stays on screen while the tab loads plotly.js, and the chart takes its place without a blank.
HIDE_WHEN_DRAWN = (f'[data-testid="stElementContainer"]:has(.{CLASS}):has(+ [data-testid="stElementContainer"] '
                   '[data-testid="stPlotlyChart"] .main-svg){display:none}')


class PreviewStore:
    """PNG previews of figures by key, made in one background thread, least recently used dropped first
    (at most `MAX_PREVIEWS` and `MAX_BYTES`). A request replaces the one still waiting in its slot (a page):
    a slider moved ten times in a row renders the last figure only."""

    def __init__(self, render: Any, delay_s: float = DELAY_S, idle_s: float = 30.0, disk: Path | None = None,
                 warm_up: Any = None, shipped: Path | None = None):
        self._render = render  # (figure JSON, height) -> PNG bytes: app.export.preview_png
        self._warm_up = warm_up  # starts what `render` uses (app.export's Chromium), with the first preview to make
        self.delay_s, self.idle_s = delay_s, idle_s
        self.disk = disk  # previews kept across app processes (`folder()`), or None: this process only
        self.shipped = shipped  # previews the repository ships (`shipped_folder()`), read after `disk`, never written
        self._images: OrderedDict[str, bytes] = OrderedDict()
        self._waiting: dict[str, tuple[str, str, int]] = {}  # slot -> (key, figure JSON, height)
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.rendered = 0  # previews made (tests count the work)

    def get(self, key: str) -> bytes | None:
        with self._cond:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
                return image
        image = self._read(key)
        if image is not None:
            with self._cond:
                self._keep(key, image)
        return image

    def request(self, slot: str, key: str, spec: str, height: int) -> None:
        """Make the preview of the figure `spec` (its JSON) in the background, unless it exists."""
        if self.get(key) is not None:
            return
        with self._cond:
            if key in self._images:
                return
            self._waiting[slot] = (key, spec, height)
            if self._warm_up is not None:
                threading.Thread(target=self._warm_up, name="figure-previews-warm-up", daemon=True).start()
                self._warm_up = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="figure-previews", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing waits to be rendered or is being rendered (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and not self._busy, timeout_s)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._waiting), self.idle_s):
                    self._thread = None  # nothing asked for a while: the thread ends, a request starts another
                    return
            time.sleep(self.delay_s)  # the page that asked draws first; a newer request may replace this one
            with self._cond:
                slot = next(iter(self._waiting))
                key, spec, height = self._waiting.pop(slot)
                self._busy = True
            try:
                image: bytes | None = self._render(spec, height)
            except Exception as err:  # no Chromium, a figure kaleido cannot draw: the chart as before
                log.info("no preview for a figure: %s", err)
                image = None
            if image is not None:
                self._write(key, image)
            with self._cond:
                self._busy = False
                if image is not None:
                    self._keep(key, image)
                    self.rendered += 1
                self._cond.notify_all()

    def _keep(self, key: str, image: bytes) -> None:
        self._images[key] = image
        self._images.move_to_end(key)
        while len(self._images) > MAX_PREVIEWS or sum(map(len, self._images.values())) > MAX_BYTES:
            self._images.popitem(last=False)

    def _read(self, key: str) -> bytes | None:
        for folder in (self.disk, self.shipped):
            if folder is None:
                continue
            path = folder / f"{key}.png"
            try:
                image = path.read_bytes()
            except OSError:
                continue
            if not image.startswith(PNG_SIGNATURE) or len(image) > MAX_BYTES:
                continue
            if folder == self.disk:
                try:
                    os.utime(path)  # used now: the files dropped first are the ones no tab has asked for longest
                except OSError:
                    pass
            return image
        return None

    def _write(self, key: str, image: bytes) -> None:
        """The preview to disk (whole or not at all: written aside, then renamed), the oldest files beyond
        `MAX_PREVIEWS` removed; a disk that refuses is logged and the preview kept in memory only."""
        if self.disk is None or not image.startswith(PNG_SIGNATURE):
            return
        tmp = None
        try:
            self.disk.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.disk, suffix=".part")
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, self.disk / f"{key}.png")
            tmp = None
            files = sorted(self.disk.glob("*.png"), key=lambda f: f.stat().st_mtime)
            for old in files[:-MAX_PREVIEWS]:
                old.unlink(missing_ok=True)
        except OSError as err:
            log.info("a figure preview was not kept on disk: %s", err)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
