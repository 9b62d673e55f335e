"""The validation vocabulary: one spelling for "an integer in a range", "a finite number", "one of these".

A leaf module beside `thoughtscope.errors`: it imports nothing of the project but that module, so
`cache`, `saes`, `probes`, `analyses` and `app` all use it. Each check takes the parameter's name
(as the user knows it) and its value, raises `BadInputError` with a message that names the
parameter, the allowed range and the value given, and returns the checked value. Nothing is
mutated: a check never writes back into the object it was asked about.

    n = checks.integer("n", n, low=1)                    # "n must be an integer >= 1, got 0"
    t = checks.number("temperature", t, low=0, low_open=True)
    rule = checks.choice("rule", rule, ("fixed", "nucleus"))
    layers = checks.int_list("layers", layers, low=0, high=n_layers - 1)
    sink, recent = checks.window(sink, recent, context_length)
    folder = checks.user_path("SAE folder", text)        # before any file-system call on it
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from thoughtscope.errors import BadInputError

T = TypeVar("T")

__all__ = ["integer", "number", "choice", "int_list", "window", "is_integer", "user_path", "writable_folder"]

SEED_MAX = 2**31 - 1  # a seed the user gives (the app's and the command line's range): derived seeds stay in int64
PATH_MAX_BYTES = 4096  # Linux's PATH_MAX
NAME_MAX_BYTES = 255  # the longest file name the common file systems hold


def is_integer(value: Any) -> bool:
    """True for Python and numpy integers; False for bools (True is not the integer 1 to a user)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def _int_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in {low}..{high}"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None,
            none_ok: bool = False, why: str = "") -> Any:
    """`value` as an `int` when it is an integer in [low, high] (bounds inclusive, None: unbounded).

    With `none_ok`, None passes through unchanged. `why` is appended to the message in
    parentheses ("a token must see itself")."""
    if value is None and none_ok:
        return None
    if not is_integer(value) or (low is not None and value < low) or (high is not None and value > high):
        note = f" ({why})" if why else ""
        alt = " or None" if none_ok else ""
        raise BadInputError(f"{name} must be an integer{_int_range(low, high)}{alt}{note}, got {value!r}")
    return int(value)


def _num_range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, none_ok: bool = False, why: str = "") -> Any:
    """`value` when it is a finite real number within the bounds (closed unless `low_open`/`high_open`).

    Python ints and floats come back as given (so provenance records keep `1` as `1`); numpy
    scalars come back as Python floats. Bools, strings, NaN and infinities are refused."""
    if value is None and none_ok:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"
    if ok:
        try:
            ok = math.isfinite(value)
        except OverflowError:  # an int past float's range (a JSON number with 400 digits)
            ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        note = f" ({why})" if why else ""
        alt = " or None" if none_ok else ""
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise BadInputError(f"{name} must be a finite number{_num_range(low, high, low_open, high_open)}{alt}{note}, "
                            f"got {shown}")
    return value if type(value) in (int, float) else float(value)


def choice(name: str, value: T, options: Iterable[T]) -> T:
    """`value` when it is one of `options` (compared with ==), else a message listing them."""
    options = tuple(options)
    try:
        ok = value in options
    except TypeError:  # an unhashable value against a set-like options object
        ok = False
    if not ok:
        raise BadInputError(f"{name} {value!r} is not an option; use one of {', '.join(repr(o) for o in options)}")
    return value


def int_list(name: str, values: Any, *, low: int | None = None, high: int | None = None,
             empty_ok: bool = False) -> list[int]:
    """A new list of ints when `values` is a list or tuple of integers in [low, high] (non-empty
    unless `empty_ok`); the message names the first offending entry."""
    what = f"a {'' if empty_ok else 'non-empty '}list of integers{_int_range(low, high)}"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise BadInputError(f"{name} must be {what}, got {values!r}")
    if not values and not empty_ok:
        raise BadInputError(f"{name} must be {what}, got an empty list")
    for v in values:
        if not is_integer(v) or (low is not None and v < low) or (high is not None and v > high):
            raise BadInputError(f"{name} must be {what}, got {v!r} among them")
    return [int(v) for v in values]


def window(sink: Any, recent: Any, context_length: int, *, owner: str = "",
           hint: str = "choose a smaller window") -> tuple[int, int]:
    """(sink, recent) of a sink-plus-recent attention/KV window, checked against the model's context.

    sink: leading positions always kept (>= 0); recent: trailing positions kept (>= 1, a token
    must see itself); sink + recent must stay below `context_length`, else the window covers
    everything. `owner` prefixes the parameter names ("SinkRecent.sink"); `hint` ends the
    message when the window is too wide."""
    prefix = f"{owner}." if owner else ""
    sink = integer(f"{prefix}sink", sink, low=0)
    recent = integer(f"{prefix}recent", recent, low=1, why="a token must see itself")
    if sink + recent >= context_length:
        raise BadInputError(f"sink + recent = {sink + recent} reaches this model's context ({context_length}): "
                            f"{hint}")
    return sink, recent


def user_path(name: str, value: Any) -> Path:
    """A path the user typed (a text box, a command-line option, a stored preset), checked before any file-system
    call on it, with `~` expanded. The file system's own refusals are tracebacks otherwise: `Path.is_file()` raises
    `OSError` ("File name too long") for a name over 255 bytes, and `open` a `ValueError` for a NUL character.
    The message never repeats an over-long value whole."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise BadInputError(f"the {name} is empty")
    if "\x00" in text:
        raise BadInputError(f"the {name} holds a NUL character, which no path can")
    size = len(text.encode("utf-8", "surrogateescape"))
    if size > PATH_MAX_BYTES:
        raise BadInputError(f"the {name} is {size:,} bytes long ({text[:40]!r}...); a path has at most "
                            f"{PATH_MAX_BYTES:,}")
    try:
        path = Path(text).expanduser()
    except RuntimeError as err:  # "~someone/..." for a user this machine does not know
        raise BadInputError(f"the {name} {text[:80]!r} starts with an unknown user's home (~): {err}") from err
    for part in path.parts:
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
            raise BadInputError(f"the {name} holds a name of {len(part.encode('utf-8', 'surrogateescape')):,} bytes "
                                f"({part[:40]!r}...); a file or folder name has at most {NAME_MAX_BYTES}")
    return path


def writable_folder(name: str, value: Any) -> Path:
    """A folder the user named for writing into (made later if missing), checked before the work that fills it:
    a long run that ends by writing into a file's place, or under a folder it may not write, loses its result.
    The nearest existing folder on the way must be a folder this process may write in."""
    path = user_path(name, value)
    if path.exists() and not path.is_dir():
        raise BadInputError(f"the {name} {path} is a file, not a folder")
    ancestor = path.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BadInputError(f"the {name} {path} cannot be made: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise BadInputError(f"the {name} {path}: this process may not write in {ancestor}")
    return path


def free_port(host: str, port: int, option: str = "--port") -> int:
    """`port` on `host` when a server could listen there now, checked before a model loads: otherwise the
    app printed its address and then Streamlit's "Port N is not available", and `serve` loaded the model
    before uvicorn's bind error. Bound the way uvicorn and Streamlit bind (SO_REUSEADDR), then released."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise BadInputError(f"cannot listen on {host!r}: {err.strerror or err}") from err
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise BadInputError(f"port {port} on {host} is in use (another thoughtscope app or server?); "
                                    f"choose another with {option}") from err
            raise BadInputError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return port


def server_url(url: Any, option: str = "--server") -> str:
    """`url` when it names a model server (http or https, a host, a valid port), without a trailing slash:
    otherwise `--server notaurl` started the workbench, which then failed at the first request."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url.strip():
        raise BadInputError(f"{option} is empty; give the model server's URL, e.g. http://127.0.0.1:8765")
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises on a port out of range or not a number
    except ValueError as err:
        raise BadInputError(f"{option} {url[:80]!r} is not a URL ({err})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInputError(f"{option} {url[:80]!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8765")
    if port == 0:
        raise BadInputError(f"{option} {url[:80]!r} names port 0")
    import httpx  # the client's own parser: it also refuses what urlsplit lets through (an address such as 256.0.0.1)

    try:
        httpx.URL(url.strip())
    except httpx.InvalidURL as err:
        raise BadInputError(f"{option} {url[:80]!r} is not a URL ({err})") from None
    return url.strip().rstrip("/")
