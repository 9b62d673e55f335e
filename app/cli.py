"""`thoughtscope app` (launch the Streamlit workbench) and `thoughtscope export` (rebuild a figure from JSON).

    thoughtscope app --model tiny-random:llama --port 8501
    thoughtscope export logit_lens --from logit_lens.json --format svg,pdf --out figures/

`thoughtscope app` runs Streamlit as a child process and owns it: SIGINT, SIGTERM and SIGHUP stop
the child before the command exits, and on Linux the child is also told to stop if its parent
dies without a word (SIGKILL), so no server is left holding the port and the model.
`thoughtscope export` rebuilds exactly the figure a page drew from the JSON it exported (with its
provenance record kept).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import webbrowser
from pathlib import Path
from typing import Any, Optional

import typer

MAIN = Path(__file__).resolve().parent / "main.py"


def streamlit_command(port: int = 8501, address: str = "localhost", model: str | None = None,
                      server: str | None = None) -> list[str]:
    """The `streamlit run` command line (through `python -m app.cli`, see `run_streamlit`); the model
    and server reach the app after `--`."""
    # Always headless towards Streamlit: otherwise its first run asks for an e-mail on stdin, which
    # blocks a newcomer's terminal and kills a run without one. `thoughtscope app` opens the browser.
    cmd = [sys.executable, "-m", "app.cli", "run", str(MAIN), "--server.port", str(port),
           "--server.address", address, "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--client.toolbarMode", "minimal", "--"]
    if model:
        cmd += ["--model", model]
    if server:
        cmd += ["--server", server]
    return cmd


# Streamlit's front end finds its server by trying the page's own path first: opening /trace_explorer
# asks for /trace_explorer/_stcore/health and /trace_explorer/_stcore/host-config (404s) before
# falling back to /. Telling it the server's base URL up front (its `window.__streamlit` settings)
# skips the guess. Only for an app served at the root (no --server.baseUrlPath).
BASE_URL_SCRIPT = ('<script>window.__streamlit=Object.assign({BACKEND_BASE_URL:window.location.origin+"/"},'
                   "window.__streamlit||{})</script>")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # a hard link: no space taken, and the static server sees a file inside its folder
    except OSError:
        shutil.copy2(src, dst)


def pinned_static_dir(root: Path) -> Path | None:
    """A copy (hard links) of Streamlit's static folder whose index.html sets the backend base URL; made
    once per Streamlit version under `root`. None when Streamlit's page does not have the expected shape."""
    import streamlit
    from streamlit import file_util

    src = Path(file_util.get_static_dir())
    html = (src / "index.html").read_text(encoding="utf-8")
    if html.count("<head>") != 1:
        return None
    tag = hashlib.sha256((streamlit.__version__ + BASE_URL_SCRIPT).encode()).hexdigest()[:12]
    dest = root / f"streamlit-static-{tag}"
    if (dest / "index.html").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    (tmp / "index.html").unlink()
    (tmp / "index.html").write_text(html.replace("<head>", "<head>\n    " + BASE_URL_SCRIPT, 1), encoding="utf-8")
    try:
        tmp.rename(dest)
    except OSError:  # another launch made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest if (dest / "index.html").is_file() else None


def run_streamlit(argv: list[str]) -> None:
    """`streamlit <argv>`. The pages are modules in `app/views/` served through `st.navigation`; the folder
    is not called `pages/`, which Streamlit would treat as an old-style multipage app of bare scripts.
    Streamlit serves its front end from `pinned_static_dir` (see BASE_URL_SCRIPT) when it can."""
    from streamlit import file_util
    from streamlit.web import cli as streamlit_cli

    if not any(arg.startswith("--server.baseUrlPath") for arg in argv):
        try:
            from probes.zoo import user_cache_dir

            pinned = pinned_static_dir(user_cache_dir() / "app")
        except OSError:  # a read-only cache: serve Streamlit's own page (and its harmless 404s)
            pinned = None
        if pinned is not None:
            file_util.get_static_dir = lambda: str(pinned)
    sys.argv = ["streamlit", *argv]
    streamlit_cli.main()


def _open_when_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Open the browser once Streamlit answers its health check (in a thread; never blocks)."""
    def wait_then_open() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2):
                    webbrowser.open(url)
                    return
            except OSError:
                time.sleep(0.5)

    threading.Thread(target=wait_then_open, daemon=True).start()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, receive SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:  # another libc: the signal handlers below still stop the child
            pass


def stop_child(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """Terminate the Streamlit child and wait for it (kill after `timeout_s`); returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run_app(cmd: list[str], env: dict[str, str], on_start: Any = None, grace_s: float = 15.0) -> int:
    """Run the Streamlit child until it exits or we are told to stop; the child never outlives us.

    A stop signal only asks the child to terminate (a handler must not wait on it: the main loop
    below is inside `wait` already); the loop kills it if it is still there after `grace_s`."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if os.name == "posix" else None)
    stopping: list[float] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if not stopping:
            stopping.append(time.monotonic())
        if proc.poll() is None:
            proc.terminate()

    signals = [sig for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if sig is not None]
    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    try:
        if on_start is not None:
            on_start(proc)
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > grace_s:
                    proc.kill()
    finally:
        stop_child(proc, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if stopping else code


def register(cli: typer.Typer) -> None:
    from analyses.clikit import path_check  # here: `python -m app.cli` (the Streamlit launch) needs none of it

    @cli.command("app")
    def app_command(
        server: Optional[str] = typer.Option(None, help="URL of a `thoughtscope serve` model server"),
        model: Optional[str] = typer.Option(None, help="model id to load in-process (default smollm2-135m)"),
        port: int = typer.Option(8501, min=1, max=65535, help="port of the web app"),
        address: str = typer.Option("localhost", help="address to listen on"),
        headless: bool = typer.Option(False, help="do not open a browser"),
    ) -> None:
        """Open the Streamlit workbench in the browser."""
        from thoughtscope import checks
        from thoughtscope.errors import BadInputError

        if server is not None and model is not None:
            raise BadInputError("give --server (a model server) or --model (a model in this process), not both")
        if server is not None:
            server = checks.server_url(server)
        elif model not in (None, "smollm2-135m"):  # the default needs no check (and the start no torch import)
            from probes.zoo import check_load_options

            check_load_options(model)
        checks.free_port(address, port)
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        url = f"http://{'localhost' if address in ('0.0.0.0', '::') else address}:{port}"

        def started(proc: subprocess.Popen) -> None:
            print(f"thoughtscope: the workbench is at {url} (Ctrl+C stops it)", flush=True)
            if not headless:
                _open_when_ready(url, proc)

        raise typer.Exit(run_app(streamlit_command(port, address, model, server), env, started))

    @cli.command("export")
    def export_command(
        figure: str = typer.Argument(..., help="figure name: entropy, logit_lens, attention, residual_norms, steering, "
                                              "or any name in an app/figures module's FIGURES"),
        source: Path = typer.Option(..., "--from", help="RESULT.json exported by the app (a result's to_dict())",
                                    callback=path_check("--from")),
        formats: str = typer.Option("svg,pdf", "--format", help="comma-separated: png, svg, pdf, csv, json"),
        out: Path = typer.Option(Path("."), "--out", help="folder to write into", callback=path_check("--out", "folder")),
    ) -> None:
        """Rebuild a figure from a saved result and write it as PNG/SVG/PDF (and its data as CSV/JSON).

        The figure is the one the app drew from the same JSON; the JSON written keeps its provenance."""
        from app.export import ExportError, build_figure, figure_registry, parse_formats, save_figure

        if figure not in figure_registry():
            build_figure(figure, {})  # raises the "unknown figure" error with the list of names
        wanted = parse_formats(formats)
        try:
            data = json.loads(source.read_text())
        except (OSError, ValueError, RecursionError) as err:
            raise ExportError(f"could not read {source}: {err}") from err
        name = figure.replace(".", "-")
        own = [fmt for fmt in wanted if (out / f"{name}.{fmt}").resolve() == source.resolve()]
        if own:
            raise ExportError(f"--format {own[0]} would write {source} over itself; choose another --out folder")
        try:
            fig = build_figure(figure, data)
            written = save_figure(fig, data, name, out, wanted, figure=figure)  # the tables read the data too
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            what = f"missing field {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
            raise ExportError(f"{source} does not hold a result the '{figure}' figure draws ({what})") from err
        for path in written:
            print(path)


if __name__ == "__main__":
    run_streamlit(sys.argv[1:])
