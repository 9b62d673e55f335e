"""`thoughtscope.imports`: the methods' lazy imports of scipy and scikit-learn take the heavy-imports lock from a job
thread, and take nothing once the module is loaded."""

from __future__ import annotations

import threading

from tests.lock_helpers import run_while_heavy_imports_held
from thoughtscope import imports


def test_a_job_threads_first_scipy_import_waits_for_the_heavy_imports_lock():
    """In a fresh interpreter the main thread holds `HEAVY_IMPORTS`: a thread computing a normal quantile
    (`analyses.evaluation._z`, scipy.stats) must be seen waiting inside `importing`, with scipy.stats not
    imported, until the lock is released; then it gets the quantile."""
    printed = run_while_heavy_imports_held("from analyses.evaluation import _z", "_z(0.975)", "scipy.stats",
                                           "importing", "'z', round(out['value'], 6)")
    assert printed == ["waiting", "True", "imported", "False", "z", "1.959964"]


def test_a_loaded_module_is_imported_without_the_lock():
    """Another thread holding the lock for a long import does not hold up a module already loaded."""
    entered = []
    with imports.HEAVY_IMPORTS:
        def use_json() -> None:
            with imports.importing("json", "numpy"):
                import json  # noqa: F401  (loaded already)
            entered.append(True)

        thread = threading.Thread(target=use_json)
        thread.start()
        thread.join(60)
        assert entered == [True] and not thread.is_alive()  # it ran to the end while the lock was held here
