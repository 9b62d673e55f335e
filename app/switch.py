"""One-click model switches: a page asks for another model, the sidebar picks it on the next run.

A page that cannot show its method on the loaded model (no router, no vision) shows the shipped result of
the toy it is best shown on, with a button "switch to <toy>". The button calls `request_model(id)` and
reruns; the sidebar calls `apply_request()` before it draws its model box, so the box shows the new
model and the page renders on it. This is the only way a page moves the model, and only on a click (the
settings belong to the user: no navigation path changes them).
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from app.persist import keep
from thoughtscope import shipped

PICK_KEY = "model_pick"  # app/sidebar.py's model selectbox
BACKEND_KEY = "backend_kind"  # app/sidebar.py's backend radio
_REQUEST = "_switch_model_request"


def request_model(model_id: str) -> None:
    """Ask the sidebar to load `model_id` on the next run (then call `st.rerun()`)."""
    st.session_state[_REQUEST] = str(model_id)


def apply_backend_request() -> bool:
    """Called by the sidebar before its backend radio draws: a requested model runs in this app (a model server
    serves the one model it was started with), so the radio moves to in-process. True when a request is pending.
    (Before, a switch clicked on the server backend did nothing, and its request waited to change the model the
    next time the user picked in-process.)"""
    if not st.session_state.get(_REQUEST):
        return False
    st.session_state[BACKEND_KEY] = "in-process"
    keep(BACKEND_KEY, "in-process")
    return True


def apply_request() -> str | None:
    """Called by the sidebar before its model box draws: the requested model becomes the box's value."""
    wanted = st.session_state.pop(_REQUEST, None)
    if wanted:
        st.session_state[PICK_KEY] = wanted
        keep(PICK_KEY, wanted)  # the value the sidebar holds for the box (app/persist.py) moves with it
    return wanted


def switch_button(model_id: str, key: str) -> None:
    """A button "Switch to <model_id>" that requests the model and reruns the app; on the server backend it says
    that the model will run in this app ("(in-process)"), since the server keeps its own."""
    remote = st.session_state.get(BACKEND_KEY) == "server"
    label = f"Switch to {model_id}" + (" (in-process)" if remote else "")
    # a colon escaped: the label is Markdown, where `toy-vlm:small` would draw as "toy-vlm" (`:small` a directive)
    if st.button(label.replace(":", "\\:"), key=key, type="primary", icon=":material/swap_horiz:",
                 help=(f"the model server serves the model it was started with; {model_id} loads in this app"
                       if remote else None)):
        request_model(model_id)
        st.rerun()


def stored_elsewhere(name: str, model_id: str, current: str, key: str) -> Any:
    """On a model that cannot run a page's method: the stored result `name` of `model_id` (the toy that can),
    labelled as that model's and not `current`'s, with a switch to it; None (and the reason shown) when absent."""
    stored = shipped.find(name, model_id, None)
    if not stored:
        (st.warning if stored.damaged else st.caption)(stored.reason)
        return None
    st.markdown(f"**Below: the stored result of `{model_id}`, not of `{current}`.** {stored.label()}")
    switch_button(model_id, key=key)
    return stored

