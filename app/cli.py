"""`thoughtscope app` (launch the Streamlit workbench) and `thoughtscope export` (rebuild a figure from JSON).

    thoughtscope app --model tiny-random:llama --port 8501
    thoughtscope export logit_lens --from logit_lens.json --format svg,pdf --out figures/
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


def run_streamlit(argv: list[str]) -> None:
    """`streamlit <argv>`, with the app's pages served through `st.navigation` from the first request.

    Streamlit treats a `pages/` folder beside the main script as an old-style multipage app until
    the main script has called `st.navigation` once; a first visit straight to /trace_explorer would
    then run app/pages/trace_explorer.py bare. Our pages are modules, not scripts, so we say up front
    that this app navigates itself.
    """
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.web import cli as streamlit_cli

    PagesManager.uses_pages_directory = False
    sys.argv = ["streamlit", *argv]
    streamlit_cli.main()


def _open_when_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Open the browser once Streamlit answers its health check (in a thread; never blocks)."""
    import threading
    import time
    import urllib.request
    import webbrowser

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


def register(cli: typer.Typer) -> None:
    @cli.command("app")
    def app_command(
        server: Optional[str] = typer.Option(None, help="URL of a `thoughtscope serve` model server"),
        model: Optional[str] = typer.Option(None, help="model id to load in-process (default smollm2-135m)"),
        port: int = typer.Option(8501, help="port of the web app"),
        address: str = typer.Option("localhost", help="address to listen on"),
        headless: bool = typer.Option(False, help="do not open a browser"),
    ) -> None:
        """Open the Streamlit workbench in the browser."""
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        url = f"http://{'localhost' if address in ('0.0.0.0', '::') else address}:{port}"
        proc = subprocess.Popen(streamlit_command(port, address, model, server), env=env)
        print(f"thoughtscope: the workbench is at {url} (Ctrl+C stops it)", flush=True)
        if not headless:
            _open_when_ready(url, proc)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            code = 0
        raise typer.Exit(code)

    @cli.command("export")
    def export_command(
        figure: str = typer.Argument(..., help="figure name: entropy, logit_lens, attention, residual_norms, steering, "
                                              "or any name in an app/figures module's FIGURES"),
        source: Path = typer.Option(..., "--from", help="RESULT.json exported by the app (a result's to_dict())"),
        formats: str = typer.Option("svg,pdf", "--format", help="comma-separated: png, svg, pdf, csv, json"),
        out: Path = typer.Option(Path("."), "--out", help="folder to write into"),
    ) -> None:
        """Rebuild a figure from a saved result and write it as PNG/SVG/PDF (and its data as CSV/JSON)."""
        from app.export import ExportError, figure_registry, parse_formats, save_figure

        figures = figure_registry()
        if figure not in figures:
            plain = [name for name in figures if "." not in name]
            raise ExportError(f"unknown figure {figure!r}; choose one of {', '.join(plain)}")
        wanted = parse_formats(formats)
        try:
            data = json.loads(source.read_text())
        except (OSError, ValueError) as err:
            raise ExportError(f"could not read {source}: {err}") from err
        try:
            fig = figures[figure](data)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ExportError(f"{source} does not hold a {figure} result ({type(err).__name__}: {err})") from err
        for path in save_figure(fig, data, figure.replace(".", "-"), out, wanted):
            print(path)


if __name__ == "__main__":
    run_streamlit(sys.argv[1:])
