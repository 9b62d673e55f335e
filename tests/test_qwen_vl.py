"""Qwen2.5-VL and Qwen3-VL in the engine (issue 27, items 1-2), on tiny random configs of both: greedy
generation with an image equals Hugging Face `generate`; prefix states hold an image and forks, extensions
and forks of a live generation after it equal `generate` on the whole sequence (Qwen2-VL too: its old
refusal is lifted); every site of the site table captures with its documented shape; `capture_batch` takes
images (rows with and without, several per row) and equals per-row capture for every VLM family; through
the model server everything equals in-process; bad images are refused before model work.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from probes import vision
from probes.engine import Engine
from thoughtscope.errors import BadInputError

NEW = ["tiny-random:qwen2_5_vl", "tiny-random:qwen3_vl"]
QWENS = ["tiny-random:qwen2_vl", *NEW]
PROMPT = "look <image> what is it"

_ENGINES: dict[str, Engine] = {}


def _engine(model_id: str) -> Engine:
    if model_id not in _ENGINES:  # each tiny VLM loads once for the whole file
        _ENGINES[model_id] = Engine.from_id(model_id, device="cpu")
    return _ENGINES[model_id]


@pytest.fixture(params=NEW)
def new_vlm(request):
    return _engine(request.param)


@pytest.fixture(params=QWENS)
def qwen(request):
    return _engine(request.param)


def _image(seed: int = 0, size=(40, 50)) -> np.ndarray:
    return (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)


def _hf_greedy(engine: Engine, ids: list[int], images: list, n: int) -> list[int]:
    """Hugging Face's own greedy `generate` on expanded ids with their images (the reference)."""
    (row,), kw = engine._vision_inputs([ids], [images])
    with torch.no_grad():
        out = engine.model.generate(input_ids=torch.tensor([row]), **kw, max_new_tokens=n, do_sample=False)
    return out[0, len(row):].tolist()


def test_the_new_families_load_with_their_towers(new_vlm):
    spec = vision.spec_of(new_vlm)
    model_type = new_vlm.info()["arch"]["model_type"]
    assert (spec.family, spec.model_type, spec.grid, spec.n_tokens, spec.mrope) == ("qwen2_vl", model_type, 4, 16, True)
    assert type(new_vlm.model).__name__ == {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                            "qwen3_vl": "Qwen3VLForConditionalGeneration"}[model_type]
    assert new_vlm.capabilities()["vision"]


def test_greedy_generation_with_an_image_equals_hugging_face_generate(new_vlm):
    img = _image(2)
    recs = list(new_vlm.generate(PROMPT, images=[img], max_new_tokens=5, capture=["resid_post.1"]))
    assert [r.token_id for r in recs] == _hf_greedy(new_vlm, new_vlm.encode(PROMPT), [img], 5)
    # a batch: the first prompt with its image, the second with another image, the third without any
    batch = list(new_vlm.generate(prompts=[PROMPT, PROMPT, "no picture"], images=[img, _image(3), None],
                                  max_new_tokens=5))
    assert [r.token_id for r in batch if r.batch_index == 0] == [r.token_id for r in recs]
    assert [r.token_id for r in batch if r.batch_index == 2] == [
        r.token_id for r in new_vlm.generate("no picture", max_new_tokens=5)]
    # the record's activation is the trace's at that position; the image matters
    ids = new_vlm.trace(PROMPT, images=[img]).token_ids
    full = new_vlm.trace(ids + [r.token_id for r in recs], capture=["resid_post.1"], images=[img])
    assert torch.allclose(recs[1].activations["resid_post.1"], full.activations["resid_post.1"][len(ids)], atol=1e-4)
    other = new_vlm.trace(PROMPT, images=[_image(3)])
    assert not torch.allclose(full.logprobs[len(ids) - 2:len(ids)], other.logprobs[-2:])
    # the gradient slot runs from input embeddings with the image and the 3-D positions: its target is the trace's
    seq = ids + [r.token_id for r in recs]
    g = new_vlm.input_x_gradient(seq, target="logprob", positions=[len(seq) - 2, len(seq) - 1], sites=["resid_pre.0"],
                                 images=[img])
    assert g.target_value == pytest.approx(float(full.logprobs[-2:].double().sum()), abs=1e-3)


def test_a_fork_from_an_image_prefix_equals_hugging_face(qwen):
    """Prefill with the image, then text after it at the model's own 3-D positions: forks, extensions and
    a live generation's state all continue as `generate` over the whole sequence does."""
    img = _image(5)
    spec = qwen.handle.vision
    suffix = qwen.encode(" and then", add_special_tokens=False)
    state = qwen.prefill(PROMPT, images=[img])
    ids = state.ids
    assert state.cache_len == len(ids) == len(qwen.encode(PROMPT)) - 1 + 16 + 2
    # text after one 4 x 4-token image sits 16 - 4 = 12 positions before its index on every axis
    assert vision.mrope_offset(qwen.model, spec, ids) == -12
    forked = qwen.fork(state, suffix, max_new_tokens=4)
    assert [r.token_id for r in forked] == _hf_greedy(qwen, ids + suffix, [img], 4)
    traced = qwen.trace(ids + suffix + [r.token_id for r in forked], images=[img])
    assert np.allclose([r.logprob for r in forked[:3]], traced.logprobs[len(ids) + len(suffix):][:3].numpy(),
                       atol=1e-4)
    so = qwen.encode(" so", add_special_tokens=False)
    longer = qwen.prefill(ids + suffix, base=state)  # an extension computes the suffix only
    assert [r.token_id for r in qwen.fork(longer, so, max_new_tokens=3)] == _hf_greedy(qwen, ids + suffix + so,
                                                                                     [img], 3)
    stream = qwen.generate(PROMPT, images=[img], max_new_tokens=3)
    first = next(stream)
    live = stream.state()
    assert [r.token_id for r in qwen.fork(live, suffix, max_new_tokens=2)] == _hf_greedy(
        qwen, ids + [first.token_id] + suffix, [img], 2)
    stream.close()
    # a fork before the image is plain text; a fork whose text would follow part of an image is refused
    start = ids.index(spec.image_token_id) - 1  # the <|vision_start|> token: the text before it
    assert [r.token_id for r in qwen.fork(state, suffix, at=start, max_new_tokens=2)] == [
        r.token_id for r in qwen.generate(ids[:start] + suffix, max_new_tokens=2)]
    with pytest.raises(BadInputError, match="inside an image"):
        qwen.fork(state, suffix, at=start + 5)


def _expected_shape(row: dict, arch, seq: int) -> tuple[int, ...]:
    sizes = {"d_model": arch.d_model, "heads": arch.n_heads, "kv_heads": arch.n_kv_heads, "head_dim": arch.head_dim,
             "kv_len": seq, "vocab": arch.vocab_size}
    return (seq, *(sizes[part.strip()] for part in row["shape"].strip("[]").split(",")))


def test_every_site_captures_with_its_shape_and_the_residual_equals_hugging_face(new_vlm):
    img = _image(6)
    rows = new_vlm.sites()
    assert {r["site"] for r in rows} >= {"resid_pre.0", "attn_pattern.1", "z.1", "q.0", "k.0", "v.0", "mlp_out.1",
                                         "logits"}
    t = new_vlm.trace(PROMPT, capture=[r["site"] for r in rows], images=[img])
    seq = len(t.token_ids)
    arch = new_vlm.arch()
    for row in rows:
        assert tuple(t.activations[row["site"]].shape) == _expected_shape(row, arch, seq), row["site"]
    (ids,), kw = new_vlm._vision_inputs([new_vlm.encode(PROMPT)], [[img]])
    with torch.no_grad():
        out = new_vlm.model(input_ids=torch.tensor([ids]), **kw, output_hidden_states=True)
    hidden = out.hidden_states
    assert torch.allclose(t.activations["resid_pre.0"], hidden[0][0], atol=1e-5)
    assert torch.allclose(t.activations["resid_post.0"], hidden[1][0], atol=1e-5)
    assert torch.allclose(t.activations["logits"], out.logits[0], atol=1e-4)
    probs = t.activations["attn_pattern.1"]
    assert torch.allclose(probs.sum(-1), torch.ones(seq, arch.n_heads), atol=1e-5)
    assert float(probs.permute(1, 0, 2).triu(1).abs().max()) == 0.0  # [seq, heads, kv_len]: causal per head


def test_qwen3_vl_deepstack_enters_after_the_first_layer():
    """Qwen3-VL adds DeepStack features at the image tokens after language layer 0: resid_post.0 is the
    layer's own output, resid_pre.1 holds the addition (and only at the image tokens)."""
    engine = _engine("tiny-random:qwen3_vl")
    t = engine.trace(PROMPT, capture=["resid_post.0", "resid_pre.1"], images=[_image(6)])
    diff = (t.activations["resid_pre.1"] - t.activations["resid_post.0"]).abs().sum(-1)
    image_tokens = vision.image_token_groups(engine.handle.vision, t.token_ids)[0]
    assert sorted(diff.nonzero().flatten().tolist()) == image_tokens


@pytest.mark.parametrize("model_id", ["tiny-random:llava", "tiny-random:smolvlm", *NEW])
def test_capture_batch_with_image_rows_equals_per_row_capture(model_id):
    engine = _engine(model_id)
    rows = [engine.encode(PROMPT), engine.encode("plain text only here"), engine.encode("two <image> and <image> ok")]
    images = [_image(1), None, [_image(2), _image(3, (64, 64))]]
    sites = ["resid_pre.0", "resid_post.1"]
    batch = engine.capture_batch(rows, sites, images=images, stop_after_last_site=False)
    expanded = []
    for b, (ids, ims) in enumerate(zip(rows, images)):
        per_row = [] if ims is None else ims if isinstance(ims, list) else [ims]
        one = engine.trace(ids, capture=sites, images=per_row or None)
        expanded.append(one.token_ids)
        for site in sites:
            n = len(one.token_ids)
            assert torch.allclose(batch[site][b, :n], one.activations[site], atol=1e-5), (model_id, b, site)
    # positions index the expanded rows: the last token of each
    picked = engine.capture_batch(rows, sites[1:], images=images, positions=[[len(r) - 1] for r in expanded])
    assert torch.allclose(picked["resid_post.1"],
                          torch.stack([batch["resid_post.1"][b, len(r) - 1] for b, r in enumerate(expanded)]), atol=1e-5)


def test_capture_batch_after_an_image_prefix_equals_the_full_trace(qwen):
    img = _image(4)
    state = qwen.prefill(PROMPT, images=[img])
    tails = [qwen.encode(t, add_special_tokens=False) for t in (" red", " a blue one")]
    got = qwen.capture_batch([state.ids + t for t in tails], ["resid_post.1"], prefix=state)
    for b, tail in enumerate(tails):
        full = qwen.trace(state.ids + tail, capture=["resid_post.1"], images=[img]).activations["resid_post.1"]
        assert torch.allclose(got["resid_post.1"][b, :len(tail)], full[len(state.ids):], atol=1e-4)


@pytest.mark.parametrize("model_id", NEW)
def test_through_the_server_equals_in_process(model_id):
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    engine = _engine(model_id)
    img, other = _image(7), _image(8, (64, 64))
    with serving_in_thread(create_app(engine)) as url, RemoteBackend(url, timeout=120) as remote:
        assert remote.info()["vision"] == engine.info()["vision"] and remote.info()["vision"]["model_type"]
        local = engine.trace(PROMPT, capture=["resid_post.1"], images=[img])
        served = remote.trace(PROMPT, capture=["resid_post.1"], images=[img])
        assert served.token_ids == local.token_ids
        assert torch.allclose(served.logprobs[1:], local.logprobs[1:], atol=1e-5)
        assert torch.allclose(served.activations["resid_post.1"], local.activations["resid_post.1"], atol=1e-5)
        assert ([r.token_id for r in remote.generate(PROMPT, images=[img], max_new_tokens=4)]
                == [r.token_id for r in engine.generate(PROMPT, images=[img], max_new_tokens=4)])
        local_state, remote_state = engine.prefill(PROMPT, images=[img]), remote.prefill(PROMPT, images=[img])
        assert remote_state.ids == local_state.ids
        assert ([r.token_id for r in remote.fork(remote_state, " so", max_new_tokens=3)]
                == [r.token_id for r in engine.fork(local_state, " so", max_new_tokens=3)])
        rows, images = [engine.encode(PROMPT), engine.encode("text"), engine.encode("<image> <image>")], \
            [img, None, [img, other]]
        here = engine.capture_batch(rows, ["resid_post.0"], images=images)
        there = remote.capture_batch(rows, ["resid_post.0"], images=images)
        assert torch.allclose(there["resid_post.0"], here["resid_post.0"], atol=1e-5)
        g_local = engine.input_x_gradient(PROMPT, sites=["resid_pre.0"], images=[img])
        g_remote = remote.input_x_gradient(PROMPT, sites=["resid_pre.0"], images=[img])
        assert torch.allclose(g_remote.site_scores["resid_pre.0"], g_local.site_scores["resid_pre.0"], atol=1e-5)
        with pytest.raises(BadInputError, match="placeholder"):
            remote.capture_batch([engine.encode("no image")], ["resid_post.0"], images=[img])
        with pytest.raises(BadInputError, match="inside an image"):
            remote.fork(remote_state, " so", at=local_state.ids.index(engine.handle.vision.image_token_id) + 3)


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _declared_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height (the pixels are never there: a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_bad_images_are_refused_before_model_work(new_vlm, llama):
    def boom(*a, **k):
        raise AssertionError("the model ran")

    text_state = new_vlm.prefill("text")
    forward, new_vlm.model.forward = new_vlm.model.forward, boom
    try:
        with pytest.raises(BadInputError, match="decompression bomb"):  # 20000 x 20000 declared in a 70-byte file
            new_vlm.trace(PROMPT, images=[_declared_png(20000, 20000)])
        with pytest.raises(BadInputError, match="each side"):  # under PIL's limit, over ours
            new_vlm.trace(PROMPT, images=[_declared_png(9000, 100)])
        with pytest.raises(BadInputError, match="not an image"):  # a PNG cut short
            new_vlm.trace(PROMPT, images=[_png(_image(1))[:60]])
        with pytest.raises(BadInputError, match="not an image"):
            new_vlm.capture_batch([new_vlm.encode(PROMPT)], ["resid_post.0"], images=[b"GIF89a not really"])
        with pytest.raises(BadInputError, match="without a prefix"):
            new_vlm.capture_batch([text_state.ids + [5]], ["resid_post.0"], prefix=text_state, images=[_image()])
        with pytest.raises(BadInputError, match="2 image entries for 1 prompts"):
            new_vlm.capture_batch([new_vlm.encode(PROMPT)], ["resid_post.0"], images=[_image(), _image()])
        with pytest.raises(BadInputError, match="without their pixels"):  # image tokens given as ids, no image
            new_vlm.capture_batch([[new_vlm.handle.vision.image_token_id] * 16], ["resid_post.0"])
        with pytest.raises(BadInputError, match="without their pixels"):  # ... or in a tail after a prefix
            new_vlm.capture_batch([text_state.ids + [new_vlm.handle.vision.image_token_id]], ["resid_post.0"],
                                  prefix=text_state)
        with pytest.raises(BadInputError, match="text-only"):
            llama.capture_batch([llama.encode("a <image>")], ["resid_post.0"], images=[_image()])
    finally:
        new_vlm.model.forward = forward
    # grey-scale and 1 x 1 images are converted (RGB, resized to the tower's input), not refused
    grey = np.full((30, 20), 200, dtype=np.uint8)
    assert vision.load_image(_png(grey)).mode == "RGB"
    a = new_vlm.trace(PROMPT, images=[grey]).logprobs
    b = new_vlm.trace(PROMPT, images=[np.stack([grey] * 3, -1)]).logprobs
    assert torch.allclose(a[1:], b[1:], atol=1e-6)  # grey is the same picture as its RGB copy
    dot = new_vlm.trace(PROMPT, images=[np.array([[[10, 200, 30]]], dtype=np.uint8)])
    same = new_vlm.trace(PROMPT, images=[np.tile(np.array([[[10, 200, 30]]], dtype=np.uint8), (64, 64, 1))])
    assert torch.allclose(dot.logprobs[1:], same.logprobs[1:], atol=1e-6)  # 1 x 1 is a uniform picture


def test_bad_images_through_the_server_are_4xx(tiny_server_url):
    """The session's tiny-random:llama server (text only) answers an image with a 400, a declared bomb with a 400
    that names it, an image over the server's side limit with a 413."""
    import httpx

    ids = [1, 2, 3]
    small = vision.image_to_b64(_image())
    r = httpx.post(f"{tiny_server_url}/capture_batch", json={"sequences": [ids], "capture": ["resid_post.0"],
                                                               "images": [[small]]}, timeout=60)
    assert r.status_code == 400 and "text-only" in r.text
    import base64

    bomb = base64.b64encode(_declared_png(20000, 20000)).decode()
    r = httpx.post(f"{tiny_server_url}/capture_batch", json={"sequences": [ids], "capture": ["resid_post.0"],
                                                               "images": [[bomb]]}, timeout=60)
    assert r.status_code == 400 and "decompression bomb" in r.text
    wide = base64.b64encode(_declared_png(9000, 100)).decode()
    r = httpx.post(f"{tiny_server_url}/capture_batch", json={"sequences": [ids], "capture": ["resid_post.0"],
                                                               "images": [[wide]]}, timeout=60)
    assert r.status_code == 413 and "9000x100" in r.text


def test_the_vlm_stream_generate_bench_row():
    """`thoughtscope bench vision` holds `vlm_stream_generate`; its row's ratio is its two printed times'."""
    from probes.vision_bench import bench_vlm_stream_generate
    from thoughtscope.cli import benchmark_groups

    assert "vision" in benchmark_groups()
    row = bench_vlm_stream_generate(_engine("tiny-random:qwen2_5_vl"), tokens=3, repeats=1)
    assert (row["bench"], row["target"], row["engine_tokens"], row["image_tokens"]) == ("vlm_stream_generate", 1.10,
                                                                                        3, 16)
    assert row["ratio"] == pytest.approx(row["engine_s_per_token"] / row["hf_s_per_token"], rel=2e-3)
