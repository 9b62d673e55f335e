"""The `thoughtscope` command: the entry point above every package.

It discovers what the packages offer, the way `app/registry.py` discovers pages:
- sub-commands: `probes.cli` (models, sites, generate), `probes.server_cli` (serve), `app.cli`
  (app, export), and every method package `analyses/<method>/cli.py` that defines `register(cli)`;
- benchmarks: `BENCHMARKS = {group: run(model) -> [rows]}` in `probes.bench`, `app.bench` and in every
  `analyses/<method>/bench.py`, run as `thoughtscope bench GROUP` (one JSON object per line).

Adding a method is one package with a `cli.py` and a `bench.py`; nothing here changes.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich.console import Console

from thoughtscope.errors import BadInputError, ThoughtscopeError

CORE_COMMANDS = ("probes.cli", "probes.server_cli", "app.cli")
CORE_BENCHMARKS = ("probes.bench", "app.bench")

console = Console(stderr=True)


def method_packages() -> list[str]:
    """Every method package: a sub-package of `analyses` (e.g. `analyses.rise`)."""
    import analyses

    return sorted(f"analyses.{info.name}" for info in pkgutil.iter_modules(analyses.__path__) if info.ispkg)


def _optional(name: str) -> Any | None:
    """Import `name`, or None when that module does not exist (a package without a CLI or a bench)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name:
            return None
        raise


def command_modules() -> Iterator[Any]:
    for name in [*CORE_COMMANDS, *(f"{pkg}.cli" for pkg in method_packages())]:
        module = _optional(name)
        if module is not None and hasattr(module, "register"):
            yield module


def benchmark_groups() -> dict[str, Callable[[str], list[dict[str, Any]]]]:
    """{group: run(model_id) -> rows} from the probes and every method package."""
    groups: dict[str, Callable[[str], list[dict[str, Any]]]] = {}
    for name in [*CORE_BENCHMARKS, *(f"{pkg}.bench" for pkg in method_packages())]:
        module = _optional(name)
        for group, run in getattr(module, "BENCHMARKS", {}).items():
            if group in groups:
                raise RuntimeError(f"two packages define the benchmark group {group!r}")
            groups[group] = run
    return groups


def bench(
    group: str = typer.Argument(..., help="a benchmark group (`thoughtscope bench list` lists them)"),
    model: str = typer.Option("smollm2-135m", help="model id"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """Performance ratios measured side by side in one run (these machines are noisy: ratios, not times)."""
    groups = benchmark_groups()
    if group == "list":
        for name in sorted(groups):
            print(name)
        return
    if group not in groups:
        raise BadInputError(f"unknown benchmark group {group!r}; groups: {', '.join(sorted(groups))}")
    import torch

    device = "cuda" if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads"
    for row in groups[group](model):
        row.setdefault("device", device)
        if as_json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{row['bench']:>24}: ratio {row['ratio']:.3f} (target {row.get('target', '-')})  {row}")


def build() -> typer.Typer:
    """The whole command: `bench` here, every other sub-command from the package that offers it."""
    cli = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="thoughtscope: look inside models while they reason.")
    cli.command("bench")(bench)
    for module in command_modules():
        module.register(cli)
    return cli


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app = build()
    try:
        app()
    except ThoughtscopeError as err:
        console.print(f"[red]error:[/red] {err}")
        sys.exit(2)


if __name__ == "__main__":
    main()
