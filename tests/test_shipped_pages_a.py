"""Shipped results of the CoT entropy, RISE and feature browser pages: each page opens on its stored
result without a click (labelled as stored), never shows one made on other weights, reports a damaged
one, and `thoughtscope ship` rebuilds a shipped result equal to the stored files."""

from __future__ import annotations

import json
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import apptest_helpers as helpers  # noqa: E402

from app import jobs  # noqa: E402
from thoughtscope import numerics, shipped  # noqa: E402

TINY = "tiny-random:llama"
SMOL = "smollm2-135m"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path, request):
    # A private cache, except for SmolLM2's tests: they load its dequantised weights from the user cache (in a
    # private one every test would dequantise the GGUF again, ~15 s); `smollm2_files()` remembers the first
    # folder this process used, so an earlier test's private folder is forgotten first.
    if "model" not in request.keywords:
        monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    else:  # forget a folder an earlier test's private cache left in the process (the tiny models' tokenizer)
        from probes.zoo import smollm2_files

        smollm2_files.cache_clear()
    jobs.registry.clear()  # no finished result of an earlier test (every page keeps its results there)
    yield
    for job in jobs.registry().running():  # a job a page started on opening (RISE's steering): end it here
        job.stop("the test ended")
        job.thread.join(120)
    jobs.registry.clear()


def _engine(model_id: str):
    from probes import Engine

    return Engine.from_id(model_id)


# ----------------------------------------------------------------------------- CoT entropy


def _ship_tiny_calibration(root, fingerprint: str | None = None):
    """The tiny model's calibration at the page's defaults for an 8-token AppTest, shipped under `root`."""
    from analyses.cot_entropy import ship as cot_ship
    from analyses.cot_entropy.calibration import calibrate
    from analyses.families import family_for

    engine = _engine(TINY)
    cal = calibrate(engine, "arith", family_for(TINY), n_calibration=cot_ship.DEFAULTS["n_calibration"],
                    n_development=cot_ship.DEFAULTS["n_development"], max_new_tokens=8)
    folder = shipped.write(cot_ship.NAME, TINY, fingerprint or engine.info()["fingerprint"],
                           {cot_ship.FILE: cal.to_json()}, command="test", root=root)
    return cal, folder


def test_cot_page_opens_on_the_shipped_calibration_and_refuses_other_weights_or_damage(monkeypatch, tmp_path):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TINY)
    monkeypatch.setenv(shipped.ENV, str(tmp_path / "shipped"))
    cal, folder = _ship_tiny_calibration(tmp_path / "shipped")

    at = helpers.open_page("cot_entropy", 8)  # no click
    helpers.assert_clean(at)
    assert not jobs.registry().running()
    assert "Calibration densities" in helpers.chart_titles(at)
    assert any(c.value.startswith("A stored result, made on") and "`test`" in c.value for c in at.caption)
    assert helpers.metric(at, "Uncertain steps (f0)") == str(cal.detector.n_uncertain_)
    assert helpers.metric(at, "h chosen on development") == f"{cal.h:g}"
    assert at.slider(key="cot_h").value == pytest.approx(max(0.1, cal.h))
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Calibration densities" in c.proto.spec))
    curve = cal.detector.to_dict()["curve"]
    assert spec["data"][-1]["y"] == pytest.approx(curve["log_ratio"])  # the stored fit, refitted exactly

    at.slider(key="cot_n_cal").set_value(3).run()  # other settings: the stored result is not the answer
    assert "Calibration densities" not in helpers.chart_titles(at)
    assert any("made with other settings (n_calibration 12)" in i.value for i in at.info)

    manifest = json.loads((folder / shipped.MANIFEST).read_text())
    manifest["fingerprint"] = "0123456789abcdef"  # other weights under the same id
    (folder / shipped.MANIFEST).write_text(json.dumps(manifest))
    at = helpers.open_page("cot_entropy", 8)
    helpers.assert_clean(at)
    assert "Calibration densities" not in helpers.chart_titles(at)
    assert any("Press **Calibrate**" in i.value for i in at.info)

    _ship_tiny_calibration(tmp_path / "shipped")
    data = folder / "calibration.json"
    data.write_text(data.read_text().replace('"n_calibration": 12', '"n_calibration": 13'))  # damaged
    at = helpers.open_page("cot_entropy", 8)
    helpers.assert_clean(at)
    assert "Calibration densities" not in helpers.chart_titles(at)
    assert any("damaged" in w.value and "rebuild" in w.value for w in at.warning)


@pytest.mark.model
def test_cot_page_on_smollm2_opens_on_the_shipped_calibration_with_the_known_answer(monkeypatch):
    from analyses.cot_entropy import ship as cot_ship

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", SMOL)
    monkeypatch.delenv(shipped.ENV, raising=False)
    stored = shipped.find(cot_ship.NAME, SMOL, _engine(SMOL).info()["fingerprint"])
    assert stored, stored.reason
    data = stored.json(cot_ship.FILE)
    from app import export
    from tests.export_helpers import capture_records

    records = capture_records(monkeypatch)
    at = helpers.open_page("cot_entropy", None)  # the sidebar's defaults: 48 tokens, the example question
    helpers.assert_clean(at)
    assert not jobs.registry().running()
    assert "Calibration densities" in helpers.chart_titles(at)
    assert any(c.value == stored.label() for c in at.caption)
    assert at.slider(key="cot_h").value == data["h_choice"]["chosen"]
    # the sidebar's example question is an arith problem: its generator's answer is the known answer
    assert any("Known answer **20**" in c.value for c in at.caption)
    at.button(key="cot_generate").click().run()  # a live trace at once: the detector is the stored one
    helpers.assert_clean(at)
    assert "Intermediate answers (target 20)" in helpers.chart_titles(at)
    probes = int(helpers.metric(at, "Alarm at step").split(" of ")[1]) if " of " in helpers.metric(
        at, "Alarm at step") else None
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "CUSUM statistic" in c.proto.spec))
    n_steps = len(spec["data"][0]["x"])
    assert probes in (None, n_steps) and spec["layout"]["xaxis"]["range"] == [0.4, max(1, n_steps) + 0.6]
    # the trace's figures: the page's record, naming the stored calibration whose detector they use
    assert records["cot_calibration"]["command"] == f"thoughtscope ship {cot_ship.NAME}"
    for name in ("cot_entropy_curve", "cot_cusum", "cot_answer_strip"):
        assert records[name]["command"] == "thoughtscope app", name
        assert records[name]["calibration_run"] == {k: records["cot_calibration"][k] for k in export.RUN_FIELDS}


# ----------------------------------------------------------------------------- RISE


def test_rise_page_opens_on_the_shipped_run_and_refuses_other_weights_or_damage(monkeypatch, tmp_path):
    from analyses.rise import ship as rise_ship

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TINY)
    monkeypatch.setenv(shipped.ENV, str(tmp_path / "shipped"))
    jobs.registry.clear()
    folder = rise_ship.build(TINY, "test", root=tmp_path / "shipped")  # the page's defaults, 48 tokens
    stored = shipped.find(rise_ship.NAME, TINY, _engine(TINY).info()["fingerprint"])
    assert stored, stored.reason
    summary = stored.json("analysis.json")["summary"]

    at = helpers.open_page("rise", 48)  # no click
    helpers.assert_clean(at)
    assert any(c.value.startswith("A stored result, made on") and "`test`" in c.value for c in at.caption)
    assert int(helpers.metric(at, "Traces")) == len(stored.json("harvest.json")["traces"])
    titles = helpers.chart_titles(at)
    assert any(t.startswith("Steps of ") for t in titles) and any(t.startswith("Decoder columns at") for t in titles)
    assert any(t.startswith("Latent ") for t in titles)  # the feature dashboard
    # the analysis rebuilt from the stored files equals the stored summary (UMAP coordinates read, not refitted)
    assert at.selectbox(key="rise_geometry_site").value == summary["best_site"]
    stats = at.dataframe[0].value
    assert list(stats["EV held-out"]) == [round(la["quality"]["heldout"]["explained_variance"], 4)
                                          for la in summary["layers"]]

    at.number_input(key="rise_sae_steps").set_value(20).run()  # other settings: not the stored run
    assert not any(t.startswith("Decoder columns at") for t in helpers.chart_titles(at))
    assert any("made with other settings (sae_steps 300)" in i.value for i in at.info)

    manifest = json.loads((folder / shipped.MANIFEST).read_text())
    (folder / shipped.MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0123456789abcdef"}))
    jobs.registry.clear()
    at = helpers.open_page("rise", 48)
    helpers.assert_clean(at)
    assert not any(t.startswith("Decoder columns at") for t in helpers.chart_titles(at))
    assert any("Press **Harvest + train**" in i.value for i in at.info)

    (folder / shipped.MANIFEST).write_text(json.dumps(manifest))
    (folder / "acts.safetensors").write_bytes((folder / "acts.safetensors").read_bytes()[:-8] + b"\0" * 8)
    at = helpers.open_page("rise", 48)
    helpers.assert_clean(at)
    assert any("damaged (acts.safetensors" in w.value for w in at.warning)
    assert not any(t.startswith("Decoder columns at") for t in helpers.chart_titles(at))


@pytest.mark.model
def test_rise_page_on_smollm2_opens_on_the_shipped_saes(monkeypatch):
    from analyses.rise import ship as rise_ship

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", SMOL)
    monkeypatch.delenv(shipped.ENV, raising=False)
    stored = shipped.find(rise_ship.NAME, SMOL, _engine(SMOL).info()["fingerprint"])
    assert stored, stored.reason
    at = helpers.open_page("rise", None)
    helpers.assert_clean(at)
    assert any(c.value == stored.label() for c in at.caption)
    titles = helpers.chart_titles(at)
    for prefix in ("Steps of ", "Decoder columns at", "Behaviour separation per layer", "Latent "):
        assert any(t.startswith(prefix) for t in titles), (prefix, titles)
    spec = json.loads(next(c.proto.spec for c in at.get("plotly_chart") if "Decoder columns at" in c.proto.spec))
    layout = spec["layout"]
    axes = (layout["xaxis"]["title"]["text"], layout["yaxis"]["title"]["text"])
    assert axes == ("UMAP 1 (cosine)", "UMAP 2 (cosine)")  # the stored UMAP map, not a PCA fallback


# ----------------------------------------------------------------------------- feature browser


def test_feature_browser_opens_on_the_shipped_index_and_refuses_other_weights_or_damage(monkeypatch, tmp_path):
    from analyses.feature_browser import ship as fb_ship

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TINY)
    monkeypatch.setenv(shipped.ENV, str(tmp_path / "shipped"))
    folder = fb_ship.build(TINY, "test", root=tmp_path / "shipped")
    stored = shipped.find(fb_ship.NAME, TINY, _engine(TINY).info()["fingerprint"])
    assert stored, stored.reason
    index = fb_ship.load(stored)

    at = helpers.open_page("feature_browser", None)  # no click
    helpers.assert_clean(at)
    assert not jobs.registry().running()
    assert any(c.value.startswith("A stored result, made on") and "subset of GSM8K" in c.value for c in at.caption)
    assert at.button(key="fb_index").label == "Index again here"  # run again, as a job
    at.radio(key="fb_kind").set_value("neuron").run()
    helpers.assert_clean(at)
    assert int(helpers.metric(at, "Contexts").replace(",", "")) == index.n_contexts
    assert "Top contexts of neuron 0" in " ".join(helpers.chart_titles(at))

    at.number_input(key="fb_n").set_value(0).run()  # the whole corpus: not the stored subset
    assert any("Press **Index the corpus**" in i.value for i in at.info)
    assert not any(c.value.startswith("A stored result") for c in at.caption)

    manifest = json.loads((folder / shipped.MANIFEST).read_text())
    (folder / shipped.MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0123456789abcdef"}))
    at = helpers.open_page("feature_browser", None)
    helpers.assert_clean(at)
    assert not any(c.value.startswith("A stored result") for c in at.caption)
    assert any("Press **Index the corpus**" in i.value for i in at.info)

    (folder / shipped.MANIFEST).write_text(json.dumps(manifest))
    data = folder / "index.safetensors"
    data.write_bytes(data.read_bytes()[:-4] + b"\1\1\1\1")
    at = helpers.open_page("feature_browser", None)
    helpers.assert_clean(at)
    assert any("damaged (index.safetensors" in w.value for w in at.warning)


@pytest.mark.model
def test_feature_browser_on_smollm2_browses_the_shipped_rise_sae_on_the_shipped_index(monkeypatch):
    from analyses.feature_browser import ship as fb_ship

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", SMOL)
    monkeypatch.delenv(shipped.ENV, raising=False)
    stored = shipped.find(fb_ship.NAME, SMOL, _engine(SMOL).info()["fingerprint"])
    assert stored, stored.reason
    at = helpers.open_page("feature_browser", None)  # no click: the stored index, the stored RISE SAE's latent 0
    helpers.assert_clean(at)
    assert any(c.value.startswith(stored.label()) for c in at.caption)
    assert "(the RISE page's stored SAE)" in at.selectbox(key="fb_sae_pick").options[0]
    assert int(helpers.metric(at, "Contexts").replace(",", "")) == fb_ship.load(stored).n_contexts
    assert "SAE latent 0" in " ".join(helpers.chart_titles(at))


@pytest.mark.model
def test_thoughtscope_ship_rebuilds_the_shipped_feature_index_exactly(monkeypatch, tmp_path):
    """The smallest shipped result, rebuilt by its command's build function into a private root: the same
    token ids and activation rows byte for byte (float16, one thread) on the CPU kind it was shipped from,
    within one float16 step elsewhere; the same description."""
    from analyses.feature_browser import ship as fb_ship
    from thoughtscope.cli import shipped_results

    monkeypatch.delenv(shipped.ENV, raising=False)
    stored = shipped.find(fb_ship.NAME, SMOL, _engine(SMOL).info()["fingerprint"])
    assert stored, stored.reason
    default_model, build = shipped_results()[fb_ship.NAME]
    assert default_model == SMOL and stored.command == f"thoughtscope ship {fb_ship.NAME}"
    monkeypatch.setenv(shipped.ENV, str(tmp_path))
    folder = build(SMOL, stored.command)
    rebuilt = shipped.find(fb_ship.NAME, SMOL, stored.manifest["fingerprint"])
    assert rebuilt and rebuilt.folder == folder
    # the same bytes (sha256 of every file) on the float arithmetic it was shipped from; made on another kind
    # of CPU, the same token ids and lengths and activations within one float16 step (0.125 at 165 there)
    assert shipped.rebuild_differences(rebuilt, stored) == []
    if numerics.same_numerics(stored.manifest):
        assert rebuilt.manifest["files"] == stored.manifest["files"]
    assert rebuilt.json("index.json") == stored.json("index.json")
