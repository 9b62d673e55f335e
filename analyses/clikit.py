"""What every method's `cli.py` shares: the `eval` group, the backend options, progress bars, JSON output.

A method package registers its commands with `register(cli)`; the `thoughtscope` entry point
finds it (see thoughtscope.cli). Progress reaches the terminal through `TerminalProgress`, a
callback the method code calls — the method code itself never prints or imports tqdm.

Example:
    >>> with TerminalProgress(enabled=False) as progress:
    ...     progress("calibration", 1, 4)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from tqdm.auto import tqdm

MODEL_OPTION = typer.Option("smollm2-135m", "--model", help="model id (see `thoughtscope models`)")
SERVER_OPTION = typer.Option(None, "--server", help="URL of a `thoughtscope serve` model server (instead of --model)")
TOKEN_OPTION = typer.Option(None, "--token", envvar="THOUGHTSCOPE_TOKEN", help="the server's bearer token")
JSON_OPTION = typer.Option(False, "--json", help="print one JSON object")


def numbers(values: str | list[str] | None, flag: str, *, integer: bool = False, low: float | None = None) -> list[Any]:
    """An option's numbers, given as `--flag 1,2,4`, `--flag "1 2 4"` or the flag repeated: floats, or ints with
    `integer` (a fraction such as 2.5 is refused, not cut to 2), each at least `low`; a word that is not one is
    a clear error naming the flag (an option not given, None, or empty gives [])."""
    from thoughtscope.errors import BadInputError

    kind = "integers" if integer else "numbers"
    out: list[Any] = []
    for value in [values] if isinstance(values, str) else values or []:
        for part in str(value).replace(",", " ").split():
            try:
                number = float(part)
            except ValueError as err:
                raise BadInputError(f"{flag} takes {kind} such as 1,2,4; got {part!r}") from err
            if not math.isfinite(number) or (integer and not number.is_integer()):
                raise BadInputError(f"{flag} takes {'finite ' if not integer else ''}{kind} such as 1,2,4; "
                                    f"got {part!r}")
            if low is not None and number < low:
                raise BadInputError(f"{flag} takes {kind} of at least {low:g}; got {part!r}")
            out.append(int(number) if integer else number)
    return out


def number_check(option: str, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                 why: str = "") -> Callable[[Any], Any]:
    """A typer callback that checks a float option when the command line is parsed (`checks.number`: finite,
    within the bounds): click's FloatRange lets NaN through, and the work before the value is used can be
    minutes of generation."""
    from thoughtscope import checks

    def check(value: Any) -> Any:
        return None if value is None else checks.number(option, value, low=low, high=high, low_open=low_open,
                                                        why=why)

    return check


def path_check(option: str, use: str = "read") -> Callable[[Any], Any]:
    """A typer callback that checks a path option as typed, when the command line is parsed (before any model
    loads): `read` a path to read (`checks.user_path`), `folder` a folder to write into, `file` a file (or a
    file stem) to write, whose folder must be writable (`checks.writable_folder`). None stays None; the value
    keeps its type (str or Path)."""
    from thoughtscope import checks
    from thoughtscope.errors import BadInputError

    def check(value: Any) -> Any:
        if value is None:
            return None
        if use == "folder":
            checks.writable_folder(option, value)
        elif use == "file":
            path = checks.user_path(option, value)
            if path.is_dir():
                raise BadInputError(f"the {option} {path} is a folder; give a file name")
            checks.writable_folder(f"folder of the {option}", path.parent if str(path.parent) else Path("."))
        else:
            checks.user_path(option, value)
        return value

    return check


def group(cli: typer.Typer, name: str, help_text: str) -> typer.Typer:
    """The sub-command group `name` of `cli`, created on first use so several packages can add to it."""
    for registered in cli.registered_groups:
        if registered.name == name:
            return registered.typer_instance
    app = typer.Typer(no_args_is_help=True, help=help_text)
    cli.add_typer(app, name=name)
    return app


def eval_group(cli: typer.Typer) -> typer.Typer:
    return group(cli, "eval", "Evaluate methods on held-out problems against their baselines.")


def backend(model: str, server: str | None, token: str | None = None) -> Any:
    """The model in this process, or the model server at `server`."""
    from probes.backend import open_backend  # lazy, torch: opened when a command runs, not for `thoughtscope --help`

    return open_backend(model, server, token or os.environ.get("THOUGHTSCOPE_TOKEN"))


class TerminalProgress:
    """A `progress(stage, done, total)` callback drawing one tqdm bar per stage on stderr."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit="item")
        bar.total = total
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    def __enter__(self) -> "TerminalProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        for bar in self._bars.values():
            bar.close()


def emit(payload: dict[str, Any], as_json: bool) -> None:
    """One JSON object on stdout (--json), or the same pretty-printed."""
    text = json.dumps(payload, default=jsonable)
    if as_json:
        print(text)
    else:
        Console().print_json(text)


def jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "to_dict"):
        return x.to_dict()
    return str(x)
