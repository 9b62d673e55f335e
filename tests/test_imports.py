"""`thoughtscope.imports`: the methods' lazy imports of scipy and scikit-learn take the heavy-imports lock from a job
thread, and take nothing once the module is loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from thoughtscope import imports


def test_a_job_threads_first_scipy_import_waits_for_the_heavy_imports_lock():
    """In a fresh interpreter the main thread holds `HEAVY_IMPORTS`: a thread computing a normal quantile
    (`analyses.evaluation._z`, scipy.stats) must be seen waiting inside `importing`, with scipy.stats not
    imported, until the lock is released; then it gets the quantile."""
    script = textwrap.dedent("""
        import sys, threading, time
        from thoughtscope import imports
        from analyses.evaluation import _z
        assert "scipy.stats" not in sys.modules
        out = {}
        with imports.HEAVY_IMPORTS:
            thread = threading.Thread(target=lambda: out.update(z=_z(0.975)))
            thread.start()
            waiting, deadline = False, time.monotonic() + 120
            while not waiting and thread.is_alive() and time.monotonic() < deadline:
                frame = sys._current_frames().get(thread.ident)
                while frame is not None and not waiting:
                    waiting = frame.f_code.co_name == "importing" and frame.f_code.co_filename == imports.__file__
                    frame = frame.f_back
                time.sleep(0.01)
            print("waiting", waiting, "imported", "scipy.stats" in sys.modules)
        thread.join(300)
        print("z", round(out["z"], 6))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["waiting", "True", "imported", "False", "z", "1.959964"]


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
