"""Figure export: PNG, SVG and PDF through plotly's kaleido and the system Chromium, data as CSV and JSON.

kaleido 1.x renders in a headless Chrome that it finds through `BROWSER_PATH` or the `PATH`
(choreographer's lookup); we point it at the system Chromium (`/usr/bin/chromium` on Debian) and
never let it download one. One kaleido browser is started on the first export and reused for the
rest of the process (a cold start costs seconds, a warm render a fraction of one). MathJax is
switched off: it would be fetched from a CDN, and no figure here uses LaTeX.

`export_buttons(fig, data, name)` is the row of download buttons under every figure in the app;
`save_figure` is what `thoughtscope export` calls.

Every JSON export carries the one provenance record (`thoughtscope.provenance`) under a top-level
`provenance` key: a page passes its own (`ctx.provenance(...)`), or the frame's record for the page
being drawn applies (`page_provenance`). Every CSV is a tidy table: the figure module's `TABLES`
entry for that figure when it has one, else `data_rows`' generic layout. A figure drawn from
`plain(result)` (what the JSON holds) is rebuilt byte for byte by `thoughtscope export`.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import csv
import hashlib
import importlib
import io
import json
import math
import os
import pkgutil
import re
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import app.figures as figures
from app.figures.template import EXPORT_SIZE
from thoughtscope.errors import ThoughtscopeError
from thoughtscope.provenance import KEY as PROVENANCE_KEY
from thoughtscope.provenance import with_provenance

IMAGE_FORMATS = ("png", "svg", "pdf")
DATA_FORMATS = ("csv", "json")
FORMATS = IMAGE_FORMATS + DATA_FORMATS
MIME = {"png": "image/png", "svg": "image/svg+xml", "pdf": "application/pdf", "csv": "text/csv",
        "json": "application/json"}
SYSTEM_CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")

_lock = threading.Lock()
_server_started = False


class ExportError(ThoughtscopeError):
    """A figure could not be exported (no Chromium, unknown format, unreadable result file)."""


def chromium_path() -> str | None:
    """The browser kaleido will use: `BROWSER_PATH` if set, else the system Chromium or Chrome."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env if Path(env).is_file() else None
    for path in SYSTEM_CHROMIUM:
        if Path(path).is_file():
            return path
    return shutil.which("chromium") or shutil.which("google-chrome")


def static_export_available() -> bool:
    return chromium_path() is not None


def parse_formats(formats: str | Iterable[str]) -> list[str]:
    """`"svg,pdf"` or `["svg", "pdf"]` -> checked, lower-case, in the order given."""
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    wanted = [f.strip().lower().lstrip(".") for f in items if f and f.strip()]
    bad = [f for f in wanted if f not in FORMATS]
    if bad or not wanted:
        raise ExportError(f"unknown export format(s) {bad or formats!r}; choose from {', '.join(FORMATS)}")
    return wanted


def _start_kaleido() -> Any:
    """Point kaleido at the system Chromium and start its reusable browser (once per process)."""
    global _server_started
    path = chromium_path()
    if path is None:
        raise ExportError("PNG/SVG/PDF export renders in Chromium, which was not found: install it "
                          "(`apt-get install chromium` on Debian) or set BROWSER_PATH to a Chrome binary")
    os.environ.setdefault("BROWSER_PATH", path)
    import kaleido

    if not _server_started:
        kaleido.start_sync_server(mathjax=False, silence_warnings=True)
        atexit.register(_stop_kaleido)
        _server_started = True
    return kaleido


def preview_png(spec: str, height: int) -> bytes:
    """A figure's static preview (app/figure_preview.py): a PNG at the preview width, from its JSON."""
    from app.figure_preview import SCALE, WIDTH

    if not static_export_available():
        raise ExportError("previews are drawn in Chromium, which was not found")
    return figure_bytes(json.loads(spec), "png", width=WIDTH, height=height, scale=SCALE)


def start_export_browser() -> None:
    """Start kaleido's Chromium now (once per process), so that a later render is a warm one."""
    with _lock:
        _start_kaleido()


def _stop_kaleido() -> None:
    global _server_started
    if _server_started:
        import kaleido

        kaleido.stop_sync_server(silence_warnings=True)
        _server_started = False


def figure_bytes(fig: Any, fmt: str, width: int | None = None, height: int | None = None,
                 scale: float | None = None) -> bytes:
    """Render a plotly figure to PNG, SVG or PDF bytes at the paper size of the figure template."""
    if fmt not in IMAGE_FORMATS:
        raise ExportError(f"{fmt!r} is not an image format; use one of {IMAGE_FORMATS}")
    fig_dict = fig.to_dict() if hasattr(fig, "to_dict") else fig
    layout = fig_dict.get("layout", {})
    meta = layout.get("meta") if isinstance(layout.get("meta"), dict) else {}
    opts = dict(
        format=fmt,
        width=width or layout.get("width") or meta.get("export_width") or EXPORT_SIZE["width"],
        height=height or meta.get("export_height") or layout.get("height") or EXPORT_SIZE["height"],
        scale=scale or (EXPORT_SIZE["scale"] if fmt == "png" else 1),
    )
    with _lock:
        kaleido = _start_kaleido()
        for wait_s in (*NOT_LOADED_RETRIES_S, None):
            try:
                out = kaleido.calc_fig_sync(fig_dict, opts=opts)
                break
            except Exception as err:  # kaleido wraps browser failures in several exception types
                if wait_s is not None and "kaleido_scopes is not defined" in str(err):
                    time.sleep(wait_s)  # its tab had not run its own scripts yet (see NOT_LOADED_RETRIES_S)
                    continue
                raise ExportError(f"rendering the figure as {fmt.upper()} failed in Chromium ({path_note()}): "
                                  f"{err}") from err
    return stable_svg(out, fig_dict) if fmt == "svg" else out


# kaleido 1.x asks its Chromium tab to render before the tab's page has always run its own scripts: on a
# loaded machine a render sometimes failed with "ReferenceError: kaleido_scopes is not defined" (seen in a
# fresh clone's `make test`; reproduced in 2 of 6 renders with the export Chromium at idle priority, SCHED_IDLE,
# while a test tier ran beside it). The same render asked again a moment later succeeds.
NOT_LOADED_RETRIES_S = (0.25, 0.5, 1.0, 2.0, 4.0)


_SVG_UID = re.compile(rb'id="defs-([0-9a-f]{4,})"')


def stable_svg(svg: bytes, fig_dict: Any) -> bytes:
    """plotly.js names an SVG's clip paths and legend with a random id per render; replace it by one
    derived from the figure, so the same figure always exports to the same bytes."""
    found = _SVG_UID.search(svg)
    if not found:
        return svg
    uid = found.group(1)
    stable = hashlib.sha256(json.dumps(fig_dict, sort_keys=True, default=str).encode()).hexdigest()[:len(uid)].encode()
    return svg.replace(uid, stable)  # defs-, clip, legend, gradient ids: 6 random hex digits nothing else has


def path_note() -> str:
    return f"browser {chromium_path() or 'not found'}"


def _registry(attribute: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for info in sorted(pkgutil.iter_modules(figures.__path__), key=lambda i: (i.name != "trace", i.name)):
        module = importlib.import_module(f"app.figures.{info.name}")
        for name, builder in getattr(module, attribute, {}).items():
            merged.setdefault(name, builder)
            merged[f"{info.name}.{name}"] = builder
    return merged


def figure_registry() -> dict[str, Any]:
    """Every figure builder the app has: the `FIGURES` dicts of all modules in app/figures/, merged.

    A name two modules both use is also reachable as `<module>.<name>`.
    """
    return _registry("FIGURES")


def table_registry() -> dict[str, Any]:
    """Every tidy-table builder: the `TABLES` dicts of app/figures/ modules (figure name -> rows(data))."""
    return _registry("TABLES")


def build_figure(name: str, data: Any) -> Any:
    """The figure `name` drawn from `data` exactly as `thoughtscope export name --from data.json` draws it."""
    figures = figure_registry()
    if name not in figures:
        plain_names = [n for n in figures if "." not in n]
        raise ExportError(f"unknown figure {name!r}; choose one of {', '.join(plain_names)}")
    return figures[name](plain(data))


# ----------------------------------------------------------------- provenance

_page_record: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("page_provenance", default=None)


@contextlib.contextmanager
def page_provenance(record: dict[str, Any] | None):
    """While a page draws, exports without their own record carry this one (the frame sets it)."""
    token = _page_record.set(record)
    try:
        yield
    finally:
        _page_record.reset(token)


def current_provenance() -> dict[str, Any] | None:
    return _page_record.get()


RUN_FIELDS = ("command", "created", "model", "fingerprint", "data", "split", "settings")


def run_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a figure made on this page from another run's result (RISE's SAEs, CoT's calibrated detector) says
    of that run, under its own record: the command that made it, when, on which weights, data and settings."""
    return {k: record.get(k) for k in RUN_FIELDS} if record else None


# ----------------------------------------------------------------- data

def _clean(value: Any) -> Any:
    """JSON without NaN/inf (standard JSON has neither): they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    return value


def plain(data: Any) -> Any:
    """A result as the JSON export holds it (dicts, lists, finite floats or None): what figures are drawn
    from, so the page's figure and the one `thoughtscope export` rebuilds are the same."""
    return _clean(data.to_dict() if hasattr(data, "to_dict") else data)


def record_of(data: Any, provenance: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The provenance an export of `data` carries: the record given, else the data's own (a stored result's,
    carried in its dict under `provenance`), else the page's (`page_provenance`)."""
    if provenance is not None:
        return provenance
    own = data.get(PROVENANCE_KEY) if isinstance(data, dict) else None
    return own if isinstance(own, dict) else current_provenance()


def data_json(data: Any, provenance: dict[str, Any] | None = None) -> str:
    """The result as JSON, with its provenance record (`record_of`) under `provenance`."""
    payload = plain(data)
    record = record_of(payload, provenance)
    if record is not None:
        payload = with_provenance(payload if isinstance(payload, dict) else {"data": payload}, record)
    return json.dumps(payload, indent=1, ensure_ascii=False)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _shape(value: Any) -> tuple[int, ...] | None:
    """() for a scalar, (n,) for a flat list, (r, c) for a rectangular list of lists, None otherwise."""
    if not isinstance(value, list):
        return ()
    if all(not isinstance(v, list) for v in value):
        return (len(value),)
    if all(isinstance(v, list) and all(not isinstance(x, list) for x in v) for v in value):
        widths = {len(v) for v in value}
        return (len(value), widths.pop()) if len(widths) == 1 else None
    return None


WIDE_MAX = 10  # a matrix this narrow whose columns match no list is one row per index, columns name_1..name_k
LONG_TEXT = 60  # scalar texts longer than this stay in the JSON and out of the CSV rows


def data_rows(data: Any) -> list[dict[str, Any]]:
    """A result as tidy table rows when its figure module has no `TABLES` entry.

    Narrow matrices whose width matches no list (top-k alternatives, 2-D coordinates) become columns
    (`name_1`, `name_2`, ...) of one row per index; over the largest remaining matrix, one row per
    cell (long format) with the lists that match its axes as columns; otherwise one row per index
    of the lists. Short scalars are repeated as columns; long texts and the provenance record stay
    in the JSON only.
    """
    source = plain(data)
    if isinstance(source, dict):
        source = {k: v for k, v in source.items() if k != PROVENANCE_KEY}
    flat = _flatten(source if isinstance(source, dict) else {"value": source})
    shapes = {k: _shape(v) for k, v in flat.items()}
    scalars = {k: flat[k] for k, s in shapes.items()
               if s == () and not (isinstance(flat[k], str) and len(flat[k]) > LONG_TEXT)}
    vectors = {k: flat[k] for k, s in shapes.items() if s is not None and len(s) == 1}
    lengths = {len(v) for v in vectors.values()}
    for k, s in list(shapes.items()):
        if s is not None and len(s) == 2 and s[1] <= WIDE_MAX and s[1] not in lengths:
            for j in range(s[1]):
                vectors[f"{k}_{j + 1}"] = [row[j] for row in flat[k]]
            shapes[k] = None
    matrices = {k: s for k, s in shapes.items() if s is not None and len(s) == 2}
    if matrices:
        rows_n, cols_n = max(matrices.values(), key=lambda s: s[0] * s[1])
        cells = [k for k, s in matrices.items() if s == (rows_n, cols_n)]
        rows = []
        for r in range(rows_n):
            for c in range(cols_n):
                row: dict[str, Any] = {"row": r, "col": c}
                for k, v in vectors.items():
                    if len(v) == rows_n:
                        row[f"{k}@row" if len(v) == cols_n else k] = v[r]
                    if len(v) == cols_n:
                        row[f"{k}@col" if len(v) == rows_n else k] = v[c]
                row.update({k: flat[k][r][c] for k in cells})
                row.update(scalars)
                rows.append(row)
        return rows
    n = max((len(v) for v in vectors.values()), default=1)
    return [{"index": i, **{k: (v[i] if i < len(v) else None) for k, v in vectors.items()}, **scalars}
            for i in range(n)]


def table_rows(data: Any, name: str | None = None) -> list[dict[str, Any]]:
    """The tidy rows of a figure's data: its module's `TABLES[name]`, else `data_rows`."""
    tables = table_registry() if name else {}
    if name in tables:
        return tables[name](plain(data))
    return data_rows(data)


def data_csv(data: Any, name: str | None = None) -> str:
    rows = table_rows(data, name)
    buf = io.StringIO()
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def export_bytes(fig: Any, data: Any, fmt: str, name: str | None = None,
                 provenance: dict[str, Any] | None = None) -> bytes:
    """One export in any of FORMATS, as bytes (`name` picks the figure's tidy table for CSV)."""
    if fmt == "csv":
        return data_csv(data, name).encode()
    if fmt == "json":
        return data_json(data, provenance).encode()
    return figure_bytes(fig, fmt)


def save_figure(fig: Any, data: Any, name: str, out_dir: str | Path, formats: Sequence[str],
                figure: str | None = None, provenance: dict[str, Any] | None = None) -> list[Path]:
    """Write `name.<fmt>` for every format into `out_dir`; returns the paths written. `figure` names
    the builder (for its tidy table; default `name`)."""
    out = Path(out_dir)
    # every file made before any is written, each written whole (a temporary file renamed into place): a
    # format that fails leaves no partial export behind, and an interrupted write no truncated file
    payloads = [(out / f"{name}.{fmt}", export_bytes(fig, data, fmt, figure or name, provenance))
                for fmt in parse_formats(formats)]
    out.mkdir(parents=True, exist_ok=True)
    for path, payload in payloads:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_bytes(payload)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return [path for path, _ in payloads]


# ----------------------------------------------------------------- the Streamlit component

def export_buttons(fig: Any, data: Any, name: str, provenance: dict[str, Any] | None = None,
                   figure: str | None = None) -> None:
    """PNG / SVG / PDF / CSV / JSON download buttons under a figure. Files are made on click
    (deferred), so drawing a page never waits for Chromium. The JSON carries `provenance` (or the
    page's record, read now: the click comes after the page has drawn)."""
    import streamlit as st

    images = static_export_available()
    record = record_of(data, provenance)  # read now: the click comes after the page has drawn
    table = figure or name
    row = st.container(horizontal=True, key=f"export-{name}")
    for fmt in FORMATS:
        needs_browser = fmt in IMAGE_FORMATS and not images
        row.download_button(
            fmt.upper(), data=lambda fmt=fmt: export_bytes(fig, data, fmt, table, record), file_name=f"{name}.{fmt}",
            mime=MIME[fmt], key=f"export-{name}-{fmt}", on_click="ignore", icon=":material/download:",
            type="tertiary", disabled=needs_browser,
            help="needs Chromium (apt-get install chromium) or BROWSER_PATH" if needs_browser else None,
        )


def show_figure(fig: Any, data: Any, name: str, provenance: dict[str, Any] | None = None,
                figure: str | None = None) -> None:
    """A figure in the page (drawn with our template, not Streamlit's theme) and its export buttons.

    `fig=None` draws the registered figure `figure or name` from `plain(data)`, which is what makes
    `thoughtscope export` rebuild it byte for byte from the JSON export."""
    import streamlit as st

    from app import first_paint

    if fig is None:
        data = plain(data)
        fig = build_figure(figure or name, data)
    # a new tab's first figure, before plotly.js has loaded
    preview = first_paint.preview_for(fig, render=preview_png, warm_up=start_export_browser)
    if preview is not None:
        st.html(preview)
    st.plotly_chart(fig, theme=None, key=f"figure-{name}", config={"displaylogo": False})
    first_paint.after_figure()  # a new visit's first figure: the rest of the page once it is painted
    export_buttons(fig, data, name, provenance, figure)
