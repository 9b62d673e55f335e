"""The `thoughtscope` command: the entry point above every package.

It discovers what the packages offer, the way `app/registry.py` discovers pages:
- sub-commands: `probes.cli` (models, sites, generate), `probes.validate_cli` (validate),
  `probes.server_cli` (serve), `app.cli`
  (app, export), and every method package `analyses/<method>/cli.py` that defines `register(cli)`;
- benchmarks: `BENCHMARKS = {group: run(model) -> [rows]}` in `probes.bench`, `app.bench` and in every
  `analyses/<method>/bench.py`, run as `thoughtscope bench GROUP` (one JSON object per line);
- shipped results (`thoughtscope.shipped`, the files pages open on): `SHIPPED = {name: (default model,
  build(model_id, command) -> folder)}` in every `analyses/<method>/ship.py`, rebuilt with
  `thoughtscope ship NAME [--model ID]` (`thoughtscope ship list`).

Adding a method is one package with a `cli.py` and a `bench.py`; nothing here changes.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

import analyses
from thoughtscope.errors import BadInputError, ThoughtscopeError
from thoughtscope.omp import spin_between_regions

CORE_COMMANDS = ("probes.cli", "probes.validate_cli", "probes.server_cli", "app.cli")
CORE_BENCHMARKS = ("probes.bench", "probes.steer_bench", "probes.omp_bench", "app.bench", "benchmarks.curves")

console = Console(stderr=True)


def method_packages() -> list[str]:
    """Every method package: a sub-package of `analyses` (e.g. `analyses.rise`)."""
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


def benchmark_groups() -> dict[str, Callable[[str], Iterable[dict[str, Any]]]]:
    """{group: run(model_id) -> rows} from the probes and every method package."""
    return _merged([*CORE_BENCHMARKS, *(f"{pkg}.bench" for pkg in method_packages())], "BENCHMARKS")


def _merged(module_names: list[str], attribute: str) -> dict[str, Any]:
    """The union of the `attribute` dicts of those modules that exist; a name defined twice is an error."""
    found: dict[str, Any] = {}
    for module_name in module_names:
        for key, value in getattr(_optional(module_name), attribute, {}).items():
            if key in found:
                raise RuntimeError(f"two packages define {attribute}[{key!r}]")
            found[key] = value
    return found


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


def shipped_results() -> dict[str, tuple[str, Callable[[str, str], Any]]]:
    """{name: (default model, build(model_id, command))} from every method package's `ship.py`."""
    return _merged([f"{pkg}.ship" for pkg in method_packages()], "SHIPPED")


def ship(
    name: str = typer.Argument(..., help="a shipped result (`thoughtscope ship list` lists them), or `all`"),
    model: str = typer.Option("", help="model id (default: the one the result is shipped for)"),
) -> None:
    """Rebuild a shipped result (docs/shipped/): the stored file a page opens on, made by this command."""
    results = shipped_results()
    if name == "list":
        for key, (default_model, _) in sorted(results.items()):
            print(f"{key}\t{default_model}")
        return
    names = sorted(results) if name == "all" else [name]
    for key in names:
        if key not in results:
            raise BadInputError(f"unknown shipped result {key!r}; known: {', '.join(sorted(results))}")
        default_model, build_result = results[key]
        model_id = model or default_model
        command = f"thoughtscope ship {key}" + (f" --model {model_id}" if model_id != default_model else "")
        folder = build_result(model_id, command)
        console.print(f"{key}: wrote {folder}", markup=False)


def build() -> typer.Typer:
    """The whole command: `bench` here, every other sub-command from the package that offers it."""
    cli = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="thoughtscope: look inside models while they reason.")
    cli.command("bench")(bench)
    cli.command("ship")(ship)
    for module in command_modules():
        module.register(cli)
    return cli


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spin_between_regions()  # before `build()` imports the packages, and torch with them: see thoughtscope/omp.py
    app = build()
    try:
        app()
    except ThoughtscopeError as err:
        # the message verbatim: it may hold brackets rich would read as markup (the rule `kind:<A>[/<B>]` crashed it)
        console.print("[red]error:[/red]", escape(str(err)), soft_wrap=True)  # a path in it stays whole
        sys.exit(2)
    except OSError as err:
        if err.filename is None:  # not the file system's refusal of a path: a bug's traceback
            raise
        # what the checks before the work cannot foresee (a full disk, a folder made read-only meanwhile)
        console.print("[red]error:[/red]", escape(f"{err.strerror or err}: {err.filename}"), soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
