"""Short work on a page (app/context.py `compute`): button, compute under a spinner, keep the result where jobs
keep theirs (`app.jobs.registry()`), and a user's mistake shown as st.error instead of a traceback."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from app import jobs
from app.jobs import DONE, JobRegistry


def _page() -> None:
    import streamlit as st

    from app.context import compute
    from thoughtscope.errors import BadInputError

    calls = st.session_state.setdefault("calls", [])
    n = st.number_input("n", -5, 50, 3, key="n")
    run = st.button("Compute", key="run")

    def work() -> int:
        calls.append(int(n))
        if n < 0:
            raise BadInputError(f"n = {int(n)}: give a count of at least 0")
        return sum(range(int(n) + 1))

    total = compute(f"demo-sum-{int(n)}", work, start=run, spinner="Adding\u2026",
                    again=st.session_state.get("again", False))
    st.write(f"total: {total}")


def _totals(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if str(m.value).startswith("total:")]


def test_compute_runs_on_the_button_keeps_the_result_and_shows_mistakes():
    jobs.registry.clear()
    at = AppTest.from_function(_page, default_timeout=30).run()
    assert _totals(at) == ["total: None"] and at.session_state["calls"] == []  # nothing runs before the button
    at.button(key="run").click().run()
    assert _totals(at) == ["total: 6"] and at.session_state["calls"] == [3]
    at.run()  # a rerun without the button: the kept result, not a second computation
    assert _totals(at) == ["total: 6"] and at.session_state["calls"] == [3]
    assert jobs.registry().finished("demo-sum-3") == 6  # kept where jobs keep their results
    at.number_input(key="n").set_value(-2).run()
    at.button(key="run").click().run()
    assert [e.value for e in at.error] == ["n = -2: give a count of at least 0"] and not at.exception
    assert _totals(at) == ["total: None"] and jobs.registry().finished("demo-sum--2") is None
    at.number_input(key="n").set_value(3).run()
    assert _totals(at) == ["total: 6"] and at.session_state["calls"] == [3, -2]
    at.session_state["again"] = True  # `again`: computed anew even though a result is kept
    at.button(key="run").click().run()
    assert _totals(at) == ["total: 6"] and at.session_state["calls"] == [3, -2, 3]
    jobs.registry.clear()


def test_a_kept_result_is_a_finished_job_and_the_newest_read_is_kept_longest(tmp_path):
    reg = JobRegistry(max_finished=2, costs_path=tmp_path / "costs.json")
    first = reg.keep("a", 1, kind="demo", label="one", page="p")
    assert (first.status, first.result, first.page, first.kind) == (DONE, 1, "p", "demo")
    reg.keep("b", 2)
    assert reg.finished("a") == 1  # read: now the newest
    reg.keep("c", 3)  # over max_finished: the oldest unread ("b") goes
    assert (reg.finished("a"), reg.finished("b"), reg.finished("c")) == (1, None, 3)
    reg.keep("a", 10)  # kept again (computed anew): the newest result for the key wins
    assert reg.finished("a") == 10


def test_one_step_work_reports_its_stage_before_and_after_the_call(tmp_path):
    from app.jobs import one_step

    reg = JobRegistry(costs_path=tmp_path / "costs.json")
    seen = []
    job = reg.start("g", one_step("generate", lambda: seen.append("called") or 42), label="one call", kind="demo")
    job.thread.join(30)
    assert (job.status, job.result, job.stage, job.done, job.total, seen) == (DONE, 42, "generate", 1, 1, ["called"])
