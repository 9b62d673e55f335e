"""The MoE router method (analyses.moe_router): router statistics, router maps over N samples, Expert-Sample
chosen on development and evaluated against temperature sampling, the CLI, the benchmark and the page.

What a newcomer learns here: `token_statistics` / `HeadTail` / `RouterProfile` describe how confident a router
is; `generation_map` captures which experts every sample used; `evaluate_expert_sample` chooses k_h, m, T_e on
development and reports pass@1..N with intervals and paired tests on evaluation; bad settings and dense models
are refused before any model work; the same run through `thoughtscope serve` equals the run in-process.
Unit tests run on tiny-random:qwen3_moe (2 layers, 8 experts, top-2); the `model` tests on toy-moe:small.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from analyses.moe_router import (ExpertSetting, HeadTail, Method, RouterMap, RouterProfile, default_grid,
                                 draw_samples, evaluate_active_experts, evaluate_expert_sample, generation_map,
                                 routing_divergence, score_view, sorted_probabilities, token_statistics)
from analyses.moe_router.evaluate import Samples
from analyses.moe_router.maps import divergence_data, heatmap_data, jaccard_distance, token_forks
from analyses.moe_router.problems import load_items
from analyses.tasks import pass_at_k
from probes.routing import ExpertSample
from thoughtscope.errors import BadInputError

PROMPT = "mixture of experts route every token"


# ----- router statistics, by hand -----


def test_sorted_probabilities_and_token_statistics_by_hand():
    p = torch.tensor([0.05, 0.5, 0.2, 0.25])
    stats = token_statistics(torch.log(p).unsqueeze(0), k=2, rule=HeadTail("fixed", k_h=1))
    torch.testing.assert_close(stats["sorted_probs"][0], torch.tensor([0.5, 0.25, 0.2, 0.05]))
    want_entropy = -sum(x * math.log(x) for x in (0.05, 0.5, 0.2, 0.25))
    assert stats["entropy"].item() == pytest.approx(want_entropy, abs=1e-6)
    assert stats["gap_k"].item() == pytest.approx(0.25 - 0.2, abs=1e-6)  # p_(2) - p_(3)
    assert stats["top1"].item() == pytest.approx(0.5) and stats["topk_mass"].item() == pytest.approx(0.75)
    assert stats["head_size"].item() == 1 and stats["head_mass"].item() == pytest.approx(0.5)
    with pytest.raises(BadInputError, match="NaN"):
        sorted_probabilities(torch.tensor([[0.0, float("nan")]]))


def test_head_tail_rules_by_hand():
    probs = torch.tensor([[0.40, 0.35, 0.10, 0.08, 0.07],   # cumulative 0.5 after 2; largest gap after 2 (0.25)
                          [0.70, 0.10, 0.08, 0.07, 0.05],   # cumulative 0.5 after 1; gap after 1 (0.60)
                          [0.20, 0.20, 0.20, 0.20, 0.20]])  # flat: cumulative 0.5 after 3; no gap -> the smallest head
    assert HeadTail("cumulative", p=0.5).head_size(probs, k=4).tolist() == [2, 1, 3]
    assert HeadTail("cumulative", p=0.8).head_size(probs, k=4).tolist() == [3, 2, 4]
    assert HeadTail("cumulative", p=0.99, max_head=2).head_size(probs, k=4).tolist() == [2, 2, 2]
    assert HeadTail("gap").head_size(probs, k=4).tolist() == [2, 1, 1]
    assert HeadTail("fixed", k_h=3).head_size(probs, k=4).tolist() == [3, 3, 3]
    for bad, match in ((HeadTail("median"), "use one of"), (HeadTail("fixed", k_h=0), "k_h"),
                       (HeadTail("cumulative", p=1.5), "p must")):
        with pytest.raises(BadInputError, match=match):
            bad.check()


def test_router_profile_through_a_backend_equals_the_captured_logits(moe):
    texts = [PROMPT, "a second short text"]
    profile = RouterProfile().fit(moe, texts)
    logits = [torch.cat([moe.capture(t, capture=[f"router.{layer}"])[f"router.{layer}"] for t in texts])
              for layer in (0, 1)]
    assert profile.n_tokens_ == logits[0].shape[0] == sum(len(moe.encode(t)) for t in texts)
    for j, x in enumerate(logits):
        np.testing.assert_allclose(profile.mean_sorted_probs_[j], sorted_probabilities(x).mean(0).numpy(), rtol=1e-6)
        assert profile.entropy_[j] == pytest.approx(float(token_statistics(x, 2)["entropy"].mean()), rel=1e-6)
    assert profile.mean_sorted_probs_[0].sum() == pytest.approx(1.0, abs=1e-5)
    counts = profile.head_sizes_["largest gap"]
    assert counts.sum(1).tolist() == [profile.n_tokens_] * 2
    payload = profile.to_dict()
    assert payload["k"] == 2 and payload["n_experts"] == 8 and payload["max_entropy"] == pytest.approx(math.log(8))


# ----- settings and bad input -----


def test_expert_settings_parse_and_the_default_grid():
    assert ExpertSetting.parse("4:12:1.5:displaced") == ExpertSetting(4, 12, 1.5, "displaced")
    with pytest.raises(BadInputError, match="k_h:m:T_e"):
        ExpertSetting.parse("4:12")
    grid = default_grid(8, 64)
    assert len(grid) == 16 and grid[0] == ExpertSetting(4, 12, 1.0)
    assert all(s.k_h < 8 and s.m >= 8 - s.k_h and s.k_h + s.m <= 64 for s in grid)
    assert {s.tail_gates for s in grid} == {"router", "displaced"}


@pytest.fixture()
def forwards(moe):
    calls = []
    handle = moe.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("setting, match", [
    (ExpertSetting(2, 4, 1.0), "k_h < k"),                # k_h = k: no tail to sample
    (ExpertSetting(3, 4, 1.0), "k_h < k"),                # k_h > k
    (ExpertSetting(1, 0, 1.0), "tail pool m=0"),          # m < k - k_h
    (ExpertSetting(1, 4, 0.0), "T_e must be a finite"),
    (ExpertSetting(1, 4, float("nan")), "T_e must be a finite"),
    (ExpertSetting(1, 4, -1.0), "T_e must be a finite"),
    (ExpertSetting(1, 8, 1.0), "k_h \\+ m = 9"),
])
def test_bad_expert_sample_settings_are_refused_before_any_model_work(moe, forwards, setting, match):
    with pytest.raises(BadInputError, match=match):
        evaluate_expert_sample(moe, "arith", n=2, n_dev=2, n_samples=2, grid=[setting])
    assert forwards == []


def test_a_bad_rule_for_a_router_map_is_refused_before_any_model_work(moe, forwards):
    with pytest.raises(BadInputError, match="tail pool m=0"):
        generation_map(moe, PROMPT, n_samples=2, max_new_tokens=3, rule=ExpertSample(k_h=1, m=0))
    with pytest.raises(BadInputError, match="n_samples"):
        generation_map(moe, PROMPT, n_samples=0)
    assert forwards == []


def test_a_dense_model_is_refused_before_any_model_work(llama):
    calls = []
    handle = llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for run in (lambda: evaluate_expert_sample(llama, "arith", n=2, n_dev=2, n_samples=2),
                    lambda: evaluate_active_experts(llama, "arith", n=2),
                    lambda: generation_map(llama, PROMPT, max_new_tokens=2),
                    lambda: RouterProfile().fit(llama, [PROMPT])):
            with pytest.raises(BadInputError, match="dense model|cannot do router"):
                run()
    finally:
        handle.remove()
    assert calls == []


# ----- pass@k, best-of-n and majority, by hand -----


def test_samples_pass_at_k_best_of_and_majority_by_hand():
    items = load_items("toy-moe:small", "evaluation", 2)
    correct = np.array([[True, False, False, True], [False, False, False, False]])
    mean_lp = np.array([[-0.1, -0.05, -0.3, -0.2], [-0.2, -0.1, -0.4, -0.3]])
    answers = [[items[0].answer, "-3", "-3", items[0].answer], ["-1", None, "-1", "-2"]]
    s = Samples(Method("x", temperature=1.0), items, correct, mean_lp, np.full((2, 4), 10), answers, 1.0)
    assert s.pass_at(1).estimate == pytest.approx((0.5 + 0.0) / 2)
    assert s.pass_at(2).estimate == pytest.approx((pass_at_k(4, 2, 2) + 0) / 2) == pytest.approx(5 / 12)
    assert s.pass_at(4).estimate == pytest.approx(0.5)
    assert s.best_of(1).tolist() == [1.0, 0.0]   # first sample only
    assert s.best_of(2).tolist() == [0.0, 0.0]   # sample 1 (log-prob -0.05) wins problem 0, and is wrong
    assert s.best_of(4).tolist() == [0.0, 0.0]
    assert s.majority_at(4).tolist() == [1.0, 0.0]  # problem 0: a 2-2 tie goes to the first answer seen (right)
    assert s.majority_at(3).tolist() == [0.0, 0.0]  # "3" twice against the right answer once
    assert s.majority_at(1).tolist() == [1.0, 0.0]


# ----- router maps over a generation -----


def test_generation_map_captures_the_rules_experts_and_gates(moe):
    rule = ExpertSample(k_h=1, m=4, t_e=1.0, seed=1)
    rmap = generation_map(moe, PROMPT, n_samples=3, max_new_tokens=5, rule=rule)
    assert rmap.experts.shape == (3, 5, 2, 2) and rmap.logits.shape == (3, 5, 2, 8) and rmap.rule == rule.describe()
    for b in range(3):
        for t in range(len(rmap.tokens[b])):
            for j in range(2):
                logits = torch.as_tensor(rmap.logits[b, t, j])
                ranked = logits.argsort(descending=True).tolist()
                chosen = rmap.experts[b, t, j].tolist()
                assert chosen[0] == ranked[0] and chosen[1] in ranked[1:5]  # head kept, tail from the pool of 4
                # this tiny Qwen3-MoE does not renormalise: a gate is the expert's router probability
                np.testing.assert_allclose(rmap.gates[b, t, j], torch.softmax(logits, -1)[chosen].numpy(), rtol=1e-5)
    plain = generation_map(moe, PROMPT, max_new_tokens=5)
    greedy = list(moe.generate(PROMPT, max_new_tokens=5, top_k=0))
    assert plain.token_ids[0] == [r.token_id for r in greedy]
    assert (plain.experts[0] == torch.topk(torch.as_tensor(plain.logits[0]), 2, dim=-1)[1].numpy()).all()
    # the three samples routed differently somewhere (fresh noise per sample)
    assert routing_divergence(rmap)["divergence"][:, 0].max() > 0


def _synthetic_map() -> RouterMap:
    experts = np.array([[[[0, 1]], [[2, 3]]], [[[0, 1]], [[2, 4]]], [[[0, 5]], [[2, 3]]]])  # [3 samples, 2 steps, 1 layer, 2]
    logits = np.log(np.array([0.4, 0.3, 0.1, 0.1, 0.05, 0.05], dtype=np.float32))
    return RouterMap([0], 2, 6, [["a", "b"], ["a", "b"], ["a", "c"]], [[5, 6], [5, 6], [5, 7]],
                     np.broadcast_to(logits, (3, 2, 1, 6)).copy(), experts, np.full((3, 2, 1, 2), 0.5, np.float32))


def test_routing_divergence_and_forks_by_hand():
    d = routing_divergence(_synthetic_map())
    assert jaccard_distance([0, 1], [0, 5]) == pytest.approx(2 / 3)
    # step 0: pairs (0,1) 0, (0,2) 2/3, (1,2) 2/3; all three share the prefix "a"
    assert d["divergence"][0, 0] == pytest.approx(4 / 9) and d["same_prefix"][0, 0] == pytest.approx(4 / 9)
    # step 1: (0,1) 2/3, (0,2) 0, (1,2) 2/3; only samples 0 and 1 still share their tokens ("a b")
    assert d["divergence"][0, 1] == pytest.approx(4 / 9) and d["same_prefix"][0, 1] == pytest.approx(2 / 3)
    assert d["distinct_tokens"].tolist() == [1, 2] and d["forks"] == [None, None, 1]
    assert token_forks(_synthetic_map()) == [None, None, 1]
    data = divergence_data(_synthetic_map())
    assert json.loads(json.dumps(data))["divergence"] == [[pytest.approx(4 / 9, abs=1e-4)] * 2]


def test_score_view_splits_head_routed_tail_and_pool():
    view = score_view(_synthetic_map(), sample=0, step=1, layer_index=0, k_h=1, m=3, p=0.5)
    np.testing.assert_allclose(view["probs"], [0.4, 0.3, 0.1, 0.1, 0.05, 0.05], rtol=1e-5)
    assert view["experts"][:2] == [0, 1] and view["chosen"] == [2, 3] and view["token"] == "b"
    assert (view["k"], view["k_h"], view["m"]) == (2, 1, 3)
    assert view["cumulative_head"] == 2 and view["gap_head"] == 2  # 0.4 + 0.3 >= 0.5; largest drop after rank 2
    with pytest.raises(BadInputError, match="k_h must be"):
        score_view(_synthetic_map(), 0, 0, 0, k_h=3)
    heat = heatmap_data(_synthetic_map(), sample=2)
    assert heat["experts"] == [[[0, 5], [2, 3]]] and heat["tokens"] == ["a", "c"]


# ----- the evaluation, the server and the CLI -----


def test_expert_sample_evaluation_reports_every_method_with_intervals(moe):
    stages = []
    grid = [ExpertSetting(1, 3, 1.0), ExpertSetting(1, 6, 2.0, "displaced")]
    report = evaluate_expert_sample(moe, "arith", n=3, n_dev=2, n_samples=4, grid=grid, temperatures=[0.6, 1.0],
                                    combined_temperatures=[1.0], max_new_tokens=4, n_resamples=200,
                                    progress=lambda stage, done, total: stages.append(stage))
    out = json.loads(json.dumps(report.to_dict(per_problem=True)))
    assert [m["name"] for m in out["methods"]] == ["greedy", "temperature 0.6", "temperature 1", "Expert-Sample",
                                                   "Expert-Sample + temperature 1"]
    choice = out["choices"]["expert_sample"]
    assert choice["split"] == "development" and len(choice["grid"]) == 2
    assert ExpertSetting(**choice["chosen"]) in grid
    for m in out["methods"]:
        n = m["n_samples"]
        assert n == (1 if m["name"] == "greedy" else 4) and sorted(map(int, m["pass_at"])) == list(range(1, n + 1))
        estimates = [m["pass_at"][str(k)]["estimate"] for k in range(1, n + 1)]
        assert estimates == sorted(estimates)  # pass@k never falls with k
        per = m["per_problem"]
        assert m["pass_at"]["1"]["estimate"] == pytest.approx(np.mean([p["correct"] / p["n"] for p in per]))
    assert len(out["tests"]) == 2 * 3 and all("pass@1" in t for t in out["tests"])
    assert any(s.startswith("evaluation 4/5") for s in stages)
    assert report.samples["Expert-Sample"].tokens.shape == (3, 4)


def test_active_experts_rows_for_every_k(moe):
    report = evaluate_active_experts(moe, "arith", n=3, max_new_tokens=4, n_resamples=200)
    assert [r["active_experts"] for r in report.rows] == [2, 1] and report.rows[0]["vs_model_k"] is None
    assert report.rows[1]["vs_model_k"]["test"] == "exact McNemar"


def test_the_same_expert_sample_run_through_the_server_equals_in_process():
    from probes.server_bench import served

    items = load_items("arith", "evaluation", 3)
    method = Method("Expert-Sample", expert=ExpertSetting(1, 4, 1.5))
    with served("tiny-random:qwen3_moe") as (engine, remote):
        here = draw_samples(engine, items, method, 3, max_new_tokens=6, seed=4, keep_texts=True)
        there = draw_samples(remote, items, method, 3, max_new_tokens=6, seed=4, keep_texts=True)
        map_here = generation_map(engine, PROMPT, n_samples=2, max_new_tokens=4, rule=method.expert.rule(9))
        map_there = generation_map(remote, PROMPT, n_samples=2, max_new_tokens=4, rule=method.expert.rule(9))
    assert here.texts == there.texts and len({t for row in here.texts for t in row}) > 1
    np.testing.assert_array_equal(here.tokens, there.tokens)
    np.testing.assert_allclose(here.mean_logprob, there.mean_logprob, atol=1e-5)
    np.testing.assert_array_equal(map_here.experts, map_there.experts)
    np.testing.assert_allclose(map_here.gates, map_there.gates, atol=1e-6)


def _cli(args: list[str]) -> dict:
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    result = CliRunner().invoke(build(), args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_eval_cli_prints_json_with_provenance():
    model = ["--model", "tiny-random:qwen3_moe"]
    out = _cli(["eval", "expert-sample", *model, "--task", "arith", "--n", "2", "--n-dev", "2", "--samples", "2",
                "--grid", "1:3:1,1:4:2:displaced", "--temperature", "1", "--max-new-tokens", "3",
                "--n-resamples", "100", "--json"])
    assert out["provenance"]["model"] == "tiny-random:qwen3_moe"
    assert out["provenance"]["command"] == "thoughtscope eval expert-sample"
    assert len(out["choices"]["expert_sample"]["grid"]) == 2 and out["n_samples"] == 2
    active = _cli(["eval", "active-experts", *model, "--task", "arith", "--n", "2", "--max-new-tokens", "3",
                   "--n-resamples", "100", "--json"])
    assert [r["active_experts"] for r in active["rows"]] == [2, 1] and active["provenance"]["split"] == "evaluation"
    profile = _cli(["router", "profile", *model, "--task", "arith", "--n", "2", "--max-new-tokens", "3", "--json"])
    assert profile["layers"] == [0, 1] and len(profile["mean_sorted_probs"][0]) == 8


def test_cli_refuses_a_bad_grid_before_loading_a_model():
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    result = CliRunner().invoke(build(), ["eval", "expert-sample", "--model", "tiny-random:qwen3_moe", "--grid", "2:4"])
    assert result.exit_code != 0 and "k_h:m:T_e" in str(result.exception or result.output)


# ----- the benchmark -----


def test_expert_sample_overhead_bench_row(moe):
    from analyses.moe_router.bench import bench_expert_sample_overhead

    row = bench_expert_sample_overhead(moe, n_problems=2, max_new_tokens=4, rounds=1)
    assert row["bench"] == "expert_sample_overhead" and row["target"] == 1.10
    assert row["tokens"]["greedy"] == row["tokens"]["expert_sample"] == 2 * 4  # tiny-random never stops early
    assert row["ratio"] == pytest.approx(row["greedy_tokens_per_s"] / row["expert_sample_tokens_per_s"], rel=0.01)
    assert row["setting"] == {"k_h": 1, "m": 4, "t_e": 1.0, "tail_gates": "router", "where": "all"}
    k = moe.info()["arch"]["experts_top_k"]
    spread = row["distinct_experts_per_step"]
    assert spread["top_k"] == k and k <= spread["greedy"] <= 2 * k and k <= spread["expert_sample"] <= 2 * k
    # one sequence: each side computes exactly its k experts per layer and step
    single = bench_expert_sample_overhead(moe, n_problems=1, max_new_tokens=3, rounds=1)
    assert single["distinct_experts_per_step"]["greedy"] == single["distinct_experts_per_step"]["expert_sample"] == k
    # at T_e near 0 the drawn tail is the model's own next ranks: the same experts as greedy, the rule's full cost
    from analyses.moe_router.evaluate import ExpertSetting

    cold = bench_expert_sample_overhead(moe, n_problems=2, max_new_tokens=4, rounds=1, target=None,
                                        setting=ExpertSetting(1, 4, 1e-4), name="expert_sample_cold_overhead")
    assert cold["distinct_experts_per_step"]["expert_sample"] == cold["distinct_experts_per_step"]["greedy"]
    identity = bench_expert_sample_overhead(moe, n_problems=2, max_new_tokens=4, rounds=1, identity=True, target=None,
                                            name="router_rule_overhead")
    assert identity["tokens"] == {"greedy": 8, "identity": 8} and "target" not in identity
    assert identity["ratio"] == pytest.approx(identity["greedy_tokens_per_s"] / identity["identity_tokens_per_s"], rel=0.01)


# ----- the page -----


@pytest.fixture()
def page_on_tiny_moe(monkeypatch):
    import app.views.moe_router as page

    from app import jobs

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:qwen3_moe")
    jobs.registry.clear()
    yield page
    jobs.registry.clear()


def test_the_page_routes_a_generation_and_draws_every_figure(page_on_tiny_moe, moe, tmp_path):
    from app.figures.moe_router import FIGURES
    from app.export import figure_registry
    from tests import apptest_helpers as helpers

    assert set(FIGURES) <= set(figure_registry())
    at = helpers.open_page("moe_router", max_new_tokens=5)
    helpers.assert_clean(at)
    assert helpers.chart_titles(at) == []
    at.radio(key="moe_routing").set_value("Expert-Sample").run()
    at.slider(key="moe_samples").set_value(3).run()
    helpers.finish_jobs(at.button(key="moe_generate").click().run())  # the generation runs as a job
    helpers.assert_clean(at)
    titles = helpers.chart_titles(at)
    assert len(titles) == 3 and titles[0].startswith("Router scores at layer 0 for token 0")
    assert "head 1 of 2" in titles[0] and titles[1].startswith("Experts used at every layer (sample 0)<br><sup>under expert-sample")
    assert titles[2].startswith("Where 3 samples part")
    at.slider(key="moe_view_k_h").set_value(2).run()
    assert "head 2 of 2" in helpers.chart_titles(at)[0]
    # pass@n from an evaluation JSON, as `thoughtscope eval expert-sample --json` writes it
    report = evaluate_expert_sample(moe, "arith", n=2, n_dev=2, n_samples=2, grid=[ExpertSetting(1, 3, 1.0)],
                                    temperatures=[1.0], max_new_tokens=3, n_resamples=100)
    path = tmp_path / "es.json"
    path.write_text(json.dumps(report.to_dict()))
    at.text_input(key="moe_eval_path").set_value(str(path)).run()
    helpers.assert_clean(at)
    assert "pass@n on 2 evaluation problems (95% bootstrap intervals)" in helpers.chart_titles(at)
    at.text_input(key="moe_eval_path").set_value(str(tmp_path / "missing.json")).run()
    assert any("cannot read" in e.value for e in at.error)


def test_the_page_runs_on_an_uploaded_problem_file(page_on_tiny_moe, moe, monkeypatch, tmp_path):
    """On an MoE model other than a toy the task can be the user's own problems: the task prompt is the file's
    first development problem, and the router profile is the one of that file's development half."""
    import app.sections.tasks as tasks_section
    from analyses import tasks
    from analyses.moe_router.ship import router_profile, task_prompt
    from app.sections.moe_router import prompt_text
    from tests import apptest_helpers as helpers

    monkeypatch.setattr(tasks_section, "store_problem_file",
                        lambda data, name: tasks.store_problem_file(data, name, folder=tmp_path))
    data = "\n".join(json.dumps({"question": f"What is {k} + 1?", "answer": k + 1}) for k in range(6)).encode()
    task = tasks.store_problem_file(data, "six.jsonl", folder=tmp_path)
    at = helpers.open_page("moe_router", max_new_tokens=3)
    assert at.selectbox(key="moe_task").value == "arith"  # the model's own task first
    at.selectbox(key="moe_task").set_value(tasks_section.OWN_PROBLEMS).run()
    at.file_uploader(key="moe_task_file").set_value(("six.jsonl", data, "application/json"))
    at.run()
    helpers.assert_clean(at)
    prompt, _, answer = task_prompt(moe, 0, task=task)
    assert answer in {str(k + 1) for k in range(6)}
    assert f"prompt: {prompt_text(prompt)} (answer {answer})" in [c.value for c in at.caption]
    helpers.finish_jobs(at.button(key="moe_profile_run").click().run())
    helpers.assert_clean(at)
    expected = router_profile(moe, task=task)
    assert expected["task"] == task and expected["n_problems"] == 3  # the development half of six problems
    top1 = ", ".join(f"{v:.2f}" for v in expected["top1"])
    assert any(c.value.startswith(f"top-1 mean probability per layer: {top1};") for c in at.caption)
    # the title names the file, not its path in the user cache (which filled the title in a browser)
    assert helpers.chart_titles(at)[0].startswith(f"Router profile on {Path(task.partition('#')[0]).name}: mean")


def test_a_grid_setting_the_router_cannot_run_is_refused_before_the_evaluation_job(page_on_tiny_moe, moe):
    from app import jobs
    from tests import apptest_helpers as helpers

    arch = moe.arch()
    k = arch.experts_top_k
    at = helpers.open_page("moe_router", max_new_tokens=5)
    at.number_input(key="moe_eval_n").set_value(2)
    for grid, says in ((f"1:{k - 2}:1", f"the tail pool m={k - 2} is smaller than the {k - 1} experts"),
                       (f"1:{arch.n_experts}:1", f"this model has {arch.n_experts} experts per layer"),
                       (f"{k}:{k}:1", f"k_h < k = {k}")):
        at.text_input(key="moe_eval_grid").set_value(grid).run()
        at.button(key="moe_eval_run").click().run()
        assert any(says in e.value for e in at.error), (grid, [e.value for e in at.error])
        assert jobs.registry().running() == [] and not any("failed" in e.value for e in at.error)  # no job ran


# ----- on the organism (toy-moe:small: trained once, under a minute, cached) -----


@pytest.mark.model
def test_on_toy_moe_fewer_experts_cost_accuracy_and_expert_sample_diversifies():
    from probes import Engine
    from probes.toys import moe as toy

    engine = Engine.from_id("toy-moe:small")
    active = evaluate_active_experts(engine, "auto", n=40, n_resamples=200)
    accuracy = {r["active_experts"]: r["accuracy"]["estimate"] for r in active.rows}
    # the model's own k: the toy's own greedy decoding scores the same problems the same way
    problems = toy.problems("eval", 40, config=toy.task_config("small"))
    texts = toy.greedy_continuations(engine.model, engine.tok, [p.prompt for p in problems], max_new_tokens=48)
    assert accuracy[4] == pytest.approx(np.mean([toy.is_correct(t, p) for t, p in zip(texts, problems)]))
    assert accuracy[4] >= 0.6 and accuracy[1] < accuracy[4]
    items = load_items("toy-moe:small", "evaluation", 20)
    samples = draw_samples(engine, items, Method("es", expert=ExpertSetting(2, 8, 2.0)), 4)
    assert max(len(set(a)) for a in samples.answers) > 1  # greedy tokens, yet different answers
    assert samples.pass_at(4).estimate >= samples.pass_at(1).estimate > 0.2


def test_the_page_on_a_dense_model_says_why_and_shows_the_toys_stored_result(monkeypatch, tmp_path):
    """On a dense model: why the page cannot run here, then the toy MoE's shipped result labelled as the toy's
    (never this model's), with one button, the switch to the toy; without a shipped result, only the why."""
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    at = helpers.open_page("moe_router")
    helpers.assert_clean(at)
    assert at.title[0].value == "MoE router & Expert-Sample"
    assert "has no MoE router" in at.info[0].value
    from analyses.moe_router.ship import DEFAULT_MODEL as toy

    assert [b.label for b in at.button] == [f"Switch to {toy}"]
    assert any(f"stored result of `{toy}`, not of `tiny-random:llama`" in m.value for m in at.markdown)
    titles = helpers.chart_titles(at)
    assert titles[0].startswith(f"Router profile on {toy}") and any(t.startswith("Where 4 samples part")
                                                                    for t in titles)
    monkeypatch.setenv("THOUGHTSCOPE_SHIPPED_DIR", str(tmp_path))  # nothing ships there
    at = helpers.open_page("moe_router")
    helpers.assert_clean(at)
    assert "has no MoE router" in at.info[0].value and not at.button and not at.get("plotly_chart")
