"""One lock for importing the heavy third-party packages from background threads (standard library only).

Two threads that import a package with circular imports at once, each entering it through another module, can
break each other's import. The app's warm-up thread imports sae_lens (and with it transformer_lens) while the
correctness badge's validation thread imports `transformer_lens.model_bridge`. Python's import-deadlock
avoidance then hands one of them a partially initialised module ("cannot import name 'TransformerBridge' from
partially initialized module"), or a failed import removes a module the other is still reading (KeyError:
'transformer_lens'). Each time, the badge said TransformerLens was skipped. Seen in 3 of 7 fresh-cache runs of
a browser test, 2026-12-07.

Each background thread takes `HEAVY_IMPORTS` around such an import (`app.warm` per module, the bridge in
`probes.zoo`, sae_lens in `saes.io`, `saes.train` and `analyses.rise.quality`, umap in `analyses.rise.columns`:
the app's job threads reach them), so those imports run one at a time. The methods' lazy imports of scipy and
scikit-learn (both deep package graphs with imports among their submodules, reached from job threads) run inside
`importing(...)`, which keeps the `from ... import ...` statement and its types. A module already imported costs a
dictionary lookup, and the lock is not taken again for it.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HEAVY_IMPORTS = threading.RLock()


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


@contextmanager
def importing(*names: str) -> Iterator[None]:
    """Hold `HEAVY_IMPORTS` around the import statements in the block unless every module in `names` is already
    loaded whole (then nothing is taken):

        with importing("scipy.stats"):
            from scipy.stats import rankdata
    """
    if all(_loaded(name) for name in names):
        yield
        return
    with HEAVY_IMPORTS:
        yield


def import_module(name: str) -> Any:
    """`importlib.import_module(name)`, under `HEAVY_IMPORTS` unless the module is already loaded."""
    if _loaded(name):
        return sys.modules[name]
    with HEAVY_IMPORTS:
        return importlib.import_module(name)


# Modules plotly reads from `sys.modules` however far their import has got (`get_module(name, should_load=False)`
# whenever it builds a trace): a figure drawn while another thread was half-way through importing one failed
# ("partially initialized module 'pandas' has no attribute 'Series'"). A thread that may import one (the app's
# warm-up, the badge's validation via TransformerLens -> datasets, a job) is started after `before_thread()`.
PEEKED = ("pandas",)


def before_thread() -> None:
    """Import the `PEEKED` modules whole in the calling thread, before it starts a thread that may import them
    (once they are loaded, a dictionary lookup each)."""
    for name in PEEKED:
        import_module(name)


def settle(name: str) -> None:
    """Wait until a module another thread is importing has finished, so that code which only peeks at
    `sys.modules` sees it whole. Plotly builds every trace with `get_module("pandas", should_load=False)` (the
    module if already in `sys.modules`, however far its import has got): a page that drew a figure while the
    app's warm-up thread was importing pandas got "partially initialized module 'pandas' has no attribute
    'Series'" (seen in the browser tier, 2026-12-07). A module not imported at all stays so (nothing is
    imported here); one already complete costs a dictionary lookup."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
        importlib.import_module(name)  # blocks on the module's import lock until the other thread is done


def import_from(module: str, name: str) -> Any:
    """`from module import name`, under `HEAVY_IMPORTS` (see the module docstring)."""
    return getattr(import_module(module), name)
