"""The Streamlit workbench: every page under AppTest on tiny-random:llama, the trace read-outs by hand,
and figure export (SVG that parses, a PDF that starts with %PDF, tidy CSV, JSON with provenance, the
`export` command)."""

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

from analyses.logit_lens import attention_pattern, logit_lens, resid_sites, residual_norms  # noqa: E402
from analyses.steering import diff_of_means_direction, steered_comparison  # noqa: E402
from app.export import data_csv, data_json, data_rows, figure_bytes, figure_registry  # noqa: E402
from app.figures.trace import FIGURES, entropy_figure, records_data, tokens_html  # noqa: E402
from app.registry import discover_pages  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402
from probes.records import Readout, Trace  # noqa: E402

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


def test_home_names_the_model_in_full_and_links_the_docs():
    at = open_page("home")
    model_line = next(m.value for m in at.markdown if m.value.startswith("**Model**"))
    assert f"`{MODEL}`" in model_line  # the whole id, never cut like a metric would
    assert "tiny-random:llama" in at.sidebar.caption[0].value
    models = at.sidebar.selectbox(key="model_pick").options
    toys = ["toy-reasoner", "toy-reasoner:small", "toy-moe", "toy-moe:small", "toy-vlm", "toy-vlm:small"]
    assert models[:7] == ["smollm2-135m", *toys]  # the toys and their small variants open from the sidebar
    pages = " ".join(m.value for m in at.markdown)
    assert "METHODS.md" not in pages  # a file outside the repository
    assert "docs/app.md" in [e.label for e in at.expander]
    # a document is drawn when its expander is opened (all of them drawn hidden held a new tab's Home)
    heading = "### A new tab's first figure: the static preview"
    assert not any(heading in m.value for m in at.markdown)
    at.session_state["home-doc-app"] = True  # the user opens docs/app.md
    at.run()
    assert_clean(at)
    assert [e.label for e in at.expander if any(heading in m.value for m in e.markdown)] == ["docs/app.md"]


def test_trace_explorer_streams_tokens_then_draws_every_figure():
    at = open_page("trace_explorer")
    assert not at.get("plotly_chart"), "nothing is drawn before Generate"
    at.button(key="generate").click().run()
    assert_clean(at)
    html = at.html[0].proto.body
    assert html.count('class="ts-tok"') + html.count('class="ts-tok ts-special"') == 8
    assert html.count('class="ts-tip"') == 8 and "top alternatives" in html  # a tooltip on every token
    assert "title=" not in html  # real tooltips, not the browser's plain title text
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert [t.split(":")[0].split(",")[0] for t in titles] == [
        "Entropy per generated token", "Logit lens", "Residual stream norm per layer", "Attention pattern"]
    assert len(at.get("download_button")) == 4 * 5  # PNG SVG PDF CSV JSON under each figure


def test_the_lens_writes_a_token_in_every_cell_at_the_default_size():
    """30 layers x 32 positions (the embedded model's default view) still carries its labels."""
    from app.figures.trace import logit_lens_figure, logit_lens_next_figure

    layers, n = list(range(30)), 32
    data = {"tokens": [f"t{j}" for j in range(n)], "layers": layers, "positions": list(range(100, 100 + n)),
            "top_ids": [[1] * n for _ in layers], "top_tokens": [[" answer"] * n for _ in layers],
            "top_probs": [[0.5] * n for _ in layers], "prompt_len": 110, "next_tokens": ["x"] * n,
            "next_probs": [[0.25] * n for _ in layers], "next_ranks": [[2] * n for _ in layers]}
    fig = logit_lens_figure(data)
    heat = fig.data[0]
    assert heat.texttemplate == "%{text}" and heat.textfont.size >= 10
    assert heat.text[0][0] == " ans\u2026"  # cut to fit a cell (the hover has the whole token)
    assert list(fig.layout.xaxis.ticktext[:2]) == ["t0", "t1"]
    assert fig.layout.template.layout.xaxis.automargin  # titles make room below rotated ticks
    assert fig.layout.meta["export_width"] >= 40 * n  # the export is wide enough for the labels
    assert [s.x0 for s in fig.layout.shapes] == [109.5]  # the prompt | generation boundary
    nxt = logit_lens_next_figure(data).data[0]
    assert nxt.text[0][0] == "3" and nxt.z[0][0] == 0.25  # rank (1-based) and probability of the next token


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
    spec = json.loads(attention_spec())
    assert len(spec["layout"]["xaxis"]["ticktext"]) == len(spec["data"][0]["x"])  # a token label on every key
    at.selectbox(key="attn_head").set_value("all heads").run()
    assert_clean(at)
    grid = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Every head of layer" in c.proto.spec))
    assert len(grid["data"]) == 4  # tiny-random:llama has 4 heads: one small pattern each

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


def test_a_user_error_shows_next_to_its_control_and_keeps_the_page():
    at = open_page("trace_explorer")
    at.text_area(key="prompt").set_value("   ").run()
    assert_clean(at)
    assert "prompt is empty" in at.error[0].value
    assert at.button(key="generate")  # the Generate button is still there, above the message
    assert at.radio(key="colour_by")


def test_an_unknown_model_is_reported_in_the_sidebar(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "no-such-model")
    at = open_page("home")
    assert_clean(at)
    assert "unknown model id" in at.sidebar.error[0].value


def test_steering_scale_slider_changes_the_steered_text():
    from app.views.steering import GRID

    at = open_page("steering", max_new_tokens=12)
    assert_clean(at)
    slider = at.select_slider(key="steer_scale")  # snaps to the measured stops (app.views.steering.GRID)
    assert "\u00d7 mean \u2016resid_post.1\u2016" in slider.label  # the unit is stated on the slider
    unsteered, steered = (t.value for t in at.text[:2])
    slider.set_value(GRID[0]).run()
    assert_clean(at)
    unsteered_after, steered_after = (t.value for t in at.text[:2])
    assert unsteered_after == unsteered, "the baseline does not depend on the slider"
    assert steered_after != steered and steered_after.strip()
    at.select_slider(key="steer_scale").set_value(0.0).run()
    assert at.text[1].value == unsteered, "scale 0 is no steering"


def test_a_steering_sweep_renders_every_scale_with_its_perplexity():
    at = open_page("steering", max_new_tokens=6)
    at.multiselect(key="steer_sweep_scales").set_value([-1.0, 0.5, 1.0]).run()
    at.button(key="steer_sweep_run").click().run()
    assert_clean(at)
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Steering sweep" in c.proto.spec))
    assert spec["data"][0]["x"] == [-1.0, 0.5, 1.0]
    assert all(p > 1.0 for p in spec["data"][0]["y"])  # a perplexity under the unsteered model per scale
    boxes = [t.value for t in at.text[2:]]
    assert len(boxes) == 3 and all(b.strip() for b in boxes)  # the three steered texts, side by side


def test_steering_direction_at_another_layer_and_reduction():
    at = open_page("steering", max_new_tokens=6)
    caption = at.caption[0].value
    at.radio(key="steer_reduce").set_value("last").run()
    assert_clean(at)
    assert at.caption[0].value != caption  # another direction, another norm
    at.selectbox(key="steer_layer").set_value(0).run()
    assert_clean(at)
    assert "resid_post.0" in at.select_slider(key="steer_scale").label


# ----------------------------------------------------------------- read-outs by hand

def _hand_trace() -> Trace:
    acts = {"resid_post.0": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
            "resid_post.1": torch.tensor([[0.0, 1.0], [3.0, 0.0]])}
    return Trace("ab", [0, 1], ["a", "b"], acts, torch.tensor([math.nan, -1.0]), torch.tensor([0.5, 0.5]))


class HandBackend:
    """A backend whose final norm and unembedding are given by hand (readout as `Engine.readout` does it)."""

    def __init__(self, norm, unembed, words):
        self.norm, self.unembed, self.words = norm, unembed, words

    def readout(self, vectors, *, norm=True, top_k=10, bottom_k=0, token_ids=None):
        logits = (self.norm(vectors) if norm else vectors) @ self.unembed.T
        probs = logits.softmax(-1)
        tv, ti = logits.topk(top_k, dim=-1)
        chosen = logits.gather(-1, torch.tensor(token_ids).view(-1, 1))
        return Readout(ti, tv, probs.gather(-1, ti), ti[:, :0], tv[:, :0],
                       probs.gather(-1, torch.tensor(token_ids).view(-1, 1)).view(-1), (logits > chosen).sum(-1))

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_logit_lens_against_a_hand_computation():
    unembed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])  # vocab of 3, d_model 2
    lens = logit_lens(_hand_trace(), HandBackend(lambda h: 2 * h, unembed, "xyz"))
    # layer 0: [2,0] -> logits [2,0,-2] (x); [0,4] -> [0,4,-4] (y)
    # layer 1: [0,2] -> logits [0,2,-2] (y); [6,0] -> [6,0,-6] (x)
    assert lens.layers == [0, 1]
    assert lens.top_tokens == [["x", "y"], ["y", "x"]]
    assert lens.top_ids.tolist() == [[0, 1], [1, 0]]

    def top(a):  # softmax probability of the largest of logits (a, 0, -a)
        return math.exp(a) / (math.exp(a) + 1 + math.exp(-a))

    assert lens.top_probs.flatten().tolist() == pytest.approx([top(2), top(4), top(2), top(6)], rel=1e-6)
    # the next token after position 0 is "b" (id 1): rank 1 at layer 0 (x wins), rank 0 at layer 1
    assert lens.next_ranks[:, 0].tolist() == [1, 0] and lens.next_ranks[:, 1].tolist() == [-1, -1]
    assert lens.next_probs[1, 0] == pytest.approx(top(2), rel=1e-6) and math.isnan(lens.next_probs[0, 1])
    assert lens.window(1, 2).to_dict()["positions"] == [1]


def test_logit_lens_at_the_last_layer_is_the_models_own_prediction(engine):
    trace = engine.trace("Sara has 9 pencils.", capture=resid_sites(2) + ["logits"])
    lens = logit_lens(trace, engine)
    probs = torch.softmax(trace.activations["logits"].float(), dim=-1)
    assert lens.top_ids[-1].tolist() == probs.argmax(-1).tolist()
    assert lens.top_probs[-1] == pytest.approx(probs.max(-1).values.numpy(), abs=1e-5)
    following = torch.tensor(trace.token_ids[1:])
    assert lens.next_probs[-1, :-1] == pytest.approx(probs[:-1].gather(-1, following.view(-1, 1)).view(-1).numpy(),
                                                     abs=1e-5)


def test_residual_norms_and_attention_pattern_by_hand():
    norms = residual_norms(_hand_trace())
    assert norms.norms.tolist() == [[1.0, 2.0], [1.0, 3.0]]
    trace = _hand_trace()
    trace.activations["attn_pattern.0"] = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.25, 0.75], [0.5, 0.5]]])
    assert attention_pattern(trace, 0, 1).weights.tolist() == [[1.0, 0.0], [0.5, 0.5]]
    with pytest.raises(BadInputError, match="head 5 out of range"):
        attention_pattern(trace, 0, 5)
    # a window from position 1: every head, the weight on keys before the window kept as `earlier`
    tail = attention_pattern(trace, 0, None, start=1, prompt_len=1)
    assert tail.weights.tolist() == [[[0.75]], [[0.5]]] and tail.earlier.tolist() == [[0.25], [0.5]]
    assert tail.to_dict()["positions"] == [1] and tail.heads == [0, 1]


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


def test_tokens_html_has_one_span_per_token_with_a_tooltip_and_hides_special_tokens(engine):
    records = [r.to_dict() for r in engine.generate("Sara has 9 pencils.", max_new_tokens=5)]
    records[-1] = {**records[-1], "text": "<|im_end|>", "token_id": 7}
    html = tokens_html(records, special=[7])
    assert html.count('class="ts-tok"') == 4 and html.count('class="ts-tok ts-special"') == 1
    assert html.count('role="tooltip"') == 5 and "title=" not in html
    assert "&lt;|im_end|&gt;" not in html.split("ts-special")[1].split("ts-tip")[0]  # not printed as text
    assert "<script" not in html and "http" not in html  # no CDN, nothing to fetch


def test_display_text_hides_special_tokens_and_never_shows_an_empty_box():
    from app.figures.trace import display_text

    assert display_text(["Hi", " there", "<|im_end|>"], [1, 2, 3], special=[3]) == "Hi there"
    blank = display_text(["\n", "\n", " "], [5, 5, 6])
    assert blank.strip() and "\u21b5" in blank and "3 tokens, whitespace only" in blank


def _results(engine) -> dict:
    from analyses.steering import steering_sweep

    trace = engine.trace("Sara has 9 pencils.", capture=resid_sites(2) + ["attn_pattern.1"])
    cmp = steered_comparison(engine, "Today", "resid_post.0", torch.ones(64), scale=2.0, max_new_tokens=3)
    sweep = steering_sweep(engine, "Today", "resid_post.0", torch.ones(64), [-1.0, 1.0], max_new_tokens=3)
    lens = logit_lens(trace, engine, prompt_len=3)
    return {"entropy": _records(engine), "logit_lens": lens, "logit_lens_next": lens,
            "attention": {**attention_pattern(trace, 1, 0, start=2).to_dict(), "scale": "linear"},
            "attention_heads": attention_pattern(trace, 1, None, prompt_len=4).to_dict(),
            "residual_norms": residual_norms(trace), "steering": cmp, "steering_sweep": sweep}


def test_every_figure_rebuilds_from_its_exported_json(engine):
    results = _results(engine)
    assert set(results) == set(FIGURES)
    assert set(FIGURES) <= set(figure_registry()), "`thoughtscope export` knows every figure"
    for name, result in results.items():
        fig = FIGURES[name](json.loads(data_json(result)))
        assert fig.layout.template.layout.colorway, f"{name} uses the project template"
        assert data_rows(result), name


def test_every_csv_is_tidy_one_row_per_observation(engine):
    """No value repeated per top-k alternative, no text repeated per row, one column per variable."""
    import csv
    import io

    results = _results(engine)
    tables = {name: list(csv.DictReader(io.StringIO(data_csv(result, name)))) for name, result in results.items()}
    entropy = tables["entropy"]
    assert len(entropy) == 5 and {"alt1_token", "alt1_prob", "alt5_prob"} <= set(entropy[0])  # one row per token
    lens = tables["logit_lens"]
    assert len(lens) == 2 * len(results["logit_lens"].tokens) and {"layer", "position", "top_token", "next_rank"} \
        <= set(lens[0])
    steering = tables["steering"]
    assert len(steering) == 2 * 3 and "text" not in steering[0]  # one row per (generation, step)
    sweep = tables["steering_sweep"]
    assert [float(r["scale"]) for r in sweep] == [-1.0, 1.0] and float(sweep[0]["perplexity"]) > 1
    heads = tables["attention_heads"]
    n = len(results["attention_heads"]["tokens"])
    assert len(heads) == 4 * n * (n + 1) // 2  # every head, causal (query, key) pairs
    # the generic layout (figures without a TABLES entry): 2-D points are one row, long texts stay out
    rows = data_rows({"coords": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], "labels": ["a", "b", "c"],
                      "text": "x" * 200, "site": "resid_post.1"})
    assert rows == [{"index": i, "labels": lab, "coords_1": x, "coords_2": y, "site": "resid_post.1"}
                    for i, (lab, x, y) in enumerate([("a", 0.1, 0.2), ("b", 0.3, 0.4), ("c", 0.5, 0.6)])]
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
    (tmp_path / "lens.json").write_text(data_json(logit_lens(trace, engine)))
    result = CliRunner().invoke(cli, ["export", "logit_lens", "--from", str(tmp_path / "lens.json"),
                                      "--format", "svg,pdf,csv", "--out", str(tmp_path / "figs")])
    assert result.exit_code == 0, result.output
    assert ET.parse(tmp_path / "figs" / "logit_lens.svg").getroot().tag.endswith("svg")
    assert (tmp_path / "figs" / "logit_lens.pdf").read_bytes()[:4] == b"%PDF"
    assert (tmp_path / "figs" / "logit_lens.csv").read_text().startswith("layer,position,input_token")


def test_export_command_says_what_a_result_file_lacks(tmp_path):
    """A JSON file that is not the figure's result is refused with the field it lacks, not a traceback."""
    import typer
    from typer.testing import CliRunner

    from app.cli import register
    from app.export import ExportError

    cli = typer.Typer()
    register(cli)
    (tmp_path / "other.json").write_text('{"figure": "entropy"}')
    (tmp_path / "cut.json").write_text('{"tokens": ')
    lacks = CliRunner().invoke(cli, ["export", "entropy", "--from", str(tmp_path / "other.json")])
    assert isinstance(lacks.exception, ExportError)
    assert str(lacks.exception) == f"{tmp_path / 'other.json'} does not hold a result the 'entropy' figure draws " \
                                   "(missing field 'tokens')"
    cut = CliRunner().invoke(cli, ["export", "entropy", "--from", str(tmp_path / "cut.json")])
    assert isinstance(cut.exception, ExportError) and str(cut.exception).startswith(
        f"could not read {tmp_path / 'cut.json'}: ")
    assert not list(tmp_path.glob("*.svg"))


# ----------------------------------------------------------------- the other backend, the SAE source

@pytest.fixture(scope="module")
def model_server(tiny_server_url):
    """`thoughtscope serve --model tiny-random:llama` on a free loopback port: the session's (tests/conftest.py)."""
    return tiny_server_url


def test_pages_run_against_the_model_server(model_server, monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", model_server)
    at = open_page("trace_explorer")
    assert at.radio(key="backend_kind").value == "server"
    at.button(key="generate").click().run()
    assert_clean(at)
    assert at.html[0].proto.body.count('class="ts-tok"') == 8
    assert not at.info  # the logit lens reads out on the server: nothing is refused
    assert len(at.get("plotly_chart")) == 4  # entropy, logit lens, residual norms, attention
    steer = open_page("steering", max_new_tokens=6)
    assert_clean(steer)
    assert len(steer.text) == 2
    browse = open_page("feature_browser")  # capture_batch with positions and readout, through the server
    browse.number_input(key="fb_n").set_value(6).run()
    browse.button(key="fb_index").click().run()
    helpers.finish_jobs(browse)  # the index is a job
    browse.radio(key="fb_kind").set_value("neuron").run()
    assert_clean(browse)
    assert browse.html and "fb-row" in browse.html[0].proto.body


def test_the_method_pages_run_against_the_model_server(model_server, monkeypatch, tmp_path):
    """CoT entropy and RISE through `thoughtscope serve`: no page refuses the server backend."""
    from app import jobs

    monkeypatch.setenv("THOUGHTSCOPE_SERVER", model_server)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    jobs.registry.clear()  # no finished result of an earlier test
    cot = open_page("cot_entropy", max_new_tokens=8)
    cot.slider(key="cot_n_cal").set_value(2).run()
    cot.button(key="cot_calibrate").click().run()
    helpers.finish_jobs(cot)  # the calibration is a job
    assert_clean(cot)
    assert "Calibration densities" in helpers.chart_titles(cot)
    cot.button(key="cot_generate").click().run()
    assert_clean(cot)
    assert "CUSUM statistic" in " ".join(helpers.chart_titles(cot))

    rise = open_page("rise", max_new_tokens=12)
    rise.number_input(key="rise_n").set_value(4)
    rise.number_input(key="rise_sae_steps").set_value(20)
    rise.multiselect(key="rise_layers").set_value([1])
    rise.radio(key="rise_projection").set_value("pca")
    rise.run()
    rise.button(key="rise_run").click().run()
    helpers.finish_jobs(rise)  # harvest and training are a job
    assert_clean(rise)
    assert int(helpers.metric(rise, "Traces")) == 4 and "Decoder columns" in " ".join(helpers.chart_titles(rise))


def test_rlkv_training_through_the_model_server_is_offered_in_process_only(model_server, monkeypatch, tmp_path):
    """The RLKV page on the server backend: the gates live inside the model's attention, so its Train button is
    disabled with the way to train them (in-process, or the command on the server's machine); in-process it is
    enabled and says nothing of the kind."""
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", model_server)
    remote = open_page("rlkv", max_new_tokens=8)
    assert_clean(remote)
    assert remote.radio(key="backend_kind").value == "server"
    assert remote.button(key="rlkv_train_run").disabled
    assert any(c.value.startswith("Training the gates runs in the process that holds the model") for c in remote.caption)
    monkeypatch.delenv("THOUGHTSCOPE_SERVER")
    local = open_page("rlkv", max_new_tokens=8)
    assert_clean(local)
    assert local.radio(key="backend_kind").value == "in-process" and not local.button(key="rlkv_train_run").disabled
    assert not any(c.value.startswith("Training the gates runs in the process") for c in local.caption)


def test_a_switch_on_the_server_backend_loads_the_toy_in_process(model_server, monkeypatch, tmp_path):
    """The visual attribution page through a server of a text model: its switch says the toy runs in this app,
    and one click moves the backend to in-process and the model to toy-vlm, whose stored result the page then
    shows; no request is left waiting. (Before, the click did nothing on the server backend, and the request
    waited to change the model the next time the user picked in-process.)"""
    from app import switch

    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", model_server)
    at = open_page("visual_attribution", None)
    helpers.assert_clean(at)
    assert at.radio(key="backend_kind").value == "server"
    button = at.button(key="va_switch")
    assert button.label == "Switch to toy-vlm (in-process)" and "started with" in button.help
    at = button.click().run()
    helpers.assert_clean(at)
    assert at.radio(key="backend_kind").value == "in-process"
    assert at.selectbox(key="model_pick").value == "toy-vlm" and switch._REQUEST not in at.session_state
    assert any(s.value.startswith("A stored result, made on") and "on `toy-vlm`" in s.value for s in at.success)
    assert any(c.value == "model: `toy-vlm` (in-process)" for c in at.caption)


def test_a_server_that_does_not_answer_is_an_error_in_the_sidebar(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", "http://127.0.0.1:9")  # nothing listens on the discard port
    at = open_page("home")
    assert_clean(at)
    assert "no answer from the model server" in at.sidebar.error[0].value


def test_steering_from_a_saved_sae_feature(engine, tmp_path, monkeypatch):
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
    manual = at.text[1].value

    # An SAE the RISE page saved for this model at the chosen site is offered by name, first
    site = f"{at.selectbox(key='steer_kind').value}.{at.selectbox(key='steer_layer').value}"
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    saved = tmp_path / "cache" / "rise" / "run1" / site
    save_sae(sae, saved)
    (saved / "rise.json").write_text(json.dumps({"model_id": MODEL, "site": site, "quality": {}}))
    at = open_page("steering", max_new_tokens=6)
    at.radio(key="steer_source").set_value("a saved SAE feature").run()
    assert_clean(at)
    choice = at.selectbox(key="steer_sae_saved")
    assert len(choice.options) == 2 and site in choice.value  # the saved one, then "another folder"
    assert not at.text_input  # no folder to type
    assert at.text[1].value == manual  # the same SAE, the same feature 0: the same steered text


class _Kaleido:
    """kaleido's sync API as app.export uses it, failing the first `fails` renders with `error`."""

    def __init__(self, fails: int, error: str):
        self.fails, self.error, self.calls = fails, error, 0

    def calc_fig_sync(self, fig_dict, opts):
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError(self.error)
        return b"<svg><g/></svg>"


NOT_LOADED = "JavascriptError: ReferenceError: kaleido_scopes is not defined"


def test_a_render_asked_before_kaleidos_tab_ran_its_scripts_is_asked_again(monkeypatch):
    import plotly.graph_objects as go

    from app import export

    monkeypatch.setattr(export, "NOT_LOADED_RETRIES_S", (0.0, 0.0, 0.0))
    fig = go.Figure(go.Scatter(y=[1, 2]))
    late = _Kaleido(fails=2, error=NOT_LOADED)
    monkeypatch.setattr(export, "_start_kaleido", lambda: late)
    assert export.figure_bytes(fig, "svg") == b"<svg><g/></svg>" and late.calls == 3
    never = _Kaleido(fails=10, error=NOT_LOADED)  # still failing after every retry: the error, not a hang
    monkeypatch.setattr(export, "_start_kaleido", lambda: never)
    with pytest.raises(export.ExportError, match="kaleido_scopes"):
        export.figure_bytes(fig, "svg")
    assert never.calls == 4
    broken = _Kaleido(fails=1, error="Target closed")  # any other failure is reported at once
    monkeypatch.setattr(export, "_start_kaleido", lambda: broken)
    with pytest.raises(export.ExportError, match="Target closed"):
        export.figure_bytes(fig, "png")
    assert broken.calls == 1
