"""Shared fixtures: models load once per session; nothing is ever downloaded."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread in the tests and in every server/app they start (they inherit the environment): the
# tests' models are tiny, and a second OpenMP thread on a 2-core machine that also runs the server, the app,
# Chromium and a second test worker only spins. Measured on the busy 2-core machine, 3 x 24-token
# generations on tiny-random:llama: 2 threads 6.5 CPU-s / 58 s wall, 1 thread 0.47 CPU-s / 5.3 s wall.
# A test that wants more threads sets them itself; `OMP_NUM_THREADS=2 pytest ...` overrides this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import pytest  # noqa: E402


CACHE_PREFIX = "thoughtscope-tests-cache-"  # then the creating process's id, then mkdtemp's letters


def sweep_stale_caches(folder: str) -> list[str]:
    """Remove the private cache folders (below) of runs whose process is gone: a run killed before its end
    (Ctrl-C twice, a CI timeout) leaves its folder, about 26 MB of the app's static files and what its
    tests wrote. A folder whose process still runs is kept (two runs side by side). Returns the removed."""
    import re
    import shutil

    removed = []
    for entry in os.scandir(folder):
        found = re.fullmatch(re.escape(CACHE_PREFIX) + r"(\d+)-\w+", entry.name)
        if not found or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            os.kill(int(found.group(1)), 0)
            continue  # its run goes on
        except PermissionError:
            continue  # a process of another user holds that id: not ours to judge
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _private_cache() -> None:
    """Tests neither read nor write the user's thoughtscope cache: a RISE run made on the app's page showed its
    SAE in the trace explorer's tests (and failed them), and tests wrote their traces into the user's store. A
    run gets a private cache folder (kept by its subprocesses, xdist's workers, servers and apps, through the
    environment, and removed at the end, or by the next run if this one was killed), except `models`: the user's, so SmolLM2's dequantised weights and
    the toy models (content-addressed, minutes to build) are built once. A cache folder the caller names
    (`THOUGHTSCOPE_CACHE_DIR=...`) is used as it is."""
    import atexit
    import shutil
    import tempfile

    from probes.paths import user_cache_dir

    if os.environ.get("THOUGHTSCOPE_CACHE_DIR"):
        return
    models = user_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    sweep_stale_caches(tempfile.gettempdir())
    private = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-")
    os.symlink(models, os.path.join(private, "models"), target_is_directory=True)
    os.environ["THOUGHTSCOPE_CACHE_DIR"] = private
    creator = os.getpid()
    atexit.register(lambda: os.getpid() == creator and shutil.rmtree(private, ignore_errors=True))


_private_cache()


def _installed_packages(paths: list[str]) -> dict[str, str]:
    from importlib import metadata

    return {(d.metadata["Name"] or "").lower(): d.version for d in metadata.distributions(path=paths)}


# the folders read are those on sys.path now: a test that later puts another environment's site-packages
# on sys.path (one does) adds no install
_SEARCHED = list(sys.path)
_PACKAGES_AT_START = _installed_packages(_SEARCHED)


def pytest_sessionfinish(session, exitstatus):
    """Nothing installs a package at run time: a run that changed this environment fails, naming what.
    (TransformerLens once ran `pip install torchvision` from a test, swapping torch mid-run: probes.zoo.)"""
    now = _installed_packages(_SEARCHED)
    changed = sorted(f"{name} {_PACKAGES_AT_START.get(name, '(absent)')} -> {now.get(name, '(removed)')}"
                     for name in set(now) | set(_PACKAGES_AT_START) if now.get(name) != _PACKAGES_AT_START.get(name))
    if changed:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(
            "FAILED: this test run changed the installed packages: " + "; ".join(changed), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def llama():
    from probes import Engine

    return Engine.from_id("tiny-random:llama")


@pytest.fixture(scope="session")
def moe():
    from probes import Engine

    return Engine.from_id("tiny-random:qwen3_moe")


@pytest.fixture(scope="session")
def smollm2():
    from probes import Engine

    return Engine.from_id("smollm2-135m")


# ----- browser tier: one Chromium and one app on the tiny model for every browser test that needs no other


@pytest.fixture(scope="session")
def browser():
    """The system Chromium (never a downloaded one), driven by Playwright; launched once per session."""
    from tests.test_browser import CHROMIUM, CHROMIUM_ARGS

    if not os.path.isfile(CHROMIUM):
        pytest.fail("Debian chromium is not installed: run `make chromium` (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="session")
def tiny_app_url():
    """`thoughtscope app --model tiny-random:llama --headless` on a loopback port, started once per session
    (each start is a Streamlit boot plus a model load in it); a test that needs a fresh app starts its own."""
    from tests.test_browser import serve

    with serve("tiny-random:llama") as url:
        yield url


# ----- unit tier: one `thoughtscope serve` on the tiny model for the tests that need no special settings


@pytest.fixture(scope="session")
def tiny_server_url():
    """`thoughtscope serve --model tiny-random:llama` (the CLI, default settings) on a free loopback port,
    started once per session; tests that need a token, small queues or state budgets start their own."""
    import socket
    import subprocess
    import sys
    import time

    from probes.client import RemoteBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "thoughtscope", "serve", "--model", "tiny-random:llama",
                             "--port", str(port), "--log-level", "warning"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                RemoteBackend(url, timeout=2).ready()
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the model server did not start")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
