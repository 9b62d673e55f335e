"""Settings that hold: every widget keeps the value the user gave it, whatever the navigation path.

Why this exists (reproduced in headless Chromium, issue 20): a widget whose value came only through
`st.session_state` (no `value=`) is sent to the browser with the widget's *own* default, for a slider
its minimum, and the value itself only in the one run that set it. When a page switch interrupts
the first run before the browser has mounted the sidebar's widgets (a click on a page link while Home
still draws), the browser has no state for them: it re-creates each from that default and sends it
back as the user's choice. So max new tokens became 1, top-p 0.05, alternatives 1. Separately,
Streamlit drops the state of any widget that a run does not draw, so a page's own settings are gone
after a visit to another page.

The cure, once for every widget: the values live under one non-widget key (`HELD`), which Streamlit
never drops. At the start of each run `hold_widgets` records every value widget's current value
there and puts back the ones Streamlit dropped; the sidebar passes its held value as each widget's
`value=`, so even the browser's fallback is the user's value. The sidebar's settings are also
mirrored into the URL's query string (`mirror_to_url`), so a reload or a copied link opens with them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import streamlit as st
from streamlit.runtime.state.session_state_proxy import get_session_state

HELD = "_ts_held"  # a plain session-state key, not a widget's: it survives runs that do not draw a widget
# Value widgets: their state may be set through session state. Buttons, uploads and chart selections
# (trigger values, file states, dict-shaped selection states) may not, and are never held.
_SETTABLE = {"bool_value", "int_value", "double_value", "double_array_value", "string_value",
             "string_array_value", "int_array_value"}


def held() -> dict[str, Any]:
    return st.session_state.setdefault(HELD, {})


def _widget_values() -> dict[str, Any]:
    """The current value of every keyed value widget this session knows (Streamlit's own records)."""
    state = get_session_state()
    found = {}
    for key in list(st.session_state.keys()):
        if not isinstance(key, str) or key == HELD:
            continue
        try:
            widget_id = state._state.get_widget_id_from_key(key)
            meta = state._state.get_widget_metadata(widget_id) if widget_id else None
            if meta is None or meta.value_type not in _SETTABLE:
                continue
            value = st.session_state[key]
        except (AttributeError, KeyError):
            continue
        if not isinstance(value, dict):  # a chart's selection or an editor's edits: not a setting
            found[key] = value
    return found


def hold_widgets(skip: Iterable[str] = ()) -> list[str]:
    """At the start of a run: remember every value widget's value; put back those Streamlit dropped.

    Keys in `skip` are only remembered (the sidebar gives those their value through `value=`).
    Returns the keys put back this run."""
    store = held()
    store.update(_widget_values())
    skip = set(skip)
    restored = []
    for key, value in store.items():
        if key not in skip and key not in st.session_state:
            st.session_state[key] = value
            restored.append(key)
    return restored


def forget(keys: Iterable[str]) -> None:
    """Drop held values (a restored value the widget refused, e.g. outside a range that has shrunk)."""
    store = held()
    for key in keys:
        store.pop(key, None)
        st.session_state.pop(key, None)


def kept(key: str, default: Any) -> Any:
    """The value the user last gave the widget `key`, or `default` when they never did."""
    return held().get(key, default)


def keep(key: str, value: Any) -> Any:
    """Record a widget's value as drawn this run; returns it."""
    held()[key] = value
    return value


def seed_from_url(types: dict[str, type], ranges: dict[str, tuple[Any, Any]] | None = None) -> None:
    """A new session opened with settings in its URL (a reload, a copied link) starts from them; a value that
    does not parse, is not finite or lies outside its widget's range in `ranges` is dropped (the default stands).

    Only the first run of a session reads the URL: afterwards the held values are the user's."""
    if st.session_state.get("_ts_url_seeded"):
        return
    st.session_state["_ts_url_seeded"] = True
    store = held()
    for key, kind in types.items():
        raw = st.query_params.get(key)
        if raw is None:
            continue
        try:
            value = _parse(raw, kind)
        except ValueError:
            continue  # a hand-edited URL: the default stands
        low, high = (ranges or {}).get(key, (None, None))
        if isinstance(value, float) and not math.isfinite(value) or (
                low is not None and not low <= value <= high):
            continue  # NaN, inf, or outside the widget's range: a widget handed it would stop the page
        store.setdefault(key, value)


def _parse(raw: str, kind: type) -> Any:
    if kind is bool:
        if raw not in ("0", "1"):
            raise ValueError(raw)
        return raw == "1"
    return kind(raw)


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def mirror_to_url(defaults: dict[str, Any]) -> None:
    """Write the held values that differ from their defaults into the URL (and remove the others)."""
    store = held()
    for key, default in defaults.items():
        value = store.get(key, default)
        if value != default:
            text = _format(value)
            if st.query_params.get(key) != text:
                st.query_params[key] = text
        elif key in st.query_params:
            del st.query_params[key]
