"""The visual attribution page with regions in image coordinates (issue 27, items 3-4), on a Qwen2-VL
(tiny random): boxes typed on the image become the regions of the streamed heat map and of the exhaustive
effects, outlined over the image; a bad box is an error on the page, not a traceback."""

from __future__ import annotations

import json

import numpy as np

from analyses.visual_attribution import cell_map, exhaustive_effects, regions_from_json
from app.views.visual_attribution import parse_boxes
from probes.engine import Engine
from probes.vision import spec_of
from tests import apptest_helpers as helpers

BOXES = "left half 0 0 32 64\nbottom right 32 32 64 64"


def test_typed_boxes_are_the_regions_of_the_heat_map_and_the_exhaustive_effects(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:qwen2_vl")
    at = helpers.open_page("visual_attribution", max_new_tokens=6)
    helpers.assert_clean(at)
    at.radio(key="va_regions").set_value("boxes").run()
    at.text_area(key="va_boxes").set_value("left half 0 0 32 64\nflat 5 5 5 9").run()
    assert any("zero area" in e.value for e in at.error)  # refused on the page; the visual tokens stay the regions
    at.text_area(key="va_boxes").set_value(BOXES).run()
    helpers.assert_clean(at)
    at.button(key="va_generate").click().run()
    helpers.assert_clean(at)
    helpers.finish_jobs(at.button(key="va_exhaustive").click().run())
    helpers.assert_clean(at)
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert charts[0]["layout"]["title"]["text"] == "drag a box on the image"
    heat, done = charts[1:]
    engine = Engine.from_id("tiny-random:qwen2_vl", device="cpu")
    spec = spec_of(engine)
    run = at.session_state["va_run"]
    span = run["spans"][0]
    regions = regions_from_json(spec, {"regions": parse_boxes(BOXES)}, (64, 64))
    assert [r.cells for r in regions] == [(0, 1, 4, 5, 8, 9, 12, 13), (10, 11, 14, 15)]
    assert span.attention.shape == (2,)
    shown = np.array(heat["data"][1]["z"], dtype=float)  # None (no region) arrives as NaN
    assert np.allclose(shown, cell_map(spec, regions, span.attention, empty=np.nan), atol=1e-6, equal_nan=True)
    assert [s["label"]["text"] for s in heat["layout"]["shapes"]] == ["left half", "bottom right"]
    ours = exhaustive_effects(engine, run["ids"], run["image"], [(span.start, span.end)], regions)[0]
    assert np.allclose(np.array(done["data"][1]["z"], dtype=float), cell_map(spec, regions, ours, empty=np.nan),
                       atol=1e-5, equal_nan=True)


def test_a_box_dragged_on_the_image_becomes_whole_pixels_of_it():
    """Streamlit's plotly selection state of a box drag (axis units: pixel i is centred at i) -> a pixel box,
    clipped to the image; nothing drawn, or a flat box, is None."""
    from app.views.visual_attribution import drawn_box

    state = {"selection": {"points": [], "point_indices": [], "lasso": [],
                           "box": [{"xref": "x", "yref": "y", "x": [40.2, 9.6], "y": [-3.0, 30.4]}]}}
    assert drawn_box(state, (64, 48)) == (10, 0, 41, 31)
    assert drawn_box({"selection": {"box": [{"x": [10, 90], "y": [50, 70]}]}}, (64, 48)) is None  # below the image
    assert drawn_box(None, (64, 48)) is None and drawn_box({"selection": {"box": []}}, (64, 48)) is None
