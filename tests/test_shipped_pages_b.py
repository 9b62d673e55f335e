"""Shipped results on the fuzzy-concepts, MoE-router, visual-attribution pages: opened without a click, refused
when made on other weights, reported when damaged, rebuilt by their own command.

Unit tier: a fuzzy study made by `analyses.fuzzy_concepts.ship.build` on tiny-random:llama into a private
shipped folder (THOUGHTSCOPE_SHIPPED_DIR). Model tier: the files in docs/shipped on SmolLM2, toy-moe
and toy-vlm:small, and one rebuild (visual-attribution, the cheapest) compared with the shipped files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests import apptest_helpers as helpers  # noqa: E402
from tests.test_fuzzy_concepts import DOG_TEXTS  # noqa: E402
from thoughtscope import numerics, shipped  # noqa: E402

REPO_SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "shipped"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """A private store and cache, and no finished jobs or page results of earlier tests."""
    import app.views.fuzzy_concepts as fz
    from app import jobs

    monkeypatch.setattr("cache.store.default_root", lambda: tmp_path / "store")
    for clear in (fz._shipped_found.clear, jobs.registry.clear):
        clear()
    yield
    for clear in (fz._shipped_found.clear, jobs.registry.clear):
        clear()


# ----------------------------------------------------------------------------- unit: the fuzzy page


def _page_options():
    """What the fuzzy page computes from the widgets `_set_widgets` fills (and the sidebar's 8 new tokens)."""
    from analyses.fuzzy_concepts.study import FuzzyOptions

    return FuzzyOptions(word="dog", source="texts", n=20, texts=DOG_TEXTS, where="generated", layer=0, k=2, seeds=2,
                        steps=20, max_new_tokens=8, batch_size=16, seed=0)


def _set_widgets(at):
    at.selectbox(key="fz_source").set_value("texts").run()
    at.text_area(key="fz_texts").set_value("\n".join(DOG_TEXTS))
    at.text_input(key="fz_word").set_value("dog")
    for key, value in (("fz_k", 2), ("fz_n", 20), ("fz_seeds", 2), ("fz_steps", 20)):
        at.number_input(key=key).set_value(value)
    at.selectbox(key="fz_layer").set_value(0)
    return at.run()


@pytest.fixture(scope="module")
def tiny_shipped(tmp_path_factory):
    """A real shipped fuzzy study of tiny-random:llama (the build function of `thoughtscope ship`)."""
    from analyses.fuzzy_concepts.ship import build
    from probes import Engine

    root = tmp_path_factory.mktemp("shipped")
    folder = build("tiny-random:llama", "thoughtscope ship fuzzy-concepts --model tiny-random:llama", root=root,
                   backend=Engine.from_id("tiny-random:llama"), options=_page_options())
    return root, folder


def _open_fuzzy(monkeypatch, root: Path):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setenv(shipped.ENV, str(root))
    return _set_widgets(helpers.open_page("fuzzy_concepts", 8))


def test_the_fuzzy_page_draws_the_shipped_study_without_a_click(monkeypatch, tiny_shipped):
    root, folder = tiny_shipped
    at = _open_fuzzy(monkeypatch, root)
    helpers.assert_clean(at)
    assert any(s.value.startswith("A stored result, made on ") and "tiny-random:llama" in s.value for s in at.success)
    assert at.button(key="fz_run").label == "Run again with these settings"
    study = json.loads((folder / "study.json").read_text())
    assert helpers.metric(at, "Site") == study["representations"]["site"] == "resid_post.0"
    assert helpers.metric(at, "Samples") == str(study["representations"]["n_samples"])
    titles = helpers.chart_titles(at)
    assert titles[0] == "Fuzzy rules vs baselines on held-out samples (2 seeds, 95% intervals)"
    assert any(t.startswith("Rule firing for") for t in titles)
    # the rule cards are the shipped rules, read back from the shipped layer
    assert sorted(c.value for c in at.code) == sorted(rule["text"] for rule in study["rules"])  # two columns
    # other settings: the page says the stored result was made with others and draws nothing
    at.number_input(key="fz_k").set_value(3).run()
    helpers.assert_clean(at)
    assert any("made with other settings" in i.value for i in at.info) and not at.get("plotly_chart")


def test_a_shipped_study_of_other_weights_is_not_shown(monkeypatch, tiny_shipped, tmp_path):
    import shutil

    root, folder = tiny_shipped
    other = tmp_path / "other"
    shutil.copytree(root, other)
    manifest_path = other / folder.relative_to(root) / shipped.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["fingerprint"] = "0123456789abcdef"  # the same id, other weights
    manifest_path.write_text(json.dumps(manifest))
    at = _open_fuzzy(monkeypatch, other)
    helpers.assert_clean(at)
    assert not at.success and not at.get("plotly_chart")
    assert any("other weights of tiny-random:llama" in i.value for i in at.info)


def test_a_damaged_shipped_study_is_reported_and_not_used(monkeypatch, tiny_shipped, tmp_path):
    import shutil

    root, folder = tiny_shipped
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    study = broken / folder.relative_to(root) / "study.json"
    study.write_text(study.read_text().replace('"dog"', '"cat"', 1))
    at = _open_fuzzy(monkeypatch, broken)
    assert not at.exception and not at.success and not at.get("plotly_chart")
    (warning,) = at.warning
    assert "is damaged (study.json does not match its checksum)" in warning.value
    assert "Harvest + fit" in warning.value  # the page offers to make it here


def test_a_shipped_study_reads_back_as_the_study_that_made_it(tiny_shipped):
    """`load_study` on the shipped files: the same explanations and reconstructions as a fresh run."""
    from analyses.fuzzy_concepts import run_study
    from analyses.fuzzy_concepts.ship import load_study
    from cache.store import ActivationStore
    from probes import Engine

    root, folder = tiny_shipped
    found = shipped.find("fuzzy-concepts", "tiny-random:llama", None, root=root)
    loaded = load_study(found)
    fresh = run_study(Engine.from_id("tiny-random:llama"), _page_options(), store=ActivationStore(root / "fresh"))
    row = loaded.splits["eval"][0]
    assert loaded.splits == fresh.splits
    assert loaded.explain(row)["firing"] == pytest.approx(fresh.explain(row)["firing"], abs=1e-6)
    assert [r.text() for r in loaded.rules] == [r.text() for r in fresh.rules]
    assert loaded.metric_table() == fresh.metric_table()


# ----------------------------------------------------------------------------- model tier: docs/shipped


@pytest.mark.model
def test_the_fuzzy_page_opens_on_smollm2s_shipped_study(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    at = helpers.open_page("fuzzy_concepts", None)  # the sidebar's defaults: the shipped study's settings
    helpers.assert_clean(at)
    found = shipped.find("fuzzy-concepts", "smollm2-135m", None, root=REPO_SHIPPED)
    assert found, found.reason
    assert any(s.value.startswith(found.label()) for s in at.success)
    study = found.json("study.json")
    shown = at.dataframe[0].value
    assert list(shown["method"]) == ["fuzzy", "semi-NMF", "k-means", "PCA"]
    mean = study["metric_table"][0]["reconstruction_error"]
    assert shown["reconstruction error"][0].startswith(f"{mean:.3f} [")
    assert sorted(c.value for c in at.code) == sorted(rule["text"] for rule in study["rules"])  # two columns


@pytest.mark.model
def test_the_moe_page_opens_on_the_toys_shipped_result_and_a_dense_model_switches_to_it(monkeypatch):
    from analyses.moe_router.ship import DEFAULT_MODEL as toy

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    at = helpers.open_page("moe_router", None)
    helpers.assert_clean(at)
    assert [b.label for b in at.button] == [f"Switch to {toy}"]
    at.button[0].click().run()  # one click: the sidebar loads the toy and the page runs on it
    helpers.assert_clean(at)
    assert at.session_state["model_pick"] == toy
    found = shipped.find("moe-router", toy, None, root=REPO_SHIPPED)
    assert any(s.value.startswith(found.label()) for s in at.success)  # now its own stored result
    titles = helpers.chart_titles(at)
    assert titles[0].startswith(f"Router profile on {toy}")
    assert any(t.startswith("Where 4 samples part") for t in titles)
    assert "pass@n on 12 evaluation problems (95% bootstrap intervals)" in titles
    # the samples' routing parts: the divergence the figure draws is not empty
    from analyses.moe_router.maps import routing_divergence
    from analyses.moe_router.ship import map_from_dict

    divergence = routing_divergence(map_from_dict(found.json("map.json")))["divergence"]
    assert np.nanmax(divergence) > 0


def test_a_switch_button_moves_the_model_box_without_a_streamlit_warning(monkeypatch):
    """The visual attribution page on a text model offers toy-vlm's stored result and a switch to it; one click
    and the sidebar's box holds toy-vlm (its state written, so a browser's box moves too), and Streamlit logs
    nothing: an index passed beside that state made it log "created with a default value but also had its
    value set via the Session State API" (with a stack) on every switch's first run."""
    import logging

    import streamlit.elements.lib.policies as policies

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setattr(policies, "_shown_default_value_warning", False)  # logged once a process otherwise
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(policies.__name__)
    logger.addHandler(handler)
    try:
        at = helpers.open_page("visual_attribution", None)
        helpers.assert_clean(at)
        switch = next(b for b in at.button if b.key == "va_switch")
        assert switch.label == "Switch to toy-vlm"
        at = switch.click().run()
    finally:
        logger.removeHandler(handler)
    helpers.assert_clean(at)
    assert at.session_state["model_pick"] == "toy-vlm" and at.selectbox(key="model_pick").value == "toy-vlm"
    found = shipped.find("visual-attribution", "toy-vlm", None, root=REPO_SHIPPED)
    assert any(s.value.startswith(found.label()) for s in at.success)  # now on the toy's own stored result
    assert logged == []


@pytest.mark.model
def test_the_visual_attribution_page_opens_on_the_toys_shipped_estimator_and_study(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "toy-vlm:small")
    at = helpers.open_page("visual_attribution", None)
    helpers.assert_clean(at)
    found = shipped.find("visual-attribution", "toy-vlm:small", None, root=REPO_SHIPPED)
    assert any(s.value.startswith(found.label()) for s in at.success)
    assert any(c.value.startswith("amortized estimator: the shipped one") for c in at.caption)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith("stored: span 0 ") and titles[1].startswith("faithfulness against exhaustive")
    r2 = found.json("study.json")["metrics"]["amortized_r2_all_pairs"]
    assert any(c.value.startswith(f"amortized R^2 over all (span, region) pairs: {r2:.3f}") for c in at.caption)


@pytest.mark.model
def test_rebuilding_the_visual_attribution_result_gives_the_shipped_files(tmp_path):
    """`thoughtscope ship visual-attribution`'s build into a private folder: the estimator's weights and settings
    are byte-identical, and so is every field of the study but `costs` (wall-clock seconds of this run), on the
    CPU kind it was shipped from; elsewhere the same within float tolerance (see below)."""
    from analyses.visual_attribution.ship import DEFAULT_MODEL, NAME, build
    from probes import Engine

    engine = Engine.from_id(DEFAULT_MODEL)  # the shipped toy weights (the zoo reads docs/shipped/models)
    ref = shipped.find(NAME, DEFAULT_MODEL, engine.info()["fingerprint"], root=REPO_SHIPPED)
    assert ref, ref.reason
    folder = build(DEFAULT_MODEL, ref.command, root=tmp_path, backend=engine)
    new = shipped.find(NAME, DEFAULT_MODEL, engine.info()["fingerprint"], root=tmp_path)
    assert new and new.folder == folder
    # On the float arithmetic it was shipped from: the estimator's files the same bytes and every field of the
    # study but `costs` (wall-clock seconds) equal. Made on another kind of CPU: the estimator within float
    # tolerance (6e-7 of 0.37 measured) and the study's statistics within 0.02 (Spearman and LDS rank
    # effects, and near-tied effects swap ranks there: 0.0055 at most, measured AVX2 against the shipped).
    assert shipped.rebuild_differences(new, ref, ignore={"study.json": {"costs"}}, atol={"study.json": 0.02}) == []
    if numerics.same_numerics(ref.manifest):
        for name in ("estimator.safetensors", "estimator.json"):
            assert (folder / name).read_bytes() == ref.path(name).read_bytes(), name
    assert set(new.json("study.json")) == set(ref.json("study.json"))
    assert new.manifest["settings"] == ref.manifest["settings"] and new.command == ref.command
