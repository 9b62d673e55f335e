"""Import the libraries the method pages load lazily, in the background, once per app process, after its first
page has been drawn: the first visit to a method page then does not pay for them.

Why (issue 28, a new tab's first figure): the analyses import scikit-learn, SAELens (and with it
TransformerLens) and Streamlit's data frames import pandas and pyarrow only when a page needs them, so that
the app and the model server start fast. The first tab of a page in a fresh app process paid for them before
its first figure. Measured 2026-12-06 on the 2-core AMD EPYC, SmolLM2-135M, each page's first run in one
process after the trace explorer (AppTest): the CoT page 1.29 s (pandas, pyarrow, scikit-learn), then RISE
2.12 s (SAELens and TransformerLens: reading the shipped run took 1.9 s of imports and 1.3 s of analysis,
0.75 s of it importing scikit-learn), every later method page 0.25-0.5 s. In Chromium, the first tab of a page
after an app restart painted its stored preview at 1.2-1.6 s on every page but RISE (2.5 s).

The list is what those first runs imported; a library missing from the environment is skipped (logged). Pandas
is imported in the calling thread first (`FIRST`: plotly reads it half-imported from `sys.modules`), and every
page run waits for an import of it under way (`thoughtscope.imports.settle`, in `app.main`). Started
by `app.main` after a page of a session served by `streamlit run` has drawn (never under AppTest or in the
model server), in a daemon thread, so a page that imports one of these while the thread runs waits for that
module's import lock and then finds it loaded: the thread imports third-party packages only, never a module of
ours, so it never waits on a lock a page's import holds. It imports under `thoughtscope.imports.HEAVY_IMPORTS`,
as the correctness badge's validation thread imports TransformerLens: two threads entering transformer_lens at
once broke one of the imports (thoughtscope/imports.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from thoughtscope.imports import PEEKED

log = logging.getLogger(__name__)

# in the order the pages reach them: CoT's calibration densities and data frames, then RISE's SAE loading and
# quality (sae_lens.evals), the fuzzy and visual-attribution baselines
MODULES = ("pyarrow", "sklearn.neighbors", "sklearn.metrics", "sae_lens", "sae_lens.evals",
           "sklearn.linear_model", "sklearn.cluster", "sklearn.decomposition")
# imported by `start` in the calling script thread, after its page has drawn (about 0.4 s), never in the background:
# the modules plotly reads half-imported (thoughtscope.imports.PEEKED)
FIRST = PEEKED

_lock = threading.Lock()
_thread: threading.Thread | None = None
loaded: dict[str, float] = {}  # module -> seconds its import took in the warm-up (for the log and the tests)


def start(modules: Sequence[str] = MODULES, first: Sequence[str] = FIRST) -> threading.Thread | None:
    """Import `first` here, then start importing `modules` in a daemon thread, once per process: the thread, or
    None when it was started before."""
    global _thread
    with _lock:
        if _thread is not None:
            return None
        _import_all(tuple(first))
        _thread = threading.Thread(target=_import_all, args=(tuple(modules),), name="thoughtscope-warm-imports",
                                   daemon=True)
        _thread.start()
        return _thread


def _import_all(modules: tuple[str, ...]) -> None:
    from thoughtscope.imports import import_module

    for name in modules:
        t = time.perf_counter()
        try:
            import_module(name)  # one at a time with the other background threads' (thoughtscope/imports.py)
        except Exception as err:  # noqa: BLE001 - an optional library that is absent or broken: the page says so itself
            log.info("warm-up: %s not imported (%s)", name, err)
            continue
        loaded[name] = time.perf_counter() - t
    log.debug("warm-up imports: %s", {k: round(v, 2) for k, v in loaded.items()})
