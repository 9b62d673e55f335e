"""The CoT entropy page under AppTest on tiny-random:llama: it draws, calibration (a job) draws the densities,
the h slider moves the exit on the finished trace without regenerating, and the evaluations (jobs) draw."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamlit.testing.v1 import AppTest  # noqa: E402

from tests import apptest_helpers as helpers  # noqa: E402

import app.views.cot_entropy as page  # noqa: E402
from analyses.cot_entropy import CalibrationTrace, CusumDetector  # noqa: E402
from analyses.cot_entropy.calibration import PageCalibration  # noqa: E402
from app import jobs  # noqa: E402

MODEL = "tiny-random:llama"


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    jobs.registry.clear()  # no finished result (detectors, traces, jobs) of an earlier test leaks in
    yield
    for job in jobs.registry().running():  # a job a page started on opening (RISE's steering): end it here
        job.stop("the test ended")
        job.thread.join(120)
    jobs.registry.clear()


def open_page(max_new_tokens: int = 8) -> AppTest:
    return helpers.open_page('cot_entropy', max_new_tokens)


assert_clean, chart_titles, metric = helpers.assert_clean, helpers.chart_titles, helpers.metric


def finish_jobs(at: AppTest, timeout_s: float = 300) -> AppTest:
    """Wait for the page's jobs (threads of this process) to end, then draw the page again."""
    deadline = time.monotonic() + timeout_s
    while jobs.registry().running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not jobs.registry().running(), "a job did not finish in time"
    return at.run()


def test_the_page_draws_and_waits_for_calibration():
    at = open_page()
    assert_clean(at)
    assert any("Calibrate" in i.value for i in at.info)
    assert not at.get("plotly_chart")
    at.text_input(key="cot_delimiter").set_value("(").run()
    assert not at.exception
    assert any("not a valid regular expression" in e.value for e in at.error)


def test_calibration_with_a_tiny_n_draws_the_densities():
    at = open_page()
    at.slider(key="cot_n_cal").set_value(2).run()
    at.slider(key="cot_n_dev").set_value(1).run()
    at.button(key="cot_calibrate").click().run()
    assert_clean(at)
    assert jobs.registry().for_key(next(iter(jobs.registry()._jobs.values())).key).kind == "cot-calibration"
    finish_jobs(at)
    assert_clean(at)
    assert "Calibration densities" in chart_titles(at)
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Calibration densities" in c.proto.spec))
    # the default KDE: each class's calibration steps as bars under its density curve, then log f1/f0
    assert [t["name"].split(" (")[0] for t in spec["data"]] == ["f0 uncertainty", "f0 KDE", "f1 confidence", "f1 KDE",
                                                                "log f1/f0"]
    assert int(metric(at, "Uncertain steps (f0)")) + int(metric(at, "Confident steps (f1)")) > 0
    # random weights never settle on an answer: every step is "uncertain", and the page says f1 is flat
    assert any("flat" in w.value for w in at.warning)
    # the delimiter is shown as code (as a metric, the regex [.!?](?=\s) rendered as a Markdown link)
    assert not any(m.label == "Step delimiter" for m in at.metric)
    assert any("Step delimiter: `" in c.value and "calibration split" in c.value for c in at.caption)
    assert "KDE" in spec["data"][1]["name"] and spec["layout"]["title"]["subtitle"]["text"].endswith("calibration split")

    at.text_input(key="cot_target").set_value("20").run()  # the sidebar's example question
    at.button(key="cot_generate").click().run()
    assert_clean(at)
    assert "Intermediate answers (target 20)" in chart_titles(at)
    assert metric(at, "Exit after token")  # the exit metrics are drawn for the sidebar prompt too


RELEASE = threading.Event()


def _synthetic_calibration(engine, task, family, *, n_calibration, on_progress=None, **_settings):
    """A detector whose confidence density covers [0, 3) nats, where the tiny model's probe entropies
    (~2 nats) fall, so each probed step adds Z = log 3 (random weights never reach an alarm otherwise);
    its h (as if chosen on development) is 2. It waits for `RELEASE`, so the test sees the job running."""
    assert RELEASE.wait(60), "the test never released the calibration"
    if on_progress:
        on_progress("calibration", n_calibration, n_calibration)
    detector = CusumDetector(threshold=2.0, density="histogram", bins=2, value_range=(0.0, 6.0)).fit(
        [CalibrationTrace([4.5, 4.5, 1.5, 1.5], ["1", "1", "2", "2"], "2")])
    choice = {"chosen": 2.0, "objective": "synthetic", "grid": [{"setting": 2.0, "accuracy": 0.0, "exit_rate": 1.0,
                                                                 "mean_generated_tokens": 4.0}]}
    return PageCalibration(detector, {}, [], {"accuracy": 0.0, "steps": 4, "warnings": []}, choice,
                           {"accuracy": 0.0, "mean_generated_tokens": 8.0})


def test_generate_then_the_h_slider_moves_the_exit_without_regenerating(monkeypatch):
    monkeypatch.setattr(page, "calibrate", _synthetic_calibration)
    runs = []
    real_run = page.run_with_rule
    monkeypatch.setattr(page, "run_with_rule", lambda *a, **k: runs.append(1) or real_run(*a, **k))

    at = open_page()
    at.radio(key="cot_source").set_value(page.FROM_TASK).run()
    at.button(key="cot_generate").click().run()  # nothing calibrated yet: starts the calibration job
    assert_clean(at)
    assert any("Calibrating first" in i.value for i in at.info)
    assert not runs and not chart_titles(at)
    RELEASE.set()
    finish_jobs(at)
    assert metric(at, "h chosen on development") == "2"
    assert at.slider(key="cot_h").value == 2.0  # the slider starts at the h chosen on development
    assert not runs
    at.button(key="cot_generate").click().run()  # streams the trace
    assert_clean(at)
    assert len(runs) == 1
    titles = chart_titles(at)
    for title in ("Calibration densities", "Token entropy and the CUSUM exit", "CUSUM statistic"):
        assert title in titles
    assert any(t.startswith("Intermediate answers (target ") for t in titles)

    steps = int(metric(at, "Alarm at step").split(" of ")[1])
    assert steps >= 2, "the tiny trace needs two probed steps for this test"
    assert metric(at, "Alarm at step") == f"2 of {steps}"  # h = 2 < 2 log 3
    exit_at_2 = metric(at, "Exit after token")

    at.slider(key="cot_h").set_value(0.5).run()
    assert_clean(at)
    assert metric(at, "Alarm at step") == f"1 of {steps}"
    assert metric(at, "Exit after token") != exit_at_2
    tail = int(metric(at, "Redundant tail").split()[0])
    assert tail == 8 - int(metric(at, "Exit after token").split(" of ")[0]) and tail > 0

    at.slider(key="cot_h").set_value(10.0).run()
    assert metric(at, "Alarm at step") == "none"
    assert metric(at, "Exit after token") == "no exit"
    assert metric(at, "Redundant tail") == "0 tokens"
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "CUSUM statistic" in c.proto.spec))
    assert any(a.get("text") == "h = 10" for a in spec["layout"].get("annotations", []))
    # a few probes are narrow bars on an axis that fits the probes made, not one bar across the plot
    assert spec["layout"]["xaxis"]["range"] == [0.4, steps + 0.6] and spec["data"][0]["width"] == 0.5
    strip = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Intermediate answers" in c.proto.spec))
    legend = [t["name"] for t in strip["data"] if t.get("showlegend", True)]
    assert strip["layout"]["showlegend"] and {"correct", "wrong", "answer at the alarm"} <= set(legend)
    assert len(runs) == 1, "moving h must not regenerate"


def test_the_evaluations_draw_the_pareto_plot_and_the_voting_bars():
    at = open_page(max_new_tokens=6)
    at.slider(key="cot_n_cal").set_value(2).run()
    for key in ("cot_eval_ncal", "cot_eval_ndev", "cot_eval_n"):
        at.slider(key=key).set_value(2)
    at.multiselect(key="cot_eval_h").set_value([1.0, 4.0])
    at.run()
    at.button(key="cot_eval_run").click().run()
    finish_jobs(at)
    assert_clean(at)
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Accuracy vs tokens" in c.proto.spec))
    assert "evaluation split, n=2; 95% intervals" in spec["layout"]["title"]["text"]
    assert [t["name"].split(" (")[0] for t in spec["data"]] == ["vanilla", "cusum", "deer", "dynasor"]
    assert all("error_y" in t and "error_x" in t for t in spec["data"])  # intervals on both axes
    low, high = spec["layout"]["yaxis"]["range"]
    assert 0.0 <= low < high <= 1.0  # the accuracy axis never runs below 0% (it ran to -50%)
    methods = at.dataframe[0].value
    assert list(methods["method"]) == ["vanilla", "cusum", "deer", "dynasor"]
    assert all(v.startswith("n = 2 cannot tell these apart") for v in methods["accuracy vs vanilla"][1:])
    dev = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "development split" in c.proto.spec))
    assert [t["name"] for t in dev["data"]][:3] == ["cusum", "deer", "dynasor"]
    assert dev["data"][0]["text"] == ["1.0", "4.0"]  # the h grid asked for, each tried on development
    at.slider(key="cot_vote_samples").set_value(2).run()
    at.slider(key="cot_vote_n").set_value(1).run()
    at.button(key="cot_vote_run").click().run()
    finish_jobs(at)
    assert_clean(at)
    titles = chart_titles(at)
    assert any(t.startswith("Accuracy vs tokens") for t in titles)  # kept while voting runs
    assert any(t.startswith("Voting over 2 samples") for t in titles)


def test_the_task_can_be_the_users_own_problem_file(monkeypatch, tmp_path):
    """The task box's last choice uploads a problem file: the held-out problems to generate for are the file's;
    a malformed file says which line is wrong, and the model's own task stands."""
    import app.sections.tasks as tasks_section
    from analyses import tasks

    monkeypatch.setattr(tasks_section, "store_problem_file",
                        lambda data, name: tasks.store_problem_file(data, name, folder=tmp_path))
    lines = [json.dumps({"question": f"What is {k} + 1?", "answer": f"{k} + 1 = {k + 1}\n#### {k + 1}"})
             for k in range(40)]
    at = open_page()
    at.selectbox(key="cot_task").set_value(tasks_section.OWN_PROBLEMS).run()
    assert any("until then the task is" in i.value for i in at.info)
    at.file_uploader(key="cot_task_file").set_value(("sums.jsonl", "\n".join(lines).encode(), "application/json"))
    at.run()
    assert_clean(at)
    at.radio(key="cot_source").set_value(page.FROM_TASK).run()
    assert_clean(at)
    problem = next(s for s in at.selectbox if s.key and s.key.startswith("cot_problem_"))
    assert problem.key.startswith(f"cot_problem_{tmp_path}/sums-") and "#sha256=" in problem.key
    assert problem.value.question.startswith("What is ") and problem.value.answer == str(
        int(problem.value.question.split()[2]) + 1)
    at.file_uploader(key="cot_task_file").set_value(("bad.jsonl", b'{"question": "a?", "answer": "lots"}\n',
                                                    "application/json"))
    at.run()
    assert not at.exception
    assert any("bad.jsonl: " in e.value and "line 1: the answer 'lots' is not a number" in e.value for e in at.error)
