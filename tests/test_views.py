"""Views a researcher can trust (issue 16): every export carries its provenance, `thoughtscope export`
rebuilds the page's figure byte for byte, the lens and attention read one stored pass, steering reuses
its drafts without changing the text, and stopping `thoughtscope app` leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import apptest_helpers as helpers  # noqa: E402

from analyses.logit_lens import attention_pattern, logit_lens, resid_sites, trace_completion  # noqa: E402
from analyses.steering import (diff_of_means_direction, generate_from_draft, generate_text, site_norm,  # noqa: E402
                               steered_comparison, steering_vector)
from probes.interventions import AddVector  # noqa: E402
from app import export  # noqa: E402

MODEL = "tiny-random:llama"
ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_FIELDS = {"model", "fingerprint", "prompt", "data", "split", "seed", "settings", "interventions", "version"}


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)


@pytest.fixture(scope="module")
def engine():
    from probes import Engine

    return Engine.from_id(MODEL)


@pytest.fixture
def exported(monkeypatch):
    """Every (figure, data, name, provenance, builder) a page hands to its export buttons."""
    seen: list[tuple] = []
    real = export.export_buttons

    def capture(fig, data, name, provenance=None, figure=None):
        seen.append((fig, data, name, provenance if provenance is not None else export.current_provenance(),
                     figure or name))
        real(fig, data, name, provenance, figure)

    monkeypatch.setattr(export, "export_buttons", capture)
    return seen


# ----------------------------------------------------------------- provenance and exact rebuilds

def _run_pages(exported) -> None:
    at = helpers.open_page("trace_explorer", max_new_tokens=6)
    at.button(key="generate").click().run()
    helpers.assert_clean(at)
    at.selectbox(key="attn_head").set_value("all heads").run()
    steer = helpers.open_page("steering", max_new_tokens=6)
    steer.button(key="steer_sweep_run").click().run()
    helpers.assert_clean(steer)


def test_every_exported_json_carries_the_provenance_record(exported):
    _run_pages(exported)
    names = {name for _, _, name, _, _ in exported}
    assert {"entropy", "logit_lens", "residual_norms", "attention", "attention_heads", "steering",
            "steering_sweep"} <= names
    for fig, data, name, record, figure in exported:
        payload = json.loads(export.export_bytes(fig, data, "json", figure, record))
        prov = payload["provenance"]
        assert PROVENANCE_FIELDS <= set(prov), name
        assert prov["model"] == MODEL and len(prov["fingerprint"]) >= 8 and prov["seed"] == 0
        assert prov["settings"]["generation"]["max_new_tokens"] == 6
        assert prov["prompt"][-1]["role"] == "user"  # the chat messages the model got
    steering = next(e for e in exported if e[2] == "steering")
    prov = steering[3]
    from app.views.steering import DEFAULT_SCALE

    assert prov["interventions"][0].startswith(f"add {DEFAULT_SCALE:g} * v") and prov["settings"]["unit"] == "norm"
    assert prov["settings"]["direction"]["source"] == "difference of means"


def test_thoughtscope_export_rebuilds_the_page_figure_byte_for_byte(exported, tmp_path):
    import typer
    from typer.testing import CliRunner

    from app.cli import register

    _run_pages(exported)
    cli = typer.Typer()
    register(cli)
    for fig, data, name, record, figure in exported:
        if name not in ("logit_lens", "attention", "attention_heads", "steering_sweep", "entropy"):
            continue
        source = tmp_path / f"{name}.json"
        source.write_bytes(export.export_bytes(fig, data, "json", figure, record))
        out = tmp_path / name
        result = CliRunner().invoke(cli, ["export", figure, "--from", str(source), "--format", "svg,json", "--out",
                                          str(out)])
        assert result.exit_code == 0, result.output
        rebuilt = export.build_figure(figure, json.loads(source.read_text()))
        assert rebuilt.to_json() == fig.to_json(), name  # the same figure, to the byte
        assert (out / f"{figure}.svg").read_bytes() == export.figure_bytes(fig, "svg"), name
        assert json.loads((out / f"{figure}.json").read_text())["provenance"] == json.loads(source.read_text())["provenance"]


def test_the_png_export_is_as_wide_as_the_lens_needs():
    from app.figures.trace import logit_lens_figure

    n, layers = 32, list(range(30))
    data = {"tokens": ["a"] * n, "layers": layers, "top_ids": [[0] * n for _ in layers],
            "top_tokens": [["b"] * n for _ in layers], "top_probs": [[0.5] * n for _ in layers]}
    png = export.figure_bytes(logit_lens_figure(data), "png")
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width >= 2 * 40 * n and height >= 2 * 22 * len(layers)  # scale 2, and room for every cell and tick


# ----------------------------------------------------------------- one pass, windows

def test_one_pass_holds_what_every_view_reads(engine):
    done = trace_completion(engine, "Sara has 9 pencils.", [16, 17, 18], chat=False)
    assert done.prompt_len == len(engine.encode("Sara has 9 pencils.")) and done.attention_layers == [0, 1]
    again = engine.trace(done.trace.token_ids, capture=resid_sites(2) + ["attn_pattern.1"])
    assert torch.allclose(done.trace.activations["attn_pattern.1"], again.activations["attn_pattern.1"], atol=1e-6)
    heads = attention_pattern(done.trace, 1, None, start=2, prompt_len=done.prompt_len)
    # every query's weights: the window plus the mass on earlier keys sum to one
    assert torch.allclose(torch.tensor(heads.weights).sum(-1) + torch.tensor(heads.earlier), torch.ones(4, len(heads.tokens)),
                          atol=1e-5)
    # a budget too small for the patterns: they are read one layer at a time, on demand
    small = trace_completion(engine, "Sara has 9 pencils.", [16, 17, 18], attention_budget=1)
    assert small.attention_layers == []
    small.pattern_of(engine, 1)
    assert small.attention_layers == [1]


def test_a_lens_window_knows_the_next_token_past_its_end(engine):
    trace = engine.trace("Sara has 9 pencils and 3 pens.", capture=resid_sites(2))
    full, part = logit_lens(trace, engine), logit_lens(trace, engine, 2, 5)
    assert part.top_ids.tolist() == full.top_ids[:, 2:5].tolist()
    assert part.next_ranks.tolist() == full.next_ranks[:, 2:5].tolist()  # position 4's next token is known
    assert part.next_tokens == trace.tokens[3:6] and part.start == 2


# ----------------------------------------------------------------- steering

def test_steering_from_a_draft_is_the_steered_greedy_generation(engine):
    v = diff_of_means_direction(engine, ["I love it", "so happy"], ["I hate it", "so sad"], "resid_post.0")
    norm = site_norm(engine, "Today I feel", "resid_post.0")
    base = generate_text(engine, "Today I feel", max_new_tokens=12)
    kept_any = False
    for scale in (-1.0, -0.1, 0.05, 0.5):
        steer = AddVector("resid_post.0", steering_vector(v, "norm", norm), scale)
        direct = generate_text(engine, "Today I feel", interventions=[steer], max_new_tokens=12)
        fast, kept = generate_from_draft(engine, "Today I feel", base, interventions=[steer], max_new_tokens=12)
        assert fast.token_ids == direct.token_ids and fast.tokens == direct.tokens
        assert fast.entropies == pytest.approx(direct.entropies, abs=1e-4)
        assert fast.logprobs == pytest.approx(direct.logprobs, abs=1e-4)
        kept_any |= kept > 0
    assert kept_any  # small scales keep part of the unsteered text


def test_scales_are_fractions_of_the_site_norm(engine):
    v = torch.randn(64)
    norm = site_norm(engine, "Today I feel", "resid_post.1")
    acts = engine.capture("Today I feel", ["resid_post.1"])["resid_post.1"]
    assert norm == pytest.approx(float(acts[1:].norm(dim=-1).mean()), rel=1e-5)
    cmp = steered_comparison(engine, "Today I feel", "resid_post.1", v, 0.5, unit="norm", max_new_tokens=4, quality=True)
    assert cmp.added_norm == pytest.approx(0.5 * norm, rel=1e-5) and cmp.reference_norm == pytest.approx(norm)
    assert cmp.perplexity > 1.0
    with pytest.raises(Exception, match="zero"):
        steering_vector(torch.zeros(64), "norm", norm)


@pytest.fixture
def model_calls(monkeypatch):
    """The engine's generations and teacher-forced passes made while a test runs (every page shares one engine)."""
    from probes.engine import Engine

    calls: list[str] = []
    for name in ("generate", "trace", "capture", "capture_batch"):
        real = getattr(Engine, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Engine, name, counted)
    return calls


def test_a_slider_move_reads_the_grid_and_shows_the_single_row_generation(engine, exported, model_calls):
    from analyses.steering_defaults import chat_input
    from app.views.steering import DEFAULT_SCALE, GRID, PROMPT, SET_A, SET_B

    at = helpers.open_page("steering", max_new_tokens=7)  # a length no other test uses: nothing cached yet
    helpers.assert_clean(at)
    slider = at.select_slider(key="steer_scale")
    assert f"snaps to the {len(GRID)} stops {GRID[0]:g}, {GRID[1]:g}" in slider.label and slider.options == [
        f"{s:g}" for s in GRID]
    assert model_calls.count("generate") == 1  # one batched generation made every stop (and the unsteered text)
    model_calls.clear()
    moves = (GRID[0], GRID[-1], 0.0)
    for scale in moves:
        at.select_slider(key="steer_scale").set_value(scale).run()
        helpers.assert_clean(at)
    assert model_calls == []  # a move runs no model at all
    site, prompt = "resid_post.1", chat_input(PROMPT)  # the page's own prompt: one user turn
    v = diff_of_means_direction(engine, SET_A.splitlines(), SET_B.splitlines(), site)
    norm = site_norm(engine, prompt, site, chat=True)
    shown = {data["scale"]: data for _, data, name, *_ in exported if name == "steering"}
    assert set(shown) == {DEFAULT_SCALE, *moves}
    for scale in (GRID[0], GRID[-1], DEFAULT_SCALE):
        direct = generate_text(engine, prompt, chat=True, max_new_tokens=7,
                               interventions=[AddVector(site, steering_vector(v, "norm", norm), scale)])
        assert shown[scale]["steered"]["token_ids"] == direct.token_ids, scale
        assert shown[scale]["draft"] == "grid"
    plain = generate_text(engine, prompt, chat=True, max_new_tokens=7)
    assert shown[0.0]["steered"]["token_ids"] == shown[0.0]["unsteered"]["token_ids"] == plain.token_ids
    assert len({tuple(c["steered"]["token_ids"]) for c in shown.values()}) >= 3  # the moves showed different texts


def test_the_greedy_sweep_adds_only_perplexity_passes(model_calls):
    at = helpers.open_page("steering", max_new_tokens=6)
    model_calls.clear()
    at.multiselect(key="steer_sweep_scales").set_value([-0.5, 1.0]).run()
    at.button(key="steer_sweep_run").click().run()
    helpers.assert_clean(at)
    assert "generate" not in model_calls and model_calls.count("trace") <= 3  # two texts, the unsteered one
    boxes = [t.value for t in at.text[2:]]
    assert len(boxes) == 2 and all(b.strip() for b in boxes)


def test_a_sweep_run_in_one_session_is_drawn_only_where_it_was_asked_for(model_calls):
    """The perplexities are kept per process, but another session's Run sweep must not add the sweep's text boxes
    to a fresh page (they shifted every element after them: the stack's text read the sweep's first row)."""
    from app.steering_single import SWEEP_DEFAULT, steered_store

    first = helpers.open_page("steering", max_new_tokens=6)
    first.button(key="steer_sweep_run").click().run()  # the default scales
    helpers.assert_clean(first)
    assert len(first.text) == 2 + len(SWEEP_DEFAULT)  # unsteered, steered, one box per scale
    grids = [g for g in steered_store()._items.values() if hasattr(g, "perplexities")]
    assert any(set(SWEEP_DEFAULT) <= set(g.perplexities) for g in grids)  # the process keeps every perplexity
    fresh = helpers.open_page("steering", max_new_tokens=6)  # a new session, same prompt, settings and direction
    helpers.assert_clean(fresh)
    assert [t.value for t in fresh.text] == [t.value for t in first.text[:2]]  # no sweep boxes it did not ask for
    assert any("Press **Run sweep**" in i.value for i in fresh.info)
    model_calls.clear()
    fresh.button(key="steer_sweep_run").click().run()
    helpers.assert_clean(fresh)
    assert [t.value for t in fresh.text] == [t.value for t in first.text]  # asked for here: the same sweep
    assert "trace" not in model_calls  # read from the process's perplexities, no pass again


def test_sampled_steering_generates_the_scale_alone_from_the_seed(engine, exported):
    from analyses.steering_defaults import chat_input
    from app.views.steering import PROMPT, SET_A, SET_B
    from probes.engine import Sampling

    at = helpers.open_page("steering", max_new_tokens=5)
    at.session_state["temperature"] = 1.0
    at.run()
    at.select_slider(key="steer_scale").set_value(-1.0).run()
    helpers.assert_clean(at)
    shown = [data for _, data, name, *_ in exported if name == "steering" and data["scale"] == -1.0][-1]
    assert shown["draft"] == "none"
    assert any("sampled: generated alone from the seed" in c.value for c in at.caption)
    site = "resid_post.1"
    v = diff_of_means_direction(engine, SET_A.splitlines(), SET_B.splitlines(), site)
    alone = steered_comparison(engine, chat_input(PROMPT), site, v, -1.0, max_new_tokens=5,
                               sampling=Sampling(temperature=1.0), chat=True, unit="norm",
                               reference_norm=shown["reference_norm"])
    assert shown["steered"]["token_ids"] == alone.steered.token_ids
    assert shown["unsteered"]["token_ids"] == alone.unsteered.token_ids


# ----------------------------------------------------------------- no orphaned process

def _children(pid: int) -> list[int]:
    """The direct children of `pid` (none once it has exited and been reaped); psutil: any POSIX system."""
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_stopping_thoughtscope_app_leaves_no_child_process(how):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "thoughtscope", "app", "--headless", "--model", MODEL,
                             "--port", str(port), "--address", "127.0.0.1"], cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the app did not start"
            time.sleep(0.5)
        children = _children(proc.pid)
        assert children, "thoughtscope app runs Streamlit as a child process"
        proc.send_signal(how)
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while any(_alive(c) for c in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(c) for c in children), f"Streamlit outlived `thoughtscope app` after {how.name}"
    finally:
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)


def test_exports_without_their_own_record_carry_the_page_record():
    """What the method pages (CoT, RISE) get for free: the frame's record for the page being drawn."""
    record = {"model": MODEL, "fingerprint": "ab12", "seed": 3}
    assert "provenance" not in json.loads(export.data_json({"x": [1.0]}))
    with export.page_provenance(record):
        assert json.loads(export.data_json({"x": [1.0]}))["provenance"] == record
        own = {"model": MODEL, "fingerprint": "cd34"}
        assert json.loads(export.data_json({"x": [1.0]}, own))["provenance"] == own
    assert export.current_provenance() is None


def test_the_slider_benchmark_times_what_the_page_does(engine):
    from app.bench import GOALS, bench_steer_slider
    from app.views.steering import GRID

    row = bench_steer_slider(engine, moves=(1.0, -0.5), max_new_tokens=5)
    assert row["bench"] == "steer_slider_s" and row["first_draw_rows"] == len(GRID) and row["first_draw_s"] > 0
    assert row["rows_equal_single"] == "3 of 3"  # two moved-to scales and the unsteered row
    assert len(row["runs_s"]) == 2 and row["seconds"] == pytest.approx(sorted(row["runs_s"])[0] / 2
                                                                        + sorted(row["runs_s"])[1] / 2, abs=1e-3)
    assert row["ratio"] == pytest.approx(row["seconds"] / GOALS["steer_slider"], abs=1e-3)
    assert row["from_scratch_s"] > 0 and row["page_first_draw_s"] > 0 and "load_avg_1m" in row
