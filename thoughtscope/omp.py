"""How OpenMP's helper threads wait, set before torch loads: model work off the main thread must not pay
for a thread wake-up at every parallel region.

Every thread that runs a parallel torch op leads its own OpenMP team, and the server (a thread per
request), the app's jobs and Streamlit's script threads all run model work outside the main thread.
libgomp counts the helper threads of every team it keeps; once they outnumber the cores (on a 2-core
machine: the main thread's team, which loaded the model, plus any one more) it cuts each helper's spin
before sleeping from about 3 ms to 100 spins (GCC's libgomp/env.c, `gomp_throttled_spin_count_var`), so
each of the thousands of small parallel regions of a generation wakes a sleeping helper through the
kernel. Measured here (2-core AMD EPYC, torch 2.13.0+cpu, 2 threads, toy-moe, 16 rows x 32 tokens):
150 ms a generation on the main thread, 330-360 ms on a worker thread; with this module's setting
110 ms and 150-180 ms. `thoughtscope bench omp` measures it side by side for any model.

OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=300000 (libgomp's own default spin) keeps the unthrottled
~3 ms spin for every team; it is not the policy's unbounded spin. The server runs one model call at a
time, so no two teams compete for the cores. A user who sets either variable keeps their choice.

A leaf: standard library only, called by `thoughtscope.cli` before anything imports torch (libgomp
reads the variables once, when torch loads it); child processes (the Streamlit app, a server started
by a benchmark) inherit them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def spin_between_regions(environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> bool:
    """Set `SPIN` in `environ` (default: this process's) unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT; True when set before torch loaded, so that this process's libgomp reads it."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in SPIN):
        return False
    environ.update(SPIN)
    return not ("torch" in sys.modules if torch_loaded is None else torch_loaded)
