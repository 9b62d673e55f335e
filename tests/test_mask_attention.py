"""MaskAttention in teacher-forced passes: chosen (query, key) pairs masked in all or chosen layers.

What amortized visual attribution's exhaustive effects need: the log-prob of a span with its
attention to some positions removed. Checked against an eager forward given the same mask as an
explicit 4D mask, and against a hand-computed layer-0 attention.
"""

from __future__ import annotations

import pytest
import torch

from probes import MaskAttention
from probes.kv_policy import SinkRecent
from probes.wire import intervention_from_spec, intervention_to_spec
from thoughtscope.errors import BadInputError

TEXT = "one two three four five six seven eight nine ten"
KEYS, QUERIES = [2, 3], [6, 7, 8, 9]


@pytest.fixture(scope="module")
def ids(llama):
    ids = llama.encode(TEXT)
    assert len(ids) == 10
    return ids


def explicit_mask(n: int, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Additive [1, 1, n, n] float mask: causal plus the given (query, key) pairs."""
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, n, n)
    mask[0, 0][torch.ones(n, n, dtype=torch.bool).triu(1)] = low
    for q, k in pairs:
        mask[0, 0, q, k] = low
    return mask


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1)


def test_masked_keys_are_unreachable_in_every_layer(llama, ids):
    masked = llama.trace(ids, capture=["attn_pattern.0", "attn_pattern.1"],
                         interventions=[MaskAttention(KEYS, queries=QUERIES)])
    plain = llama.trace(ids, capture=["attn_pattern.0", "attn_pattern.1"])
    for site in ("attn_pattern.0", "attn_pattern.1"):
        pattern = masked.activations[site]  # [query, head, key]
        assert pattern[QUERIES][:, :, KEYS].abs().max() == 0
        torch.testing.assert_close(pattern.sum(-1), torch.ones(10, 4), atol=1e-5, rtol=0)
        assert plain.activations[site][QUERIES][:, :, KEYS].min() > 0
        # queries before the first masked one read exactly what they read without the mask
        torch.testing.assert_close(pattern[:6], plain.activations[site][:6], atol=1e-6, rtol=0)
    assert (masked.logprobs[7:] - plain.logprobs[7:]).abs().max() > 1e-3
    torch.testing.assert_close(masked.logprobs[1:7], plain.logprobs[1:7], atol=1e-5, rtol=0)


def test_masked_trace_equals_an_eager_forward_with_the_explicit_mask(llama, ids):
    """sdpa (the hook builds the causal mask) and eager (it edits the additive mask) both equal the
    stock eager forward handed the 4D mask directly."""
    masked = llama.trace(ids, interventions=[MaskAttention(KEYS, queries=QUERIES)])  # sdpa
    eager = llama.trace(ids, capture=["attn_pattern.0"], interventions=[MaskAttention(KEYS, queries=QUERIES)])
    model = llama.model
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            mask = explicit_mask(10, [(q, k) for q in QUERIES for k in KEYS])
            reference = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0]
    finally:
        model.set_attn_implementation(saved)
    torch.testing.assert_close(masked.logprobs[1:], token_logprobs(reference, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(eager.logprobs[1:], token_logprobs(reference, ids), atol=1e-5, rtol=0)


def test_chosen_layer_equals_a_hand_computed_attention(llama, ids):
    """Masking only layer 0: its pattern and output equal softmax(q k^T / sqrt(d) + mask) v o_proj by
    hand from the layer's input; layer 1 still reads the masked keys."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tr = llama.trace(ids, capture=["resid_pre.0", "attn_pattern.0", "attn_pattern.1", "attn_out.0"],
                     interventions=[MaskAttention(KEYS, queries=QUERIES, layers=[0])])
    layer = llama.model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        x = layer.input_layernorm(tr.activations["resid_pre.0"].unsqueeze(0))  # [1, T, d]
        q = attn.q_proj(x).view(1, 10, 4, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, 10, 2, 16).transpose(1, 2)
        v = attn.v_proj(x).view(1, 10, 2, 16).transpose(1, 2)
        cos, sin = llama.model.model.rotary_emb(x, torch.arange(10).view(1, -1))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA: 4 query heads on 2 KV heads
        scores = q @ k.transpose(-1, -2) / 4.0 + explicit_mask(10, [(q_, k_) for q_ in QUERIES for k_ in KEYS])
        weights = scores.softmax(-1)
        out = attn.o_proj((weights @ v).transpose(1, 2).reshape(1, 10, 64))[0]
    torch.testing.assert_close(tr.activations["attn_pattern.0"], weights[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(tr.activations["attn_out.0"], out, atol=1e-5, rtol=0)
    assert tr.activations["attn_pattern.1"][QUERIES][:, :, KEYS].min() > 0


def test_default_queries_are_every_other_position(llama, ids):
    tr = llama.trace(ids, capture=["attn_pattern.0"], interventions=[MaskAttention([0, 4])])
    pattern = tr.activations["attn_pattern.0"]
    rows = [q for q in range(10) if q not in (0, 4)]
    assert pattern[rows][:, :, [0, 4]].abs().max() == 0
    assert pattern[4, :, 4].min() > 0  # a masked position still reads itself
    torch.testing.assert_close(pattern[0, :, 0], torch.ones(4))


def test_capture_and_capture_batch_mask_the_same_pairs(llama, ids):
    iv = [MaskAttention(KEYS, queries=QUERIES)]
    single = llama.capture(ids, ["attn_pattern.1", "resid_post.1"], interventions=iv)
    batch = llama.capture_batch([ids, ids[:8]], ["attn_pattern.1", "resid_post.1"], stop_after_last_site=False,
                                interventions=iv)
    torch.testing.assert_close(batch["resid_post.1"][0], single["resid_post.1"], atol=1e-5, rtol=0)
    assert batch["attn_pattern.1"][:, 6:8][..., KEYS].abs().max() == 0


def test_capture_batch_after_a_prefix_masks_by_absolute_position(llama, ids):
    """With a prefix state the tails' queries sit after the cached tokens: the hook places them there."""
    state = llama.prefill(ids[:5])
    iv = [MaskAttention(KEYS, queries=QUERIES)]
    with_prefix = llama.capture_batch([ids], ["resid_post.1"], prefix=state, interventions=iv)
    whole = llama.capture(ids, ["resid_post.1"], interventions=iv)
    torch.testing.assert_close(with_prefix["resid_post.1"][0], whole["resid_post.1"][5:], atol=1e-5, rtol=0)


def test_generation_can_mask_chosen_layers(llama, ids):
    recs = list(llama.generate(ids, max_new_tokens=3, capture=["attn_pattern.0", "attn_pattern.1"],
                               interventions=[MaskAttention([1, 2], layers=[0])]))
    for r in recs:
        assert r.activations["attn_pattern.0"][:, [1, 2]].abs().max() == 0
        assert r.activations["attn_pattern.1"][:, [1, 2]].min() > 0
    assert recs[0].interventions == ["mask attention to 2 positions [1, 2] in layers [0]"]


def test_mask_travels_over_the_wire():
    iv = MaskAttention([3, 4], queries=[7], layers=[1])
    back = intervention_from_spec(intervention_to_spec(iv))
    assert (back.positions, back.queries, back.layers) == ([3, 4], [7], [1])


# ----- bad input: a project error before any model work -----


@pytest.fixture()
def forwards(llama):
    """Counts model forwards, so a test can show an error came first."""
    calls = []
    handle = llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("mask, match", [
    (MaskAttention([10]), "beyond the text"),
    (MaskAttention([2], queries=[3, 12]), "beyond the text"),
    (MaskAttention([2], layers=[2]), r"layers must be a non-empty list of integers in 0\.\.1, got 2"),
    (MaskAttention([2], layers=[-1]), r"layers must be a non-empty list of integers in 0\.\.1, got -1"),
    (MaskAttention([-1]), "positions must be a non-empty list of integers >= 0, got -1"),
    (MaskAttention([]), "non-empty"),
    (MaskAttention([1], queries=[]), "non-empty"),
    (MaskAttention([0, 1], queries=[1]), "nothing to attend to"),
])
def test_bad_masks_are_refused_before_the_model_runs(llama, ids, forwards, mask, match):
    with pytest.raises(BadInputError, match=match):
        llama.trace(ids, interventions=[mask])
    with pytest.raises(BadInputError, match=match):
        llama.capture_batch([ids], ["resid_post.0"], interventions=[mask])
    assert forwards == []


def test_queries_and_kv_policies_belong_to_their_own_calls(llama, ids, forwards):
    with pytest.raises(BadInputError, match="queries= applies to"):
        next(iter(llama.generate(ids, max_new_tokens=2, interventions=[MaskAttention([1], queries=[9])])))
    with pytest.raises(BadInputError, match="pass it to generate"):
        llama.trace(ids, interventions=[SinkRecent(sink=1, recent=4)])
    assert forwards == []


def test_row_pairs_equal_each_rows_pairs_and_build_each_mask_once_per_forward(llama, ids, monkeypatch):
    """`AttentionMasker.row_pairs` (the per-row mask of a RowMask batch) equals stacking `pairs` row by row,
    with masks limited to layers, queries and mixed with a whole-batch mask; in a traced forward of 5 rows
    whose 4 row masks cover every layer, each mask's pairs are built once, not once per row and layer."""
    from probes.attention_masks import AttentionMasker, RowMask

    masks = [RowMask([1], queries=[3, 5], rows=[1]), RowMask([0, 2], rows=[2, 3], layers=[1]),
             RowMask([4], rows=[4]), MaskAttention([6], queries=[8])]
    masker = AttentionMasker(None, masks)
    cols = torch.arange(2, 10)  # queries 2..9 of 10 keys (a part of the sequence, as after a prefix)
    for layer in (0, 1):
        want = torch.stack([masker.pairs(layer, cols, 10, row=r) for r in range(5)])
        got = masker.row_pairs(layer, cols, 10, 5)
        assert torch.equal(got, want) and int(got.sum()) > 0
    assert not torch.equal(masker.row_pairs(0, cols, 10, 5), masker.row_pairs(1, cols, 10, 5))  # layers=[1]

    built = []
    original = AttentionMasker._mask_pairs
    monkeypatch.setattr(AttentionMasker, "_mask_pairs",
                        lambda self, m, q, c: built.append(m) or original(self, m, q, c))
    row_masks = [RowMask([k], rows=[k]) for k in range(1, 5)]
    t = llama.trace(ids, interventions=row_masks)
    assert t.logprobs.shape == (5, len(ids))
    assert len(built) == len(row_masks)  # once per mask (before: once per mask and layer, 8)
    for k in (1, 4):  # each row still equals its own masked trace
        ref = llama.trace(ids, interventions=[MaskAttention([k])])
        torch.testing.assert_close(t.logprobs[k, 1:], ref.logprobs[1:], atol=1e-5, rtol=0)
