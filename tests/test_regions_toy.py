"""Object regions on the small toy VLM (issue 27, item 3): the study over each object's true box and the
background runs end to end and reports the same table as the grid cells."""

from __future__ import annotations

import numpy as np
import pytest

from analyses.visual_attribution.evaluate import REGION_NOTES, run_study, toy_scene
from probes.engine import Engine
from probes.toys import vlm


@pytest.fixture(scope="module")
def small_vlm():
    return Engine.from_id("toy-vlm:small", device="cpu")


@pytest.mark.model
def test_object_regions_effects_are_the_grid_effects_of_the_objects_cells(small_vlm):
    """On toy-vlm each object box lies in one cell, one visual token: masking the object region is masking
    that cell, so the span's drop equals the grid study's drop for that cell."""
    ex = vlm.examples("eval", 1, seed=3)[0]
    grid, objects = toy_scene(small_vlm, ex), toy_scene(small_vlm, ex, regions="objects")
    assert objects.true_cells == list(range(len(ex.objects))) and objects.spans == grid.spans
    cells = [o.cell for o in ex.objects]
    assert np.allclose(objects.effects[:, :len(cells)], grid.effects[:, cells], atol=1e-4)
    assert objects.regions[-1].cells == tuple(c for c in range(9) if c not in cells)
    assert np.allclose(objects.features[:, :len(cells)], grid.features[:, cells], atol=1e-6)
    # the background's attention is the sum of its cells' attention
    assert np.allclose(objects.features[:, -1], grid.features[:, objects.regions[-1].cells].sum(1), atol=1e-5)


@pytest.mark.model
def test_the_study_over_object_regions_reports_the_grid_cells_table(small_vlm):
    grid = run_study(small_vlm, n_train=2, n_eval=2, n_subsets=3).to_dict()
    objects = run_study(small_vlm, n_train=2, n_eval=2, n_subsets=3, regions="objects").to_dict()
    assert sorted(objects["metrics"]) == sorted(grid["metrics"]) and len(grid["metrics"]) == 23
    assert sorted(objects["comparison"]) == sorted(grid["comparison"])
    assert sorted(objects["costs"]) == sorted(grid["costs"])
    assert (objects["settings"]["regions"], grid["settings"]["regions"]) == (REGION_NOTES["objects"],
                                                                             REGION_NOTES["grid"])
    assert objects["metrics"]["amortized_hit"]["n"] == grid["metrics"]["amortized_hit"]["n"] == \
        objects["settings"]["n_eval_spans"]
    # the example scene: one score per object and the background for every span
    ex = vlm.examples("eval", 1, seed=0)[0]
    assert np.shape(objects["example"]["effects"]) == (len(ex.spans), len(ex.objects) + 1)
    assert np.shape(grid["example"]["effects"]) == (len(ex.spans), 9)


@pytest.mark.model
def test_the_page_attributes_to_the_scenes_objects_and_runs_the_object_study(monkeypatch):
    """toy-vlm:small on the page: with "scene objects" the streamed span's heat map paints each object's and the
    background's attention on their tokens; the faithfulness study over objects gives `run_study`'s numbers."""
    import json

    from analyses.visual_attribution import cell_map, object_regions
    from probes.vision import spec_of
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "toy-vlm:small")
    at = helpers.open_page("visual_attribution", max_new_tokens=8)
    at.radio(key="va_regions").set_value("scene objects").run()
    at.number_input(key="va_ntrain").set_value(2)
    at.number_input(key="va_neval").set_value(2)
    at.number_input(key="va_lds").set_value(3)
    at.radio(key="va_study_regions").set_value("objects")
    helpers.finish_jobs(at.button(key="va_study").click().run())
    at.button(key="va_generate").click().run()
    helpers.assert_clean(at)
    charts = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
              for c in at.get("plotly_chart")}
    study = next(v for k, v in charts.items() if k.startswith("faithfulness against exhaustive"))
    bars = {(t["xaxis"], tuple(t["x"])): t["y"] for t in study["data"]}
    ours = run_study(Engine.from_id("toy-vlm:small"), n_train=2, n_eval=2, n_subsets=3, regions="objects")
    assert bars[("x3", ("amortized", "attention", "gradient", "exhaustive"))] == pytest.approx(
        [ours.metrics[f"{m}_hit"]["estimate"] for m in ("amortized", "attention", "gradient", "exhaustive")])
    span = at.session_state["va_run"]["spans"][0]
    heat = next(v for k, v in charts.items() if k.startswith("span '0: "))
    ex = vlm.examples("eval", 1, seed=0)[0]
    spec = spec_of(Engine.from_id("toy-vlm:small"))
    regions = object_regions(spec, ex)
    assert span.attention.shape == (len(regions),)
    assert np.allclose(np.array(heat["data"][1]["z"], dtype=float), cell_map(spec, regions, span.attention),
                       atol=1e-6)
    assert [s["label"]["text"] for s in heat["layout"]["shapes"]] == [r.name for r in regions[:-1]]
