"""A job thread's first import of a heavy package, watched in a fresh interpreter (shared by the tests of
`thoughtscope.imports` and of the SAE loader)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_while_heavy_imports_held(setup: str, work: str, module: str, waits_in: str, then: str) -> list[str]:
    """In a fresh interpreter: run `setup`, then hold `thoughtscope.imports.HEAVY_IMPORTS` while a thread runs
    `work` (an expression; its value lands in `out["value"]`). Returns the words printed: "waiting" (the thread
    was seen inside `thoughtscope.imports.<waits_in>`), "imported" (`module` was in `sys.modules` then), and
    after the release and the thread's end, the words `then` (an expression over `out["value"]`) prints."""
    script = setup + textwrap.dedent(f"""
        import sys, threading, time
        from thoughtscope import imports
        assert {module!r} not in sys.modules
        out = {{}}
        with imports.HEAVY_IMPORTS:
            thread = threading.Thread(target=lambda: out.update(value={work}))
            thread.start()
            waiting, deadline = False, time.monotonic() + 120
            while not waiting and thread.is_alive() and time.monotonic() < deadline:
                frame = sys._current_frames().get(thread.ident)
                while frame is not None and not waiting:
                    waiting = frame.f_code.co_name == {waits_in!r} and frame.f_code.co_filename == imports.__file__
                    frame = frame.f_back
                time.sleep(0.01)
            print("waiting", waiting, "imported", {module!r} in sys.modules)
        thread.join(300)
        print({then})
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()
