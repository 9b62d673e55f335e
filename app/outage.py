"""A lost model server: said at the top of the page, with the results already drawn kept.

When `thoughtscope serve` goes away, the sidebar's `info()` call fails. Instead of "No model is
loaded" (with the cause below the fold in the sidebar), the page opens on a banner naming the
server, the cause and the way back, and keeps drawing: the sidebar hands the page a
`LastKnownServer`, which answers `info()` and `capabilities()` with the server's last answers, so a
page's stored results (finished generations, cached figures, job results) still draw, while any new
model work goes to the server and fails with its message. The banner polls the server's /health and
reruns the page once it answers again.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from probes.arch import ArchInfo
from probes.backend import Backend

OUTAGE = "_ts_server_outage"  # this run's lost server: {"url", "cause", "model_id"}, or absent
SEEN = "_ts_server_seen"  # per server URL: its last info() and capabilities()
POLLS = "_ts_outage_polls"
RECONNECT_S = 3.0  # how often the banner asks the server whether it is back


class LastKnownServer:
    """The `Backend` of a server that stopped answering: `info()` and `capabilities()` are its last
    answers; every other call goes to the real client (and raises its error while the server is away)."""

    def __init__(self, backend: Backend, info: dict[str, Any], capabilities: dict[str, bool]):
        self._backend, self._info, self._capabilities = backend, info, capabilities

    def info(self) -> dict[str, Any]:
        return self._info

    def capabilities(self) -> dict[str, bool]:
        return self._capabilities

    def arch(self) -> ArchInfo:
        return ArchInfo.from_dict(self._info["arch"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def remember(url: str, backend: Backend, info: dict[str, Any]) -> None:
    """After a good answer: keep the server's info (and, once per model, its capabilities)."""
    seen = st.session_state.setdefault(SEEN, {})
    last = seen.get(url)
    if last is None or last["info"].get("fingerprint") != info.get("fingerprint"):
        last = {"capabilities": dict(backend.capabilities())}
    seen[url] = {**last, "info": dict(info)}


def last_known(url: str, backend: Backend) -> LastKnownServer | None:
    """`backend` answering with what the server at `url` last said; None if it never answered here."""
    last = st.session_state.get(SEEN, {}).get(url)
    return None if last is None else LastKnownServer(backend, last["info"], last["capabilities"])


def clear() -> None:
    """At the start of a run: nothing is lost until a call fails."""
    st.session_state.pop(OUTAGE, None)


def note(url: str, err: BaseException) -> None:
    """Record that the server at `url` failed to answer this run (`err` says why)."""
    cause = getattr(err, "cause", None) or str(err)
    model_id = st.session_state.get(SEEN, {}).get(url, {}).get("info", {}).get("model_id")
    st.session_state[OUTAGE] = {"url": url, "cause": cause, "model_id": model_id,
                                "unreachable": getattr(err, "server_url", None) is not None}


def note_error(err: BaseException) -> None:
    """A page's error: when it is the client's "no answer from the model server", the banner says so."""
    url = getattr(err, "server_url", None)
    if url is not None and get_script_run_ctx(suppress_warning=True) is not None:  # not from a job's thread
        note(url, err)


def current() -> dict[str, Any] | None:
    return st.session_state.get(OUTAGE)


def banner_text(lost: dict[str, Any]) -> str:
    url = lost["url"]
    port = urlparse(url).port
    serve = "thoughtscope serve" + (f" --model {lost['model_id']}" if lost.get("model_id") else "") + \
        (f" --port {port}" if port else "")
    what = "stopped answering" if lost.get("unreachable", True) else "refused the request"
    return (f"**The model server at {url} {what}**: {lost['cause']}.  \n"
            f"To recover, start it again (`{serve}`, with its usual options); this page reconnects by itself "
            f"within a few seconds once it answers. Results already on the page stay; new model work waits "
            "for the server.")


def show_banner(where: Any) -> None:
    """Draw this run's lost-server banner (if any) in `where`, the top of the page, and poll for the server."""
    lost = current()
    if lost is None:
        return
    with where:
        st.error(banner_text(lost), icon=":material/cloud_off:")
        st.session_state[POLLS] = 0
        _reconnect(lost["url"])


@st.fragment(run_every=RECONNECT_S)
def _reconnect(url: str) -> None:
    # The first call runs inside the page's own run (which just failed): only the later, timed calls
    # ask the server, so a server that answers /health but fails the page's call cannot loop the page.
    polls = st.session_state.get(POLLS, 0)
    st.session_state[POLLS] = polls + 1
    if polls and server_answers(url):
        st.rerun()
    st.caption(f"waiting for {url} \u2026 (checked every {RECONNECT_S:.0f} s)")


def server_answers(url: str, timeout_s: float = 1.5) -> bool:
    import httpx  # lazy: asked only when a server is down; keeps the first paint from importing it

    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
