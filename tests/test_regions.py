"""Regions in image coordinates -> visual tokens (issue 27, item 3): boxes and masks mapped through each
family's patch and merge geometry (probes.image_regions), checked against the models themselves, and the
refusals of bad regions before any model work."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from probes.engine import Engine
from probes.image_regions import cell_box, coverage, region_cells, region_tokens
from probes.vision import TINY_VLMS, VisionSpec, expand, image_token_groups, spec_of
from thoughtscope.errors import BadInputError

TEXT = "a <image> b c"


def _local_vision_tower(engine: Engine) -> None:
    """Zero the output projection of every attention in the vision tower (the only place where patches
    mix), so each visual token at the language model's input is a function of its own patches: the
    embedding, the per-token MLPs and norms and the merger (pixel shuffle, spatial merge) stay the model's."""
    with torch.no_grad():
        for name, module in engine.model.named_modules():
            if re.search(r"(vision_tower|vision_model|visual)\..*(self_attn\.out_proj|attn\.proj)$", name):
                module.weight.zero_()


@pytest.fixture(scope="module", params=TINY_VLMS)
def local_vlm(request):
    engine = Engine.from_id(f"tiny-random:{request.param}", device="cpu")
    _local_vision_tower(engine)
    return engine


def test_a_box_over_exactly_one_merged_patch_selects_exactly_that_token_and_the_model_agrees(local_vlm):
    """On every tiny family: the box a token sees (cell_box) maps to that token alone, and painting the box's
    pixels changes the language model's input at exactly that token, so the map follows the model's own
    patch / pixel-shuffle / spatial-merge layout rather than a convention."""
    spec = spec_of(local_vlm)
    side = spec.image_size
    assert spec.grid == 4
    base = (np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8)
    ids = expand(spec, local_vlm.encode(TEXT), 1)[0]
    group = image_token_groups(spec, ids)[0]
    before = local_vlm.trace(TEXT, images=[base], capture=["resid_pre.0"]).activations["resid_pre.0"]
    for cell in (0, 6, 15):
        box = cell_box(spec, cell, (side, side))
        assert region_cells(spec, box, (side, side)) == [cell]
        x0, y0, x1, y1 = (int(v) for v in box)
        painted = base.copy()
        painted[y0:y1, x0:x1] = 255 - painted[y0:y1, x0:x1]
        after = local_vlm.trace(TEXT, images=[painted], capture=["resid_pre.0"]).activations["resid_pre.0"]
        changed = [p for p in range(len(ids)) if not torch.equal(before[p], after[p])]
        assert changed == region_tokens(spec, ids, box, (side, side)) == [group[spec.lead + cell]]


@pytest.mark.parametrize("family,size,patch,merge", [("llava", 32, 8, 1), ("idefics3", 64, 8, 2),
                                                      ("qwen2_vl", 64, 8, 2), ("qwen2_vl", 448, 14, 2)])
def test_boxes_and_masks_map_through_the_resize_by_area(family, size, patch, merge):
    """The engine resizes any image to the tower's square input (no crop): a box of the original image covers
    the tokens its scaled box overlaps, each by the exact fraction of its area (hand-computed here)."""
    spec = VisionSpec(family, image_token_id=7, image_size=size, patch_size=patch, merge=merge)
    g = spec.grid
    # a 200 x 100 image: one token's square is 200/g x 100/g original pixels
    w, h = 200, 100
    box = (0, 0, 200 / g * 1.5, 100 / g)  # one and a half tokens wide, one token high
    cov = coverage(spec, box, (w, h))
    assert cov[0, 0] == pytest.approx(1.0) and cov[0, 1] == pytest.approx(0.5) and cov[1:].sum() == 0
    assert region_cells(spec, box, (w, h)) == [0, 1]
    assert region_cells(spec, box, (w, h), min_coverage=0.5) == [0]
    # a mask on a 12g x 6g image: the bottom-right token's 12 x 6 pixels, and half of its left neighbour
    w, h = 12 * g, 6 * g
    mask = np.zeros((h, w), dtype=bool)
    mask[h - 6:, w - 18:] = True
    assert region_cells(spec, mask, (w, h)) == [g * g - 2, g * g - 1]
    assert coverage(spec, mask, (w, h))[g - 1, g - 2:].tolist() == pytest.approx([0.5, 1.0])
    assert region_cells(spec, mask, (w, h), min_coverage=0.5) == [g * g - 1]


def test_several_images_one_region_each():
    spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    ids, groups = expand(spec, [1, 7, 9, 7, 9], 2)
    assert region_tokens(spec, ids, (32, 32, 48, 48), (48, 48), image_index=1) == [groups[1][8]]
    with pytest.raises(BadInputError, match="image 2"):
        region_tokens(spec, ids, (0, 0, 8, 8), (48, 48), image_index=2)


@pytest.mark.parametrize("box,match", [
    ((50, 50, 70, 60), "not inside"),
    ((-1, 0, 10, 10), "not inside"),
    ((float("nan"), 0, 10, 10), "NaN"),
    ((0, 0, float("inf"), 10), "NaN or infinite"),
    ((5, 5, 5, 20), "zero area"),
    ((10, 10, 4, 20), "zero area"),
    ((0, 0, 10), r"\(x0, y0, x1, y1\)"),
    (("a", 0, 1, 1), "four numbers"),
])
def test_bad_boxes_are_refused(box, match):
    spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    with pytest.raises(BadInputError, match=match):
        region_cells(spec, box, (64, 64))


def test_bad_masks_and_thresholds_are_refused():
    spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    with pytest.raises(BadInputError, match="empty"):
        region_cells(spec, np.zeros((48, 48), bool), (48, 48))
    with pytest.raises(BadInputError, match="image is 48x48"):
        region_cells(spec, np.ones((10, 48), bool), (48, 48))
    with pytest.raises(BadInputError, match="0/1"):
        region_cells(spec, np.full((48, 48), np.nan), (48, 48))
    with pytest.raises(BadInputError, match="min_coverage"):
        region_cells(spec, (0, 0, 8, 8), (48, 48), min_coverage=1.0)
    with pytest.raises(BadInputError, match="covers no visual token"):
        region_cells(spec, (0, 0, 8, 8), (48, 48), min_coverage=0.5)  # a quarter of one token
    with pytest.raises(BadInputError, match="width, height"):
        region_cells(spec, (0, 0, 8, 8), (0, 48))


def test_a_regions_json_of_boxes_and_masks_becomes_token_regions():
    """The page's upload format: boxes and masks in pixels of the image as given, one region each (with the
    box it was drawn as), the minimum coverage applied; the count and each region's own check before any model work."""
    import json

    from analyses.visual_attribution import cell_map, regions_from_json

    spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)  # 3 x 3 tokens
    mask = np.zeros((96, 96), dtype=int)
    mask[64:, 64:] = 1  # the bottom-right token, on an image twice the input's side
    doc = {"size": [96, 96], "regions": [{"name": "top row", "box": [0, 0, 96, 32]},
                                         {"name": "corner", "mask": mask.tolist()},
                                         {"box": [0, 0, 40, 40]}]}
    regions = regions_from_json(spec, json.dumps(doc), (96, 96))
    assert [(r.name, r.cells, r.box) for r in regions] == [
        ("top row", (0, 1, 2), (0.0, 0.0, 96.0, 32.0)), ("corner", (8,), (64.0, 64.0, 96.0, 96.0)),
        ("region 2", (0, 1, 3, 4), (0.0, 0.0, 40.0, 40.0))]
    assert [r.cells for r in regions_from_json(spec, {**doc, "min_coverage": 0.5}, (96, 96))][2] == (0,)
    # overlapping regions paint their mean; a token in none draws nothing (NaN)
    painted = cell_map(spec, regions[:2], [1.0, 3.0], empty=np.nan)
    assert painted[0].tolist() == [1.0, 1.0, 1.0] and painted[2, 2] == 3.0 and np.isnan(painted[1, 1])
    bad = [({"regions": [{"box": [0, 0, float("nan"), 5]}]}, "region 0 .*NaN"),
           ({"regions": [{"name": "flat", "box": [3, 3, 3, 9]}]}, "region 0 \\('flat'\\).*zero area"),
           ({"regions": [{"box": [50, 50, 120, 60]}]}, "not inside the 96x96"),
           ({"regions": [{"box": [0, 0, 1, 1], "mask": [[1]]}]}, "exactly one"),
           ({"regions": [{"mask": [[1, 0], [0, 1]]}]}, "mask is 2x2"),
           ({"regions": []}, "1..256 regions"),
           ({"size": [48, 48], "regions": [{"box": [0, 0, 8, 8]}]}, "drawn on a 48x48 image"),
           ({"boxes": []}, "regions JSON"),
           ({"regions": [{"mask": [[1, 0], [1]]}]}, "H rows of W"),
           ({"size": 96, "regions": [{"box": [0, 0, 8, 8]}]}, "width, height"),
           ("not json {", "not JSON")]
    for doc, match in bad:
        with pytest.raises(BadInputError, match=match):
            regions_from_json(spec, doc if isinstance(doc, str) else json.dumps(doc), (96, 96))


def test_a_toy_scenes_object_regions_are_its_objects_cells_and_the_background():
    from analyses.visual_attribution import object_regions
    from probes.toys import vlm

    spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)  # toy-vlm's geometry
    ex = vlm.examples("eval", 1, seed=0)[0]
    regions = object_regions(spec, ex)
    cells = [o.cell for o in ex.objects]
    assert [r.cells for r in regions] == [(c,) for c in cells] + [tuple(c for c in range(9) if c not in cells)]
    assert [r.box for r in regions[:-1]] == [tuple(float(v) for v in o.box) for o in ex.objects]
    assert regions[-1].name == "background" and regions[0].name == f"{ex.objects[0].cell_name} " \
        f"{ex.objects[0].colour} {ex.objects[0].shape}"


@pytest.mark.parametrize("family", TINY_VLMS)
def test_the_toy_scenes_spans_on_every_family_are_the_description_phrases(family):
    """The study runs on any VLM family: the toy scene's text through the model's own placeholder and
    tokenizer, each span's token positions decoding to its description phrase."""
    from analyses.visual_attribution.evaluate import scene_regions, scene_text_and_spans
    from probes.toys import vlm

    engine = Engine.from_id(f"tiny-random:{family}", device="cpu")
    spec = spec_of(engine)
    ex = vlm.examples("eval", 1, seed=0)[0]
    text, spans = scene_text_and_spans(engine, ex)
    ids = expand(spec, engine.encode(text), 1)[0]
    assert [engine.decode(ids[s:e]).strip() for s, e in spans] == [ex.trace[s.start:s.end] for s in ex.spans]
    grid, true = scene_regions(engine, spec, ex, text)  # 4 x 4 tokens: each to the scene cell holding its centre
    assert [r.cells for r in grid] == [(0,), (1, 2), (3,), (4, 8), (5, 6, 9, 10), (7, 11), (12,), (13, 14), (15,)]
    assert true == [s.cell for s in ex.spans]


def test_eval_vis_attr_runs_on_another_family_over_object_regions(monkeypatch, capsys):
    """`thoughtscope eval vis-attr` on a SmolVLM (tiny random: code paths, not faithfulness): the toy scenes
    resized to its input, object regions, the study's table; a bad --regions is a clear error."""
    import json

    from typer.testing import CliRunner

    from probes.toys import vlm
    from thoughtscope import cli as cli_module

    args = ["eval", "vis-attr", "--model", "tiny-random:smolvlm", "--n", "2", "--n-train", "2", "--n-dev", "0",
            "--lds-subsets", "0", "--regions", "objects", "--json"]
    result = CliRunner().invoke(cli_module.build(), args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["settings"]["regions"].startswith("each object's true pixel box")
    assert out["provenance"]["model"] == "tiny-random:smolvlm"
    spans = sum(len(ex.spans) for ex in vlm.examples("eval", 2, seed=0))
    assert out["settings"]["n_eval_spans"] == spans == out["metrics"]["exhaustive_hit"]["n"]
    assert np.shape(out["example"]["effects"])[1] == len(vlm.examples("eval", 1, seed=0)[0].objects) + 1
    monkeypatch.setattr("sys.argv", ["thoughtscope", *args[:-3], "--regions", "stars"])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "regions 'stars' is not an option" in err and "Traceback" not in err


def test_streamed_span_attention_over_a_box_and_a_mask_equals_the_offline_features():
    """The streaming heat map over pixel regions (tiny SmolVLM: pixel shuffle): each finished span's attention
    to a box and to a mask equals `attention_features` over the same regions on the finished sequence, and
    each region's feature is the sum of its tokens' single-token features."""
    from analyses.visual_attribution import Region, attention_features, box_regions, mask_regions
    from analyses.visual_attribution.stream import stream_attribution

    engine = Engine.from_id("tiny-random:smolvlm", device="cpu")
    spec = spec_of(engine)
    image = (np.random.default_rng(1).random((100, 80, 3)) * 255).astype(np.uint8)  # 80 wide, 100 high
    mask = np.zeros((100, 80), dtype=bool)
    mask[60:, :30] = True
    regions = box_regions(spec, [(40, 0, 80, 50)], (80, 100), ["top right"]) + mask_regions(spec, [mask], (80, 100))
    assert [r.cells for r in regions] == [(2, 3, 6, 7), (8, 9, 12, 13)]
    prompt = "look <image> then"
    events = list(stream_attribution(engine, prompt, image, regions, max_new_tokens=10, delimiters=("e", "a", "s")))
    spans = [e.span for e in events if e.span is not None]
    assert spans and len(events) == 10
    full = expand(spec, engine.encode(prompt), 1)[0] + [e.record.token_id for e in events]
    offline = attention_features(engine, full, image, [(s.start, s.end) for s in spans], regions)
    singles = attention_features(engine, full, image, [(s.start, s.end) for s in spans],
                                 [Region(f"t{c}", (c,)) for c in range(16)])
    for s, feats, one in zip(spans, offline, singles):
        assert np.allclose(s.features, feats, atol=1e-5)
        assert np.allclose(feats, [one[list(r.cells)].sum(0) for r in regions], atol=1e-5)


def test_probes_vision_box_cells_gives_the_same_cells_as_the_region_map():
    """probes.vision.box_cells (the engine's own box helper) and probes.image_regions agree on random integer
    boxes of images of several sizes, edges on token edges after inexact scaling included."""
    from probes.vision import box_cells

    rng = np.random.default_rng(0)
    for spec in (VisionSpec("llava", 7, 48, 16), VisionSpec("idefics3", 7, 64, 8, 2), VisionSpec("qwen2_vl", 7, 448, 14, 2)):
        for w, h in ((64, 64), (100, 37), (333, 500)):
            for _ in range(100):
                x0, x1 = sorted(rng.choice(w + 1, 2, replace=False).tolist())
                y0, y1 = sorted(rng.choice(h + 1, 2, replace=False).tolist())
                assert box_cells(spec, (x0, y0, x1, y1), (w, h)) == region_cells(spec, (x0, y0, x1, y1), (w, h))
