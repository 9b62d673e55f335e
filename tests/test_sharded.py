"""Sharded models (issue 26 item 4): a model placed by a device map keeps every read, edit and KV policy exact.

On this CPU machine the map spreads a tiny llama over the CPU and the disk: accelerate's dispatch
hooks then load every module's weights at its forward (all parameters sit on `meta` between calls).
Site reads, steered generation, head ablation, a KV policy, prefix states and batched captures of the dispatched
model equal the plainly loaded one bit for bit. A map that misses part of the model, names a module it
lacks or a device this machine lacks is refused with a message that says which.
"""

from __future__ import annotations

import json

import pytest
import torch

from probes import Engine
from probes.interventions import AddVector, HeadAblation
from probes.kv_policy import SinkRecent
from probes.sharding import parse_device_map
from thoughtscope.errors import BadInputError

# layer 0 and the head on the CPU (offloaded: weights moved in at each call), layer 1 on disk
CPU_AND_DISK = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}
PROMPT = "The dragon counted the coins, then it counted them again because"


@pytest.fixture(scope="module")
def dispatched():
    return Engine.from_id("tiny-random:llama", device_map=CPU_AND_DISK)


def test_the_dispatched_model_is_offloaded_and_keeps_its_identity(llama, dispatched):
    model = dispatched.handle.model
    assert {p.device.type for p in model.parameters()} == {"meta"}  # weights live in accelerate's maps / on disk
    assert model.hf_device_map == CPU_AND_DISK
    assert dispatched.handle.device == torch.device("cpu")  # where inputs go: the embedding's execution device
    assert dispatched.info()["fingerprint"] == llama.info()["fingerprint"]  # fingerprinted before dispatch


def test_every_site_read_equals_the_undispatched_model(llama, dispatched):
    ids = llama.encode(PROMPT)
    sites = [s["site"] for s in llama.sites()]
    assert len(sites) == 19  # resid_pre/resid_post/attn_out/mlp_out/attn_pattern/q/k/v/z per layer, logits
    plain, sharded = llama.capture(ids, sites), dispatched.capture(ids, sites)
    for site in sites:
        assert torch.equal(sharded[site], plain[site]), site
    x = torch.tensor([ids])  # and the dispatched model's own HF forward is the plain one's
    assert torch.equal(dispatched.handle.model(input_ids=x).logits, llama.handle.model(input_ids=x).logits)


def _records(engine, **kw):
    return [(r.token_id, r.entropy, r.logprob) for r in engine.generate(PROMPT, max_new_tokens=5, **kw)]


def test_steered_and_ablated_generation_and_a_kv_policy_equal_the_undispatched_model(llama, dispatched):
    vec = torch.randn(llama.handle.arch.d_model, generator=torch.Generator().manual_seed(0))
    for interventions in ([AddVector("resid_post.0", vec, scale=2.0)], [HeadAblation(1, heads=[0, 1])],
                          [SinkRecent(sink=2, recent=4)]):
        plain = _records(llama, interventions=interventions)
        assert _records(dispatched, interventions=interventions) == plain, interventions
        assert plain != _records(llama), interventions  # each edit changes the generation (it is not a no-op)


def test_prefix_states_and_batched_capture_equal_the_undispatched_model(llama, dispatched):
    ids = llama.encode(PROMPT)
    probe = llama.encode(" so the answer is")
    forks = [engine.fork(engine.prefill(ids), probe, max_new_tokens=3) for engine in (llama, dispatched)]
    assert [(r.token_id, r.entropy) for r in forks[1]] == [(r.token_id, r.entropy) for r in forks[0]]
    sequences = [llama.encode(p) for p in (PROMPT, "One, two, three", "A ring")]
    a = llama.capture_batch(sequences, ["resid_post.1", "z.0"])
    b = dispatched.capture_batch(sequences, ["resid_post.1", "z.0"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_map_that_misses_part_of_the_model_is_refused_by_module():
    partial_map = {k: v for k, v in CPU_AND_DISK.items() if k not in ("model.layers.1", "lm_head")}
    with pytest.raises(BadInputError, match=r"does not cover the model: 10 parameters/buffers have no device, in "
                                            r"lm_head, model\.layers\.1; add these modules"):
        Engine.from_id("tiny-random:llama", device_map=partial_map)
    with pytest.raises(BadInputError, match=r"names 'model\.layers\.7', which this model does not have"):
        Engine.from_id("tiny-random:llama", device_map={**CPU_AND_DISK, "model.layers.7": "cpu"})


def test_device_map_text_is_parsed_and_bad_devices_are_refused(tmp_path):
    assert parse_device_map(json.dumps(CPU_AND_DISK)) == CPU_AND_DISK
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"": "cpu"}))
    assert parse_device_map(str(path)) == {"": "cpu"}
    assert parse_device_map("balanced") == "balanced"
    with pytest.raises(BadInputError, match="--device-map takes auto, balanced, balanced_low_0, sequential"):
        parse_device_map("everywhere")
    with pytest.raises(BadInputError, match=r"'lm_head' -> 'tpu' is not a device"):
        parse_device_map({"": "cpu", "lm_head": "tpu"})
    if torch.cuda.device_count() == 0:
        with pytest.raises(BadInputError, match=r"'model.layers.1' -> 'cuda:1', but this machine has 0 CUDA GPU"):
            parse_device_map({"": "cpu", "model.layers.1": "cuda:1"})
        # with no GPU a strategy places the whole model on the CPU, where it equals the plain load
        assert Engine.from_id("tiny-random:llama", device_map="auto").handle.model.hf_device_map == {"": "cpu"}
