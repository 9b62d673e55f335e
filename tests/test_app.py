"""The Streamlit workbench: every page under AppTest on tiny-random:llama, the trace read-outs by hand,
and figure export (SVG that parses, a PDF that starts with %PDF, CSV/JSON, the `export` command)."""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamlit.testing.v1 import AppTest  # noqa: E402

from tests import apptest_helpers as helpers  # noqa: E402

from analyses.logit_lens import (attention_pattern, lens_readout, logit_lens, resid_sites,  # noqa: E402
                                 residual_norms)
from analyses.steering import diff_of_means_direction, steered_comparison  # noqa: E402
from app.export import data_csv, data_json, data_rows, figure_bytes, figure_registry  # noqa: E402
from app.figures.trace import FIGURES, entropy_figure, records_data, tokens_html  # noqa: E402
from app.registry import discover_pages  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402
from probes.records import Trace  # noqa: E402

MODEL = "tiny-random:llama"


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)


def assert_clean(at: AppTest) -> None:
    helpers.assert_clean(at, no_errors=False)


open_page = helpers.open_page


@pytest.fixture(scope="module")
def engine():
    from probes import Engine

    return Engine.from_id(MODEL)


# ----------------------------------------------------------------- pages

@pytest.mark.parametrize("name", [m.__name__.rsplit(".", 1)[-1] for _, m in discover_pages()])
def test_every_page_runs_without_an_exception(name):
    at = open_page(name)
    assert_clean(at)
    assert not at.error, [e.value for e in at.error]


def test_home_names_the_model_and_the_prompt():
    at = open_page("home")
    assert MODEL in [m.value for m in at.metric]
    assert "tiny-random:llama" in at.sidebar.caption[0].value


def test_trace_explorer_streams_tokens_then_draws_every_figure():
    at = open_page("trace_explorer")
    assert not at.get("plotly_chart"), "nothing is drawn before Generate"
    at.button(key="generate").click().run()
    assert_clean(at)
    html = at.html[0].proto.body
    assert html.count('class="ts-tok"') == 8
    assert "top alternatives" in html  # the hover text of every token
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert [t.split(":")[0].split(",")[0] for t in titles] == [
        "Entropy per generated token", "Logit lens", "Residual stream norm per layer", "Attention pattern"]
    assert len(at.get("download_button")) == 4 * 5  # PNG SVG PDF CSV JSON under each figure


def test_trace_explorer_widgets_change_what_is_shown():
    at = open_page("trace_explorer")
    at.button(key="generate").click().run()
    by_entropy = at.html[0].proto.body
    at.radio(key="colour_by").set_value("log-prob").run()
    assert at.html[0].proto.body != by_entropy  # same tokens, other shading

    def attention_spec():
        return next(c.proto.spec for c in at.get("plotly_chart") if "Attention pattern" in c.proto.spec)

    before = attention_spec()
    at.selectbox(key="attn_head").set_value(2).run()
    assert_clean(at)
    assert attention_spec() != before and "head 2" in attention_spec()

    lens = next(s for s in at.slider if s.key.startswith("lens_window_"))
    n = lens.max
    lens.set_value((n - 3, n)).run()
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Logit lens" in c.proto.spec))
    assert len(spec["data"][0]["x"]) == 3


def test_reopening_the_trace_explorer_shows_the_finished_generation_at_once():
    first = open_page("trace_explorer", max_new_tokens=6)
    first.button(key="generate").click().run()
    again = open_page("trace_explorer", max_new_tokens=6)  # a new session, same prompt and settings
    assert again.html and again.html[0].proto.body == first.html[0].proto.body
    assert len(again.get("plotly_chart")) == 4


def test_a_user_error_is_an_st_error_not_a_traceback():
    at = open_page("trace_explorer")
    at.text_area(key="prompt").set_value("   ").run()
    assert_clean(at)
    assert "prompt is empty" in at.error[0].value


def test_an_unknown_model_is_reported_in_the_sidebar(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "no-such-model")
    at = open_page("home")
    assert_clean(at)
    assert "unknown model id" in at.sidebar.error[0].value


def test_steering_scale_slider_changes_the_steered_text():
    at = open_page("steering", max_new_tokens=12)
    assert_clean(at)
    unsteered, steered = (t.value for t in at.text)
    at.slider(key="steer_scale").set_value(-12.0).run()
    assert_clean(at)
    unsteered_after, steered_after = (t.value for t in at.text)
    assert unsteered_after == unsteered, "the baseline does not depend on the slider"
    assert steered_after != steered
    at.slider(key="steer_scale").set_value(0.0).run()
    assert at.text[1].value == unsteered, "scale 0 is no steering"


def test_steering_direction_at_another_layer_and_reduction():
    at = open_page("steering", max_new_tokens=6)
    caption = at.caption[0].value
    at.radio(key="steer_reduce").set_value("last").run()
    assert_clean(at)
    assert at.caption[0].value != caption  # another direction, another norm


# ----------------------------------------------------------------- read-outs by hand

def _hand_trace() -> Trace:
    acts = {"resid_post.0": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
            "resid_post.1": torch.tensor([[0.0, 1.0], [3.0, 0.0]])}
    return Trace("ab", [0, 1], ["a", "b"], acts, torch.tensor([math.nan, -1.0]), torch.tensor([0.5, 0.5]))


def test_logit_lens_against_a_hand_computation():
    unembed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])  # vocab of 3, d_model 2
    lens = logit_lens(_hand_trace(), lambda h: 2 * h, unembed, decode=lambda i: "xyz"[i])
    # layer 0: [2,0] -> logits [2,0,-2] (x); [0,4] -> [0,4,-4] (y)
    # layer 1: [0,2] -> logits [0,2,-2] (y); [6,0] -> [6,0,-6] (x)
    assert lens.layers == [0, 1]
    assert lens.top_tokens == [["x", "y"], ["y", "x"]]
    assert lens.top_ids.tolist() == [[0, 1], [1, 0]]

    def top(a):  # softmax probability of the largest of logits (a, 0, -a)
        return math.exp(a) / (math.exp(a) + 1 + math.exp(-a))

    assert lens.top_probs.flatten().tolist() == pytest.approx([top(2), top(4), top(2), top(6)], rel=1e-6)
    assert lens.window(1, 2).to_dict()["positions"] == [1]


def test_logit_lens_at_the_last_layer_is_the_models_own_prediction(engine):
    trace = engine.trace("Sara has 9 pencils.", capture=resid_sites(2) + ["logits"])
    lens = logit_lens(trace, *lens_readout(engine))
    probs = torch.softmax(trace.activations["logits"].float(), dim=-1)
    assert lens.top_ids[-1].tolist() == probs.argmax(-1).tolist()
    assert lens.top_probs[-1] == pytest.approx(probs.max(-1).values.numpy(), abs=1e-5)


def test_residual_norms_and_attention_pattern_by_hand():
    norms = residual_norms(_hand_trace())
    assert norms.norms.tolist() == [[1.0, 2.0], [1.0, 3.0]]
    trace = _hand_trace()
    trace.activations["attn_pattern.0"] = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.25, 0.75], [0.5, 0.5]]])
    assert attention_pattern(trace, 0, 1).weights.tolist() == [[1.0, 0.0], [0.5, 0.5]]
    with pytest.raises(BadInputError, match="head 5 out of range"):
        attention_pattern(trace, 0, 5)


def test_diff_of_means_steering_changes_the_greedy_text(engine):
    v = diff_of_means_direction(engine, ["I love it", "so happy"], ["I hate it", "so sad"], "resid_post.0")
    assert v.shape == (64,)
    same = steered_comparison(engine, "Today I feel", "resid_post.0", v, scale=0.0, max_new_tokens=6)
    assert same.steered_text == same.unsteered_text
    moved = steered_comparison(engine, "Today I feel", "resid_post.0", v, scale=10.0, max_new_tokens=6)
    assert moved.steered_text != moved.unsteered_text
    with pytest.raises(BadInputError, match="prompt set B is empty"):
        diff_of_means_direction(engine, ["a"], ["  "], "resid_post.0")
    with pytest.raises(BadInputError, match="width 3"):
        steered_comparison(engine, "Today", "resid_post.0", torch.ones(3), scale=1.0, max_new_tokens=2)


# ----------------------------------------------------------------- figures and export

def _records(engine, n=5):
    return records_data(list(engine.generate("Sara has 9 pencils.", max_new_tokens=n)))


def test_tokens_html_has_one_span_per_token_with_its_alternatives(engine):
    data = _records(engine)
    html = tokens_html([{"text": t, "entropy": e, "logprob": lp, "top_tokens": tt, "top_probs": tp}
                        for t, e, lp, tt, tp in zip(*data.values())])
    assert html.count("<span") == 5 and html.count("title=") == 5
    assert "<script" not in html and "http" not in html  # no CDN, nothing to fetch


def test_every_figure_rebuilds_from_its_exported_json(engine):
    trace = engine.trace("Sara has 9 pencils.", capture=resid_sites(2) + ["attn_pattern.1"])
    cmp = steered_comparison(engine, "Today", "resid_post.0", torch.ones(64), scale=2.0, max_new_tokens=3)
    results = {"entropy": _records(engine), "logit_lens": logit_lens(trace, *lens_readout(engine)),
               "attention": attention_pattern(trace, 1, 0), "residual_norms": residual_norms(trace), "steering": cmp}
    assert set(results) == set(FIGURES)
    assert set(FIGURES) <= set(figure_registry()), "`thoughtscope export` knows every figure"
    for name, result in results.items():
        fig = FIGURES[name](json.loads(data_json(result)))
        assert fig.layout.template.layout.colorway, f"{name} uses the project template"
        assert data_rows(result), name


def test_data_csv_is_long_format_over_the_largest_matrix_and_json_has_no_nan():
    lens = logit_lens(_hand_trace(), lambda h: h, torch.eye(2), decode=lambda i: "xy"[i])
    header, *rows = data_csv(lens).strip().splitlines()
    assert header.split(",")[:2] == ["row", "col"] and "top_tokens" in header and len(rows) == 4
    assert json.loads(data_json({"logprobs": [math.nan, -1.0]})) == {"logprobs": [None, -1.0]}


def test_export_writes_a_valid_svg_and_a_pdf(engine):
    fig = entropy_figure(_records(engine))
    root = ET.fromstring(figure_bytes(fig, "svg"))
    assert root.tag.endswith("svg")
    assert figure_bytes(fig, "pdf").startswith(b"%PDF")
    assert figure_bytes(fig, "png").startswith(b"\x89PNG")


def test_export_command_rebuilds_a_figure_from_result_json(engine, tmp_path):
    import typer
    from typer.testing import CliRunner

    from app.cli import register

    cli = typer.Typer()
    register(cli)
    trace = engine.trace("2 + 2 =", capture=resid_sites(2))
    (tmp_path / "lens.json").write_text(data_json(logit_lens(trace, *lens_readout(engine))))
    result = CliRunner().invoke(cli, ["export", "logit_lens", "--from", str(tmp_path / "lens.json"),
                                      "--format", "svg,pdf,csv", "--out", str(tmp_path / "figs")])
    assert result.exit_code == 0, result.output
    assert ET.parse(tmp_path / "figs" / "logit_lens.svg").getroot().tag.endswith("svg")
    assert (tmp_path / "figs" / "logit_lens.pdf").read_bytes()[:4] == b"%PDF"
    assert (tmp_path / "figs" / "logit_lens.csv").read_text().startswith("row,col")


# ----------------------------------------------------------------- the other backend, the SAE source

@pytest.fixture(scope="module")
def model_server():
    """`thoughtscope serve --model tiny-random:llama` on a free loopback port."""
    import socket
    import subprocess
    import sys
    import time

    from probes.client import RemoteBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "from probes.cli import main; main()", "serve", "--model", MODEL,
                             "--port", str(port), "--log-level", "warning"],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                RemoteBackend(url, timeout=2).ready()
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the model server did not start")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pages_run_against_the_model_server(model_server, monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", model_server)
    at = open_page("trace_explorer")
    assert at.radio(key="backend_kind").value == "server"
    at.button(key="generate").click().run()
    assert_clean(at)
    assert at.html[0].proto.body.count('class="ts-tok"') == 8
    assert "in-process backend" in at.info[0].value  # the lens needs weights the server keeps
    assert len(at.get("plotly_chart")) == 3  # entropy, residual norms, attention
    steer = open_page("steering", max_new_tokens=6)
    assert_clean(steer)
    assert len(steer.text) == 2


def test_a_server_that_does_not_answer_is_an_error_in_the_sidebar(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", "http://127.0.0.1:9")  # nothing listens on the discard port
    at = open_page("home")
    assert_clean(at)
    assert "no answer from the model server" in at.sidebar.error[0].value


def test_steering_from_a_saved_sae_feature(engine, tmp_path):
    from saes.io import save_sae
    from saes.train import SAETrainSettings, train_sae

    from analyses.steering import sae_feature_direction

    sae, _ = train_sae(torch.randn(256, 64), SAETrainSettings(d_sae=16, batch_size=64, steps=5, progress=False))
    save_sae(sae, tmp_path / "sae")
    v = sae_feature_direction(str(tmp_path / "sae"), 3, d_model=64, site="resid_post.1")
    assert torch.allclose(v, sae.W_dec[3].detach().float())
    with pytest.raises(BadInputError, match="feature 16 out of range"):
        sae_feature_direction(str(tmp_path / "sae"), 16, d_model=64)
    with pytest.raises(BadInputError, match="width 64"):
        sae_feature_direction(str(tmp_path / "sae"), 0, d_model=576)

    at = open_page("steering", max_new_tokens=6)
    at.radio(key="steer_source").set_value("a saved SAE feature").run()
    assert "folder of an SAE" in at.info[0].value
    at.text_input(key="steer_sae").set_value(str(tmp_path / "sae")).run()
    assert_clean(at)
    assert len(at.text) == 2 and at.text[1].value
