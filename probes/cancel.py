"""Stopping long work at its next model call, from outside the analysis that runs it.

A job (app.jobs) runs an analysis in a thread; the analysis reports progress between its items, and
a Stop pressed meanwhile used to wait for the item in progress: a whole generation, a study step. The
job's thread now installs its check with `checking(job.check)`, and the backends call `check()` before
every model forward (the engine: each decoding step, prefill, fork, trace and capture; the remote
client: before each request and each streamed record). Whatever the check raises ends the work there,
through the same paths as any error: a generation's lock is released and its hooks removed, a remote
stream's connection is closed (the server frees the model at its next token).

The check is per thread, so other threads' work (the model server's request threads, the app's page
thread, a badge's validation) never sees it; checks nest, the innermost last.

Example (app.jobs does this for every job):

    with checking(job.check):
        result = analysis(backend)  # a Stop ends it within one forward
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def checking(check: Callable[[], None]) -> Iterator[None]:
    """Run `check()` before each model call this thread makes inside the block."""
    stack = getattr(_local, "checks", None)
    if stack is None:
        stack = _local.checks = []
    stack.append(check)
    try:
        yield
    finally:
        stack.remove(check)


def check() -> None:
    """Call this thread's checks (none outside `checking`); what they raise propagates."""
    for fn in tuple(getattr(_local, "checks", ())):
        fn()
