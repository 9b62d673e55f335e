"""One contract for every method: the Backend protocol, in this process and through `thoughtscope serve`.

Each method runs end to end through a model server in a subprocess on `tiny-random:llama` and must
give what the in-process engine gives with the same seed; prefix states behave the same on both
sides and stay within the server's bounds.
"""

from __future__ import annotations

import time

import pytest
import torch

from analyses.cot_entropy import StoppingRule, evaluate_cot_exit, evaluate_cot_vote, run_with_rule
from analyses.rise import RiseOptions, RisePipeline, confidence_vectors, feature_dashboard
from analyses.tasks import load_task
from probes import Engine
from probes.backend import Backend, require
from probes.client import RemoteBackend, RemotePrefix
from probes.server_bench import free_port, server_log, start_server, stop_server, wait_ready
from thoughtscope.errors import BadInputError, RequestTooLargeError, UnknownStateError

MODEL = "tiny-random:llama"


def _serve(extra: str = ""):
    port = free_port()
    proc = start_server(MODEL, port, device="cpu", extra=extra)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, timeout=180)
    return proc, url


@pytest.fixture(scope="module")
def server():
    # small state budget: 12 states of at most ~96 KB in all, expiring after 3 s unused
    proc, url = _serve("max_states=12, max_state_bytes=96 * 1024, state_ttl_s=3.0")
    try:
        yield url
    finally:
        stop_server(proc)
        assert "Traceback" not in server_log(proc), server_log(proc)[-3000:]


@pytest.fixture(scope="module")
def remote(server):
    with RemoteBackend(server, timeout=300) as backend:
        yield backend


@pytest.fixture(scope="module")
def engine():
    return Engine.from_id(MODEL, device="cpu")


def test_both_backends_implement_the_whole_protocol(remote, engine):
    assert isinstance(remote, Backend) and isinstance(engine, Backend)
    # everything but the head gates, which train against the weights in the process that holds them
    assert remote.capabilities() == {**engine.capabilities(), "head_gates": False} and engine.capabilities()["head_gates"]
    assert remote.arch() == engine.arch() and remote.arch().moe_layers == engine.arch().moe_layers == ()
    assert remote.arch().to_dict() == engine.info()["arch"]
    with pytest.raises(BadInputError, match="head gates need the model in this process"):
        remote.head_gates(sink=1, recent=2)
    with pytest.raises(BadInputError, match="capture_batch with interventions runs in the process"):
        remote.capture_batch([[1, 2, 3]], ["resid_post.0"], interventions=[object()])
    assert remote.encode("2 + 2 = ?", chat=True) == engine.encode("2 + 2 = ?", chat=True)
    ids = engine.encode("Sara has 9 pencils.")
    assert remote.decode(ids) == engine.decode(ids) and remote.token_texts(ids) == engine.token_texts(ids)
    assert remote.eos_ids() == engine.eos_ids()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    a, b = remote.readout(x, top_k=4, bottom_k=2, token_ids=[1, 2, 3, 4, 5]), engine.readout(x, top_k=4, bottom_k=2,
                                                                                              token_ids=[1, 2, 3, 4, 5])
    assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.token_ranks, b.token_ranks)
    torch.testing.assert_close(a.top_probs, b.top_probs)
    torch.testing.assert_close(remote.head_means(["hello there"], 1), engine.head_means(["hello there"], 1))
    got, want = (b.input_x_gradient("Sara has 9 pencils", target="logit", token=5, sites=["resid_post.0"])
                 for b in (remote, engine))
    torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.site_scores["resid_post.0"], want.site_scores["resid_post.0"], atol=1e-5, rtol=1e-4)
    assert got.target_value == pytest.approx(want.target_value, abs=1e-5)


# ----- prefix states


def test_a_fork_through_the_server_equals_a_local_fork(remote, engine):
    prefix = "The quick brown fox jumps over the lazy dog and then"
    local, far = engine.prefill(prefix), remote.prefill(prefix)
    assert far.ids == local.ids and far.fingerprint == engine.info()["fingerprint"]
    for at in (None, 5):
        want = engine.fork(local, " it", max_new_tokens=4, capture=["resid_post.1"], at=at)
        got = remote.fork(far, " it", max_new_tokens=4, capture=["resid_post.1"], at=at)
        assert [r.token_id for r in got] == [r.token_id for r in want]
        assert [r.logprob for r in got] == pytest.approx([r.logprob for r in want], abs=1e-5)
        torch.testing.assert_close(got[-1].activations["resid_post.1"], want[-1].activations["resid_post.1"])
    # extending a state computes only the new tokens and equals a fresh prefill
    longer = local.ids + engine.encode(" a cat", add_special_tokens=False)
    grown = remote.prefill(longer, base=far)
    assert [r.token_id for r in remote.fork(grown, " so", max_new_tokens=3)] == \
        [r.token_id for r in engine.fork(engine.prefill(longer), " so", max_new_tokens=3)]
    remote.free(far)
    remote.free(grown)


def test_unknown_and_expired_state_ids_are_404s_that_say_so(remote):
    made = remote.prefill("hello there")
    ghost = RemotePrefix("0123456789abcdef", made.ids, made.fingerprint, url=remote.url)
    with pytest.raises(UnknownStateError, match="no prefix state") as info:
        remote.fork(ghost, " x")
    assert info.value.http_status == 404
    time.sleep(3.5)  # the server's TTL in this module
    with pytest.raises(UnknownStateError, match="expired"):
        remote.fork(made, " x")
    assert remote.ready()["busy"] is False  # the server keeps serving


def test_state_memory_stays_within_its_bound_under_200_calls(remote):
    before = remote.ready()["prefix_states"]
    for i in range(100):
        state = remote.prefill(f"call number {i} with a few more words to hold")
        remote.fork(state, " x", max_new_tokens=1)
        stats = remote.ready()["prefix_states"]
        assert stats["states"] <= before["max_states"] and stats["bytes"] <= before["max_bytes"]
    # none of the 100 states was freed by the client: all but the ones still held were evicted or expired
    gone = (stats["evicted"] - before["evicted"]) + (stats["expired"] - before["expired"])
    assert gone == 100 + before["states"] - stats["states"]


def test_states_from_elsewhere_are_refused_before_any_model_work(remote, engine):
    other = Engine.from_id("tiny-random:qwen2", device="cpu")
    with pytest.raises(BadInputError, match="another model"):
        engine.fork(other.prefill("hello"), " x")
    with pytest.raises(BadInputError, match="not a prefix state"):
        remote.fork(engine.prefill("hello"), " x")
    with pytest.raises(BadInputError, match="belongs to the server"):
        remote.fork(RemotePrefix("abc", [1], "f", url="http://127.0.0.1:1"), " x")
    with pytest.raises(BadInputError, match="at=99"):
        remote.fork(remote.prefill("hello"), " x", at=99)


def test_a_server_refuses_a_state_bigger_than_its_whole_budget(remote):
    with pytest.raises(RequestTooLargeError, match="state budget"):
        remote.prefill("word " * 400)


# ----- every method through the server equals in-process


def _cot(backend):
    problem = load_task("arith", 1, seed=5)[0]
    # 4 development problems, not the default 60 (which were most of this test's generations): the settings
    # chosen on them still decide every method's exits below, so the development sweep is compared too
    report = evaluate_cot_exit(backend, "arith", 2, 2, n_dev=4, max_new_tokens=12, batch_size=2)
    votes = evaluate_cot_vote(backend, "arith", 2, 2, samples=3, max_new_tokens=12, batch_size=6)
    live = run_with_rule(backend, problem, StoppingRule(probe_step_ends=True), max_new_tokens=12)
    return ([m.to_dict(with_results=True)["per_problem"] for m in report.methods], report.detector.to_dict(),
            [(r["answers"], r["weights"], r["majority"], r["weighted"]) for r in votes.per_problem],
            [(p.token_index, p.answer_text, round(p.mean_entropy, 5)) for p in live.probes])


def test_cot_entropy_through_the_server_equals_in_process(remote, engine):
    got, want = _cot(remote), _cot(engine)
    assert got[0] == want[0]  # every method's per-problem answers, exits and token counts
    assert_close_tree(got[1], want[1])  # the detector fitted on the same calibration traces
    assert got[2] == want[2] and got[3] == want[3]


def assert_close_tree(a, b, path="detector"):
    """Equal structure, equal strings, numbers within 1e-5 (the sides run separate processes)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_close_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=1e-5, nan_ok=True), path
    else:
        assert a == b, path


def _rise(backend, tmp_path, tag):
    opts = RiseOptions(n=4, layers=(1,), max_new_tokens=10, batch_size=4, augment="templated", delimiter="sentence",
                       sae_steps=20, projection="pca", store=str(tmp_path / f"store-{tag}"),
                       saes=str(tmp_path / f"saes-{tag}"))
    found = RisePipeline(backend, opts).run()
    site = "resid_post.1"
    sae = found["saes"][site]
    steering = RisePipeline(backend, opts).steer("reflection", [0.0, 1.0], n_heldout=2, layer=1) \
        if "reflection" in found["analysis"].layer(site).vectors else None
    conf = confidence_vectors(backend, found["harvest"], sae, site, iterations=2, batch_size=2)
    board = feature_dashboard(found["harvest"], sae, site, 0, backend)
    return found["harvest"].acts[site], sae.W_dec.detach(), steering, conf.coefficients, board.promoted_tokens


def test_rise_through_the_server_equals_in_process(remote, engine, tmp_path):
    got, want = _rise(remote, tmp_path, "remote"), _rise(engine, tmp_path, "local")
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)  # harvested step vectors
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-3)  # the SAE trained on them
    if want[2] is not None:
        assert [r["mean_tokens"] for r in got[2]["steering"]["rows"]] == \
            [r["mean_tokens"] for r in want[2]["steering"]["rows"]]
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=1e-4)  # confidence coefficients (a gradient fit)
    assert [w for w, _ in got[4]] == [w for w, _ in want[4]]


# ----- capabilities


def test_a_page_states_what_it_needs_and_ndif_handles_say_what_they_lack(engine):
    from app.registry import discover_pages

    needs = {spec.title: spec.requires for spec, _ in discover_pages()}
    assert "fork" in needs["CoT entropy phases"] and "grad" in needs["RISE reasoning vectors"]
    require(engine, *needs["CoT entropy phases"], *needs["RISE reasoning vectors"])
    remote_only = Engine(engine.handle)
    remote_only.handle = type(engine.handle)(**{**engine.handle.__dict__, "remote": True})
    have = remote_only.capabilities()
    # an ndif: model generates through nnsight's generate (records after the run) but keeps no prefix states
    assert have["trace"] and have["generate"] and not have["fork"] and not have["grad"] and not have["head_gates"]
    with pytest.raises(BadInputError, match="cannot do fork on this backend \\(fork: prefix states are KV caches"):
        require(remote_only, "fork")
