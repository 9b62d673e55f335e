"""Benchmark groups' bookkeeping, without the work: the rows the page benchmarks build from the tabs' times, and
`thoughtscope bench GROUP` printing each row of a long group as soon as it is measured.

`bench pages` once ran five minutes of browser work and then lost every row: the floor part still unpacked the
tab times as three values after they had become four. The times are a named tuple now, and the long groups
(pages, moe, vis-attr, hooks, server, curves) yield their rows; these tests drive them with stand-ins."""

from __future__ import annotations

import contextlib
import json

import pytest
from typer.testing import CliRunner

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



def test_the_bench_command_prints_a_rows_line_before_a_later_row_fails(monkeypatch):
    from thoughtscope import cli

    def group(model_id: str):
        yield {"bench": "first", "ratio": 1.25, "target": 2.0}
        raise RuntimeError("the second part broke")

    monkeypatch.setattr(cli, "benchmark_groups", lambda: {"g": group})
    result = CliRunner().invoke(cli.build(), ["bench", "g", "--json"])
    first = json.loads(result.output.splitlines()[0])
    assert first["bench"] == "first" and first["ratio"] == 1.25 and "device" in first
    assert isinstance(result.exception, RuntimeError) and "second part" in str(result.exception)


@pytest.mark.parametrize("module, group, stub", [
    ("analyses.moe_router.bench", "moe", "bench_expert_sample_overhead"),
    ("analyses.visual_attribution.bench", "vis-attr", "bench_speedup"),
    ("probes.bench", "hooks", "bench_capture_forward"),
    ("probes.bench", "server", "bench_server"),
])
def test_a_long_group_gives_its_first_row_before_measuring_the_next(monkeypatch, module, group, stub):
    """The group's first measurement is handed over before its second one starts (the second would raise)."""
    import importlib

    mod = importlib.import_module(module)
    calls = []

    class Arch:
        experts_top_k, n_experts = 4, 16

    class StubEngine:
        def arch(self):
            return Arch()

    def first(*args, **kwargs):
        calls.append(stub)
        return {"bench": stub, "ratio": 1.0}

    monkeypatch.setattr(mod, stub, first)
    monkeypatch.setattr(mod.Engine, "from_id", classmethod(lambda cls, *a, **k: StubEngine()))
    if group == "vis-attr":
        monkeypatch.setattr(mod, "random_toy_vlm", lambda *a, **k: StubEngine())
    rows = mod.BENCHMARKS[group]("stub-model")
    assert next(rows) == {"bench": stub, "ratio": 1.0} and calls == [stub]


def test_a_curves_group_gives_each_curve_as_it_is_measured():
    from benchmarks.curves import _group

    def broken(model_id: str) -> dict:
        raise RuntimeError("the second curve broke")

    rows = _group([lambda model_id: {"bench": "curve_a", "model": model_id}, broken])("m")
    assert next(rows) == {"bench": "curve_a", "model": "m"}
    with pytest.raises(RuntimeError, match="second curve"):
        next(rows)



def test_the_load_run_answers_every_request_and_counts_the_refusals():
    """`benchmarks.server_load.load` (the README's 300-request figure) against an in-thread server with no
    waiting room, so requests queue by 503 and ticket: every one is answered correctly within 30 retries,
    the 503s counted cover the most retries of one request, and the server is idle after."""
    import os

    import httpx

    from benchmarks.server_load import load
    from probes import Engine
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    engine = Engine.from_id("tiny-random:llama", device="cpu")
    with serving_in_thread(create_app(engine, max_queue=0)) as url:
        row = load(url, os.getpid(), requests=18, clients=4, max_retries=30)
        ready = httpx.get(f"{url}/ready").json()
    assert (row["requests"], row["clients"], row["lost"]) == (18, 4, 0)
    assert row["busy_503s"] >= row["most_retries"] >= 0
    assert 0 < row["p50_ms"] <= row["p95_ms"] and (ready["busy"], ready["waiting"]) == (False, 0)
