"""RLKV (issue 13): mixed attention, the GRPO gate probe, compressed inference and the evaluation.

How to use it, in order: `engine.head_gates(sink, recent)` runs every KV head as alpha * full + (1 - alpha)
* local attention; `HeadGateProbe(...).fit(engine, problems)` learns the gates with GRPO; `probe.policy(s)`
is the compressed cache that keeps only the top (1 - s) heads in full; `evaluate_rlkv` compares it with
the baselines on the same KV budget; `thoughtscope eval rlkv` prints that comparison.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from analyses.rlkv.evaluate import error_mode, evaluate_rlkv, is_repetitive  # noqa: E402
from analyses.rlkv.grpo import adaptive_l1_weight, group_advantages, grpo_loss, policy_loss  # noqa: E402
from analyses.rlkv.heads import (attention_head_scores, kv_fraction, long_range_mass, matched_entries,  # noqa: E402
                                 random_full_heads)
from analyses.rlkv.probe import HeadGateProbe, read_gates, save_checkpoint  # noqa: E402
from analyses.tasks import Problem, load_task  # noqa: E402
from probes import Engine  # noqa: E402
from probes.gates import binarised  # noqa: E402
from probes.kv_policy import HeadBudget  # noqa: E402
from tests.test_kv_policy import reference_logprobs  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402

TEXT = "one two three four five six seven eight nine ten eleven twelve"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def engines(llama):
    return {"llama": llama, **{a: Engine.from_id(f"tiny-random:{a}") for a in ARCHS[1:]}}


def stock_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1 from the model's own attention."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)


# ----- 1. mixed attention -----


@pytest.mark.parametrize("arch", ARCHS)
def test_gates_at_one_equal_the_models_own_attention(engines, arch):
    """A left-padded batch: every sequence's log-probs equal the stock model's (Gemma 3 keeps its own
    sliding-window layers: the mask function registered beside the attention function builds them)."""
    engine = engines[arch]
    seqs = [engine.encode(TEXT), engine.encode("a b c"), engine.encode("the cat sat on the mat")]
    with engine.head_gates(sink=1, recent=3) as session:
        got = session.logprobs(seqs, [1, 1, 1])
    for seq, lp in zip(seqs, got):
        # float32 sums of up to ~40 nats: a few ulps of relative error (3.4e-7 seen on gemma3) is rounding
        torch.testing.assert_close(lp, stock_logprobs(engine, seq), atol=1e-5, rtol=1e-6)
    assert engine.model.config._attn_implementation == "sdpa"  # switched back


@pytest.mark.parametrize("arch", ARCHS[:3])
def test_gates_at_zero_equal_explicit_sink_recent_attention(engines, arch):
    """All gates 0: every head reads only p < sink or p > q - recent (the eager reference masks by hand);
    gates 0/1 per head: the same with only the 0-gated heads local."""
    engine = engines[arch]
    ids = engine.encode(TEXT)
    info = engine.handle.arch
    mixed = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    for gates in (torch.zeros(info.n_layers, info.n_kv_heads), mixed):
        with engine.head_gates(sink=2, recent=3, gates=gates) as session:
            got = session.logprobs([ids], [1])[0]
        ref = reference_logprobs(engine, ids, gates < 0.5, 2, 3)
        want = ref[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_half_gates_mix_the_two_attentions_and_give_gradients(llama):
    """alpha = 0.5 lies between the two (log-probs differ from both) and every gate that matters gets a gradient."""
    ids = llama.encode(TEXT)
    out = {}
    for value in (0.0, 0.5, 1.0):
        with llama.head_gates(sink=1, recent=2, init=value) as session:
            lp = session.logprobs([ids], [4])[0]
            lp.sum().backward()
            out[value] = (lp.detach(), session.alpha.grad.clone())
    assert not torch.allclose(out[0.5][0], out[0.0][0]) and not torch.allclose(out[0.5][0], out[1.0][0])
    assert (out[0.5][1].abs() > 0).all()


def test_sampling_inside_a_session_uses_the_gates(llama):
    """session.generate is Engine.generate under the gates: all-local gates change the greedy tokens."""
    ids = llama.encode(TEXT)
    plain = [r.token_id for r in llama.generate(ids, max_new_tokens=6)]
    with llama.head_gates(sink=1, recent=2, init=1.0) as session:
        same = [r.token_id for r in session.generate(ids, max_new_tokens=6)]
    with llama.head_gates(sink=1, recent=2, init=0.0) as session:
        local = [r.token_id for r in session.generate(ids, max_new_tokens=6)]
    assert same == plain and local != plain


# ----- 2. compressed inference = mixed attention with binarised gates -----


def test_the_compressed_cache_holds_the_configured_entries_and_equals_binarised_gates(llama):
    gates = torch.tensor([[0.9, 0.2], [0.4, 0.7]])
    probe = HeadGateProbe()
    probe.gates_ = gates.numpy()
    policy = probe.policy(0.5, sink=2, recent=3)
    assert policy.full_heads.tolist() == [[True, False], [False, True]]
    ids = llama.encode(TEXT)
    stream = llama.generate(ids, max_new_tokens=6, interventions=[policy])
    recs = list(stream)
    fed = len(ids) + len(recs) - 1
    for layer_idx, layer in enumerate(stream.cache.layers):
        for head in range(2):
            held = layer.head_positions(0, head)
            expected = list(range(fed)) if policy.full_heads[layer_idx, head] else [0, 1, fed - 3, fed - 2, fed - 1]
            assert held == expected
    entry = 2 * 16 * 4  # key + value, head_dim 16, float32
    for t, r in enumerate(recs):
        n = len(ids) + t
        assert r.kv_bytes == (2 * n + 2 * min(n, 5)) * entry
    with llama.head_gates(sink=2, recent=3, gates=binarised(gates, 0.5).float()) as session:
        mixed = session.logprobs([ids + [r.token_id for r in recs]], [len(ids)])[0]
    torch.testing.assert_close(torch.tensor([r.logprob for r in recs]), mixed, atol=1e-4, rtol=0)


def test_binarised_keeps_the_top_heads_and_refuses_bad_sparsity():
    gates = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.8, 0.2]])
    assert binarised(gates, 0.5).tolist() == [[False, True, True], [False, True, False]]
    assert binarised(gates, 0.0).all()
    for bad in (1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(BadInputError, match=r"\[0, 1\)"):
            binarised(gates, bad)


def test_compressed_generation_through_a_server_equals_in_process():
    from probes.server_bench import served

    full = torch.tensor([[True, False], [False, True]])
    policy = HeadBudget(full_heads=full, sink=1, recent=3)
    kw = dict(prompts=[TEXT, "a b c d e f g"], max_new_tokens=8, interventions=[policy], top_k=3)
    with served("tiny-random:llama") as (engine, remote):
        local, far = list(engine.generate(**kw)), list(remote.generate(**kw))
    assert [(r.batch_index, r.token_id, r.top_ids, r.kv_bytes) for r in far] == \
        [(r.batch_index, r.token_id, r.top_ids, r.kv_bytes) for r in local]
    np.testing.assert_allclose([r.logprob for r in far], [r.logprob for r in local], atol=1e-5)


# ----- 3. the GRPO objective, by hand -----


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # group 1: mean 0.25, sample std sqrt(0.25) = 0.5 -> (0.75 / 0.5, -0.25 / 0.5); group 2: no signal
    np.testing.assert_allclose(adv[0].numpy(), [1.5, -0.5, -0.5, -0.5], atol=1e-5)
    assert adv[1].abs().max() == 0
    with pytest.raises(BadInputError, match="G >= 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_adaptive_l1_weight_by_hand():
    assert adaptive_l1_weight(0.5, beta=1e-3, tau=0.5) == 0.0  # only strictly above tau
    assert adaptive_l1_weight(0.2, beta=1e-3, tau=0.5) == 0.0
    assert adaptive_l1_weight(0.8, beta=1e-3, tau=0.5) == pytest.approx(1e-3 * (math.exp(0.8) - 1))
    assert adaptive_l1_weight(1.0, beta=2.0, tau=0.5) == pytest.approx(2 * (math.e - 1))


def test_grpo_loss_and_its_gradient_by_hand():
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-4.0], requires_grad=True)]
    gates = torch.tensor([0.5, 1.0], requires_grad=True)
    loss = grpo_loss(lp, [2.0, -1.0], gates, 0.1)
    # -(2 * mean(-1, -2) + (-1) * (-4)) / 2 + 0.1 * 0.75 = -(-3 + 4) / 2 + 0.075
    assert float(loss.detach()) == pytest.approx(-0.5 + 0.075)
    loss.backward()
    np.testing.assert_allclose(lp[0].grad.numpy(), [-0.5, -0.5])  # -A / (N * |o|) = -2 / (2 * 2)
    np.testing.assert_allclose(lp[1].grad.numpy(), [0.5])
    np.testing.assert_allclose(gates.grad.numpy(), [0.05, 0.05])
    # micro-batches add up to the whole
    parts = policy_loss(lp[:1], [2.0], 2) + policy_loss(lp[1:], [-1.0], 2)
    assert float(parts.detach()) == pytest.approx(-0.5)


# ----- 4. the probe finds a planted head -----


def planted_engine() -> tuple[Engine, list[int], list[int]]:
    """tiny-random:llama rewired so that exactly one KV head (layer 1, head 0) can copy the digit at
    position 1 (a 'needle' outside a sink-1 + recent-4 window) to the output; every other head's
    weights are zero, so their gates change nothing. Returns (engine, digit ids, filler ids)."""
    from probes.zoo import ModelHandle, arch_from_config, load_model

    handle = load_model("tiny-random:llama")
    model, tok = handle.model, handle.tokenizer
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    fillers = tok.convert_tokens_to_ids(list("abcdefghijk"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        emb = model.get_input_embeddings().weight
        emb[:, 13] = 1.0
        emb[:, 30:64] = 1.0  # a constant part: the residual's norm barely depends on the copied digit
        for d, t in enumerate(digits):
            emb[t, d] = 1.0
            emb[t, 10] = 1.0  # needle flag
        attn = model.model.layers[1].self_attn
        attn.k_proj.weight[7, 10] = 6.0  # KV head 0, a low-frequency RoPE dimension: content, not position
        attn.q_proj.weight[7, 13] = 6.0  # query heads 0 and 1 (they read KV head 0) look for the flag
        attn.q_proj.weight[16 + 7, 13] = 6.0
        for d in range(10):
            attn.v_proj.weight[d, d] = 1.0  # KV head 0's value: the digit
            attn.o_proj.weight[20 + d, d] = 4.0  # query head 0's output -> residual dims 20..29
        head = model.get_output_embeddings().weight
        for d, t in enumerate(digits):
            head[t, 20 + d] = 3.0
    planted = ModelHandle("planted-needle", model, tok, arch_from_config(model.config), "planted", handle.device,
                          handle.dtype)
    return Engine(planted), digits, fillers


def needle_problems(digits: list[int], fillers: list[int], n: int, seed: int = 0) -> list[Problem]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        d = int(rng.integers(10))
        ids = [fillers[0], digits[d]] + [fillers[int(j)] for j in rng.integers(len(fillers), size=10)]
        out.append(Problem(f"needle-{i}", f"needle {d} in {ids}", str(d), "planted", 1, {"ids": ids}))
    return out


def test_the_probe_raises_the_gate_of_the_head_that_carries_the_answer():
    engine, digits, fillers = planted_engine()
    problems = needle_problems(digits, fillers, 16)
    ids = problems[0].meta["ids"]
    with engine.head_gates(sink=1, recent=4) as s:  # sanity: full attention copies the needle...
        assert [r.text for r in s.generate(ids, max_new_tokens=1)] == [problems[0].answer]
    local = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    with engine.head_gates(sink=1, recent=4, gates=local) as s:  # ...and only the planted head's gate matters
        assert [r.text for r in s.generate(ids, max_new_tokens=1)] != [problems[0].answer]
    probe = HeadGateProbe(sink=1, recent=4, group_size=8, prompts_per_step=4, max_new_tokens=1, temperature=1.0,
                          lr=0.1, steps=12, seed=0, prompt_fn=lambda p: (p.meta["ids"], False))
    rows = []
    probe.fit(engine, problems, on_step=lambda done, total, row: rows.append((done, total)))
    gates = probe.gates_
    assert gates[1, 0] > 0.5 and gates[1, 0] > gates[0].max() + 0.3 and gates[1, 0] > gates[1, 1] + 0.3, gates
    assert rows == [(i, 12) for i in range(1, 13)]
    assert probe.log_[0]["reward"] > 0.9 and probe.log_[0]["l1_weight"] > 0  # solved: the penalty is on
    assert probe.keep_full(0.75).tolist() == [[False, False], [True, False]]


# ----- 5. checkpoints -----


def test_a_run_resumes_where_its_checkpoint_ends(tmp_path, llama):
    problems = load_task("arith", 6)
    kw = dict(sink=1, recent=4, steps=3, prompts_per_step=2, max_new_tokens=3, lr=0.05, seed=2)
    straight = HeadGateProbe(**kw).fit(llama, problems)
    HeadGateProbe(**{**kw, "steps": 2}).fit(llama, problems, checkpoint_dir=tmp_path)
    assert len(json.loads((tmp_path / "log.json").read_text())["log"]) == 2
    resumed = HeadGateProbe(**kw).fit(llama, problems, checkpoint_dir=tmp_path)
    assert [r["step"] for r in resumed.log_] == [1, 2, 3]
    np.testing.assert_allclose(resumed.gates_, straight.gates_, atol=1e-6)
    assert [r["reward"] for r in resumed.log_] == [r["reward"] for r in straight.log_]
    loaded = HeadGateProbe.load(tmp_path, llama)
    np.testing.assert_array_equal(loaded.gates_, resumed.gates_)
    assert loaded.sink == 1 and len(loaded.log_) == 3
    with pytest.raises(BadInputError, match="other probe settings"):
        HeadGateProbe(**{**kw, "lr": 0.01}).fit(llama, problems, checkpoint_dir=tmp_path)


# ----- 6. head scores, budgets, error modes -----


def test_long_range_mass_counts_attention_outside_the_window():
    seq, heads = 6, 2
    pattern = torch.zeros(seq, heads, seq)
    for q in range(seq):
        pattern[q, 0, q] = 1.0  # head 0 reads itself only
        pattern[q, 1, 0] = 1.0 if q < 3 else 0.0  # head 1 reads position 0 (a sink) early...
        if q >= 3:
            pattern[q, 1, 1] = 1.0  # ...then position 1, outside sink 1 + recent 2 for q >= 3
    mass, n = long_range_mass(pattern, sink=1, recent=2)
    assert n == 3 and mass.tolist() == [0.0, 3.0]


def test_attention_scores_rank_the_planted_head_first():
    engine, digits, fillers = planted_engine()
    problems = needle_problems(digits, fillers, 3)
    scores = attention_head_scores(engine, [p.meta["ids"] for p in problems], sink=1, recent=4)
    assert scores.shape == (2, 2)
    assert scores[1, 0] > 0.9 and scores[1, 0] == scores.max()


def test_budgets_and_kv_fractions_by_hand():
    assert matched_entries(100, 0.0, 4, 32) == 100
    assert matched_entries(100, 0.5, 4, 32) == 68  # 0.5 * 100 + 0.5 * 36
    assert matched_entries(20, 0.5, 4, 32) == 20  # shorter than the window: nothing to drop
    full = random_full_heads((30, 3), 0.5, seed=1)
    assert full.sum() == 45 and not np.array_equal(full, random_full_heads((30, 3), 0.5, seed=2))
    assert kv_fraction(full, 1000, 4, 32) == pytest.approx(0.5 + 0.5 * 36 / 1000)


def test_error_modes():
    assert error_mode([1, 2, 3], correct=True, hit_limit=True) == "correct"
    assert error_mode([5, 6, 7, 8] * 3, correct=False, hit_limit=True) == "repetition"
    assert error_mode(list(range(20)), correct=False, hit_limit=True) == "over-length"
    assert error_mode(list(range(20)), correct=False, hit_limit=False) == "wrong answer"
    assert is_repetitive([9, 9, 9, 9, 9, 9]) and not is_repetitive([1, 2])


# ----- 7. the evaluation, end to end -----


def test_the_evaluation_compares_every_method_on_the_same_budget(tmp_path, llama):
    gates = np.random.default_rng(0).random((2, 2)).astype(np.float32)
    save_checkpoint(tmp_path, gates, None, [], {"model": "tiny-random:llama", "fingerprint": "x", "shape": [2, 2],
                                               "settings": {}, "problems": []})
    stages = []
    report = evaluate_rlkv(llama, "arith", [0.5], gates=tmp_path, n=3, n_dev=2, n_calibration=1, sink=1, recent=4,
                           random_seeds=2, snapkv_windows=[2, 4], max_new_tokens=6, batch_size=4,
                           progress=lambda stage, done, total: stages.append(stage))
    out = report.to_dict(per_problem=True)
    methods = [(r["method"], r["setting"].get("seed")) for r in out["rows"]]
    assert methods == [("full cache", None), ("rlkv", None), ("attention", None), ("random", 0), ("random", 1),
                       ("streaming", None), ("snapkv", None), ("knorm", None)]
    ref = out["choices"]["reference_length"]["value"]
    entries = matched_entries(ref, 0.5, 1, 4)
    assert out["rows"][5]["setting"] == {"entries": entries}
    assert out["choices"]["snapkv_window"]["chosen"] in (2, 4)
    assert set(out["splits"]["sizes"].values()) == {1, 2, 3}
    for row in out["rows"][1:]:
        assert 0 < row["kv_fraction"] <= 1 and row["vs_full"]["test"] == "exact McNemar"
        assert sum(row["error_modes"].values()) == 3
    assert np.array(out["head_maps"]["rlkv"]).shape == (2, 2)
    assert out["provenance"]["command"] == "thoughtscope eval rlkv"
    assert "evaluation: full cache" in stages and any(s.startswith("development") for s in stages)
    assert set(out["curves"]) == {"rlkv", "attention", "random", "streaming", "snapkv", "knorm", "full cache"}
    # RLKV paired against each baseline on the same problems (random: the mean over its seeds)
    paired = {p["baseline"]: p for p in out["rlkv_vs_baselines"]}
    assert set(paired) == {"attention", "random", "streaming", "snapkv", "knorm"}
    runs = {(r["method"], r["setting"].get("seed")): np.array(r["correct"]) for r in out["per_problem"]}
    rand = (runs[("random", 0)] + runs[("random", 1)]) / 2
    assert paired["random"]["difference"]["estimate"] == pytest.approx(float(np.mean(runs[("rlkv", None)] - rand)))
    assert [t["seed"] for t in paired["random"]["mcnemar"]] == [0, 1]
    knorm = paired["knorm"]["mcnemar"][0]
    assert knorm["gains"] == int(((runs[("rlkv", None)] == 1) & (runs[("knorm", None)] == 0)).sum())


def test_the_inverse_control_keeps_the_lowest_gates_in_full(tmp_path, llama):
    """rlkv-inverse with gates g makes the highest gates local: the same cache as rlkv with gates 1 - g."""
    gates = np.array([[0.9, 0.2], [0.4, 0.7]], np.float32)
    meta = {"model": "tiny-random:llama", "fingerprint": "x", "shape": [2, 2], "settings": {}, "problems": []}
    save_checkpoint(tmp_path / "g", gates, None, [], meta)
    save_checkpoint(tmp_path / "flipped", 1 - gates, None, [], meta)
    kw = dict(n=3, n_dev=1, n_calibration=1, sink=1, recent=2, max_new_tokens=6, batch_size=4)
    both = evaluate_rlkv(llama, "arith", [0.5], gates=tmp_path / "g", methods="rlkv,rlkv-inverse", **kw).to_dict(True)
    flipped = evaluate_rlkv(llama, "arith", [0.5], gates=tmp_path / "flipped", methods="rlkv", **kw).to_dict(True)
    texts = {r["method"]: r["texts"] for r in both["per_problem"]}
    assert texts["rlkv-inverse"] == [r for r in flipped["per_problem"] if r["method"] == "rlkv"][0]["texts"]
    assert texts["rlkv-inverse"] != texts["rlkv"]  # other heads local, other generations
    assert "rlkv-inverse" not in [r["method"] for r in evaluate_rlkv(llama, "arith", [0.5], gates=tmp_path / "g",
                                                                        methods="all", **kw).to_dict()["rows"]]
    with pytest.raises(BadInputError, match="rlkv-inverse control needs learned gates"):
        evaluate_rlkv(llama, "arith", [0.5], methods="rlkv-inverse", n=2)
    # no random head choice: asked for by name it is refused (it ran nothing, silently); within "all" it is left out
    with pytest.raises(BadInputError, match="method random needs at least one random head choice"):
        evaluate_rlkv(llama, "arith", [0.5], methods="random,streaming", random_seeds=0, n=2)
    assert "random" not in [r["method"] for r in evaluate_rlkv(llama, "arith", [0.5], methods="all", random_seeds=0,
                                                                 **kw).to_dict()["rows"]]


def test_eval_cli_prints_json_with_provenance(tmp_path):
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    args = ["eval", "rlkv", "--model", "tiny-random:llama", "--n", "2", "--n-dev", "1", "--n-calibration", "1",
            "--sparsity", "0.25", "0.75", "--sink", "1", "--recent", "4", "--random-seeds", "1",
            "--snapkv-windows", "2", "--max-new-tokens", "4", "--methods", "random,streaming", "--json"]
    result = CliRunner().invoke(build(), args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["sparsities"] == [0.25, 0.75]
    assert [(r["method"], r["sparsity"]) for r in payload["rows"]] == [
        ("full cache", None), ("random", 0.25), ("streaming", 0.25), ("random", 0.75), ("streaming", 0.75)]
    assert payload["provenance"]["model"] == "tiny-random:llama"


# ----- 8. bad input: a clear error before any model work -----


@pytest.fixture()
def forwards(llama):
    calls = []
    handle = llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


def test_bad_sparsity_window_and_gates_files_are_refused_before_the_model_runs(tmp_path, llama, forwards):
    with pytest.raises(BadInputError, match=r"outside \[0, 1\)|lie in \[0, 1\)"):
        evaluate_rlkv(llama, "arith", [1.0], n=2)
    with pytest.raises(BadInputError, match="reaches this model's context"):
        evaluate_rlkv(llama, "arith", [0.5], n=2, sink=300, recent=300)
    with pytest.raises(BadInputError, match="reaches this model's context"):
        llama.head_gates(sink=256, recent=256)
    with pytest.raises(BadInputError, match="reaches this model's context"):
        HeadGateProbe(sink=500, recent=100, steps=1).fit(llama, load_task("arith", 2))
    save_checkpoint(tmp_path, np.ones((30, 3), np.float32), None, [], {"model": "smollm2-135m", "fingerprint": "x",
                                                                      "shape": [30, 3], "settings": {}, "problems": []})
    with pytest.raises(BadInputError, match=r"shape \(30, 3\) \(learned on smollm2-135m\).*needs \(2, 2\)"):
        evaluate_rlkv(llama, "arith", [0.5], gates=tmp_path, n=2)
    with pytest.raises(BadInputError, match="needs \\(2, 2\\)"):
        llama.head_gates(gates=np.ones((30, 3)))
    with pytest.raises(BadInputError, match="no gates file"):
        read_gates(tmp_path / "missing", llama)
    for log in ("[1, 2]", '{"settings": [1]}', '{"log": 5}'):  # JSON, but not a gates log
        (tmp_path / "log.json").write_text(log)
        with pytest.raises(BadInputError, match="is not a gates log"):
            HeadGateProbe.load(tmp_path, llama)
    assert forwards == []


def test_a_model_without_mixed_attention_is_refused():
    deepseek = Engine.from_id("tiny-random:deepseek_v2")
    with pytest.raises(BadInputError, match="mixed full/local attention .* 'deepseek_v2'"):
        deepseek.head_gates(sink=1, recent=4)
    with pytest.raises(BadInputError, match="'deepseek_v2'"):
        HeadGateProbe(steps=1).fit(deepseek, load_task("arith", 2))


def test_cli_sparsity_outside_the_range_is_refused():
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    result = CliRunner().invoke(build(), ["eval", "rlkv", "--model", "tiny-random:llama", "--sparsity", "0.5", "1.2"])
    assert result.exit_code != 0
    assert "outside [0, 1)" in str(result.exception) + result.output


# ----- 9. the embedded model -----


@pytest.mark.model
def test_eval_rlkv_end_to_end_on_the_embedded_model(tmp_path):
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    gates = np.random.default_rng(0).random((30, 3)).astype(np.float32)
    save_checkpoint(tmp_path, gates, None, [], {"model": "smollm2-135m", "fingerprint": "x", "shape": [30, 3],
                                               "settings": {}, "problems": []})
    args = ["eval", "rlkv", "--model", "smollm2-135m", "--gates", str(tmp_path), "--ops", "+", "--n", "2",
            "--n-dev", "1", "--n-calibration", "1", "--sparsity", "0.5", "--random-seeds", "1", "--snapkv-windows",
            "4", "--max-new-tokens", "16", "--json"]
    result = CliRunner().invoke(build(), args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {r["method"]: r for r in payload["rows"]}
    assert set(rows) == {"full cache", "rlkv", "attention", "random", "streaming", "snapkv", "knorm"}
    assert rows["rlkv"]["kv_fraction"] < 1 and rows["full cache"]["kv_fraction"] == 1
    assert np.array(payload["head_maps"]["attention"]).shape == (30, 3)


# ----- 10. the page -----


def test_the_page_maps_binarises_generates_and_loads_gates(tmp_path, monkeypatch):
    """Attention-statistics map on tiny-random:llama, the sparsity slider moves the memory, a compressed
    generation is tagged; then a gates file with its log draws the learned map and the training curves."""
    from tests import apptest_helpers as helpers

    from app import jobs

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    jobs.registry.clear()
    at = helpers.open_page("rlkv", 6)
    helpers.assert_clean(at)
    at.radio(key="rlkv_source").set_value("attention statistics (no training)").run()
    at.number_input(key="rlkv_sink").set_value(1)
    at.number_input(key="rlkv_recent").set_value(4)
    at.slider(key="rlkv_attn_n").set_value(1)
    helpers.finish_jobs(at.button(key="rlkv_attn_run").click().run())  # attention statistics: a job
    helpers.assert_clean(at)
    assert helpers.metric(at, "Heads with the full cache") == "2 of 4"
    at.slider(key="rlkv_sparsity").set_value(0.75).run()
    assert helpers.metric(at, "Heads with the full cache") == "1 of 4"
    helpers.finish_jobs(at.button(key="rlkv_generate").click().run())  # the compressed generation: a job
    helpers.assert_clean(at)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith("Head score from attention statistics (sparsity 0.75")
    assert any(t.startswith("KV memory") for t in titles) and any(t.startswith("Generation under compression") for t in titles)
    log = [{"step": i + 1, "reward": 0.5, "mean_alpha": 1 - 0.1 * i, "min_alpha": 0.5, "sparsity": 0.0}
           for i in range(3)]
    save_checkpoint(tmp_path, np.array([[0.9, 0.1], [0.4, 0.7]], np.float32), None, log,
                    {"model": "tiny-random:llama", "fingerprint": "x", "shape": [2, 2], "settings": {}, "problems": []})
    at.radio(key="rlkv_source").set_value("learned gates (a gates file)").run()
    at.text_input(key="rlkv_gates_path").set_value(str(tmp_path)).run()
    helpers.assert_clean(at)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith("Learned head gates") and "Gate training" in titles
    # an `eval rlkv --json` file draws the accuracy-vs-sparsity curves and the table of every run
    report = evaluate_rlkv(Engine.from_id("tiny-random:llama"), "arith", [0.5], n=2, n_dev=1, n_calibration=1, sink=1,
                           recent=4, random_seeds=1, snapkv_windows=[2], max_new_tokens=4, methods="random,streaming")
    (tmp_path / "eval.json").write_text(json.dumps(report.to_dict()))
    at.text_input(key="rlkv_eval_path").set_value(str(tmp_path / "eval.json")).run()
    helpers.assert_clean(at)
    assert "Accuracy vs sparsity, 95% intervals (evaluation split, n = 2)" in helpers.chart_titles(at)
    table = at.dataframe[-1].value
    assert list(table["method"]) == ["full cache", "random", "streaming"]
    assert list(table["correct"]) == [row["error_modes"]["correct"] for row in report.rows()]
    jobs.registry.clear()


def test_the_page_maps_heads_on_an_uploaded_problem_file(tmp_path, monkeypatch):
    """The attention statistics read traces of the task chosen at the top (here the user's own file, four
    problems, so eight traces asked take four): the same scores as the map read directly, named by the file."""
    from tests import apptest_helpers as helpers

    import app.sections.tasks as tasks_section
    from analyses import tasks
    from analyses.rlkv.data import task_problems
    from analyses.rlkv.head_map import HeadMap
    from app import export, jobs

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setattr(tasks_section, "store_problem_file",
                        lambda data, name: tasks.store_problem_file(data, name, folder=tmp_path))
    drawn: dict[str, tuple] = {}  # figure name: (its data, its provenance record), as its downloads read them
    original = export.export_buttons

    def keep(fig, data, name, provenance=None, figure=None):
        drawn[name] = (data, provenance)
        return original(fig, data, name, provenance, figure)

    monkeypatch.setattr(export, "export_buttons", keep)
    data = "\n".join(json.dumps({"question": f"What is {k} + 2?", "answer": k + 2}) for k in range(4)).encode()
    task = tasks.store_problem_file(data, "four.jsonl", folder=tmp_path)
    jobs.registry.clear()
    at = helpers.open_page("rlkv", 4)
    assert at.selectbox(key="rlkv_task").value == "arith"
    at.selectbox(key="rlkv_task").set_value(tasks_section.OWN_PROBLEMS).run()
    at.file_uploader(key="rlkv_task_file").set_value(("four.jsonl", data, "application/json"))
    at.radio(key="rlkv_source").set_value("attention statistics (no training)").run()
    at.number_input(key="rlkv_sink").set_value(1)
    at.number_input(key="rlkv_recent").set_value(4)
    at.slider(key="rlkv_attn_n").set_value(8)
    at.run()
    assert "The file holds 4 problems: the map takes all of them." in [c.value for c in at.caption]
    helpers.finish_jobs(at.button(key="rlkv_attn_run").click().run())
    helpers.assert_clean(at)
    expected = HeadMap.from_attention(Engine.from_id("tiny-random:llama"), task_problems(task, 4), 1, 4,
                                      max_new_tokens=4)
    shown, record = drawn["rlkv_head_map"]
    np.testing.assert_allclose(shown["scores"], expected.scores, rtol=1e-5)
    assert shown["task"] == task and shown["n"] == 4
    assert record["data"] == task and record["settings"]["head_map"]["task"] == task
    jobs.registry.clear()


def test_the_page_says_what_is_wrong_with_a_path_the_file_system_cannot_take(monkeypatch):
    """A 5,000-character gates path raised "File name too long" and a NUL in the evaluation path "embedded null
    byte": tracebacks on the page, now an error box each (and the page goes on)."""
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    at = helpers.open_page("rlkv", 4)
    at.text_input(key="rlkv_gates_path").set_value("g" * 5000)
    at.text_input(key="rlkv_eval_path").set_value("eval\x00.json").run()
    helpers.assert_clean(at, no_errors=False)
    errors = [e.value for e in at.error]
    assert any(e.startswith("the gates file or folder is 5,000 bytes long") for e in errors), errors
    assert "the JSON file holds a NUL character, which no path can" in errors
    assert at.button(key="rlkv_eval_run")  # the sections below still drew


def test_the_page_trains_gates_as_a_job_and_offers_them_to_the_head_map(tmp_path, monkeypatch):
    """One GRPO step on tiny-random:llama from the page: a job whose checkpoint lands in the user cache, then
    the head map offers "gates trained on this page", drawing exactly the gates and log that checkpoint holds;
    the evaluation runs as a job too."""
    from tests import apptest_helpers as helpers

    import app.views.rlkv as page
    from app import jobs

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    jobs.registry.clear()
    at = helpers.open_page("rlkv", 6)
    assert page.TRAINED not in at.radio(key="rlkv_source").options
    for key, value in (("rlkv_train_steps", 1), ("rlkv_train_prompts", 1), ("rlkv_train_group", 2),
                       ("rlkv_train_n", 2), ("rlkv_train_tokens", 4)):
        at.number_input(key=key).set_value(value)
    helpers.finish_jobs(at.button(key="rlkv_train_run").click().run())
    helpers.assert_clean(at)
    folder = at.session_state["rlkv_trained"]
    assert Path(folder).parent == tmp_path / "rlkv_runs"
    saved = read_gates(folder)
    assert [row["step"] for row in saved["log"]] == [1] and saved["meta"]["settings"]["group_size"] == 2
    assert saved["meta"]["task"] == "arith ops=+"  # the training data, named in the log (the page's defaults)
    at.radio(key="rlkv_source").set_value(page.TRAINED).run()
    helpers.assert_clean(at)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith("Learned head gates") and "Gate training" in titles
    from analyses.rlkv.heads import full_heads_from_scores

    full = full_heads_from_scores(saved["gates"].tolist(), 0.5, saved["pressure"].tolist())  # the default sparsity
    assert helpers.metric(at, "Heads with the full cache") == f"{int(full.sum())} of 4"
    at.slider(key="rlkv_eval_n").set_value(2)
    helpers.finish_jobs(at.button(key="rlkv_eval_run").click().run())
    helpers.assert_clean(at)
    assert "Accuracy vs sparsity, 95% intervals (evaluation split, n = 2)" in helpers.chart_titles(at)
    jobs.registry.clear()


def test_a_head_map_names_what_its_scores_were_read_from(tmp_path):
    """The provenance's data of a map: the attention statistics' task, the learned gates' training task from their
    log, or (a log written before the task was kept there: the shipped SmolLM2 run) the problems the log lists.
    The page said "arith" for every map, whatever it was read from."""
    from analyses.rlkv.head_map import HeadMap

    engine = Engine.from_id("tiny-random:llama")
    gates = np.array([[0.9, 0.1], [0.4, 0.7]], np.float32)
    problems = [{"id": "arith1-s0-0000", "question": "q"}, {"id": "arith1-s0-0001", "question": "r"}]
    meta = {"model": "tiny-random:llama", "fingerprint": "x", "shape": [2, 2], "settings": {}, "problems": problems}
    save_checkpoint(tmp_path / "old", gates, None, [], meta)
    save_checkpoint(tmp_path / "new", gates, None, [], {**meta, "task": "gsm8k"})
    assert HeadMap.from_gates(tmp_path / "new", engine, 1, 4).data_name() == "gsm8k"
    old = HeadMap.from_gates(tmp_path / "old", engine, 1, 4)
    assert old.data_name() == f"the 2 training problems listed beside {old.gates_file} (log.json)"
    assert HeadMap("attention", gates, 1, 4, task="arith-mixed").data_name() == "arith-mixed"


def test_the_shipped_run_is_offered_only_for_its_own_model():
    import app.views.rlkv as page

    found = read_gates(page.shipped("smollm2-135m", 0))
    assert found["gates"].shape == (30, 3) and found["log"][-1]["step"] == 24  # SmolLM2: 30 layers x 3 KV heads
    report = json.loads(Path(page.shipped("smollm2-135m", 1)).read_text())
    assert report["model"] == "smollm2-135m" and sorted(report["sparsities"]) == [0.2, 0.4, 0.6, 0.8]
    assert page.shipped("tiny-random:llama", 0) == "" and page.shipped("tiny-random:llama", 1) == ""


@pytest.mark.model
def test_the_page_opens_on_the_shipped_run_for_the_embedded_model(monkeypatch):
    from tests import apptest_helpers as helpers

    from app import jobs

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    jobs.registry.clear()
    at = helpers.open_page("rlkv", 8)
    helpers.assert_clean(at)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith("Learned head gates") and "Gate training" in titles
    assert "Accuracy vs sparsity, 95% intervals (evaluation split, n = 120)" in titles
    assert helpers.metric(at, "Heads with the full cache") == "45 of 90"  # the default sparsity 0.5
    jobs.registry.clear()
