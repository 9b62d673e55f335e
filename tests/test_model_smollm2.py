"""The embedded SmolLM2-135M end to end (marker `model`): the engine is a faithful view of the model."""

from __future__ import annotations

import pytest
import torch

from analyses.tasks import arithmetic_problems, one_shot_messages

pytestmark = pytest.mark.model


def test_greedy_stream_equals_hf_generate_token_for_token(smollm2):
    messages = one_shot_messages(arithmetic_problems(1, seed=5)[0])
    ids = smollm2.encode(messages)
    recs = list(smollm2.generate(messages, max_new_tokens=40))
    x = torch.tensor([ids])
    hf = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False,
                                pad_token_id=smollm2.tok.pad_token_id)[0, len(ids):].tolist()
    assert [r.token_id for r in recs] == hf
    text = "".join(r.text for r in recs)
    assert text == smollm2.tok.decode(hf)


def test_bridge_residuals_equal_engine_captures(smollm2):
    ids = smollm2.encode("Tom has 12 apples. He buys 5 more. How many apples does he have?", chat=True)
    layers = [0, 7, 15, 29]
    sites = [f"resid_pre.{i}" for i in layers] + [f"resid_post.{i}" for i in layers] + ["attn_out.7", "mlp_out.7"]
    # The bridge computes attention eagerly; sdpa differs from it by float32 rounding only (3e-4 on
    # SmolLM2's residuals, which reach 2.5e4), so both sides use eager attention here.
    saved = smollm2.model.config._attn_implementation
    smollm2.model.set_attn_implementation("eager")
    try:
        trace = smollm2.trace(ids, capture=sites)
    finally:
        smollm2.model.set_attn_implementation(saved)
    _, cache = smollm2.handle.bridge.run_with_cache(torch.tensor([ids]))
    for site in sites:
        tl_name = {"attn_out.7": "blocks.7.hook_attn_out", "mlp_out.7": "blocks.7.hook_mlp_out"}.get(site)
        kind, layer = site.split(".")
        tl_name = tl_name or f"blocks.{layer}.hook_{kind}"
        torch.testing.assert_close(cache[tl_name][0], trace.activations[site], atol=1e-4, rtol=0)
    # booting the bridge leaves the engine's own model untouched: generation still matches HF
    assert type(smollm2.model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_entropy_falls_over_an_arithmetic_answer(smollm2):
    """A real model answering a one-step problem: later tokens are more certain than the first ones."""
    problem = arithmetic_problems(1, seed=11)[0]
    recs = list(smollm2.generate(one_shot_messages(problem), max_new_tokens=48))
    ents = [r.entropy for r in recs]
    third = max(1, len(ents) // 3)
    assert sum(ents[:third]) / third > sum(ents[-third:]) / third
