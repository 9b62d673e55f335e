"""Visual attribution through the engine's image path (issue 14): masked keys unreachable, exhaustive
effects zero where the model cannot see, attention features, the CLI on toy-vlm:small and the page,
on the tiny random Llava."""

from __future__ import annotations

import numpy as np
import pytest

from analyses.visual_attribution import attention_features, exhaustive_effects, grid_regions, positions, raw_attention
from probes.engine import Engine
from probes.interventions import MaskAttention
from probes.vision import image_token_groups, spec_of
from thoughtscope.errors import BadInputError

TEXT = "a b <image> c d e f g"  # two tokens before the image, five after


@pytest.fixture(scope="module")
def llava():
    return Engine.from_id("tiny-random:llava", device="cpu")


def _image(seed=0):
    return (np.random.default_rng(seed).random((32, 32, 3)) * 255).astype(np.uint8)


def test_a_masked_regions_keys_are_unreachable(llava):
    spec = spec_of(llava)
    ids = llava.trace(TEXT, images=[_image()]).token_ids
    region = grid_regions(spec, 2, 2)[1]
    pos = positions(spec, ids, region)
    t = llava.trace(TEXT, images=[_image()], capture=["attn_pattern.0", "attn_pattern.1"],
                    interventions=[MaskAttention(positions=pos)])
    others = [q for q in range(len(ids)) if q not in pos]
    for site in ("attn_pattern.0", "attn_pattern.1"):
        pat = t.activations[site]  # [query, head, key]
        assert float(pat[others][:, :, pos].abs().max()) == 0.0
        assert float(pat[pos[-1], :, pos[-1]].min()) > 0  # the region still sees itself


def test_exhaustive_effects_are_zero_where_the_model_cannot_see_the_region(llava):
    spec = spec_of(llava)
    ids = llava.trace(TEXT, images=[_image()]).token_ids
    group = image_token_groups(spec, ids)[0]
    before, after = (1, 2), (group[-1] + 1, len(ids))  # "b" precedes the image: it cannot attend to it
    regions = grid_regions(spec, 2, 2)
    steps = []
    effects = exhaustive_effects(llava, TEXT, _image(), [before, after], regions,
                                 on_progress=lambda d, t: steps.append((d, t)))
    assert effects.shape == (2, 4) and steps[-1] == (4, 4)
    assert np.all(effects[0] == 0.0)
    assert np.all(np.abs(effects[1]) > 1e-4)  # the text after the image does read every block
    # the effect equals the drop computed by hand from two traces
    masked = llava.trace(TEXT, images=[_image()],
                         interventions=[MaskAttention(positions=positions(spec, ids, regions[2]))])
    base = llava.trace(TEXT, images=[_image()])
    s, e = after
    by_hand = float(base.logprobs[s:e].double().sum() - masked.logprobs[s:e].double().sum())
    assert effects[1, 2] == pytest.approx(by_hand, abs=1e-9)


def test_attention_features_sum_the_regions_attention(llava):
    spec = spec_of(llava)
    sites = ["attn_pattern.0", "attn_pattern.1"]
    t = llava.trace(TEXT, images=[_image()], capture=sites)
    regions = grid_regions(spec, 4, 4)  # one token each
    span = (len(t.token_ids) - 3, len(t.token_ids))
    feats = attention_features(llava, TEXT, _image(), [span], regions, trace=t)
    assert feats.shape == (1, 16, 2 * 4)
    pat = t.activations["attn_pattern.1"][span[0] - 1:span[1] - 1]  # queries predicting the span
    g = image_token_groups(spec, t.token_ids)[0]
    assert feats[0, 5, 4 + 2] == pytest.approx(float(pat[:, 2, g[5]].mean()), abs=1e-6)
    # over every region, the attention to the whole image
    whole = t.activations["attn_pattern.0"][span[0] - 1:span[1] - 1, 3][:, g].sum(-1).mean()
    assert feats[0].sum(0)[3] == pytest.approx(float(whole), abs=1e-5)
    assert raw_attention(feats).shape == (1, 16)


def test_attribution_refuses_text_only_models_and_bad_spans(llava, llama):
    with pytest.raises(BadInputError, match="vision"):
        exhaustive_effects(llama, "a <image>", _image(), [(1, 2)], [])
    spec = spec_of(llava)
    with pytest.raises(BadInputError, match="span"):
        exhaustive_effects(llava, TEXT, _image(), [(5, 100)], grid_regions(spec, 2, 2))


@pytest.mark.model
def test_eval_vis_attr_on_the_small_toy_vlm(tmp_path):
    """The CLI end to end on toy-vlm:small (trained once, under a minute, cached): effects on the true
    cell dominate, every method is scored with intervals, and the record says what produced it."""
    import json

    from typer.testing import CliRunner

    from thoughtscope import cli as cli_module

    result = CliRunner().invoke(cli_module.build(), ["eval", "vis-attr", "--model", "toy-vlm:small", "--n", "4",
                                                         "--n-train", "4", "--n-dev", "3", "--save",
                                                         str(tmp_path / "est"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])  # stdout: tqdm bars go to stderr
    n_spans = out["settings"]["n_eval_spans"]
    assert n_spans >= 8 and out["metrics"]["amortized_hit"]["n"] == n_spans
    assert out["metrics"]["exhaustive_hit"]["estimate"] >= 0.6  # the small model reads the named cell
    for key in ("amortized_spearman", "attention_spearman"):
        m = out["metrics"][key]
        assert -1 <= m["low"] <= m["estimate"] <= m["high"] <= 1
    assert out["costs"]["exhaustive_s_per_span"] > out["costs"]["amortized_s_per_span"] > 0
    # deleting the single cell exhaustive ablation ranks first costs the most any single cell can
    top1 = {m: out["metrics"][f"{m}_deletion_top1"]["estimate"] for m in ("exhaustive", "amortized", "attention")}
    assert top1["exhaustive"] >= max(top1["amortized"], top1["attention"]) - 1e-9
    assert out["metrics"]["amortized_lds"]["n"] == n_spans and "amortized_vs_attention_lds" in out["comparison"]
    assert out["provenance"]["model"] == "toy-vlm:small" and out["provenance"]["command"] == "eval vis-attr"
    from analyses.visual_attribution import AmortizedAttribution

    saved = AmortizedAttribution.load(tmp_path / "est")  # the fitted estimator, as the run used it
    choice = out["settings"]["dev_choice"]  # chosen on dev scenes: every candidate's score is recorded
    assert choice["n_dev_scenes"] == 3 and len(choice["candidates"]) == 18
    best = max(c["dev_spearman"] for c in choice["candidates"])
    assert next(c for c in choice["candidates"] if c["params"] == choice["chosen"])["dev_spearman"] == best
    assert out["estimator"] == str(tmp_path / "est.json")
    assert {k: getattr(saved, k) for k in choice["chosen"]} == choice["chosen"] == {
        k: out["settings"]["estimator"][k] for k in choice["chosen"]}
    assert saved.n_features_in_ == 2 * 4  # layers x heads of toy-vlm:small's language model


@pytest.mark.model
def test_the_pages_fit_equals_the_studys_estimator_on_the_same_scenes():
    """`fit_estimator` (the page's "Fit the estimator" job) fits what `run_study` fits with the same scenes,
    seed and epochs and no development choice: the same weights, the same predictions."""
    from analyses.visual_attribution.evaluate import _pairs, fit_estimator, run_study, toy_scene
    from probes.toys import vlm

    engine = Engine.from_id("toy-vlm:small")
    stages = []
    fitted = fit_estimator(engine, n_train=3, seed=1, epochs=7, progress=lambda *a: stages.append(a))
    study = run_study(engine, n_train=3, n_eval=2, seed=1, epochs=7).estimator
    assert np.array_equal(fitted.weights_, study.weights_) and fitted.calibration_ == study.calibration_
    X, _, _ = _pairs([toy_scene(engine, ex) for ex in vlm.examples("eval", 2, seed=1)])
    assert np.array_equal(fitted.predict(X), study.predict(X))
    assert stages[:3] == [("train scenes", 1, 3), ("train scenes", 2, 3), ("train scenes", 3, 3)]
    assert stages[-1] == ("fit", 7, 7)
    # an estimator setting that cannot fit is said before any scene is read (it was said after all of them)
    stages.clear()
    for call in (lambda: fit_estimator(engine, n_train=3, epochs=0, progress=lambda *a: stages.append(a)),
                 lambda: run_study(engine, n_train=3, n_eval=2, epochs=0, progress=lambda *a: stages.append(a)),
                 lambda: run_study(engine, n_train=3, n_eval=2, n_subsets=-1, progress=lambda *a: stages.append(a))):
        with pytest.raises(BadInputError, match="epochs must be an integer >= 1|n_subsets"):
            call()
    assert stages == []


def test_the_page_draws_raw_attention_then_exhaustive_effects_for_a_span(monkeypatch):
    """The page on tiny-random:llava: generate (streamed), a heat map of the first span's raw attention
    over the image, then its exhaustive effects on demand; their numbers are the analysis functions' own."""
    import json

    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llava")
    at = helpers.open_page("visual_attribution", max_new_tokens=6)
    helpers.assert_clean(at)
    assert not at.get("plotly_chart")
    at.button(key="va_generate").click().run()
    helpers.assert_clean(at)
    assert helpers.chart_titles(at)[0].startswith("span '0: ")
    helpers.finish_jobs(at.button(key="va_exhaustive").click().run())  # the exhaustive effects run as a job
    helpers.assert_clean(at)
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert len(charts) == 2 and "log-prob drop" in charts[1]["layout"]["title"]["text"]
    run = at.session_state["va_run"]
    span = run["spans"][0]
    engine = Engine.from_id("tiny-random:llava", device="cpu")
    regions = grid_regions(spec_of(engine), 4, 4)
    shown = np.array(charts[0]["data"][1]["z"]).reshape(-1)
    assert np.allclose(shown, span.attention, atol=1e-6)
    ours = exhaustive_effects(engine, run["ids"], run["image"], [(span.start, span.end)], regions)[0]
    grid = np.array(charts[1]["data"][1]["z"])
    assert grid.shape == (4, 4) and np.abs(grid).max() > 0
    assert np.allclose(grid.reshape(-1), ours, atol=1e-5)


def test_streaming_predictions_equal_offline_predictions_on_the_same_trace(llava):
    """Spans finished during generation get the raw attention and predicted effects that the offline
    functions compute from a teacher-forced trace of the finished sequence."""
    from analyses.visual_attribution import AmortizedAttribution
    from analyses.visual_attribution.stream import stream_attribution
    from probes.vision import expand

    spec = spec_of(llava)
    regions = grid_regions(spec, 2, 2)
    rng = np.random.default_rng(0)
    n_feat = 2 * 4  # layers x heads
    est = AmortizedAttribution(epochs=20).fit(rng.normal(size=(40, n_feat)), rng.normal(size=40))
    prompt = "look <image> then"
    events = list(stream_attribution(llava, prompt, _image(5), regions, est, max_new_tokens=12,
                                     delimiters=("e", "a", "s")))  # a random model rarely writes punctuation
    spans = [e.span for e in events if e.span is not None]
    assert len(spans) >= 2 and len(events) == 12
    ids, _ = expand(spec, llava.encode(prompt), 1)
    full = ids + [e.record.token_id for e in events]
    offline = attention_features(llava, full, _image(5), [(s.start, s.end) for s in spans], regions)
    for s, feats in zip(spans, offline):
        assert np.allclose(s.features, feats, atol=1e-5)
        assert np.allclose(s.attention, raw_attention(feats[None])[0], atol=1e-5)
        assert np.allclose(s.predicted, est.predict(feats), atol=1e-4)
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


def test_the_gradient_baseline_reads_the_image_tokens_at_the_language_models_input(llava):
    """Input x gradient through the gradient slot with an image: zero for a span before the image, and
    each region's score is the sum of the per-position resid_pre.0 scores over its tokens."""
    from analyses.visual_attribution import gradient_scores

    spec = spec_of(llava)
    ids = llava.trace(TEXT, images=[_image()]).token_ids
    group = image_token_groups(spec, ids)[0]
    regions = grid_regions(spec, 2, 2)
    after = (group[-1] + 2, len(ids))
    scores = gradient_scores(llava, TEXT, _image(), [(1, 2), after], regions)
    assert np.all(scores[0] == 0.0) and np.abs(scores[1]).min() > 0
    att = llava.input_x_gradient(TEXT, positions=list(range(*after)), sites=["resid_pre.0"], images=[_image()])
    assert att.token_ids == ids
    site = att.site_scores["resid_pre.0"].double()
    assert scores[1, 3] == pytest.approx(float(site[positions(spec, ids, regions[3])].sum()), abs=1e-9)
    # the image changes the gradient: another image, other scores
    assert not np.allclose(gradient_scores(llava, TEXT, _image(7), [after], regions)[0], scores[1])


@pytest.mark.model
def test_the_page_runs_the_faithfulness_study_on_the_small_toy_vlm(monkeypatch):
    """toy-vlm:small on the page: the study at n = 2 + 2 draws every method's scores with intervals,
    the numbers of `run_study` itself; an uploaded file that is not an image is refused."""
    import json

    from app.views.visual_attribution import uploaded_image
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "toy-vlm:small")
    at = helpers.open_page("visual_attribution", max_new_tokens=8)
    helpers.assert_clean(at)
    at.number_input(key="va_ntrain").set_value(2)
    at.number_input(key="va_neval").set_value(2)
    at.number_input(key="va_lds").set_value(3)
    helpers.finish_jobs(at.button(key="va_study").click().run())  # the study runs as a job
    helpers.assert_clean(at)
    (chart,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("faithfulness against exhaustive")]
    assert chart["layout"]["title"]["text"].startswith("faithfulness against exhaustive ablation")
    bars = {(t["xaxis"], tuple(t["x"])): t["y"] for t in chart["data"]}
    assert ("x", ("amortized", "attention", "gradient")) in bars  # Spearman: exhaustive is the reference
    assert ("x3", ("amortized", "attention", "gradient", "exhaustive")) in bars  # hit rate
    from analyses.visual_attribution.evaluate import run_study

    ours = run_study(Engine.from_id("toy-vlm:small"), n_train=2, n_eval=2, n_subsets=3)
    assert bars[("x3", ("amortized", "attention", "gradient", "exhaustive"))][3] == pytest.approx(
        ours.metrics["exhaustive_hit"]["estimate"])
    with pytest.raises(BadInputError):
        uploaded_image(b"not an image")
    assert uploaded_image(None) is None


def test_the_page_opens_with_its_title_on_a_text_only_model(monkeypatch):
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    at = helpers.open_page("visual_attribution")
    helpers.assert_clean(at)
    assert at.title[0].value == "Visual attribution"
    assert "vision" in at.info[0].value and "toy-vlm" in at.info[0].value


def test_cluster_regions_of_a_toy_scene_partition_its_cells_and_hold_the_true_cell():
    """The study over K Ward clusters of the visual tokens' features (an untrained, seeded toy-vlm):
    each scene's regions partition the 9 cells, the true region holds the span's cell, and K larger
    than the number of visual tokens is refused before any model work."""
    import torch

    from analyses.visual_attribution.evaluate import run_study, toy_scene
    from probes.toys import vlm
    from probes.zoo import ModelHandle, arch_from_config

    tok = vlm.make_tokenizer()
    model = vlm.build_model(vlm.CONFIGS["small"], tok).eval()
    engine = Engine(ModelHandle("toy-vlm:untrained", model, tok, arch_from_config(model.config), "untrained",
                                torch.device("cpu"), torch.float32))
    ex = vlm.examples("eval", 1, seed=3)[0]
    scene = toy_scene(engine, ex, k=4)
    assert len(scene.regions) == 4 and sorted(c for r in scene.regions for c in r.cells) == list(range(9))
    assert [s.cell in scene.regions[j].cells for s, j in zip(ex.spans, scene.true_cells)] == [True] * len(ex.spans)
    assert scene.effects.shape == (len(ex.spans), 4)

    def boom(*a, **k):
        raise AssertionError("the model ran")

    forward, model.forward = model.forward, boom
    try:
        with pytest.raises(BadInputError, match="K=10"):
            run_study(engine, n_train=2, n_eval=2, k=10)
    finally:
        model.forward = forward


def test_a_saved_estimator_loads_only_for_a_model_of_its_shape(tmp_path, llava):
    from analyses.visual_attribution import AmortizedAttribution
    from app.views.visual_attribution import load_estimator

    rng = np.random.default_rng(0)
    AmortizedAttribution(epochs=5).fit(rng.normal(size=(20, 8)), rng.normal(size=20)).save(tmp_path / "a")
    AmortizedAttribution(epochs=5).fit(rng.normal(size=(20, 6)), rng.normal(size=20)).save(tmp_path / "b")
    arch = llava.arch()  # 2 layers x 4 heads
    assert load_estimator(str(tmp_path / "a"), arch).n_features_in_ == 8
    with pytest.raises(BadInputError, match="2 layers x 4 heads = 8"):
        load_estimator(str(tmp_path / "b"), arch)
    with pytest.raises(BadInputError, match="no saved estimator"):
        load_estimator(str(tmp_path / "missing"), arch)


def test_batched_exhaustive_effects_equal_one_masked_trace_per_region(llava):
    """Regions batched into RowMask rows (one forward for 16 regions + the unmasked row, or chunks of
    5 rows) give the per-region effects of one masked trace each, up to float noise."""
    spec = spec_of(llava)
    ids = llava.trace(TEXT, images=[_image(3)]).token_ids
    spans = [(1, 3), (len(ids) - 5, len(ids) - 2), (len(ids) - 2, len(ids))]
    regions = grid_regions(spec, 4, 4)
    one_by_one = exhaustive_effects(llava, TEXT, _image(3), spans, regions, batch_size=1)
    steps = []
    batched = exhaustive_effects(llava, TEXT, _image(3), spans, regions, batch_size=17,
                                 on_progress=lambda d, t: steps.append((d, t)))
    chunked = exhaustive_effects(llava, TEXT, _image(3), spans, regions, batch_size=5)
    last_alone = exhaustive_effects(llava, TEXT, _image(3), spans, regions, batch_size=16)  # 15 + 1 regions
    assert steps == [(16, 16)]  # one forward
    assert np.abs(one_by_one[1:]).min() > 1e-4  # the spans after the image do depend on every block
    np.testing.assert_allclose(batched, one_by_one, atol=1e-4)
    np.testing.assert_allclose(chunked, one_by_one, atol=1e-4)
    np.testing.assert_allclose(last_alone, one_by_one, atol=1e-4)
    with pytest.raises(BadInputError, match="batch_size"):
        exhaustive_effects(llava, TEXT, _image(3), spans, regions, batch_size=0)


def test_row_masks_mask_their_own_row_only(llava):
    """A trace with RowMask interventions: row r equals a plain MaskAttention trace of its mask, rows no
    mask names equal the unmasked trace; generation refuses row masks, and rows past the batch fail."""
    from probes.attention_masks import RowMask

    spec = spec_of(llava)
    ids = llava.trace(TEXT, images=[_image()]).token_ids
    a, b = (positions(spec, ids, r) for r in grid_regions(spec, 2, 2)[:2])
    t = llava.trace(TEXT, images=[_image()], capture=["attn_pattern.1"],
                    interventions=[RowMask(positions=a, rows=[1]), RowMask(positions=b, rows=[2, 3])])
    assert t.logprobs.shape == (4, len(ids)) and t.activations["attn_pattern.1"].shape[0] == 4
    plain = llava.trace(TEXT, images=[_image()])
    for row, pos in ((0, None), (1, a), (2, b), (3, b)):
        ref = plain if pos is None else llava.trace(TEXT, images=[_image()],
                                                    interventions=[MaskAttention(positions=pos)])
        np.testing.assert_allclose(t.logprobs[row, 1:].numpy(), ref.logprobs[1:].numpy(), atol=1e-5)
    others = [q for q in range(len(ids)) if q not in a]
    assert float(t.activations["attn_pattern.1"][1][others][:, :, a].abs().max()) == 0.0
    assert float(t.activations["attn_pattern.1"][0][others][:, :, a].abs().max()) > 0.0
    with pytest.raises(BadInputError, match="RowMask"):
        list(llava.generate(TEXT, images=[_image()], interventions=[RowMask(positions=a, rows=[0])],
                            max_new_tokens=2))
    with pytest.raises(BadInputError, match="rows"):
        llava.capture_batch([ids], ["resid_post.0"], images=[_image()], interventions=[RowMask(positions=a, rows=[2])])


def test_the_k16_speedup_bench_runs_on_toy_vlms_architecture_with_16_visual_tokens():
    """vis_attr_speedup at K = 16: toy-vlm's architecture with a 64-pixel input (random weights); the
    spans are toy description phrases shifted past the extra image tokens; every cost is measured."""
    from analyses.visual_attribution.bench import _scene, bench_speedup, random_toy_vlm
    from probes.toys import vlm

    engine = random_toy_vlm(4)
    spec = spec_of(engine)
    assert (spec.grid, spec.n_tokens, engine.info()["arch"]["n_layers"]) == (4, 16, vlm.CONFIGS["full"].text_layers)
    ex = vlm.examples("eval", 1)[0]
    text, _, spans, regions = _scene(engine, ex, 4)
    toks = engine.token_texts(engine.trace(text, images=[ex.image]).token_ids)
    assert "".join(toks[spans[0][0]:spans[0][1]]).split() == ex.trace.split()[2:2 + spans[0][1] - spans[0][0]]
    row = bench_speedup(engine, 4, n_scenes=1)
    assert row["regions"] == 16 and row["spans"] == len(ex.spans)
    assert row["ratio"] == pytest.approx(row["exhaustive_s_per_span"] / row["amortized_s_per_span"])
    # the amortized side batches scenes (one here); its one-scene-a-forward cost is reported beside it
    assert row["per_scene_ratio"] == pytest.approx(row["exhaustive_s_per_span"] / row["amortized_per_scene_s_per_span"])
    assert (row["batch_rows"], row["scenes_per_amortized_forward"]) == (32, 1)
    # both sides ran on SDPA (the faster kernel of an eager-built model), and the model is eager again after
    assert row["attention"] == "sdpa" and engine.model.config._attn_implementation == "eager"
    assert min(row["exhaustive_s_per_span"], row["exhaustive_unbatched_s_per_span"], row["amortized_s_per_span"]) > 0
    # the CPU clock and the load average beside the wall clock
    assert row["cpu_ratio"] > 0 and row["cpu_unbatched_ratio"] > 0 and len(row["load"]) == 2
    # in a stream the attention pass is already paid for: features and a dot product only (~100x less)
    assert 0 < row["amortized_in_stream_s_per_span"] < row["amortized_s_per_span"]


def test_the_wide_rows_regions_are_blocks_of_visual_tokens_covering_the_image_once():
    """vis_attr_speedup_k16_wide cuts a larger token grid into region_grid x region_grid blocks: here the K = 16
    architecture's 4 x 4 tokens into 2 x 2 blocks of 4 tokens, every token in exactly one region."""
    from analyses.visual_attribution.bench import _scene, random_toy_vlm
    from probes.toys import vlm

    engine = random_toy_vlm(4)
    _, _, _, regions = _scene(engine, vlm.examples("eval", 1)[0], 4, region_grid=2)
    assert [r.cells for r in regions] == [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)]
    assert len(_scene(engine, vlm.examples("eval", 1)[0], 4)[3]) == 16  # one region per token by default


def _counting_hooks(model, counts):
    """Pre-hooks adding 1 to `counts` at each Llava forward ("forward"), vision-tower pass ("vision"), call of
    the last decoder layer's MLP ("last_mlp") and, where `counts` has "layers", of any decoder layer."""
    lm = model.model.language_model

    def bump(key):
        def hook(*_):
            counts[key] += 1
        return hook

    hooks = [model.register_forward_pre_hook(bump("forward")),
             model.model.vision_tower.register_forward_pre_hook(bump("vision")),
             lm.layers[-1].mlp.register_forward_pre_hook(bump("last_mlp"))]
    if "layers" in counts:
        hooks += [layer.register_forward_pre_hook(bump("layers")) for layer in lm.layers]
    return hooks


def test_the_amortized_pass_on_the_k16_architecture_counts_its_work_and_equals_hf_attention_weights():
    """The bench's amortized side (`attention_features` without a trace) on toy-vlm's K = 16 architecture:
    the text is tokenised once, the model runs one forward with one vision-tower pass, every decoder layer
    is entered once and the last one's MLP never runs; its features equal those summed by hand from HF's
    own attention weights (`output_attentions=True`, eager) on the same input."""
    import torch

    from analyses.visual_attribution.attribution import region_positions
    from analyses.visual_attribution.bench import _scene, random_toy_vlm
    from probes.toys import vlm
    from probes.vision import prepare

    engine = random_toy_vlm(4)
    model, spec = engine.model, spec_of(engine)
    text, image, spans, regions = _scene(engine, vlm.examples("eval", 1)[0], 4)
    counts = {"forward": 0, "vision": 0, "layers": 0, "last_mlp": 0, "encode_text": 0}
    hooks = _counting_hooks(model, counts)
    encode = engine.encode

    def counting_encode(prompt, *args, **kwargs):
        counts["encode_text"] += isinstance(prompt, str)
        return encode(prompt, *args, **kwargs)

    engine.encode = counting_encode
    try:
        feats = attention_features(engine, text, image, spans, regions)
    finally:
        del engine.encode
        for h in hooks:
            h.remove()
    n_layers, n_heads = engine.arch().n_layers, engine.arch().n_heads
    assert counts == {"forward": 1, "vision": 1, "layers": n_layers, "last_mlp": 0, "encode_text": 1}

    (ids,), inputs = prepare(engine.handle.vision, "toy", [engine.encode(text)], [image])
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False,
                           **inputs).attentions  # eager: [1, heads, seq, seq] per layer
    keys = region_positions(spec, ids, regions)
    assert keys == [positions(spec, ids, r) for r in regions]
    want = np.zeros((len(spans), len(regions), n_layers * n_heads))
    for i, (s, e) in enumerate(spans):
        for j, key in enumerate(keys):
            for layer in range(n_layers):
                for head in range(n_heads):
                    rows = attentions[layer][0, head, s - 1:e - 1]  # the queries predicting the span's tokens
                    want[i, j, layer * n_heads + head] = float(rows[:, key].sum(-1).mean())
    assert feats.shape == want.shape and float(np.abs(want).sum()) > 0
    np.testing.assert_allclose(feats, want, atol=1e-6)


def test_batched_attention_features_equal_each_scenes_own_pass_and_run_one_forward_per_batch():
    """`attention_features_batch` (the bench's amortized side): scenes of different lengths, right-padded
    `batch_size` to a forward, give each scene the features of its own one-scene pass; 5 scenes at 3 a
    forward run 2 forwards and 2 vision-tower passes, and the last layer's MLP never runs. A bad scene is
    named before any model work."""
    from analyses.visual_attribution import attention_features_batch
    from analyses.visual_attribution.bench import _scene, random_toy_vlm
    from probes.toys import vlm

    engine = random_toy_vlm(4)
    model = engine.model
    scenes = [_scene(engine, ex, 4) for ex in vlm.examples("eval", 5, seed=3)]
    assert len({len(engine.encode(text)) for text, *_ in scenes}) > 1  # padding is exercised
    single = [attention_features(engine, *scene) for scene in scenes]
    counts = {"forward": 0, "vision": 0, "last_mlp": 0}
    hooks = _counting_hooks(model, counts)
    try:
        batched = attention_features_batch(engine, scenes, batch_size=3)
        assert counts == {"forward": 2, "vision": 2, "last_mlp": 0}
        text, image, spans, regions = scenes[2]
        bad = scenes[:2] + [(text, image, [(spans[0][0], 10_000)], regions)]
        with pytest.raises(BadInputError, match=r"scene 2: span .* not a non-empty range"):
            attention_features_batch(engine, bad)
        with pytest.raises(BadInputError, match="at least one scene"):
            attention_features_batch(engine, [])
        assert counts["forward"] == 2  # refused before model work
    finally:
        for h in hooks:
            h.remove()
    assert [f.shape for f in batched] == [f.shape for f in single]
    for got, want in zip(batched, single):
        assert float(np.abs(want).sum()) > 0
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_batched_attention_features_through_a_server_equal_the_in_process_features(llava):
    """`attention_features_batch` through `thoughtscope serve`'s API (one capture_batch request per batch, images
    as bytes): three scenes of different lengths, two a request, equal each scene's in-process features."""
    from analyses.visual_attribution import attention_features_batch
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    spec = spec_of(llava)
    scenes = []
    for seed, text in enumerate(["a b <image> c d e f g", "see <image> one two three four five six", "x <image> y z"]):
        n = len(llava.trace(text, images=[_image(seed)]).token_ids)
        scenes.append((text, _image(seed), [(n - 3, n - 1), (n - 2, n)], grid_regions(spec, 2, 2)))
    local = [attention_features(llava, *scene) for scene in scenes]
    with serving_in_thread(create_app(llava, max_queue=2)) as url, RemoteBackend(url) as remote:
        served = attention_features_batch(remote, scenes, batch_size=2)
    for got, want in zip(served, local):
        assert float(np.abs(want).sum()) > 0
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_set_of_scenes_gets_its_features_in_one_forward_per_batch_equal_to_each_scenes_own(monkeypatch):
    """`toy_scenes` (what the study and the page's fit run): each scene's exhaustive effects in one forward of
    its K + 1 rows, then the features of every scene `FEATURE_BATCH` scenes a forward, not one forward each;
    effects identical and features equal within float rounding to `toy_scene`'s one-scene passes, and a
    scene's feature seconds its batch's time shared out."""
    from analyses.visual_attribution import evaluate
    from analyses.visual_attribution.bench import random_toy_vlm
    from probes.toys import vlm

    engine = random_toy_vlm(3)  # toy-vlm's layout: 9 visual tokens, one per grid cell
    examples = vlm.examples("eval", 5, seed=2)
    single = [evaluate.toy_scene(engine, ex) for ex in examples]
    monkeypatch.setattr(evaluate, "FEATURE_BATCH", 3)
    counts = {"forward": 0, "vision": 0, "last_mlp": 0}
    hooks = _counting_hooks(engine.model, counts)
    reports = []
    try:
        many = evaluate.toy_scenes(engine, examples, progress=lambda done, total: reports.append((done, total)))
    finally:
        for h in hooks:
            h.remove()
    # 5 effect forwards (9 masked rows + the plain one each) and 2 feature forwards (3 + 2 scenes) that end
    # inside the last layer's attention; one scene a forward made 10
    assert counts == {"forward": 7, "vision": 7, "last_mlp": 5}
    assert reports == [(i, 5) for i in range(1, 6)]
    for got, want in zip(many, single):
        assert (got.text, got.spans, got.true_cells) == (want.text, want.spans, want.true_cells)
        np.testing.assert_array_equal(got.effects, want.effects)
        assert float(np.abs(want.features).sum()) > 0
        np.testing.assert_allclose(got.features, want.features, atol=1e-6)
    assert many[0].seconds_features == many[1].seconds_features == many[2].seconds_features > 0
    assert many[3].seconds_features == many[4].seconds_features > 0


def test_a_set_of_scenes_through_a_server_that_takes_few_images_a_request_is_batched_to_fit():
    """The study through `thoughtscope serve` with --max-images 2: a 5-scene features batch is refused (413,
    before any model work) and halved until it fits; every scene's features equal its own pass."""
    from analyses.visual_attribution import evaluate
    from analyses.visual_attribution.bench import random_toy_vlm
    from probes.client import RemoteBackend
    from probes.server import ServerLimits, create_app
    from probes.server_bench import serving_in_thread
    from probes.toys import vlm

    engine = random_toy_vlm(3)
    examples = vlm.examples("eval", 5, seed=4)
    single = [evaluate.toy_scene(engine, ex) for ex in examples]
    counts = {"forward": 0, "vision": 0, "last_mlp": 0}
    with serving_in_thread(create_app(engine, limits=ServerLimits(max_images=2))) as url, RemoteBackend(url) as remote:
        hooks = _counting_hooks(engine.model, counts)
        try:
            many = evaluate.toy_scenes(remote, examples)
        finally:
            for h in hooks:
                h.remove()
    # 5 effect forwards; features: the batch of 5 refused at sizes 32, 16, 8 and 4, then 2 + 2 + 1 in 3 forwards
    assert counts == {"forward": 8, "vision": 8, "last_mlp": 5}
    for got, want in zip(many, single):
        np.testing.assert_array_equal(got.effects, want.effects)
        np.testing.assert_allclose(got.features, want.features, atol=1e-6)
