"""The engine on tiny random models: captures equal a plain HF forward, generation streams and forks."""

from __future__ import annotations

import pytest
import torch

from probes import Engine, Sampling, UnknownModelError, load_model
from thoughtscope.errors import BadInputError, UnknownSiteError
from probes.zoo import TINY_ARCHS


def hf_hidden_states(engine: Engine, ids: list[int]):
    out = engine.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.hidden_states, out.logits[0]


@pytest.mark.parametrize("fixture", ["llama", "moe"])
def test_captures_equal_plain_hf_forward(fixture, request):
    engine = request.getfixturevalue(fixture)
    ids = engine.encode("The cat sat on the mat because it was warm")
    n = engine.handle.arch.n_layers
    sites = [f"resid_pre.{i}" for i in range(n)] + ["resid_post.0", "logits"]
    trace = engine.trace(ids, capture=sites)
    hidden, logits = hf_hidden_states(engine, ids)
    for layer in range(n):
        # hidden_states[i] is the input of layer i (the last entry is after the final norm)
        torch.testing.assert_close(trace.activations[f"resid_pre.{layer}"], hidden[layer][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(trace.activations["resid_post.0"], hidden[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(trace.activations["logits"], logits, atol=1e-5, rtol=0)
    expected_lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1)
    torch.testing.assert_close(trace.logprobs[1:], expected_lp, atol=1e-5, rtol=0)


def test_generation_captures_equal_recomputation(llama):
    """The activation recorded with token t equals a teacher-forced pass at that position."""
    recs = list(llama.generate("Once upon a time", max_new_tokens=6, capture=["resid_post.1", "k.0"]))
    prompt = llama.encode("Once upon a time")
    full = prompt + [r.token_id for r in recs]
    trace = llama.trace(full, capture=["resid_post.1", "k.0"])
    for r in recs:
        pos = len(prompt) + r.step - 1  # the position whose output chose this token
        torch.testing.assert_close(r.activations["resid_post.1"], trace.activations["resid_post.1"][pos], atol=1e-5, rtol=0)
        torch.testing.assert_close(r.activations["k.0"], trace.activations["k.0"][pos], atol=1e-5, rtol=0)
        assert r.logprob == pytest.approx(float(trace.logprobs[pos + 1]), abs=1e-4)


def test_greedy_generation_equals_hf_generate(llama):
    ids = llama.encode("2 + 2 =")
    recs = list(llama.generate(ids, max_new_tokens=8))
    out = llama.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
    assert [r.token_id for r in recs] == out.sequences[0, len(ids):].tolist()
    logp = [torch.log_softmax(scores[0].float(), -1) for scores in out.scores]
    assert [r.entropy for r in recs] == pytest.approx([float(-(lp.exp() * lp).sum()) for lp in logp], abs=1e-4)
    assert all(r.top_ids[0] == r.token_id for r in recs)
    assert recs[-1].finished and not any(r.finished for r in recs[:-1])


def test_record_fields_are_consistent(llama):
    rec = next(iter(llama.generate("hello", max_new_tokens=1, top_k=4)))
    assert len(rec.top_ids) == len(rec.top_probs) == len(rec.top_tokens) == 4
    assert rec.top_probs == sorted(rec.top_probs, reverse=True)
    assert rec.logprob == pytest.approx(torch.tensor(rec.top_probs[0]).log().item(), abs=1e-5)
    assert rec.to_dict()["token_id"] == rec.token_id


def test_batch_rows_equal_single_runs(llama):
    prompts = ["hi there", "a much longer prompt with several more tokens"]
    batch = list(llama.generate(prompts=prompts, max_new_tokens=5, capture=["resid_post.1"]))
    for b, prompt in enumerate(prompts):
        single = list(llama.generate(prompt, max_new_tokens=5, capture=["resid_post.1"]))
        rows = [r for r in batch if r.batch_index == b]
        assert [r.token_id for r in rows] == [r.token_id for r in single]
        torch.testing.assert_close(rows[-1].activations["resid_post.1"], single[-1].activations["resid_post.1"],
                                   atol=1e-4, rtol=0)


def test_sampling_is_seeded_and_samples_differ(llama):
    def run(seed: int) -> list[list[int]]:
        recs = list(llama.generate("hello", n_samples=4, max_new_tokens=6, sampling=Sampling(temperature=1.5), seed=seed))
        return [[r.token_id for r in recs if r.batch_index == b] for b in range(4)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len({tuple(s) for s in run(1)}) > 1


def test_fork_equals_full_recomputation(llama):
    prefix, suffix = "The quick brown fox", " jumps over the"
    state = llama.prefill(prefix)
    forked = llama.fork(state, suffix, max_new_tokens=5, capture=["resid_post.1"])
    full_ids = llama.encode(prefix) + llama.tok(suffix, add_special_tokens=False)["input_ids"]
    full = list(llama.generate(full_ids, max_new_tokens=5, capture=["resid_post.1"]))
    assert [r.token_id for r in forked] == [r.token_id for r in full]
    for a, b in zip(forked, full):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        torch.testing.assert_close(a.activations["resid_post.1"], b.activations["resid_post.1"], atol=1e-5, rtol=0)
    # the state is left as it was: a second fork gives the same answer
    again = llama.fork(state, suffix, max_new_tokens=5)
    assert [r.token_id for r in again] == [r.token_id for r in full]
    assert state.cache_len == len(llama.encode(prefix))


def test_fork_from_a_live_generation(llama):
    """A probe mid-generation: fork the live state, then the generation goes on unchanged."""
    plain = [r.token_id for r in llama.generate("Let me think", max_new_tokens=8)]
    stream = llama.generate("Let me think", max_new_tokens=8)
    seen, probes = [], []
    for rec in stream:
        seen.append(rec.token_id)
        if rec.step == 3:
            state = stream.state()
            probes = llama.fork(state, " Answer:", max_new_tokens=3)
            scratch_ids = llama.encode("Let me think") + seen + llama.tok(" Answer:", add_special_tokens=False)["input_ids"]
            scratch = list(llama.generate(scratch_ids, max_new_tokens=3))
            assert [p.token_id for p in probes] == [s.token_id for s in scratch]
    assert seen == plain and probes


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_every_tiny_architecture_generates_and_forks(arch):
    engine = Engine.from_id(f"tiny-random:{arch}")
    sites = ["resid_post.1", "attn_pattern.1", "q.0", "z.1"] + (["router.0"] if engine.handle.arch.is_moe else [])
    recs = list(engine.generate("hello world", max_new_tokens=3, capture=sites))
    arch_info = engine.handle.arch
    last = recs[-1].activations
    assert last["resid_post.1"].shape == (arch_info.d_model,)
    assert last["q.0"].shape == (arch_info.n_heads, arch_info.head_dim)
    assert last["attn_pattern.1"].shape[0] == arch_info.n_heads
    row_sums = last["attn_pattern.1"].sum(-1)
    if arch_info.model_type == "gpt_oss":  # attention sinks: an extra column takes weight, then is dropped
        assert bool(((row_sums > 0) & (row_sums <= 1 + 1e-5)).all()) and bool((row_sums < 1 - 1e-3).any())
    else:
        torch.testing.assert_close(row_sums, torch.ones(arch_info.n_heads), atol=1e-5, rtol=0)
    if arch_info.is_moe:
        assert last["router.0"].shape == (arch_info.n_experts,)
    state = engine.prefill("hello world foo")
    forked = engine.fork(state, " bar", max_new_tokens=3)
    ids = engine.encode("hello world foo") + engine.tok(" bar", add_special_tokens=False)["input_ids"]
    assert [r.token_id for r in forked] == [r.token_id for r in engine.generate(ids, max_new_tokens=3)]


def test_router_capture_equals_the_gate_output(moe):
    ids = moe.encode("mixture of experts routing")
    trace = moe.trace(ids, capture=["router.1", "resid_pre.1"])
    layer = moe.model.model.layers[1]
    normed = layer.post_attention_layernorm(trace.activations["resid_pre.1"]
                                            + moe.trace(ids, capture=["attn_out.1"]).activations["attn_out.1"])
    expected = layer.mlp.gate(normed)[0]
    torch.testing.assert_close(trace.activations["router.1"], expected, atol=1e-5, rtol=0)


def test_arch_facts(moe):
    arch = moe.handle.arch
    assert (arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.head_dim, arch.d_model) == (2, 4, 2, 16, 64)
    assert (arch.n_experts, arch.experts_top_k) == (8, 2)
    assert len(moe.handle.fingerprint) == 16
    assert load_model("tiny-random:qwen3_moe").fingerprint == moe.handle.fingerprint


def test_nnsight_wrapper_reads_the_same_activations(llama):
    ids = llama.encode("nnsight and the engine agree")
    trace = llama.trace(ids, capture=["resid_post.1"])
    lm = llama.handle.nnsight
    with lm.trace(torch.tensor([ids])):
        saved = lm.model.layers[1].output.save()
    out = saved[0] if isinstance(saved, tuple) else saved
    torch.testing.assert_close(out[0], trace.activations["resid_post.1"], atol=1e-6, rtol=0)


# ----- bad input: a clear project error before any model work -----

@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt_is_refused(llama, prompt):
    with pytest.raises(BadInputError):
        llama.generate(prompt, max_new_tokens=2)


def test_over_long_prompt_is_refused(llama):
    with pytest.raises(BadInputError, match="context"):
        llama.generate("word " * 2000, max_new_tokens=2)


@pytest.mark.parametrize("site,match", [("resid_post.9", "out of range"), ("bogus.1", "unknown site"),
                                         ("router.0", "no MoE router"), ("resid_post", "unknown site")])
def test_bad_sites_are_refused(llama, site, match):
    with pytest.raises(UnknownSiteError, match=match):
        llama.generate("hello", max_new_tokens=2, capture=[site])


def test_unknown_model_is_refused():
    with pytest.raises(UnknownModelError, match="thoughtscope models"):
        load_model("gpt-17")
    with pytest.raises(UnknownModelError, match="tiny-random"):
        load_model("tiny-random:transformer9000")
    with pytest.raises(UnknownModelError, match="local Hugging Face cache"):
        load_model("hf:nobody/no-such-model-here")


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(max_new_tokens=10**6), dict(sampling="hot")])
def test_bad_generation_settings_are_refused(llama, kwargs):
    with pytest.raises((BadInputError, AttributeError, TypeError)):
        list(llama.generate("hello", **kwargs))


def test_bad_sampling_values_are_refused():
    with pytest.raises(BadInputError):
        Sampling(temperature=-1)
    with pytest.raises(BadInputError):
        Sampling(top_p=0)


def test_concurrent_callers_do_not_see_each_others_hooks(llama):
    """Two threads (two browser tabs) steering differently get what each would get alone."""
    import threading

    from probes import AddVector

    v = torch.randn(64, generator=torch.Generator().manual_seed(9))
    jobs = {"plain": [], "steered": [AddVector("resid_post.0", v, scale=30.0)]}
    alone = {k: [r.token_id for r in llama.generate("shared model", max_new_tokens=6, interventions=iv)]
             for k, iv in jobs.items()}
    together: dict[str, list[int]] = {}

    def run(name: str) -> None:
        together[name] = [r.token_id for r in llama.generate("shared model", max_new_tokens=6,
                                                             interventions=jobs[name])]

    threads = [threading.Thread(target=run, args=(k,)) for k in jobs for _ in range(1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert together == alone and alone["plain"] != alone["steered"]


def test_a_readout_runs_beside_a_generation_without_its_hooks_and_equals_plain_hf(llama):
    """A readout (the logit lens, an SAE column's words) reads the final norm's and the unembedding's weights
    only: it does not wait for a generation in another thread (a RISE page's feature words waited out a whole
    steering job, holding the model lock), runs none of the hooks that generation put on those modules, and
    equals the plain Hugging Face modules. The holder keeps the model until the readout is done or 60 s pass,
    and reports which came first: the readout's work is checked by order, not by its time."""
    import threading

    model = llama.handle.model
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    fired: list[str] = []
    hooks = [model.lm_head.register_forward_hook(lambda *a: fired.append("lm_head")),
             model.model.norm.register_forward_hook(lambda *a: fired.append("norm"))]
    held, done, report = threading.Event(), threading.Event(), {}

    def holder() -> None:
        gen = iter(llama.generate("a generation holding the model", max_new_tokens=4))
        next(gen)  # a generation between two records holds the model lock
        held.set()
        report["readout_first"] = done.wait(60)
        gen.close()

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(60) and llama.lock.locked()
        fired.clear()  # the generation's own forwards ran the hooks: only the readouts' count from here
        lens = llama.readout(x, norm=True, top_k=5, bottom_k=3, token_ids=[1, 2, 3, 4, 5])
        words = llama.readout(x, norm=False, top_k=5)
        done.set()
    finally:
        done.set()
        t.join(60)
        for h in hooks:
            h.remove()
    assert report == {"readout_first": True} and fired == []
    with torch.no_grad():
        plain_lens = model.lm_head(model.model.norm(x)).float()
        plain_words = model.lm_head(x).float()
    assert torch.equal(lens.top_ids, plain_lens.topk(5, dim=-1).indices)
    assert torch.allclose(lens.top_logits, plain_lens.topk(5, dim=-1).values, atol=1e-6)
    assert torch.equal(lens.bottom_ids, (-plain_lens).topk(3, dim=-1).indices)
    assert torch.allclose(lens.token_probs, plain_lens.softmax(-1)[torch.arange(5), torch.tensor([1, 2, 3, 4, 5])],
                          atol=1e-6)
    assert torch.equal(words.top_ids, plain_words.topk(5, dim=-1).indices)
    assert torch.allclose(words.top_logits, plain_words.topk(5, dim=-1).values, atol=1e-6)
    # the norm was applied (a fresh RMSNorm only rescales each row: the same ranking, other logits)
    assert not torch.allclose(lens.top_logits, words.top_logits, atol=1e-3)


def test_capture_batch_with_a_shared_prefix_equals_single_traces(llama):
    prefix_ids = llama.encode("A shared one-shot example that every sequence starts with,")
    tails = [" then one tail", " and a second, longer tail with more tokens", " third"]
    seqs = [prefix_ids + llama.tok(t, add_special_tokens=False)["input_ids"] for t in tails]
    state = llama.prefill(prefix_ids)
    captured = llama.capture_batch(seqs, ["resid_post.0", "attn_out.1"], prefix=state)
    for b, seq in enumerate(seqs):
        single = llama.trace(seq, capture=["resid_post.0", "attn_out.1"])
        n = len(seq) - len(prefix_ids)
        for site in ("resid_post.0", "attn_out.1"):
            torch.testing.assert_close(captured[site][b, :n], single.activations[site][len(prefix_ids):],
                                       atol=1e-5, rtol=0)
    with pytest.raises(BadInputError, match="prefix"):
        llama.capture_batch([llama.encode("something else entirely")], ["resid_post.0"], prefix=state)


@pytest.mark.parametrize("fixture", ["llama", "moe"])
def test_nnsight_capture_reads_every_site_like_the_engine(fixture, request):
    """The path ndif: models take (nnsight, here with remote=False) reads exactly what the hooks read."""
    from probes.remote import nnsight_capture
    from probes.sites import list_sites, parse_site

    engine = request.getfixturevalue(fixture)
    ids = engine.encode("nnsight and the hook runner agree on every site")
    names = [row["site"] for row in list_sites(engine.handle.arch)]
    ours = engine.trace(ids, capture=names).activations
    theirs = nnsight_capture(engine.handle, ids, [parse_site(n) for n in names], remote=False)
    for name in names:
        torch.testing.assert_close(theirs[name], ours[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_prefix_states_and_gradients_need_local_weights(llama):
    """An ndif: handle (no local weights) refuses prefix states and gradients with the reason (probes.ndif)."""
    import dataclasses

    remote = Engine(dataclasses.replace(llama.handle, remote=True))
    with pytest.raises(BadInputError, match="NDIF .capability 'grad'"):
        remote.input_x_gradient("hello", target="logit", token=5)
    with pytest.raises(BadInputError, match="NDIF .capability 'fork'"):
        remote.prefill("hello")


def test_capture_is_trace_without_the_statistics(llama):
    ids = llama.encode("one forward, the sites out")
    acts = llama.capture(ids, ["resid_post.1", "logits"])
    trace = llama.trace(ids, capture=["resid_post.1", "logits"])
    assert set(acts) == {"resid_post.1", "logits"}
    for site in acts:
        torch.testing.assert_close(acts[site], trace.activations[site])


def test_generation_feeds_each_token_once(llama):
    """The KV cache is reused: the prompt is fed once, then exactly one new token per step."""
    fed: list[int] = []
    hook = llama.model.model.embed_tokens.register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    try:
        ids = llama.encode("the prefix is never run twice")
        list(llama.generate(ids, max_new_tokens=6))
        generation = list(fed)
        state = llama.prefill(ids)
        fed.clear()
        llama.fork(state, " probe", max_new_tokens=3)
    finally:
        hook.remove()
    assert generation == [len(ids), 1, 1, 1, 1, 1]  # the 6th token is emitted, never fed
    suffix = len(llama.tok(" probe", add_special_tokens=False)["input_ids"])
    assert fed == [suffix, 1, 1]
