"""Steering edits (probes.edits), where they act (probes.token_masks), proof that they fired, frozen
attention (probes.frozen_attention), one stack per row in a batch, and the same through the server.

Every edit is checked against a hand computation at the site it edits: a capture at the same site
reads the value after the edit, and the unsteered capture gives the value before it.
"""

from __future__ import annotations

import math

import pytest
import torch

from probes import Sampling
from probes.edits import (MAX_TERMS, Additive, NormScaled, ProjectionCap, ProjectOut, SAEClamp, Swap)
from probes.frozen_attention import FrozenAttention, side_by_side
from probes.token_masks import excluded_positions, special_ids
from thoughtscope.errors import BadInputError

SITE = "resid_post.0"
TEXT = "one two three four five six"


def _dir(seed: int, d: int = 64) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def _before_after(llama, edit, text=TEXT):
    before = llama.capture(text, [SITE])[SITE]
    after = llama.capture(text, [SITE], interventions=[edit])[SITE]
    return before, after


# ----- each edit against a hand computation -----


def test_additive_and_norm_scaled_are_exact(llama):
    v = _dir(0)
    h, after = _before_after(llama, Additive(SITE, v, strength=2.5))
    torch.testing.assert_close(after, h + 2.5 * v, rtol=0, atol=1e-5)
    h, after = _before_after(llama, NormScaled(SITE, v, strength=0.5))
    torch.testing.assert_close(after, h + 0.5 * h.norm(dim=-1, keepdim=True) * v / v.norm(), rtol=0, atol=1e-5)


def test_project_out_leaves_no_component(llama):
    u = _dir(1)
    h, after = _before_after(llama, ProjectOut(SITE, u))
    unit = u / u.norm()
    assert (h @ unit).abs().max() > 1e-2  # there was a component to remove
    torch.testing.assert_close(after @ unit, torch.zeros(h.shape[0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(after, h - (h @ unit).unsqueeze(-1) * unit, rtol=0, atol=1e-5)


def test_projection_cap_holds_at_every_position(llama):
    u = _dir(2)
    unit = u / u.norm()
    proj = llama.capture(TEXT, [SITE])[SITE] @ unit
    high = float(proj.median())
    h, after = _before_after(llama, ProjectionCap(SITE, u, high=high))
    assert (after @ unit <= high + 1e-5).all()
    below = proj <= high
    torch.testing.assert_close(after[below], h[below], rtol=0, atol=0)  # where the cap did not bind: unchanged
    torch.testing.assert_close((after @ unit)[~below], torch.full(((~below).sum(),), high), rtol=0, atol=1e-5)
    low = float(proj.max()) + 1.0  # "at least": every position lifted to low
    _, after = _before_after(llama, ProjectionCap(SITE, u, low=low))
    torch.testing.assert_close(after @ unit, torch.full((h.shape[0],), low), rtol=0, atol=1e-4)


def _sae(n: int = 8, d: int = 64, latent: int = 3, threshold: bool = False):
    g = torch.Generator().manual_seed(5)
    w_enc = torch.randn(d, n, generator=g) / math.sqrt(d)
    w_dec = torch.randn(n, d, generator=g)
    w_dec[latent] = w_enc[:, latent] / w_enc[:, latent].dot(w_enc[:, latent])  # W_dec[i] . W_enc[:, i] = 1
    b_enc = torch.zeros(n)
    b_enc[latent] = 50.0  # the latent is on at every position (so re-encoding reads it linearly)
    b_dec = torch.randn(d, generator=g) * 0.1
    thr = torch.full((n,), 0.5) if threshold else None
    return dict(W_enc=w_enc, b_enc=b_enc, W_dec=w_dec, b_dec=b_dec, threshold=thr)


def _encode(x, sae):
    pre = (x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"]
    if sae["threshold"] is not None:
        return pre * (pre > sae["threshold"]) * (pre > 0)
    return pre.clamp(min=0)


@pytest.mark.parametrize("threshold", [False, True])
def test_sae_clamp_sets_the_latent_and_keeps_the_error(llama, threshold):
    sae = _sae(threshold=threshold)
    h, after = _before_after(llama, SAEClamp(SITE, latent=3, value=7.0, **sae))
    z = _encode(h, sae)
    z_set = z.clone()
    z_set[:, 3] = 7.0
    decode = lambda code: code @ sae["W_dec"] + sae["b_dec"]  # noqa: E731
    torch.testing.assert_close(after - decode(z_set), h - decode(z), rtol=0, atol=1e-4)  # the error is kept
    torch.testing.assert_close(_encode(after, sae)[:, 3], torch.full((h.shape[0],), 7.0), rtol=0, atol=1e-4)


def test_sae_clamp_from_sae_sends_one_latent(llama):
    from types import SimpleNamespace

    sae = _sae(threshold=True)
    full = SAEClamp(SITE, latent=3, value=7.0, **sae)
    slim = SAEClamp.from_sae(SITE, SimpleNamespace(**sae), latent=3, value=7.0)
    assert slim.W_enc.shape == (64, 1) and slim.W_dec.shape == (1, 64) and slim.latent == 0
    assert slim.term == "sae_clamp[3]@resid_post.0"
    _, a = _before_after(llama, full)
    _, b = _before_after(llama, slim)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(BadInputError, match="latent"):
        SAEClamp.from_sae(SITE, SimpleNamespace(**sae), latent=8, value=1.0)


def test_swap_moves_the_stated_amount(llama):
    u, v = _dir(3), _dir(4)
    v = v - (v @ u) / (u @ u) * u  # orthogonal to u
    uh, vh = u / u.norm(), v / v.norm()
    h, after = _before_after(llama, Swap(SITE, u, v, strength=0.75))
    c = h @ uh
    torch.testing.assert_close(after @ uh, 0.25 * c, rtol=0, atol=1e-4)
    torch.testing.assert_close(after @ vh, h @ vh + 0.75 * c, rtol=0, atol=1e-4)
    torch.testing.assert_close(after, h + 0.75 * c.unsqueeze(-1) * (vh - uh), rtol=0, atol=1e-5)


def test_additive_stack_equals_the_sum(llama):
    v1, v2, v3 = _dir(6), _dir(7), _dir(8)
    stack = [Additive(SITE, v1, strength=1.5, term="a"), Additive(SITE, v2, strength=-0.5, term="b"),
             Additive("resid_post.1", v3, strength=2.0, term="c")]
    summed = [Additive(SITE, 1.5 * v1 - 0.5 * v2, term="ab"), Additive("resid_post.1", 2.0 * v3, term="c")]
    a = llama.trace(TEXT, capture=["logits"], interventions=stack)
    b = llama.trace(TEXT, capture=["logits"], interventions=summed)
    torch.testing.assert_close(a.activations["logits"], b.activations["logits"], rtol=0, atol=1e-4)
    assert [r.text for r in llama.generate(TEXT, max_new_tokens=6, interventions=stack)] == \
        [r.text for r in llama.generate(TEXT, max_new_tokens=6, interventions=summed)]


# ----- where it acts -----


def _content_positions(llama, messages):
    """Positions whose characters lie inside a message's content (independent of probes.token_masks)."""
    text = llama.render_chat(messages)
    enc = llama.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(text.find(m["content"]), text.find(m["content"]) + len(m["content"])) for m in messages]
    return enc["input_ids"], [p for p, (lo, hi) in enumerate(enc["offset_mapping"])
                              if any(a <= lo and hi <= b for a, b in spans)]


def test_chat_mask_edits_exactly_the_content_tokens_in_range(llama):
    messages = [{"role": "user", "content": "hi there my good friend"}]
    ids, content = _content_positions(llama, messages)
    assert ids == llama.encode(messages)
    start, stop = content[1], len(ids)
    term = Additive(SITE, _dir(9), strength=3.0, start=start, stop=stop, term="t")
    before = llama.capture(messages, [SITE])[SITE]
    after = llama.capture(messages, [SITE], interventions=[term])[SITE]
    edited = [p for p in range(len(ids)) if not torch.equal(before[p], after[p])]
    expected = [p for p in content if start <= p < stop]
    assert edited == expected
    special = special_ids(llama.tok)
    assert not any(ids[p] in special for p in edited)
    assert any(ids[p] in special for p in range(len(ids)))  # the prompt did hold special tokens
    fired = llama.trace(messages, interventions=[term]).fired["t"]  # [seq], NaN where it did not act
    assert [p for p, n in enumerate(fired.tolist()) if not math.isnan(n)] == expected
    # skip_special=False: every position in range
    term_all = Additive(SITE, _dir(9), strength=3.0, start=start, stop=stop, skip_special=False, term="t")
    after = llama.capture(messages, [SITE], interventions=[term_all])[SITE]
    assert [p for p in range(len(ids)) if not torch.equal(before[p], after[p])] == list(range(start, stop))


def test_template_pieces_come_from_the_template(llama):
    messages = [{"role": "user", "content": "hi there"}]
    ids = llama.encode(messages)
    kept = [p for p in range(len(ids)) if p not in excluded_positions(llama.tok, ids)]
    assert kept == _content_positions(llama, messages)[1]


def test_template_pieces_follow_another_template(llama):
    """Another family's template (no default system prompt, role names after the marker token): the
    excluded positions follow it, with no hand list."""
    import copy

    tok = copy.deepcopy(llama.tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>model:{% endif %}")
    messages = [{"role": "user", "content": "count the sheep please"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    lo_c = text.find(messages[0]["content"])
    # a token that straddles the boundary (" count": the template's space and the content's word) is content
    content = [p for p, (lo, hi) in enumerate(enc["offset_mapping"])
               if lo < lo_c + len(messages[0]["content"]) and hi > lo_c]
    ids = enc["input_ids"]
    assert [p for p in range(len(ids)) if p not in excluded_positions(tok, ids)] == content
    assert len(content) < len(ids) - 4  # the template's own tokens were there to exclude


def test_prompt_and_generated_tokens(llama):
    v = _dir(10)
    n = len(llama.encode(TEXT))
    recs = list(llama.generate(TEXT, max_new_tokens=4, interventions=[
        Additive(SITE, v, term="p", tokens="prompt"), Additive(SITE, v, term="g", tokens="generated")]))
    # record t is chosen at position n - 1 + t: the prompt's last position, then each generated token
    assert [sorted(r.fired) for r in recs] == [["p"], ["g"], ["g"], ["g"]]
    assert all(r.fired[k] == pytest.approx(float(v.norm()), rel=1e-5) for r in recs for k in r.fired)
    tr = llama.trace(TEXT, interventions=[Additive(SITE, v, term="p", tokens="prompt", start=2)])
    assert [not math.isnan(x) for x in tr.fired["p"].tolist()] == [p >= 2 for p in range(n)]


# ----- proof that it fired: every decoded token of every row -----


def _check_records(records, rows, expected, max_new):
    by_row = {b: [r for r in records if r.batch_index == b] for b in range(rows)}
    for b, recs in by_row.items():
        assert [r.step for r in recs] == list(range(len(recs)))
        assert len(recs) == max_new or recs[-1].finished
        for r in recs:
            assert r.fired.keys() == expected[b].keys(), (b, r.step, r.fired)
            for name, norm in expected[b].items():
                assert r.fired[name] == pytest.approx(norm, rel=1e-5), (b, r.step, name)


def test_every_token_of_every_row_carries_its_terms(llama):
    v1, v2 = _dir(11), _dir(12)
    stack = [Additive(SITE, v1, strength=2.0, rows=[0], term="row0"),
             Additive("resid_post.1", v2, strength=[0.5, 3.0], term="both")]
    records = list(llama.generate(prompts=[TEXT, "seven eight nine ten eleven twelve"], max_new_tokens=6,
                                  interventions=stack))
    expected = {0: {"row0": 2.0 * float(v1.norm()), "both": 0.5 * float(v2.norm())},
                1: {"both": 3.0 * float(v2.norm())}}
    _check_records(records, 2, expected, 6)
    # the same rows one by one: the batched stack is the per-row stacks
    solo = [r.text for r in llama.generate(TEXT, max_new_tokens=6, interventions=[
        Additive(SITE, v1, strength=2.0, term="row0"), Additive("resid_post.1", v2, strength=0.5, term="both")])]
    assert [r.text for r in records if r.batch_index == 0] == solo


def test_a_skipped_token_would_fail(llama):
    """The record check above fails when one decoded token of one row carries no record of its term."""
    v = _dir(13)
    records = list(llama.generate(prompts=[TEXT, TEXT], max_new_tokens=4,
                                  interventions=[Additive(SITE, v, term="t")]))
    _check_records(records, 2, {0: {"t": float(v.norm())}, 1: {"t": float(v.norm())}}, 4)
    records[5].fired = {}
    with pytest.raises(AssertionError):
        _check_records(records, 2, {0: {"t": float(v.norm())}, 1: {"t": float(v.norm())}}, 4)


def test_through_the_server_equal_records(llama):
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    v1, v2 = _dir(14), _dir(15)
    sae = _sae()
    stack = [Additive(SITE, v1, strength=2.0, rows=[0], term="a"),
             NormScaled("resid_post.1", v2, strength=[0.1, 0.3], term="n"),
             SAEClamp(SITE, latent=3, value=2.0, rows=[1], term="s", **sae),
             ProjectionCap("resid_post.1", v1, high=0.0, term="cap")]
    prompts = [TEXT, "seven eight nine ten eleven twelve"]
    local = list(llama.generate(prompts=prompts, max_new_tokens=5, interventions=stack))
    traced = [Additive(SITE, v1, strength=2.0, start=2, term="a"), NormScaled("resid_post.1", v2, strength=0.2, term="n")]
    local_trace = llama.trace(TEXT, interventions=traced)
    fork_term = [Additive(SITE, v1, strength=1.5, term="f")]
    local_fork = llama.fork(llama.prefill(TEXT), " seven", max_new_tokens=4, interventions=fork_term)
    sampling = Sampling(temperature=0.8, top_p=0.9)
    local_sampled = list(llama.generate(prompts=prompts, n_samples=2, max_new_tokens=4, sampling=sampling, seed=3,
                                        interventions=[Additive(SITE, v1, strength=[1.0, 2.0, 0.0, 3.0], term="a")]))
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url, timeout=60) as remote:
        served = list(remote.generate(prompts=prompts, max_new_tokens=5, interventions=stack))
        served_trace = remote.trace(TEXT, interventions=traced)
        served_fork = remote.fork(remote.prefill(TEXT), " seven", max_new_tokens=4, interventions=fork_term)
        served_sampled = list(remote.generate(
            prompts=prompts, n_samples=2, max_new_tokens=4, sampling=sampling, seed=3,
            interventions=[Additive(SITE, v1, strength=[1.0, 2.0, 0.0, 3.0], term="a")]))
        with pytest.raises(BadInputError):
            list(remote.generate(TEXT, max_new_tokens=2, interventions=[Additive(SITE, torch.ones(63))]))
    assert [(r.batch_index, r.token_id) for r in served] == [(r.batch_index, r.token_id) for r in local]
    for a, b in zip(local, served):
        assert a.fired.keys() == b.fired.keys()
        for k in a.fired:
            assert b.fired[k] == pytest.approx(a.fired[k], rel=1e-5, abs=1e-6)
    assert all(r.fired.keys() == ({"a", "n", "cap"} if r.batch_index == 0 else {"n", "s", "cap"}) for r in local)
    assert served_trace.fired.keys() == local_trace.fired.keys() == {"a", "n"}
    # a fork: every decoded token carries its term, in process and through the server alike
    assert len(local_fork) == 4 and all(r.fired == {"f": pytest.approx(1.5 * float(v1.norm()))} for r in local_fork)
    assert [(r.token_id, r.fired) for r in served_fork] == [(r.token_id, r.fired) for r in local_fork]
    # sampled, with the same seed: the same tokens and records
    assert [(r.token_id, r.fired) for r in served_sampled] == [(r.token_id, r.fired) for r in local_sampled]
    for k in local_trace.fired:
        torch.testing.assert_close(served_trace.fired[k], local_trace.fired[k], equal_nan=True)


# ----- frozen attention -----


def test_frozen_attention_uses_the_unsteered_patterns(llama):
    v = _dir(16) * 4
    stack = [Additive(SITE, v, strength=3.0, term="t")]
    sites = [f"attn_pattern.{layer}" for layer in range(2)]
    frozen = list(llama.generate(TEXT, max_new_tokens=5, capture=sites, interventions=[*stack, FrozenAttention()]))
    steered = list(llama.generate(TEXT, max_new_tokens=5, capture=sites, interventions=stack))
    ids = llama.encode(TEXT) + [r.token_id for r in frozen]
    n = len(llama.encode(TEXT))
    # the unsteered model, teacher-forced on the frozen row's tokens
    plain = llama.trace(ids[:-1], capture=sites)
    for t, rec in enumerate(frozen):
        for site in sites:
            pattern = rec.activations[site]  # [heads, kv_len] at position n - 1 + t
            torch.testing.assert_close(pattern, plain.activations[site][n - 1 + t, :, :n + t], rtol=0, atol=1e-5)
    assert all(r.fired.keys() == {"t"} for r in frozen)  # the edit still acted
    differs = any(not torch.allclose(a.activations[s], b.activations[s], atol=1e-4)
                  for a, b in zip(frozen, steered) for s in sites if a.token_id == b.token_id)
    assert differs  # without freezing, the steered patterns move


def test_frozen_attention_on_qwen2_and_refused_on_moe(moe):
    from probes import Engine

    qwen = Engine.from_id("tiny-random:qwen2", device="cpu")
    d = qwen.handle.arch.d_model
    stack = [Additive("resid_post.0", torch.randn(d, generator=torch.Generator().manual_seed(18)) * 4, term="t"),
             FrozenAttention()]
    frozen = list(qwen.generate(TEXT, max_new_tokens=4, capture=["attn_pattern.1"], interventions=stack))
    n = len(qwen.encode(TEXT))
    plain = qwen.trace(qwen.encode(TEXT) + [r.token_id for r in frozen][:-1], capture=["attn_pattern.1"])
    for t, rec in enumerate(frozen):
        torch.testing.assert_close(rec.activations["attn_pattern.1"],
                                   plain.activations["attn_pattern.1"][n - 1 + t, :, :n + t], rtol=0, atol=1e-5)
    assert not moe.capabilities()["frozen_attention"]
    with pytest.raises(BadInputError, match="dense"):
        moe.generate(TEXT, max_new_tokens=2, interventions=[FrozenAttention()])


def test_empty_stack_gives_three_equal_texts(llama):
    plain = [r.text for r in llama.generate(TEXT, max_new_tokens=8)]
    frozen = [r.text for r in llama.generate(TEXT, max_new_tokens=8, interventions=[FrozenAttention()])]
    batch = list(llama.generate(prompts=[TEXT] * 3, max_new_tokens=8, interventions=[FrozenAttention(rows=[2])]))
    assert frozen == plain
    for b in range(3):
        assert [r.text for r in batch if r.batch_index == b] == plain


def test_frozen_attention_per_row_in_one_batch(llama):
    """Row 0 unsteered, row 1 steered, row 2 steered with frozen attention: each equals its own call."""
    v = _dir(17) * 4
    term = lambda rows=None: Additive(SITE, v, strength=3.0, rows=rows, term="t")  # noqa: E731
    batch = list(llama.generate(prompts=[TEXT] * 3, max_new_tokens=5, interventions=side_by_side([term()])))
    rows = {b: [r.token_id for r in batch if r.batch_index == b] for b in range(3)}
    assert rows[0] == [r.token_id for r in llama.generate(TEXT, max_new_tokens=5)]
    assert rows[1] == [r.token_id for r in llama.generate(TEXT, max_new_tokens=5, interventions=[term()])]
    assert rows[2] == [r.token_id for r in llama.generate(TEXT, max_new_tokens=5,
                                                           interventions=[term(), FrozenAttention()])]


# ----- bad input: a clear error before any model work -----


@pytest.mark.parametrize("make, match", [
    (lambda: [Additive(SITE, torch.ones(63))], "width 63"),
    (lambda: [Additive(SITE, torch.ones(64), strength=float("nan"))], "finite"),
    (lambda: [Additive(SITE, torch.ones(64), strength=float("inf"))], "finite"),
    (lambda: [Additive(SITE, torch.ones(64), term=f"t{i}") for i in range(MAX_TERMS + 1)], "at most 32"),
    (lambda: [Additive(SITE, torch.ones(64), term="x"), Additive(SITE, torch.ones(64), term="x")], "distinct"),
    (lambda: [SAEClamp(SITE, latent=0, value=1.0)], "no SAE"),
    (lambda: [SAEClamp(SITE, latent=8, value=1.0, **_sae())], "latent"),
    (lambda: [SAEClamp(SITE, latent=0, value=1.0, **{**_sae(), "W_enc": torch.ones(32, 8)})], "W_enc"),
    (lambda: [Additive(SITE, torch.ones(64), start=50)], "outside the prompt"),
    (lambda: [Additive(SITE, torch.ones(64), start=3, stop=3)], "empty"),
    (lambda: [Additive(SITE, torch.ones(64), tokens="later")], "tokens"),
    (lambda: [Additive(SITE, torch.ones(64), rows=[2])], "rows"),
    (lambda: [ProjectionCap(SITE, torch.ones(64))], "low"),
    (lambda: [ProjectOut(SITE, torch.zeros(64))], "zero vector"),
    (lambda: [FrozenAttention(rows=[5])], "rows"),
    (lambda: [Additive(SITE, torch.ones(64), where="generated")], "tokens="),
])
def test_bad_input_is_refused_before_model_work(llama, make, match):
    with pytest.raises(BadInputError, match=match):
        llama.generate(TEXT, max_new_tokens=2, interventions=make())  # the call, not the first record


def test_bad_input_in_a_trace(llama):
    with pytest.raises(BadInputError, match="per-row strengths"):
        llama.trace(TEXT, interventions=[Additive(SITE, torch.ones(64), strength=[1.0, 2.0])])
    with pytest.raises(BadInputError, match="rows"):
        llama.trace(TEXT, interventions=[Additive(SITE, torch.ones(64), rows=[1])])


def test_frozen_attention_is_a_capability(llama):
    assert llama.capabilities()["frozen_attention"]


def test_steering_benchmarks_report_their_ratios(llama):
    from probes.steer_bench import bench_stack

    rows = [bench_stack(llama, tokens=4, repeats=1), bench_stack(llama, frozen=True, tokens=4, repeats=1)]
    assert [r["bench"] for r in rows] == ["steer_stack_generate", "steer_frozen_attention"]
    assert [r["target"] for r in rows] == [1.10, 2.2]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["plain_tokens_per_s"] / row["steered_tokens_per_s"], rel=0.02)
        assert row["steered_tokens"] <= 4 and len(row["terms"]) == (4 if row["bench"] == "steer_stack_generate" else 5)
