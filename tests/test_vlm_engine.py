"""Vision-language models in the engine (issue 14, part 1): image checks, placeholder expansion, the
region -> visual-token mapping of each family (checked against what the model computes), generation
equal to Hugging Face's, prefix states that hold an image, and a VLM trace through the model server equal
to the in-process one.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from probes import vision
from probes.engine import Engine
from thoughtscope.errors import BadInputError

VLMS = ["tiny-random:llava", "tiny-random:smolvlm", "tiny-random:qwen2_vl"]
PROMPT = "look <image> what is it"


@pytest.fixture(scope="module", params=VLMS)
def vlm(request):
    return Engine.from_id(request.param, device="cpu")


def _image(seed: int = 0, size=(40, 50)) -> np.ndarray:
    return (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)


def test_capabilities_and_info_say_vision(vlm, llama):
    assert vlm.capabilities()["vision"] and not llama.capabilities()["vision"]
    spec = vision.spec_of(vlm)
    assert spec.grid == 4 and spec.n_tokens == 16
    assert vlm.info()["arch"]["model_type"] in ("llava", "smolvlm", "qwen2_vl")
    assert any(row["site"] == "resid_post.1" for row in vlm.sites())


def test_placeholders_expand_like_the_family_says(vlm):
    spec = vision.spec_of(vlm)
    t = vlm.trace(PROMPT, images=[_image()])
    (group,) = vision.image_token_groups(spec, t.token_ids)
    assert len(group) == 16 and group == list(range(group[0], group[0] + 16))
    before = t.token_ids[group[0] - len(spec.before):group[0]]
    after = t.token_ids[group[-1] + 1:group[-1] + 1 + len(spec.after)]
    assert before == list(spec.before) and after == list(spec.after)
    assert len(t.token_ids) == len(vlm.encode(PROMPT)) - 1 + 16 + len(spec.before) + len(spec.after)
    # an expanded sequence fed back is not expanded again
    assert vlm.trace(t.token_ids, images=[_image()]).token_ids == t.token_ids


def test_region_tokens_follow_the_model(vlm):
    """A pixel box's tokens are the ones whose patches the box's pixels reach (patch embeddings of the
    vision tower, merged as the connector merges them), and feature k lands at the k-th image token."""
    spec = vision.spec_of(vlm)
    model = vlm.model
    tower = next(getattr(model.model, n) for n in ("vision_tower", "visual", "vision_model") if hasattr(model.model, n))
    embed = getattr(tower, "embeddings", None) or getattr(getattr(tower, "vision_model", None), "embeddings", None)
    img = _image(1, size=(spec.image_size, spec.image_size))
    box = (3, 20, 17, 30)  # pixels of the tower's input (no resize)
    changed = img.copy()
    changed[box[1]:box[3], box[0]:box[2]] = 255 - changed[box[1]:box[3], box[0]:box[2]]
    grid = spec.image_size // spec.patch_size

    def patches(im):
        pv = vision.preprocess(spec, im)[None]
        with torch.no_grad():
            if spec.family == "llava":
                return embed(pv)[0, 1:]  # CLS first
            if spec.family == "qwen2_vl":  # flat patches, each merge block's patches together
                return tower.patch_embed(vision.pixel_inputs(spec, [[im]])["pixel_values"])
            mask = torch.ones(1, grid, grid, dtype=torch.bool)
            return embed(pv, patch_attention_mask=mask)[0]

    diff = (patches(changed) - patches(img)).abs().sum(-1)
    if spec.family == "qwen2_vl":  # patch p belongs to merged token p // merge^2
        touched = sorted({p // spec.merge ** 2 for p in diff.nonzero().flatten().tolist()})
    else:
        touched = sorted({(p // grid // spec.merge) * spec.grid + (p % grid) // spec.merge
                          for p in diff.nonzero().flatten().tolist()})
    expected = {"llava": [8, 9, 10, 12, 13, 14], "idefics3": [4, 5], "qwen2_vl": [4, 5]}[spec.family]
    assert touched == vision.box_cells(spec, box, (spec.image_size, spec.image_size)) == expected
    # the k-th image feature is the input embedding at the k-th image token
    ids, kw = vlm._vision_inputs([vlm.encode(PROMPT)], [[img]])
    with torch.no_grad():
        feats = model.model.get_image_features(**{k: v for k, v in kw.items() if k != "mm_token_type_ids"}
                                               ).pooler_output[0]
        embeds = model(input_ids=torch.tensor(ids), **kw, output_hidden_states=True).hidden_states[0][0]
    group = vision.image_token_groups(spec, ids[0])[0]
    assert torch.allclose(embeds[group], feats.reshape(-1, feats.shape[-1]))
    # a box in an image of another size maps after scaling; a box outside the image is refused
    assert vision.box_tokens(spec, ids[0], (0, 0, 25, 20), (50, 40)) == [group[k] for k in (0, 1, 4, 5)]
    with pytest.raises(BadInputError, match="inside"):
        vision.box_tokens(spec, ids[0], (40, 30, 60, 45), (50, 40))


def test_generation_equals_hugging_face_generate(vlm):
    img = _image(2)
    recs = list(vlm.generate(PROMPT, images=[img], max_new_tokens=5, capture=["resid_post.0"]))
    ids, kw = vlm._vision_inputs([vlm.encode(PROMPT)], [[img]])
    with torch.no_grad():
        out = vlm.model.generate(input_ids=torch.tensor(ids), **kw, max_new_tokens=5, do_sample=False)
    assert [r.token_id for r in recs] == out[0, len(ids[0]):].tolist()
    # a batch of two prompts with their own images gives each its own continuation
    batch = list(vlm.generate(prompts=[PROMPT, PROMPT], images=[img, _image(3)], max_new_tokens=5))
    assert [r.token_id for r in batch if r.batch_index == 0] == [r.token_id for r in recs]
    # the image matters: another image, another trace
    t1, t2 = vlm.trace(PROMPT, images=[img]), vlm.trace(PROMPT, images=[_image(3)])
    assert not torch.allclose(t1.logprobs[-2:], t2.logprobs[-2:])


@pytest.mark.parametrize("model_id", ["tiny-random:llava", "tiny-random:smolvlm"])  # 1-D; Qwen-VL: test_qwen_vl.py
def test_a_prefix_state_holds_the_image_and_forks_after_it(model_id):
    vlm = Engine.from_id(model_id, device="cpu")
    img = _image(5)
    suffix = vlm.encode(" and then", add_special_tokens=False)
    state = vlm.prefill(PROMPT, images=[img])
    (ids,), kw = vlm._vision_inputs([vlm.encode(PROMPT)], [[img]])
    assert state.ids == ids and state.cache_len == len(ids)
    forked = [r.token_id for r in vlm.fork(state, suffix, max_new_tokens=4)]
    with torch.no_grad():
        out = vlm.model.generate(input_ids=torch.tensor([ids + suffix]), **kw, max_new_tokens=4, do_sample=False)
    assert forked == out[0, len(ids) + len(suffix):].tolist()  # the image's cache entries are reused, not recomputed
    # extending the state with text reuses it too; anything that would recompute image tokens is refused
    longer = vlm.prefill(ids + suffix, base=state)
    assert longer.ids == ids + suffix
    first_image = ids.index(vlm.handle.vision.image_token_id)
    # a fork that ends inside the image reads the cached image entries before it ...
    assert len(vlm.fork(state, suffix, at=first_image + 1, max_new_tokens=1)) == 1
    with pytest.raises(BadInputError, match="without their pixels"):
        vlm.fork(state, [], at=first_image + 1)  # ... but with no suffix it must recompute an image token
    with pytest.raises(BadInputError, match="without their pixels"):
        vlm.prefill(ids)  # image tokens given as ids, with no image
    with pytest.raises(BadInputError, match="text only"):
        vlm.prefill(PROMPT, base=state, images=[img])
    # a live generation with an image gives a state the same rules apply to
    stream = vlm.generate(PROMPT, images=[img], max_new_tokens=3)
    next(stream)
    live = stream.state()
    assert len(vlm.fork(live, suffix, max_new_tokens=2)) == 2
    with pytest.raises(BadInputError, match="without their pixels"):
        vlm.fork(live, [], at=first_image + 2)
    stream.close()


def test_bad_images_fail_before_model_work(vlm, llama):
    from PIL import Image

    def boom(*a, **k):
        raise AssertionError("the model ran")

    forward, vlm.model.forward = vlm.model.forward, boom
    try:
        with pytest.raises(BadInputError, match="not an image"):
            vlm.trace(PROMPT, images=[b"this is not a png"])
        with pytest.raises(BadInputError, match="each side"):
            vlm.trace(PROMPT, images=[np.zeros((1, 5000, 3), dtype=np.uint8)])
        with pytest.raises(BadInputError, match="mode"):
            vlm.trace(PROMPT, images=[Image.fromarray(np.zeros((8, 8), dtype=np.float32), mode="F")])
        with pytest.raises(BadInputError, match="placeholder"):
            vlm.trace("no image here", images=[_image()])
        with pytest.raises(BadInputError, match="paths"):
            vlm.trace(PROMPT, images=["/etc/passwd"])
        with pytest.raises(BadInputError, match="limit"):
            vision.load_image(b"\x89PNG" + bytes(vision.MAX_IMAGE_BYTES))
        with pytest.raises(BadInputError, match="text-only"):
            llama.trace("a <image>", images=[_image()])
    finally:
        vlm.model.forward = forward
    buf = io.BytesIO()
    Image.fromarray(_image()).save(buf, format="PNG")  # PNG bytes and their base64 are accepted
    assert vision.load_image(buf.getvalue()).size == (50, 40)
    assert vision.load_image(vision.image_to_b64(buf.getvalue())).size == (50, 40)


def test_vlm_trace_and_generation_through_the_server_equal_in_process():
    from probes.server_bench import served

    img = _image(4)
    with served("tiny-random:llava") as (engine, remote):
        assert remote.capabilities()["vision"] and remote.info()["vision"] == engine.info()["vision"]
        local = engine.trace(PROMPT, capture=["resid_post.1", "attn_pattern.0"], images=[img])
        served_trace = remote.trace(PROMPT, capture=["resid_post.1", "attn_pattern.0"], images=[img])
        assert served_trace.token_ids == local.token_ids
        assert torch.allclose(served_trace.logprobs[1:], local.logprobs[1:], atol=1e-5)
        for site in ("resid_post.1", "attn_pattern.0"):
            assert torch.allclose(served_trace.activations[site], local.activations[site], atol=1e-5)
        a = [r.token_id for r in engine.generate(PROMPT, images=[img], max_new_tokens=4)]
        b = [r.token_id for r in remote.generate(PROMPT, images=[img], max_new_tokens=4)]
        assert a == b
        # a prefix state with the image, held by the server, forks as the local one does
        local_state, remote_state = engine.prefill(PROMPT, images=[img]), remote.prefill(PROMPT, images=[img])
        assert remote_state.ids == local_state.ids
        assert ([r.token_id for r in remote.fork(remote_state, " so", max_new_tokens=3)]
                == [r.token_id for r in engine.fork(local_state, " so", max_new_tokens=3)])
        first_image = local_state.ids.index(engine.handle.vision.image_token_id)
        with pytest.raises(BadInputError, match="without their pixels"):
            remote.fork(remote_state, [], at=first_image + 1)
        with pytest.raises(BadInputError, match="placeholder"):
            remote.trace("no image", images=[img])
        g_local = engine.input_x_gradient(PROMPT, sites=["resid_pre.0"], images=[img])
        g_remote = remote.input_x_gradient(PROMPT, sites=["resid_pre.0"], images=[img])
        assert g_remote.token_ids == g_local.token_ids == local.token_ids
        assert torch.allclose(g_remote.site_scores["resid_pre.0"], g_local.site_scores["resid_pre.0"], atol=1e-5)
        # exhaustive effects batched over regions (RowMask rows travel as their wire spec)
        from analyses.visual_attribution import exhaustive_effects, grid_regions

        regions = grid_regions(vision.spec_of(engine), 4, 4)
        spans = [(len(local.token_ids) - 3, len(local.token_ids))]
        served_effects = exhaustive_effects(remote, PROMPT, img, spans, regions)
        assert np.allclose(served_effects, exhaustive_effects(engine, PROMPT, img, spans, regions), atol=1e-4)


def test_toy_vlm_runs_in_the_engine_as_its_own_code_does():
    """The engine's image path gives toy-vlm (here untrained, seeded) the inputs its own training code
    uses: the same trace log-probs, the same greedy traces, the same region -> token mapping."""
    from probes.toys import vlm
    from probes.zoo import ModelHandle, arch_from_config

    tok = vlm.make_tokenizer()
    model = vlm.build_model(vlm.CONFIGS["small"], tok).eval()
    engine = Engine(ModelHandle("toy-vlm:untrained", model, tok, arch_from_config(model.config), "untrained",
                                torch.device("cpu"), torch.float32))
    spec = vision.spec_of(engine)
    assert (spec.family, spec.grid, spec.n_tokens, spec.mean) == ("llava", 3, 9, (0.5, 0.5, 0.5))
    for ex in vlm.examples("eval", 2, seed=8):
        t = engine.trace(vlm.prompt_text(ex.question) + " " + ex.trace + " <eos>", images=[ex.image])
        ours = vlm.trace_logprobs(model, tok, ex)[0]
        assert torch.allclose(t.logprobs[vlm.prompt_length(ex.question):], ours, atol=1e-4)
        for obj in ex.objects:
            assert vision.box_tokens(spec, t.token_ids, obj.box, (vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)) == \
                vlm.box_token_indices(torch.tensor([t.token_ids]), obj.box, spec.image_token_id)
        records = engine.generate(vlm.prompt_text(ex.question), images=[ex.image], max_new_tokens=12)
        text = engine.decode([r.token_id for r in records], skip_special_tokens=True).strip()
        assert text == vlm.generate_traces(model, tok, [ex], max_new_tokens=12)[0]


def test_an_unsupported_vlm_family_fails_at_load_with_the_supported_ones_named(tmp_path):
    """A LLaVA-NeXT folder (tiled images) is refused when loaded, not later in the middle of a generation;
    Qwen2-VL and Qwen2.5-VL folders load, with a square input of 16 x 16 tokens and CLIP's normalisation
    (their processors' default when the folder holds no processor file)."""
    import transformers
    from transformers import AutoTokenizer

    from probes.zoo import load_model, smollm2_files
    from thoughtscope.errors import ModelLoadError

    tok = AutoTokenizer.from_pretrained(smollm2_files())
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64,
                                                                          num_heads=2, mlp_ratio=2))
    transformers.Qwen2VLForConditionalGeneration(cfg).save_pretrained(tmp_path / "q2")
    tok.save_pretrained(tmp_path / "q2")
    spec = load_model(f"hf:{tmp_path / 'q2'}", device="cpu").vision
    assert (spec.family, spec.image_size, spec.grid, spec.mean) == ("qwen2_vl", 448, 16, vision.OPENAI_CLIP_MEAN)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]))
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(tmp_path / "q25")
    tok.save_pretrained(tmp_path / "q25")
    spec = load_model(f"hf:{tmp_path / 'q25'}", device="cpu").vision
    assert (spec.family, spec.model_type, spec.image_size, spec.grid, spec.mean) == (
        "qwen2_vl", "qwen2_5_vl", 448, 16, vision.OPENAI_CLIP_MEAN)
    cfg = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=32, patch_size=8),
        text_config=transformers.LlamaConfig(**{k: v for k, v in text.items() if k != "rope_scaling"}),
        image_grid_pinpoints=[[32, 32]])
    transformers.LlavaNextForConditionalGeneration(cfg).save_pretrained(tmp_path / "next")
    tok.save_pretrained(tmp_path / "next")
    with pytest.raises(ModelLoadError, match="llava_next .*not supported.*llava.*Qwen2.5-VL, Qwen3-VL"):
        load_model(f"hf:{tmp_path / 'next'}", device="cpu")


@pytest.fixture(scope="module")
def qwen():
    return Engine.from_id("tiny-random:qwen2_vl", device="cpu")


def test_qwen2_vl_pixels_are_laid_out_as_its_own_processor_lays_them(qwen):
    from transformers import Qwen2VLImageProcessor

    spec = vision.spec_of(qwen)
    img = _image(5, size=(64, 64))  # the tower's input side: no resize on either side
    proc = Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, min_pixels=64 * 64, max_pixels=64 * 64)
    theirs = proc(images=[img], return_tensors="pt")
    ours = vision.pixel_inputs(qwen.handle.vision, [[img]])
    assert ours["image_grid_thw"].tolist() == theirs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert torch.allclose(ours["pixel_values"], theirs["pixel_values"], atol=1e-6)
    assert (spec.before, spec.after) == ((qwen.model.config.vision_start_token_id,),
                                         (qwen.model.config.vision_end_token_id,))


def test_qwen2_vl_decodes_with_3d_positions(qwen):
    """Generation feeds the model's 3-D rotary positions: its log-probs equal a teacher-forced trace of the
    finished sequence (where the model computes them itself), 1-D positions would change the logits, the
    gradient slot's target equals the trace, and batched exhaustive effects (RowMask rows) equal one
    masked trace per region."""
    from analyses.visual_attribution import exhaustive_effects, grid_regions

    img = _image(6)
    recs = list(qwen.generate(PROMPT, images=[img], max_new_tokens=6))
    ids, kw = qwen._vision_inputs([qwen.encode(PROMPT)], [[img]])
    full = ids[0] + [r.token_id for r in recs]
    traced = qwen.trace(full, images=[img])
    assert np.allclose([r.logprob for r in recs], traced.logprobs[len(ids[0]):].numpy(), atol=1e-4)
    inp = torch.tensor(ids)
    with torch.no_grad():
        flat = qwen.model(input_ids=inp, position_ids=torch.arange(inp.shape[1])[None],
                          **{k: v for k, v in kw.items() if k != "mm_token_type_ids"}).logits
        own = qwen.model(input_ids=inp, **kw).logits
    assert float((flat - own).abs().max()) > 1e-2  # the positions matter, so the equalities above test them
    # the gradient slot runs from input embeddings: it gets the 3-D positions too
    n = len(full)
    g = qwen.input_x_gradient(full, target="logprob", positions=[n - 2, n - 1], sites=["resid_pre.0"], images=[img])
    assert g.target_value == pytest.approx(float(traced.logprobs[n - 2:].double().sum()), abs=1e-3)
    spans = [(len(full) - 4, len(full))]
    regions = grid_regions(vision.spec_of(qwen), 2, 2)
    assert np.allclose(exhaustive_effects(qwen, full, img, spans, regions),
                       exhaustive_effects(qwen, full, img, spans, regions, batch_size=1), atol=1e-4)


def test_qwen2_vl_through_the_server_equals_in_process():
    from probes.server_bench import served

    img = _image(7)
    with served("tiny-random:qwen2_vl") as (engine, remote):
        assert remote.info()["vision"] == engine.info()["vision"]
        local = engine.trace(PROMPT, capture=["resid_post.1"], images=[img])
        served_trace = remote.trace(PROMPT, capture=["resid_post.1"], images=[img])
        assert served_trace.token_ids == local.token_ids
        assert torch.allclose(served_trace.logprobs[1:], local.logprobs[1:], atol=1e-5)
        assert torch.allclose(served_trace.activations["resid_post.1"], local.activations["resid_post.1"], atol=1e-5)
        a = [r.token_id for r in engine.generate(PROMPT, images=[img], max_new_tokens=4)]
        assert a == [r.token_id for r in remote.generate(PROMPT, images=[img], max_new_tokens=4)]
