"""A model server in this process (uvicorn in a thread) over an engine the tests already hold."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def in_process_server(engine: Any, start_s: float = 30.0) -> Iterator[str]:
    """`probes.server.create_app(engine)` served on a free loopback port; yields its URL. In this process, so a
    test shares the engine's state (budgets, counters) with the server."""
    import uvicorn

    from probes.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_s
    while not server.started:
        assert time.monotonic() < deadline, "the in-process model server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
