"""Memory bounds (probes.memory_budget): a call whose estimated size is over the budget is refused before
any model work, with the estimate in the message, in-process and through the model server; and the
work a capture does is counted (its logits: the last position only)."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import torch

from probes.arch import ArchInfo
from probes.memory_budget import ENV_VAR, estimate, format_bytes, parse_bytes
from thoughtscope.errors import BadInputError, MemoryBudgetError
from probes.server import create_app
from probes.server_bench import serving_in_thread

ARCH = ArchInfo("llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_model=64, d_mlp=128,
                vocab_size=1000, context_length=8192)


@contextlib.contextmanager
def forward_calls(engine):
    """Counts every call of the model's top-level forward (what any model work goes through)."""
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def test_the_estimate_counts_sites_patterns_logits_and_the_kv_cache_by_hand():
    # capture of 4096 tokens, one residual site, one attention pattern, float32
    est = estimate(ARCH, 4, mode="capture", lengths=[4096], sites=["resid_post.1", "attn_pattern.0"])
    assert est.parts["captured activations"] == 4096 * 64 * 4
    assert est.parts["attention patterns"] == 4 * 4096 * 4096 * 4
    assert est.parts["attention working set"] == 2 * 4 * 4096 * 4096 * 4  # eager attention's scores + softmax
    assert est.parts["logits"] == 1000 * (4 + 12)  # the last position only
    assert est.parts["layer working set"] == 4096 * (2 * 128 + 2 * 64) * 4
    assert est.total == sum(est.parts.values())
    # a trace keeps every position's logits and three float32 copies
    assert estimate(ARCH, 2, mode="trace", lengths=[100]).parts["logits"] == 100 * 1000 * (2 + 12)
    # a stream: one position per step, the KV cache of prompt + new tokens for every row
    gen = estimate(ARCH, 4, mode="generate", lengths=[10, 8], sites=["resid_post.0", "attn_pattern.1"],
                   max_new_tokens=6)
    assert gen.parts["captured activations"] == 2 * 6 * 64 * 4
    assert gen.parts["attention patterns"] == 2 * 4 * 6 * (10 + 3) * 4
    # the KV buffers: the 10-position prompt rounded up to 64 positions holds the 6 new tokens too
    assert gen.parts["kv cache"] == 2 * 2 * 2 * 16 * 2 * 64 * 4
    # 10 + 300: 64 -> 128 -> 192 -> 320 positions (grown by half when full, rounded up to 64)
    assert estimate(ARCH, 4, mode="generate", lengths=[10], max_new_tokens=300).parts["kv cache"] \
        == 2 * 2 * 2 * 16 * 1 * 320 * 4
    assert gen.parts["token records"] == 2 * 6 * 2048  # Python objects of each record
    # the residual site's steps go into a first block of 16 slots of [2 rows, 64]: 10 slots stay unwritten;
    # every record holds one tensor object per captured site
    assert gen.parts["unwritten capture slots"] == (16 - 6) * 2 * 64 * 4
    assert gen.parts["captured value objects"] == 2 * 6 * 2 * 640
    long = estimate(ARCH, 4, mode="generate", lengths=[10], sites=["resid_post.0"], max_new_tokens=300)
    assert long.parts["unwritten capture slots"] == (16 + 32 + 64 + 128 + 256 - 300) * 64 * 4
    # mask rows multiply a teacher-forced pass
    assert estimate(ARCH, 4, mode="trace", lengths=[50], rows=3, sites=["q.0"]).parts["captured activations"] \
        == 3 * 50 * 4 * 16 * 4


def test_budget_sizes_parse_and_bad_ones_are_project_errors():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("500 MB") == 500 * 10**6
    assert parse_bytes("1e6") == 10**6 and parse_bytes("off") is None
    assert format_bytes(3 * 2**30) == "3.0 GiB" and format_bytes(1536) == "1.5 KiB"
    for bad in ("lots", "-5", "0"):
        with pytest.raises(BadInputError, match=ENV_VAR):
            parse_bytes(bad)


def test_an_over_budget_capture_trace_stream_and_prefill_are_refused_before_any_model_work(llama, monkeypatch):
    ids = list(range(5, 205))  # 200 tokens
    pattern = estimate(llama.arch(), 4, mode="capture", lengths=[200], sites=["attn_pattern.0"])
    monkeypatch.setenv(ENV_VAR, str(pattern.total - 1))
    with forward_calls(llama) as calls:
        with pytest.raises(MemoryBudgetError) as err:
            llama.capture(ids, ["attn_pattern.0"])
        assert format_bytes(pattern.total) in str(err.value) and ENV_VAR in str(err.value)
        assert "attention patterns" in str(err.value) and format_bytes(pattern.total - 1) in str(err.value)
        monkeypatch.setenv(ENV_VAR, "64KiB")
        for refused in (lambda: llama.trace(ids, ["resid_post.0"]),
                        lambda: llama.generate(ids, max_new_tokens=400, capture=["resid_post.0", "resid_post.1"]),
                        lambda: llama.capture_batch([ids] * 8, ["resid_post.1"]),
                        lambda: llama.prefill(ids)):
            with pytest.raises(MemoryBudgetError, match="refused before any model work"):
                refused()
        assert calls == []  # not one forward ran
        monkeypatch.setenv(ENV_VAR, "off")
        acts = llama.capture(ids, ["attn_pattern.0"])
        assert calls == [1] and acts["attn_pattern.0"].shape == (200, 4, 200)


def test_a_capture_computes_the_last_positions_logits_only_and_reads_what_hf_reads(llama):
    """The capture used to compute (and throw away) seq x vocab logits: count the unembedding's rows."""
    rows = []
    hook = llama.model.lm_head.register_forward_hook(lambda m, a, out: rows.append(out.shape[1]))
    try:
        ids = list(range(5, 69))
        acts = llama.capture(ids, ["resid_post.0"])
        llama.trace(ids, ["resid_post.0"])
        with_logits = llama.capture(ids, ["logits"])
    finally:
        hook.remove()
    assert rows == [1, 64, 64]  # capture: one position; a trace and a capture of `logits`: all of them
    with torch.no_grad():
        plain = llama.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(acts["resid_post.0"], plain.hidden_states[1][0], rtol=0, atol=0)
    torch.testing.assert_close(with_logits["logits"], plain.logits[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def served(llama):
    """The session's tiny engine behind `create_app` in this process (so the budget and the counter are shared)."""
    with serving_in_thread(create_app(llama)) as url:
        yield url


def test_the_server_refuses_an_over_budget_request_with_the_estimate_before_any_model_work(llama, served, monkeypatch):
    from probes.client import RemoteBackend

    ids = list(range(5, 205))
    est = estimate(llama.arch(), 4, mode="trace", lengths=[200], sites=["attn_pattern.1"])
    monkeypatch.setenv(ENV_VAR, str(est.total - 1))
    with forward_calls(llama) as calls, httpx.Client(base_url=served, timeout=30) as http:
        r = http.post("/trace", json={"text": ids, "capture": ["attn_pattern.1"]})
        assert r.status_code == 413 and r.json()["kind"] == "MemoryBudgetError"
        assert "about " in r.json()["error"] and "attention patterns" in r.json()["error"]
        r = http.post("/generate", json={"prompt": "hello", "max_new_tokens": 2048, "n_samples": 64,
                                         "capture": ["resid_post.0", "resid_post.1"]})
        assert r.status_code == 413 and r.json()["kind"] == "MemoryBudgetError" and "kv cache" in r.json()["error"]
        r = http.post("/capture_batch", json={"sequences": [ids] * 64, "capture": ["attn_pattern.0"]})
        assert r.status_code == 413 and r.json()["kind"] == "MemoryBudgetError"
        with RemoteBackend(served) as remote, pytest.raises(MemoryBudgetError, match="memory budget"):
            remote.capture_batch([ids] * 64, ["attn_pattern.0"])
        assert calls == []
        monkeypatch.setenv(ENV_VAR, "off")
        r = http.post("/capture_batch", json={"sequences": [ids[:20]], "capture": ["resid_post.0"]})
        assert r.status_code == 200 and calls == [1]
