"""Helpers shared by the AppTest page tests: open one page of the app, check it drew cleanly, read it."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest


def open_page(name: str, max_new_tokens: int | None = 8) -> AppTest:
    """One page of the app, as `streamlit run app/main.py` would draw it (navigation limited to it)."""
    at = AppTest.from_string(f"from app.main import main\nmain(only={name!r})\n", default_timeout=180)
    if max_new_tokens is not None:
        at.session_state["max_new_tokens"] = max_new_tokens
    return at.run()


def assert_clean(at: AppTest, no_errors: bool = True) -> None:
    """No exception; with `no_errors`, no st.error either."""
    assert not at.exception, [e.value for e in at.exception]
    if no_errors:
        assert not at.error, [e.value for e in at.error]


def chart_titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def finish_jobs(at: AppTest, timeout_s: float = 600) -> AppTest:
    """Wait until no job of this process runs (`app.jobs`: a page's long work in a thread), then draw again.
    Waiting stands for an open page: it marks the running jobs seen, as a page's reruns do, so a job longer
    than the unwatched-job grace period (30 s) is not stopped as abandoned."""
    import time

    from app import jobs

    deadline = time.monotonic() + timeout_s
    while jobs.registry().running() and time.monotonic() < deadline:
        for job in jobs.registry().running():
            jobs.registry().seen(job)
        time.sleep(0.1)
    assert not jobs.registry().running(), "a job did not finish in time"
    return at.run()
