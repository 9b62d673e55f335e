"""The RISE page under AppTest on tiny-random:llama: it draws, Harvest + train (a job) with a tiny n shows the
SAE stats, the layer selector changes the decoder map, and the alpha slider changes the steered output."""

from __future__ import annotations

import json
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamlit.testing.v1 import AppTest  # noqa: E402

from tests import apptest_helpers as helpers  # noqa: E402

import app.views.rise as page  # noqa: E402
from app import jobs  # noqa: E402

MODEL = "tiny-random:llama"


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch, tmp_path):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))  # the harvest's ActivationStore
    jobs.registry.clear()
    yield
    for job in jobs.registry().running():  # a job a page started on opening (RISE's steering): end it here
        job.stop("the test ended")
        job.thread.join(120)
    jobs.registry.clear()


def open_page(max_new_tokens: int = 12) -> AppTest:
    return helpers.open_page('rise', max_new_tokens)


assert_clean, chart_titles, metric = helpers.assert_clean, helpers.chart_titles, helpers.metric


def finish_jobs(at: AppTest, timeout_s: float = 300) -> AppTest:
    """Wait for the page's jobs (threads of this process) to end, then draw the page again (until none starts)."""
    for _ in range(5):
        deadline = time.monotonic() + timeout_s
        while jobs.registry().running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not jobs.registry().running(), "a job did not finish in time"
        at.run()
        if not jobs.registry().running():
            return at
    return at


def harvested() -> AppTest:
    at = open_page()
    at.number_input(key="rise_n").set_value(4)
    at.number_input(key="rise_sae_steps").set_value(20)
    at.number_input(key="rise_d_sae").set_value(32)
    at.multiselect(key="rise_layers").set_value([0, 1])
    at.radio(key="rise_projection").set_value("pca")
    at.run()
    at.button(key="rise_run").click().run()
    assert_clean(at)
    finish_jobs(at)  # the harvest, then the steering section's first draw (a job too)
    assert_clean(at)
    return at


def steered_text(at: AppTest) -> str:
    """The steered side of the comparison: the page's only st.text calls are vanilla, then steered."""
    texts = [t.value for t in at.text]
    assert len(texts) == 2, texts
    return texts[1]


def test_the_page_draws_and_waits_for_the_harvest():
    at = open_page()
    assert_clean(at)
    assert any("Harvest + train" in i.value for i in at.info)
    assert not at.get("plotly_chart")


def test_harvest_train_shows_stats_geometry_follows_the_layer_and_alpha_steers(monkeypatch):
    at = harvested()
    assert int(metric(at, "Traces")) == 4
    stats = at.dataframe[0].value  # the SAE stats table comes first
    assert list(stats["site"]) == ["resid_post.0", "resid_post.1"]
    assert list(stats["d_sae"]) == [32, 32]  # the d_sae control reached the SAEs
    # the metrics are the held-out numbers of the table (one of the 4 traces is held out of training)
    assert any("quality measured on the 1 held-out traces" in c.value for c in at.caption)
    best = at.selectbox(key="rise_geometry_site").value  # the page opens the geometry at the best layer
    row = stats[stats["site"] == best].iloc[0]
    assert float(metric(at, "Explained variance (held-out)")) == pytest.approx(row["EV held-out"], abs=1e-3)
    assert float(metric(at, "L0 (held-out)")) == pytest.approx(row["L0 held-out"], abs=1e-2)
    assert int(metric(at, "Dead latents")) == row["dead latents"]
    # a random model's step vectors are noise: the SAEs reconstruct held-out steps poorly, and the page says so
    poor = [w.value for w in at.warning if "of the variance of held-out steps" in w.value]
    assert len(poor) == sum(ev < 0.5 for ev in stats["EV held-out"]) and poor
    assert any("resid_post.0" in c.value for c in at.code)  # where the SAEs were saved
    titles = chart_titles(at)
    assert "SAE explained variance: training vs held-out steps" in titles
    assert any(t.startswith("Steps of ") for t in titles)
    assert "Behaviour separation per layer" in titles
    assert any(t.startswith("Latent ") for t in titles)

    # the layer selector moves the decoder map
    def map_title() -> str:
        return next(t for t in chart_titles(at) if t.startswith("Decoder columns at"))

    first = at.selectbox(key="rise_geometry_site").value
    other = "resid_post.0" if first == "resid_post.1" else "resid_post.1"
    assert first in map_title()
    spec_before = next(c.proto.spec for c in at.get("plotly_chart") if "Decoder columns at" in c.proto.spec)
    layout = json.loads(spec_before)["layout"]
    assert (layout["xaxis"]["title"]["text"], layout["yaxis"]["title"]["text"]) == ("PC 1", "PC 2")
    at.selectbox(key="rise_geometry_site").set_value(other).run()
    assert_clean(at)
    assert other in map_title()
    spec_after = next(c.proto.spec for c in at.get("plotly_chart") if "Decoder columns at" in c.proto.spec)
    assert json.loads(spec_before)["data"] != json.loads(spec_after)["data"]

    # the alpha slider changes the steered text (additive mode along a latent's column); the first draw
    # generates every stop in one batch, so moving the slider afterwards generates nothing
    import importlib

    steer_module = importlib.import_module("analyses.rise.steer")  # the module (the package exports the function)

    grids = []
    real_grid = steer_module._alpha_grid
    monkeypatch.setattr(steer_module, "_alpha_grid", lambda *a, **k: grids.append(a[4]) or real_grid(*a, **k))
    at.radio(key="rise_steer_source").set_value(page.FROM_LATENT).run()
    at.radio(key="rise_steer_mode").set_value("add").run()
    finish_jobs(at)
    assert_clean(at)
    at.slider(key="rise_alpha").set_value(0.0).run()
    vanilla = steered_text(at)
    drawn = len(grids)
    at.slider(key="rise_alpha").set_value(1.5).run()
    assert_clean(at)
    assert steered_text(at) != vanilla
    assert len(grids) == drawn and grids[-1] == list(page.ALPHA_STOPS)  # the move was a lookup
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Behaviour counts" in c.proto.spec))
    # reflection, backtracking and all steps per alpha: never an empty chart (the step bars are there)
    assert [t["name"] for t in spec["data"]] == ["reflection", "backtracking", "all steps"]
    assert spec["data"][2]["x"] == [f"{a:g}" for a in page.ALPHA_STOPS] and min(spec["data"][2]["y"]) > 0

    # the behaviour vector (templated steps give the labeller reflection/backtracking to find) and confidence
    at.radio(key="rise_steer_source").set_value(page.FROM_BEHAVIOUR).run()
    finish_jobs(at)
    assert not at.exception, [e.value for e in at.exception]
    # with 4 traces the behaviour often has no column of its own: the page says so instead of steering
    assert len(at.text) == 2 or any("vector at" in w.value for w in at.warning)
    at.number_input(key="rise_conf_iters").set_value(2)
    at.number_input(key="rise_conf_batch").set_value(2)
    at.button(key="rise_conf_run").click().run()
    finish_jobs(at)
    assert_clean(at)
    assert any(t.startswith("Confidence coefficients at") for t in chart_titles(at))


def test_steering_and_confidence_figures_name_the_run_whose_saes_they_use(monkeypatch):
    """The steering and confidence figures are the page's own work on a RISE run's SAEs: their exports once
    carried the page's record alone, which said nothing of the SAEs. They carry it with `sae_run`: the command,
    date, data and settings of the run the harvest and SAE figures export."""
    from app import export
    from tests.export_helpers import capture_records

    seen = capture_records(monkeypatch)
    at = harvested()
    at.radio(key="rise_steer_source").set_value(page.FROM_LATENT).run()
    finish_jobs(at)
    at.number_input(key="rise_conf_iters").set_value(2)
    at.number_input(key="rise_conf_batch").set_value(2)
    at.button(key="rise_conf_run").click().run()
    finish_jobs(at)
    assert_clean(at)
    run = seen["rise_timeline"]  # the harvest + SAE run's own record (this page's job)
    assert run["settings"]["rise"]["n"] == 4 and run["settings"]["rise"]["d_sae"] == 32
    for name in ("rise_steering", "rise_confidence"):
        own = seen[name]
        assert own["command"] == "thoughtscope app" and own["model"] == MODEL, name
        assert own["sae_run"] == {k: run[k] for k in export.RUN_FIELDS} and "settings" in export.RUN_FIELDS, name


def test_a_harvest_of_the_users_own_problem_file(monkeypatch, tmp_path):
    """RISE harvests an uploaded problem file: its questions are the traces' problems, and the run's record names
    the file by its content."""
    import app.sections.tasks as tasks_section
    from analyses import tasks
    from tests.export_helpers import capture_records

    monkeypatch.setattr(tasks_section, "store_problem_file",
                        lambda data, name: tasks.store_problem_file(data, name, folder=tmp_path / "problems"))
    seen = capture_records(monkeypatch)
    rows = [{"question": f"Ada has {k} pens. She buys 2 more. How many pens does Ada have now?", "answer": k + 2}
            for k in range(3, 13)]
    at = open_page()
    at.selectbox(key="rise_task").set_value(tasks_section.OWN_PROBLEMS).run()
    at.file_uploader(key="rise_task_file").set_value(
        ("pens.jsonl", "\n".join(json.dumps(r) for r in rows).encode(), "application/json"))
    at.number_input(key="rise_n").set_value(12)  # more than the file holds: the harvest takes all 10
    at.number_input(key="rise_sae_steps").set_value(20)
    at.radio(key="rise_projection").set_value("pca")
    at.run()
    assert any(c.value == "The file holds 10 problems: the harvest takes all of them." for c in at.caption)
    at.button(key="rise_run").click().run()
    finish_jobs(at)
    assert_clean(at)
    assert int(metric(at, "Traces")) == 10
    record = seen["rise_timeline"]
    assert record["data"].startswith(str(tmp_path / "problems" / "pens-")) and "#sha256=" in record["data"]
    assert record["settings"]["rise"]["task"] == record["data"]
