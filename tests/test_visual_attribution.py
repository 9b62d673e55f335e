"""Visual attribution (issue 14): regions and the amortized estimator on synthetic features (no model).
The parts that run a VLM are in tests/test_visual_attribution_engine.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from analyses.visual_attribution import (AmortizedAttribution, box_regions, cell_map, cluster_regions, grid_regions,
                                         pearson_loss)
from probes.vision import VisionSpec
from thoughtscope.errors import BadInputError


def test_regions_cover_the_grid_and_refuse_what_does_not_fit():
    spec = VisionSpec("llava", image_token_id=7, image_size=64, patch_size=16)  # 4 x 4 tokens
    blocks = grid_regions(spec, 2, 2)
    assert [r.cells for r in blocks] == [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)]
    # two flat halves of different colour: Ward with K=2 recovers them, as connected regions
    feats = np.zeros((16, 3))
    feats[[0, 1, 4, 5, 8, 9, 12, 13]] = 1.0
    feats += np.random.default_rng(0).normal(scale=0.01, size=feats.shape)
    halves = cluster_regions(spec, feats, 2)
    assert [r.cells for r in halves] == [(0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)]
    assert box_regions(spec, [(0, 0, 10, 40)], (64, 64))[0].cells == (0, 4, 8)
    assert cell_map(spec, halves, [1.0, 2.0])[0].tolist() == [1.0, 1.0, 2.0, 2.0]
    with pytest.raises(BadInputError, match="K=17"):
        cluster_regions(spec, feats, 17)
    with pytest.raises(BadInputError, match="inside"):
        box_regions(spec, [(50, 50, 70, 60)], (64, 64))
    with pytest.raises(BadInputError, match="does not fit"):
        grid_regions(spec, 5, 1)


def test_the_estimator_recovers_planted_linear_weights(tmp_path):
    rng = np.random.default_rng(0)
    n_spans, n_regions, n_feat = 80, 8, 12
    X = rng.normal(size=(n_spans * n_regions, n_feat)) * rng.uniform(0.5, 3, size=n_feat)
    w = rng.normal(size=n_feat)
    w[[2, 7]] = 0.0
    y = X @ w + 0.5 + rng.normal(scale=0.01, size=len(X))
    groups = np.repeat(np.arange(n_spans), n_regions)
    est = AmortizedAttribution(epochs=400, lr=0.05, l2=0.0, seed=0).fit(X, y, groups)
    assert not hasattr(AmortizedAttribution(), "weights_")  # learned state appears only with fit
    cos = est.coef_ @ w / (np.linalg.norm(est.coef_) * np.linalg.norm(w))
    assert cos > 0.999
    assert np.allclose(est.coef_, w, atol=0.05)  # the calibration puts the scale back
    assert np.corrcoef(est.predict(X), y)[0, 1] > 0.999
    assert est.history_[-1] < 1e-3
    est.save(tmp_path / "est")
    again = AmortizedAttribution.load(tmp_path / "est")
    assert np.array_equal(again.predict(X), est.predict(X)) and again.epochs == 400
    assert (tmp_path / "est.safetensors").is_file() and (tmp_path / "est.json").is_file()
    with pytest.raises(BadInputError, match="features"):
        est.predict(X[:, :3])


def test_pearson_loss_ignores_scale_and_constant_groups():
    t = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    assert float(pearson_loss(10 * t + 3, t, g)) == pytest.approx(0.0, abs=1e-9)
    assert float(pearson_loss(-t, t, g)) == pytest.approx(2.0, abs=1e-9)
    with pytest.raises(BadInputError):
        pearson_loss(t[3:], t[3:])


def test_the_heat_map_lies_over_the_image_one_cell_per_region():
    """The overlay: the image trace, then a semi-transparent heat map whose grid x grid cells tile the
    image's pixel extent (cell (r, c) centred on the pixels its token sees), on the same axes."""
    from app.figures.visual_attribution import FIGURES

    image = np.zeros((48, 48, 3), dtype=np.uint8).tolist()
    scores = np.arange(9.0).reshape(3, 3).tolist()
    fig = FIGURES["vis_attr_heatmap"]({"image": image, "scores": scores, "method": "amortized", "unit": "nats",
                                       "title": "span 'top-left red ring'"})
    img, heat = fig.data
    assert (img.type, heat.type) == ("image", "heatmap")
    assert np.array(heat.z).tolist() == scores and 0 < heat.opacity < 1
    assert heat.xaxis == img.xaxis and heat.yaxis == img.yaxis  # drawn over the image, not beside it
    centres = [heat.x0 + c * heat.dx for c in range(3)]  # pixels 0..15 -> 7.5, 16..31 -> 23.5, ...
    assert centres == [7.5, 23.5, 39.5] and heat.y0 + 2 * heat.dy == 39.5
    assert tuple(fig.layout.yaxis.range) == (47.5, -0.5)  # image rows top-down
    assert fig.layout.title.text == "span 'top-left red ring'"


def test_the_estimators_settings_are_chosen_on_development_scenes():
    """Effects linear in log attention: the development choice takes features="log" (it ranks dev spans
    better), records every candidate's dev score, and a log estimator saves and loads as such."""
    from analyses.visual_attribution.evaluate import SceneResult, choose_settings

    rng = np.random.default_rng(0)
    w = rng.normal(size=6)

    def scene():
        feats = rng.dirichlet(np.full(9, 0.3), size=(4, 6)).transpose(0, 2, 1)  # [spans, regions, heads]
        effects = np.log(feats + 1e-4) @ w + rng.normal(scale=0.05, size=(4, 9))
        return SceneResult([0] * 4, effects, feats, 0.0, 0.0, spans=[(1, 2)] * 4)

    train, dev = [scene() for _ in range(10)], [scene() for _ in range(4)]
    grid = {"features": ("raw", "log"), "epochs": (300,), "l2": (0.0, 1e-1)}
    choice = choose_settings(train, dev, grid=grid)
    scores = {(c["params"]["features"], c["params"]["l2"]): c["dev_spearman"] for c in choice["candidates"]}
    assert choice["chosen"]["features"] == "log" and len(scores) == 4
    assert scores[("log", 0.0)] > 0.9 > scores[("raw", 0.0)]
    assert choice["n_dev_spans"] == 16 and choice["grid"]["l2"] == [0.0, 0.1]
    with pytest.raises(BadInputError, match="development"):
        choose_settings(train, [])
    with pytest.raises(BadInputError, match="features"):
        AmortizedAttribution(features="sqrt").fit(np.ones((4, 2)), np.arange(4.0))
    with pytest.raises(BadInputError, match=">= 0"):
        AmortizedAttribution(features="log").fit(-np.ones((4, 2)), np.arange(4.0))


def test_a_log_feature_estimator_saves_and_loads_with_its_transform(tmp_path):
    from analyses.visual_attribution import AmortizedAttribution

    rng = np.random.default_rng(1)
    X = rng.dirichlet(np.ones(5), size=60)
    est = AmortizedAttribution(epochs=50, features="log").fit(X, np.log(X + 1e-4) @ np.arange(5.0))
    back = AmortizedAttribution.load(est.save(tmp_path / "log_est"))
    assert back.features == "log" and np.allclose(back.predict(X), est.predict(X))


@pytest.mark.parametrize("damage, says", [
    ("weights cut short", "no saved estimator"),
    ("json a list", "not a JSON object"),
    ("params unknown", "unexpected keyword argument 'zzz'"),
    ("calibration missing", "KeyError: 'calibration'"),
    ("weights of another width", "weights has shape [3]"),
])
def test_a_damaged_saved_estimator_is_a_clear_error(tmp_path, damage, says):
    """The page's Load box and `--estimator` read these files; each damage was a KeyError, TypeError,
    AttributeError or SafetensorError traceback."""
    import json

    from safetensors.torch import save_file

    from thoughtscope.errors import BadInputError

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 4))
    path = AmortizedAttribution(epochs=3).fit(X, X @ np.array([1.0, -1.0, 0.5, 0.0])).save(tmp_path / "est")
    meta, weights = json.loads(path.read_text()), path.with_suffix(".safetensors")
    if damage == "weights cut short":
        weights.write_bytes(weights.read_bytes()[:50])
    elif damage == "json a list":
        path.write_text("[1]")
    elif damage == "params unknown":
        path.write_text(json.dumps({**meta, "params": {"zzz": 1}}))
    elif damage == "calibration missing":
        path.write_text(json.dumps({k: v for k, v in meta.items() if k != "calibration"}))
    else:
        save_file({"weights": torch.ones(3), "mean": torch.zeros(3), "scale": torch.ones(3)}, str(weights))
    with pytest.raises(BadInputError, match=re.escape(says)):
        AmortizedAttribution.load(path)
