"""The page benchmarks' bookkeeping (app/bench.py), without a browser: the rows built from the tabs' times, and
`thoughtscope bench pages` printing each part's rows as soon as it is measured.

`bench pages` once ran five minutes of browser work and then lost every row: the floor part still unpacked the
tab times as three values after they had become four. The times are a named tuple now; these tests drive the
floor part with a stand-in browser."""

from __future__ import annotations

import contextlib

import pytest

from app import bench


class _Closable:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Browser(_Closable):
    def new_context(self, **_: object) -> _Closable:
        return _Closable()


class _Playwright:
    class chromium:  # noqa: N801  (playwright's attribute name)
        @staticmethod
        def launch(**_: object) -> _Browser:
            return _Browser()


def test_the_floor_rows_are_the_median_of_the_tabs_painted_times(monkeypatch):
    tabs = iter([bench.TabTimes(painted=t, driver=t + 0.5, interactive=t + 1.0, preview=False)
                 for t in (9.0, 1.0, 3.0, 2.0, 5.0, 4.0,  # "one metric": a warm-up tab, then five rounds
                           9.0, 2.0, 6.0, 4.0, 8.0, 7.0)])  # "one plotly figure"
    monkeypatch.setattr(bench, "_browser_path", lambda: "/usr/bin/chromium")
    monkeypatch.setattr(bench, "_bare_app", lambda source: contextlib.nullcontext("http://127.0.0.1:1"))
    monkeypatch.setattr(bench, "page_first_result_times", lambda *a, **k: next(tabs))
    monkeypatch.setattr("playwright.sync_api.sync_playwright", lambda: contextlib.nullcontext(_Playwright()))

    rows = bench.bench_streamlit_floor(rounds=5)

    assert [r["page"] for r in rows] == [f"bare Streamlit app: {what} (the floor)" for what in bench.FLOOR_APPS]
    metric, figure = rows
    assert metric["runs_s"] == [1.0, 3.0, 2.0, 5.0, 4.0] and metric["seconds"] == 3.0  # the warm-up left out
    assert metric["driver_runs_s"] == [1.5, 3.5, 2.5, 5.5, 4.5]
    assert figure["seconds"] == 6.0 and figure["ratio"] == round(6.0 / bench.GOALS["page_first_result"], 3)
    assert next(tabs, None) is None  # every tab the part opened was read


def test_bench_pages_prints_each_parts_rows_before_a_later_part_fails(monkeypatch):
    first = {"bench": "page_first_result_s", "page": "cot_entropy", "ratio": 0.6}
    monkeypatch.setattr(bench, "bench_page_first_result", lambda model_id: [first])

    def restart_fails(model_id: str) -> list:
        raise RuntimeError("the app did not start")

    monkeypatch.setattr(bench, "bench_first_tab_after_restart", restart_fails)
    rows = bench.run_pages("smollm2-135m")
    assert next(rows) == first
    with pytest.raises(RuntimeError, match="did not start"):
        next(rows)

