"""The server's benchmark: tokens/s streamed in-process vs through HTTP, side by side in one run.

`bench_server` starts `thoughtscope serve` in a subprocess on a free loopback port, loads the same
model in this process, and alternates the two (in-process, HTTP, in-process, ...) so machine
noise hits both alike. The figure is `ratio = inproc_tps / http_tps` (target <= 1.15): what the
HTTP hop, the JSON/safetensors encoding and the SSE parsing cost per token.

Example:
    >>> from probes.server_bench import bench_server
    >>> bench_server("tiny-random:llama", tokens=16)["bench"]  # doctest: +SKIP
    'server_stream'
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import torch
import uvicorn

from probes.client import RemoteBackend
from probes.engine import Engine
from probes.timing import alternate, sig
from probes.wire import ServerError

BENCH_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TARGET_RATIO = 1.15


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_id: str, port: int, extra: str = "", device: str = "auto",
                 torch_threads: int | None = None) -> subprocess.Popen:
    """`serve(model_id)` in a child process on 127.0.0.1:port (stderr to a temp file, read on failure)."""
    code = (f"from probes.server import serve; serve({model_id!r}, port={port}, device={device!r}, "
            f"log_level='warning'{', ' + extra if extra else ''})")
    if torch_threads:
        code = f"import torch; torch.set_num_threads({int(torch_threads)}); " + code
    log = tempfile.TemporaryFile()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def wait_ready(proc: subprocess.Popen, url: str, token: str | None = None, timeout: float = 300.0) -> None:
    """Poll GET /ready until the model is loaded; a dead child raises with the tail of its log."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"the model server exited with code {proc.returncode}: {server_log(proc)[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", headers=headers, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise ServerError(f"the model server at {url} was not ready after {timeout:.0f} s: {server_log(proc)[-2000:]}")


def server_log(proc: subprocess.Popen) -> str:
    log = getattr(proc, "log", None)
    if log is None:
        return ""
    log.seek(0)
    return log.read().decode(errors="replace")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tokens_per_s(backend: Any, tokens: int, capture: Sequence[str]) -> tuple[int, float]:
    # In a worker thread, as the server runs its model and as Streamlit runs a page: torch's
    # intra-op threads behave differently in the main thread (on a busy 2-core machine the
    # engine ran 10-20x slower there), and the comparison must be like for like.
    def run() -> tuple[int, float]:
        start = time.perf_counter()
        n = sum(1 for _ in backend.generate(BENCH_PROMPT, max_new_tokens=tokens, capture=capture, chat=True))
        return n, n / (time.perf_counter() - start)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def bench_server(model_id: str = "smollm2-135m", tokens: int = 128, rounds: int = 3,
                 capture: Sequence[str] = (), device: str = "auto", torch_threads: int | None = 1) -> dict[str, Any]:
    """Tokens/s of `rounds` greedy generations in-process and through HTTP, alternating, and their ratio.

    `ratio` compares each side's best round: other work on the machine only ever slows a round
    down, so the best is the least disturbed; `ratio_median` is given beside it.
    Both sides run torch with `torch_threads` intra-op threads (None: torch's default): on a
    shared CPU an idle intra-op thread spinning beside the model slowed one side up to 10x,
    which is a fact about the machine, not about HTTP.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_id, port, device=device, torch_threads=torch_threads)
    threads_before = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        engine = Engine.from_id(model_id, device=device)  # loads while the server loads
        wait_ready(proc, url)
        with RemoteBackend(url, timeout=120.0) as remote:
            for backend in (engine, remote):  # warm-up: first-call allocations, connection set-up
                _tokens_per_s(backend, 4, capture)
            inproc, http, counts = [], [], set()
            for _ in range(rounds):
                for backend, into in ((engine, inproc), (remote, http)):
                    n, tps = _tokens_per_s(backend, tokens, capture)
                    counts.add(n)
                    into.append(tps)
            info = remote.info()
    finally:
        stop_server(proc)
        torch.set_num_threads(threads_before)
    return {
        "bench": "server_stream",
        "ratio": round(max(inproc) / max(http), 4),
        "ratio_median": round(statistics.median(inproc) / statistics.median(http), 4),
        "inproc_tps": sig(max(inproc)),
        "http_tps": sig(max(http)),
        "target": TARGET_RATIO,
        "model": model_id,
        "device": info["device"],
        "tokens": sorted(counts),
        "rounds": rounds,
        "capture": list(capture),
        "torch_threads": torch_threads or threads_before,
    }


@contextmanager
def served(model_id: str, device: str = "cpu", torch_threads: int | None = 1) -> Iterator[tuple[Any, Any]]:
    """(engine in this process, RemoteBackend to a server subprocess) over the same model, for side-by-side runs.

    Both sides run torch with `torch_threads` intra-op threads, so neither gets the other's cores.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_id, port, device=device, torch_threads=torch_threads)
    threads_before = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        engine = Engine.from_id(model_id, device=device)  # loads while the server loads
        wait_ready(proc, url)
        with RemoteBackend(url, timeout=600.0) as remote:
            yield engine, remote
    finally:
        stop_server(proc)
        torch.set_num_threads(threads_before)


@contextmanager
def serving_in_thread(app: Any) -> Iterator[str]:
    """An ASGI app (`probes.server.create_app(engine)`) served by uvicorn in a thread of this process on a
    free loopback port; yields its URL. Tests use it to watch the engine the server drives."""
    from probes.server import uvicorn_config

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))  # as `thoughtscope serve` runs it
    thread = threading.Thread(target=server.run, name=f"server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServerError(f"the in-thread server on port {port} did not start")
        time.sleep(0.02)
    loop = server.servers[0].get_loop()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True  # read by uvicorn's main loop every 0.1 s; wake it in case it sleeps in select
        loop.call_soon_threadsafe(lambda: None)
        thread.join(timeout=10)


def bench_server_fork_probe(model_id: str = "smollm2-135m", prefix_tokens: int = 512, probe_tokens: int = 16,
                            rounds: int = 15, device: str = "cpu") -> dict[str, Any]:
    """A `probe_tokens` probe forked from a `prefix_tokens` prefix: through the server / in-process (target <= 1.3)."""
    with served(model_id, device) as (engine, remote):
        base = engine.encode(BENCH_PROMPT)
        prefix = (base * (prefix_tokens // len(base) + 1))[:prefix_tokens]
        probe = (base * 2)[:probe_tokens]
        local_state, remote_state = engine.prefill(prefix), remote.prefill(prefix)
        times = alternate({"inproc": lambda: engine.fork(local_state, probe, max_new_tokens=1),
                           "server": lambda: remote.fork(remote_state, probe, max_new_tokens=1)}, rounds)
    inproc, server = statistics.median(times["inproc"]), statistics.median(times["server"])
    return {"bench": "server_fork_probe", "ratio": round(server / inproc, 3), "target": 1.3, "model": model_id,
            "prefix_tokens": prefix_tokens, "probe_tokens": probe_tokens, "inproc_s": sig(inproc),
            "server_s": sig(server), "rounds": rounds}


if __name__ == "__main__":
    print(json.dumps(bench_server(*sys.argv[1:2])))
