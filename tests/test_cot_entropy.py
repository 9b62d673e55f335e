"""CoT entropy phases (Xu et al.): CUSUM maths by hand, probes via fork, stopping rules, the eval commands.

Read top to bottom as a tour of `analyses.cot_entropy`: the detector on hand-worked numbers, then
the stopping rules on hand-built probes, then real probes and exits on the tiny random model, then
the `thoughtscope eval` commands end to end.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from analyses.cot_entropy import (
    CalibrationTrace,
    CusumDetector,
    CusumStop,
    DeerStop,
    DynasorStop,
    Probe,
    ProbedTrace,
    StoppingRule,
    analyze_trace,
    cusum_path,
    cusum_weighted_vote,
    entropy_thirds,
    first_alarm,
    generate_with_early_exit,
    majority_vote,
    moving_average,
    pareto_status,
    pareto_table,
    probe_positions,
    probe_traces,
    replay,
    run_with_rule,
)
from analyses.cot_entropy.bench import bench_cusum_overhead
from analyses.cot_entropy.cli import parse_thresholds, register
from analyses.families import FAMILIES as COT_FAMILIES
from analyses.families import family_for as cot_family_for
from analyses.steps import StepEnd
from analyses.steps import step_ends as segment_steps
from analyses.tasks import load_task, one_shot_messages
from thoughtscope.errors import BadInputError
from probes.records import TokenRecord

# --------------------------------------------------------------------------- CUSUM by hand


def test_cusum_recursion_on_a_hand_worked_sequence():
    # S_i = max(0, S_{i-1} + Z_i): 0.5, max(0, -0.5) = 0, 2, 3.5, 3.3
    z = [0.5, -1.0, 2.0, 1.5, -0.2]
    assert cusum_path(z).tolist() == pytest.approx([0.5, 0.0, 2.0, 3.5, 3.3])
    assert first_alarm(cusum_path(z), threshold=3.0) == 3
    assert first_alarm(cusum_path(z), threshold=4.0) is None


def _hand_detector(threshold: float) -> CusumDetector:
    """Two bins on [0, 2]. Uncertain steps: one at 0.5, three at 1.5; confident: three at 0.5, one at 1.5.
    With one pseudo-count per bin f0 = (2/6, 4/6), f1 = (4/6, 2/6), so Z = +log 2 below 1, -log 2 above."""
    settles_late = CalibrationTrace([1.5, 1.5, 1.5, 0.5], ["1", "2", "3", "9"], final_answer="9")
    settles_early = CalibrationTrace([0.5, 0.5, 0.5, 1.5], ["7", "9", "9", "9"], final_answer="9")
    return CusumDetector(threshold=threshold, density="histogram", bins=2, smoothing=1.0, value_range=(0.0, 2.0)).fit(
        [settles_late, settles_early])


def test_detector_densities_and_alarm_by_hand():
    detector = _hand_detector(threshold=2.0)
    assert detector.counts0_.tolist() == [1, 3] and detector.counts1_.tolist() == [3, 1]
    assert detector.log_ratio_ == pytest.approx([math.log(2), -math.log(2)])
    entropies = [1.5, 0.5, 0.5, 1.5, 0.5, 0.5]
    # Z = -l, l, l, -l, l, l with l = log 2: S = 0, l, 2l, l, 2l, 3l = 2.08 >= 2 at step 5
    assert detector.batch_statistic(entropies) == pytest.approx(np.array([0, 1, 2, 1, 2, 3]) * math.log(2))
    assert detector.alarm_index(entropies) == 5
    assert detector.with_threshold(1.3).alarm_index(entropies) == 2
    # Out-of-range values fall into the edge bins; every log density is finite.
    assert detector.log_likelihood_ratio([-1.0, 7.0]).tolist() == pytest.approx([math.log(2), -math.log(2)])


def test_calibration_split_is_settled_on_the_final_answer():
    # Confident from the step whose answer equals the final one and stays equal; a flip resets it.
    assert CalibrationTrace([1, 1, 1, 1], ["3", "5", "3", "5"], "5").labels() == [0, 0, 0, 1]
    assert CalibrationTrace([1, 1, 1], ["5", "5", "5"], "5").labels() == [1, 1, 1]
    assert CalibrationTrace([1, 1], ["5", "5"], None).labels() == [0, 0]


def test_online_update_and_batch_statistic_agree():
    detector = _hand_detector(threshold=1.5)
    rng = np.random.default_rng(0)
    entropies = rng.uniform(0, 2, size=40).tolist()
    detector.reset()
    online = []
    for h in entropies:
        s, alarm = detector.update(h)
        online.append(s)
        assert alarm == (s >= 1.5)
    assert online == pytest.approx(detector.batch_statistic(entropies).tolist())
    assert detector.alarm_step_ == detector.alarm_index(entropies)
    assert detector.reset().statistic_ == 0.0


def _two_regime(rng, change: int, length: int = 12) -> CalibrationTrace:
    """Uncertain steps ~ N(1.2, 0.2) nats, then confident ones ~ N(0.3, 0.1) once the answer settles on 42."""
    h = np.r_[rng.normal(1.2, 0.2, change), rng.normal(0.3, 0.1, length - change)].clip(0)
    answers = [str(i) for i in range(change)] + ["42"] * (length - change)
    return CalibrationTrace(h.tolist(), answers, "42")


def test_fitted_densities_recover_the_change_point_within_one_step():
    rng = np.random.default_rng(1)
    detector = CusumDetector(threshold=3.0).fit([_two_regime(rng, int(rng.integers(2, 9))) for _ in range(50)])
    hits = 0
    for seed in range(200):
        draw = np.random.default_rng(1000 + seed)
        change = int(draw.integers(2, 9))
        alarm = detector.alarm_index(_two_regime(draw, change).entropies)
        hits += alarm is not None and abs(alarm - change) <= 1
    assert hits / 200 >= 0.95


def test_the_kde_does_not_quantise_the_log_likelihood_ratio():
    """The paper's 10-bin histogram makes Z piecewise constant (issue 11: h = 1 and h = 2 could give the
    same alarms for that reason alone); the KDE gives each entropy its own Z, smooth between the classes."""
    rng = np.random.default_rng(1)
    calibration = [_two_regime(rng, int(rng.integers(2, 9))) for _ in range(50)]
    histogram = CusumDetector(density="histogram", bins=10).fit(calibration)
    kde = CusumDetector(density="kde").fit(calibration)
    x = np.linspace(0.0, 1.6, 33)
    assert len(set(np.round(histogram.log_likelihood_ratio(x), 9))) <= 10
    assert len(set(np.round(kde.log_likelihood_ratio(x), 9))) == 33
    # Silverman's rule per class: the confident steps (sd 0.1) get a narrower kernel than the uncertain (sd 0.2)
    assert kde.bandwidths_[1] < kde.bandwidths_[0] < 0.2
    # confident entropies favour f1, uncertain ones f0, and Z crosses zero once in between
    z = kde.log_likelihood_ratio(x)
    assert z[x <= 0.4].min() > 2 and z[(x >= 1.0) & (x <= 1.4)].max() < -2
    assert np.count_nonzero(np.diff(np.sign(z[(x > 0.2) & (x < 1.2)]))) == 1
    # far outside the calibration range Z stays finite (the uniform floor), and the fit is scored per class
    assert np.isfinite(kde.log_likelihood_ratio([-5.0, 50.0])).all()
    assert kde.score(calibration) > CusumDetector(density="kde", bandwidth=2.0).fit(calibration).score(calibration)


def test_the_bandwidth_is_chosen_on_development_steps():
    from analyses.cot_entropy import choose_density

    rng = np.random.default_rng(2)
    calibration = [_two_regime(rng, int(rng.integers(2, 9))) for _ in range(40)]
    development = [_two_regime(rng, int(rng.integers(2, 9))) for _ in range(40)]
    choice = choose_density(calibration, development, bandwidths=[0.002, 0.05, 0.1, 3.0])
    rows = choice.to_dict()["grid"]
    assert [r["setting"] for r in rows] == [0.002, 0.05, 0.1, 3.0]
    loglik = [r["dev_log_likelihood"] for r in rows]
    assert choice.chosen in (0.05, 0.1) and loglik[choice.index] == max(loglik)
    assert loglik[0] < loglik[choice.index] and loglik[3] < loglik[choice.index]  # too narrow and too wide lose
    assert rows[0]["dev_steps"] == sum(len(t.entropies) for t in development)
    default = choose_density(calibration, development)  # 1/4..4 x Silverman's bandwidth of the pooled steps
    assert len(default.grid) == 5 and default.grid == sorted(default.grid)


def test_detector_refuses_bad_use():
    with pytest.raises(BadInputError, match="threshold"):
        CusumDetector(threshold=0)
    with pytest.raises(BadInputError, match="not fitted"):
        CusumDetector().update(0.5)
    with pytest.raises(BadInputError, match="no probe entropies"):
        CusumDetector().fit([CalibrationTrace([], [], "1")])
    with pytest.raises(BadInputError, match="density"):
        CusumDetector(density="gaussian")
    with pytest.raises(BadInputError, match="bandwidth"):
        CusumDetector(bandwidth=0)


@pytest.mark.parametrize("grids, says", [
    (dict(h_grid=[1.0, math.nan]), "the CUSUM threshold h must be a finite number > 0"),
    (dict(h_grid=[-2.0]), "the CUSUM threshold h"),
    (dict(deer_grid=[0.9, 1.0]), "the DEER threshold"),
    (dict(deer_grid=[math.inf]), "the DEER threshold"),
])
def test_evaluations_refuse_a_bad_threshold_grid_before_any_trace(monkeypatch, grids, says):
    """A NaN h was said only after the calibration and development traces (a minute on the tiny model); a
    DEER threshold of 1 or more never exits (a silent vanilla)."""
    from analyses.cot_entropy import evaluate as ev, settling

    traced = []
    monkeypatch.setattr(ev, "probe_traces", lambda *a, **k: traced.append(a))
    monkeypatch.setattr(settling, "planted_traces", lambda *a, **k: traced.append(a))
    with pytest.raises(BadInputError, match=says):
        ev.evaluate_cot_exit(object(), "arith", 2, 2, 2, **grids)
    if "h_grid" in grids:
        with pytest.raises(BadInputError, match=says):
            settling.evaluate_settling(object(), "toy-reasoner:small", 2, 2, 2, h_grid=grids["h_grid"])
    assert traced == []


# --------------------------------------------------------------------------- curves and steps


def test_entropy_smoothing_and_thirds():
    assert moving_average([1, 2, 3, 4], window=2).tolist() == [1, 1.5, 2.5, 3.5]  # trailing: what a live view knows
    assert moving_average([1, 2, 3, 4], window=3, centered=True).tolist() == [1.5, 2, 3, 3.5]
    assert entropy_thirds([1, 1, 0.5, 0.5, 0.2, 0.2]) == [1, 0.5, 0.2]


def test_sentence_steps_are_seen_one_token_late():
    tokens = ["Tom", " has", " 3", ".", " He", " buys", " 2", ".\n", "So", " 3.5", " is", " 5", "."]
    ends = segment_steps(tokens, COT_FAMILIES["smollm2"].step_delimiter)
    # "." ends step 1 after 4 tokens, but only " He" shows it is a sentence end; ".\n" shows it at once;
    # "3.5" is no sentence end, and the final "." has nothing after it yet.
    assert ends == [StepEnd(4, 5), StepEnd(8, 8)]
    paragraphs = segment_steps(["First", ".", "\n\n", "Wait", ",", "\n", "\n", "x"], r"\n\n")
    assert paragraphs == [StepEnd(3, 3), StepEnd(7, 7)]


def test_families_by_model_id():
    assert cot_family_for("smollm2-135m").answer_suffix == " The answer is "
    assert cot_family_for("hf:deepseek-ai/DeepSeek-R1-Distill-Qwen-7B").answer_suffix.startswith("</think>")
    assert cot_family_for("hf:meta-llama/Llama-3.2-1B-Instruct").step_delimiter == r"\n\n"
    with pytest.raises(BadInputError):
        COT_FAMILIES["smollm2"].with_delimiter("(")


# --------------------------------------------------------------------------- stopping rules by hand


def _rec(text: str, entropy: float, logprob: float, token_id: int = 7) -> TokenRecord:
    return TokenRecord(step=0, batch_index=0, token_id=token_id, text=text, logprob=logprob, entropy=entropy)


def test_probe_reads_the_answer_and_drops_the_stop_token():
    records = [_rec(" ", 0.1, -0.01), _rec("2", 0.4, -0.1), _rec("0", 0.2, -0.3), _rec(".", 0.9, -0.5)]
    probe = Probe.from_records(records, token_index=12, suffix_tokens=4)
    assert probe.answer == "20" and probe.answer_text == " 20."
    assert probe.entropies == [0.4, 0.2] and probe.mean_entropy == pytest.approx(0.3)
    assert probe.confidence == pytest.approx(math.exp(-0.2))  # geometric mean of the digits' probabilities
    assert probe.tokens_computed == 8


def _probe(at: int, answer: str | None, entropy: float = 0.5, confidence: float = 0.5, text: str = "") -> Probe:
    return Probe(at, text or f" {answer}.", answer, [entropy], [math.log(confidence)], tokens_computed=4)


def _trace(probes: list[Probe], step_ends: list[StepEnd], n_tokens: int = 30, target: str = "20") -> ProbedTrace:
    return ProbedTrace("p0", target, list(range(n_tokens)), ["x"] * n_tokens, [1.0] * n_tokens, step_ends,
                       {p.token_index: p for p in probes})


def test_deer_exits_at_the_first_confident_step_end():
    probes = [_probe(5, "17", confidence=0.80), _probe(12, "20", confidence=0.97), _probe(20, "20", confidence=0.99)]
    trace = _trace(probes, [StepEnd(5, 6), StepEnd(12, 13), StepEnd(20, 21)])
    result = replay(trace, DeerStop(threshold=0.95))
    assert (result.exited, result.answer, result.correct) == (True, "20", True)
    assert result.generated_tokens == 13  # the step end was seen at token 13
    assert result.probe_tokens == 8 and result.tokens_with_probes == 21
    assert replay(trace, DeerStop(threshold=0.999)).exited is False


def test_dynasor_needs_agreeing_answers_without_hesitation():
    rule = DynasorStop(probe_every=8, agree=2)
    assert rule.points_at(16, []) == [16] and rule.points_at(17, [5]) == []  # step ends are not its probes
    probes = [_probe(8, "17"), _probe(16, "20", text=" 20, but wait"), _probe(24, "20"), _probe(32, "20")]
    result = replay(_trace(probes, [], n_tokens=40), rule)
    # 16 and 24 agree but 16 hesitates; 24 and 32 agree cleanly: exit at 32 after four probes.
    assert (result.exit_token, result.generated_tokens, result.probe_tokens) == (32, 32, 16)
    assert replay(_trace(probes, [], n_tokens=30), rule).exited is False  # a probe at the last token is never made


def test_cusum_rule_exits_at_the_alarm_with_that_probes_answer():
    detector = _hand_detector(threshold=1.3)
    probes = [_probe(4, "3", entropy=1.5), _probe(9, "17", entropy=0.5), _probe(15, "20", entropy=0.5)]
    result = replay(_trace(probes, [StepEnd(4, 5), StepEnd(9, 10), StepEnd(15, 16)]), CusumStop(detector=detector))
    assert result.statistic == pytest.approx([0, math.log(2), 2 * math.log(2)])
    assert (result.answer, result.generated_tokens, result.exit_token) == ("20", 16, 15)


def test_vanilla_and_votes():
    result = replay(_trace([_probe(4, "3")], [StepEnd(4, 5)]), StoppingRule(name="vanilla"))
    assert (result.exited, result.probe_tokens, result.generated_tokens) == (False, 0, 30)
    assert majority_vote(["3", "5", "5", None, "3"]) == "3"  # a tie goes to the answer seen first
    assert cusum_weighted_vote(["3", "5", "5"], [4.0, 1.0, 1.5]) == "3"
    assert cusum_weighted_vote(["3", "5", "5"], [0.0, 0.0, 0.0]) == "5"  # no evidence: plain majority


def test_pareto_status():
    baselines = [(35.0, 0.40), (25.0, 0.35)]
    assert pareto_status((30.0, 0.30), baselines) == "behind"
    assert pareto_status((30.0, 0.38), baselines) == "on"
    assert pareto_status((24.0, 0.36), baselines) == "beyond"
    methods = [dict(name="vanilla", accuracy=0.20, mean_generated_tokens=34.0, mean_tokens_with_probes=34.0),
               dict(name="cusum h=1", accuracy=0.20, mean_generated_tokens=27.0, mean_tokens_with_probes=37.0),
               dict(name="deer", accuracy=0.15, mean_generated_tokens=22.0, mean_tokens_with_probes=31.0),
               dict(name="dynasor", accuracy=0.10, mean_generated_tokens=27.0, mean_tokens_with_probes=48.0)]
    assert pareto_table(methods) == {"cusum h=1": {
        "vs_deer_dynasor": {"generated": "beyond", "with_probes": "beyond"},  # it beats Dynasor outright
        "vs_all_baselines": {"generated": "beyond", "with_probes": "behind"}}}  # vanilla wins once probes count


# --------------------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny():
    from probes.engine import Engine

    return Engine.from_id("tiny-random:llama")


def test_probes_via_fork_equal_probes_from_scratch(tiny):
    family = cot_family_for(tiny)
    messages = one_shot_messages(load_task("arith", 1)[0])
    prompt_ids = tiny.encode(messages, chat=True)
    token_ids = [r.token_id for r in tiny.generate(messages, max_new_tokens=10, top_k=0)]
    probes = probe_positions(tiny, prompt_ids, token_ids, [3, 7, 10], family)
    suffix_ids = tiny.encode(family.answer_suffix, add_special_tokens=False)
    for b, probe in probes.items():
        scratch = list(tiny.generate(prompt_ids + token_ids[:b] + suffix_ids, max_new_tokens=family.answer_max_tokens,
                                     stop=family.answer_stop, top_k=0))
        expected = Probe.from_records(scratch, b, len(suffix_ids), tiny.eos_ids())
        assert probe.answer_text == expected.answer_text
        assert probe.entropies == pytest.approx(expected.entropies, abs=1e-4)
        assert probe.tokens_computed == len(suffix_ids) + len(scratch)  # the prefix is never recomputed


def test_live_exits_equal_replayed_exits(tiny):
    family = cot_family_for(tiny)
    problems = load_task("arith", 1, seed=5)
    rules = [CusumStop(detector=_hand_detector(0.5)), DeerStop(threshold=0.3), DynasorStop(probe_every=4, agree=2)]
    traces = probe_traces(tiny, problems[:1], family, rules, max_new_tokens=12)
    for rule in rules:
        live = run_with_rule(tiny, problems[0], rule, family=family, max_new_tokens=12)
        replayed = replay(traces[0], rule)
        assert (live.generated_tokens, live.probe_tokens, live.answer, live.exit_token) == (
            replayed.generated_tokens, replayed.probe_tokens, replayed.answer, replayed.exit_token)
        assert [p.answer_text for p in live.probes] == [p.answer_text for p in replayed.probes]
    early = generate_with_early_exit(tiny, problems[0], _hand_detector(0.5), family=family, max_new_tokens=12)
    assert early.method.startswith("cusum") and early.generated_tokens <= 12


def test_trace_analysis_moves_the_exit_with_h(tiny):
    from app.figures.cot_entropy import FIGURES, exit_at

    analysis = analyze_trace(tiny, load_task("arith", 1)[0], _hand_detector(0.5), max_new_tokens=12)
    d = analysis.to_dict()
    assert len(d["statistic"]) == len(d["step_probe_entropies"]) == len(d["log_ratios"])
    assert exit_at(d, 1e9) == (None, None) and analysis.redundant_tail(1e9) == 0
    if analysis.alarm_at() is not None:
        assert analysis.redundant_tail() == analysis.trace.n_tokens - analysis.exit_token_at()
    for name in ("cot_entropy_curve", "cot_cusum", "cot_answer_strip"):
        assert FIGURES[name](d).data
    assert FIGURES["cot_calibration"](_hand_detector(0.5)).data


def _cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.mark.filterwarnings("ignore:calibration gave")  # random weights never settle on an answer
def test_cot_exit_command_chooses_on_development_and_runs_once_on_evaluation():
    result = CliRunner().invoke(_cli(), ["eval", "cot-exit", "--model", "tiny-random:llama", "--n", "4",
                                         "--n-calibration", "2", "--n-dev", "3", "--h", "0.5,2", "--deer", "0.5,0.9",
                                         "--dynasor", "4:2,8:2", "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [m["name"] for m in report["methods"]] == ["vanilla", "cusum", "deer", "dynasor"]
    # the splits are disjoint and of the sizes asked for
    ids = report["splits"]["ids"]
    assert {k: len(v) for k, v in ids.items()} == {"calibration": 2, "development": 3, "evaluation": 4}
    assert not set(ids["calibration"]) & set(ids["development"]) and not set(ids["development"]) & set(ids["evaluation"])
    # every grid is measured on development, and the evaluation runs each method at its chosen setting
    choices = report["choices"]
    assert [r["setting"] for r in choices["cusum"]["grid"]] == [0.5, 2.0]
    assert [r["setting"] for r in choices["deer"]["grid"]] == [0.5, 0.9]
    assert [r["setting"] for r in choices["dynasor"]["grid"]] == [[4, 2], [8, 2]]
    assert all(row["n"] == 3 for c in ("cusum", "deer", "dynasor") for row in choices[c]["grid"])
    assert choices["density"]["name"] == "bandwidth" and len(choices["density"]["grid"]) == 5
    methods = {m["name"]: m for m in report["methods"]}
    assert methods["cusum"]["params"]["h"] == choices["cusum"]["chosen"]
    assert methods["deer"]["params"]["threshold"] == choices["deer"]["chosen"]
    assert [methods["dynasor"]["params"][k] for k in ("every", "agree")] == choices["dynasor"]["chosen"]
    vanilla = methods["vanilla"]
    assert vanilla["mean_probe_tokens"] == 0 and vanilla["exit_rate"] == 0 and vanilla["vs_vanilla"] is None
    by_id = {row["id"]: row for row in vanilla["per_problem"]}
    assert list(by_id) == ids["evaluation"]
    for m in report["methods"]:
        ci = m["accuracy_ci"]
        assert ci["n"] == 4 and ci["estimate"] == m["accuracy"] == np.mean([r["correct"] for r in m["per_problem"]])
        assert ci["low"] <= ci["estimate"] <= ci["high"]
        assert m["generated_tokens_ci"]["estimate"] == pytest.approx(m["mean_generated_tokens"])
        for row in m["per_problem"]:  # an exit only truncates the same greedy trace
            assert row["generated"] <= by_id[row["id"]]["generated"]
        if m["name"] != "vanilla":
            test = m["vs_vanilla"]["accuracy"]
            discordant = sum(r["correct"] != by_id[r["id"]]["correct"] for r in m["per_problem"])
            assert test["test"] == "exact McNemar" and test["gains"] + test["losses"] == discordant
            assert test["verdict"].startswith("n = 4 cannot tell these apart")
            shorter = sum(r["generated"] < by_id[r["id"]]["generated"] for r in m["per_problem"])
            assert m["vs_vanilla"]["tokens"]["generated"][0]["gains"] == shorter
    assert report["provenance"]["model"] == "tiny-random:llama" and report["provenance"]["seed"] == 0
    assert report["provenance"]["command"] == "eval cot-exit"
    from app.figures.cot_entropy import pareto_figure

    assert len(pareto_figure(report, measure="with_probes").data) == 4


@pytest.mark.filterwarnings("ignore:calibration gave")  # random weights never settle on an answer
def test_cot_vote_command_end_to_end_on_tiny_model():
    result = CliRunner().invoke(_cli(), ["eval", "cot-vote", "--model", "tiny-random:llama", "--n", "2",
                                         "--n-calibration", "2", "--samples", "3", "--max-new-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["samples"] == 3 and len(report["per_problem"]) == 2
    assert all(len(row["answers"]) == len(row["weights"]) == 3 for row in report["per_problem"])
    majority = [row["majority"] for row in report["per_problem"]]
    assert report["intervals"]["majority"]["estimate"] == report["majority_accuracy"]
    assert report["weighted_vs_majority"]["test"] == "exact McNemar" and report["provenance"]["command"] == "eval cot-vote"
    assert all(m is None or any(m == a for a in row["answers"]) for m, row in zip(majority, report["per_problem"]))
    from app.figures.cot_entropy import voting_figure

    assert voting_figure(report).data


def test_threshold_option_parsing():
    from analyses.cot_entropy.cli import parse_dynasor

    assert parse_thresholds(["1,2", "4"]) == [1.0, 2.0, 4.0]
    with pytest.raises(BadInputError):
        parse_thresholds(["one"])
    assert parse_dynasor(["8:2,16:3", "4:2"]) == [(8, 2), (16, 3), (4, 2)]
    with pytest.raises(BadInputError, match="k:m"):
        parse_dynasor(["8"])


def test_bench_cusum_overhead_runs(tiny):
    row = bench_cusum_overhead(tiny, max_new_tokens=8, repeats=1)
    assert row["bench"] == "cusum_overhead"
    assert row["ratio"] == pytest.approx(row["instrumented_s_per_token"] / row["plain_s_per_token"])
    # one probe per step end of an 8-token trace: each probe costs its suffix and its (at most 3) answer tokens
    suffix = len(tiny.encode(cot_family_for(tiny).answer_suffix, add_special_tokens=False))
    assert row["probes"] * (suffix + 1) <= row["probe_tokens"] <= row["probes"] * (suffix + 3)


# --------------------------------------------------------------------------- the embedded model


@pytest.mark.model
def test_cot_exit_on_the_embedded_model():
    result = CliRunner().invoke(_cli(), ["eval", "cot-exit", "--model", "smollm2-135m", "--n", "4",
                                         "--n-calibration", "4", "--n-dev", "4", "--h", "1,2", "--max-new-tokens", "64",
                                         "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    vanilla = report["methods"][0]
    # The one-shot prompt makes SmolLM2 end with "The answer is N.": a short trace with a numeric answer.
    assert 10 <= vanilla["mean_generated_tokens"] < 64
    assert all(row["answer"] is not None for row in vanilla["per_problem"])
    assert report["detector"]["n_uncertain"] + report["detector"]["n_confident"] > 0


@pytest.mark.model
def test_embedded_model_probes_read_numbers():
    from probes.engine import Engine

    engine = Engine.from_id("smollm2-135m")
    problem = load_task("arith", 1)[0]
    analysis = analyze_trace(engine, problem, _hand_detector(1.0), max_new_tokens=64)
    assert analysis.step_probes, "SmolLM2's trace should hold at least one sentence end before its last"
    assert all(p.answer is not None and p.answer.lstrip("-").isdigit() for p in analysis.step_probes)


# --------------------------------------------------------------------------- the organism's settling step


def test_settling_delay_by_hand():
    from analyses.cot_entropy.settling import SettlingRow, settling_row, summarise_delays

    detector = _hand_detector(threshold=1.3)  # Z = +log 2 below 1 nat, -log 2 above
    # S = 0, 0, l, 2l = 1.39 >= 1.3 at step 3; the trace settles at step 2: one step late
    row = settling_row("p", [1.5, 1.5, 0.5, 0.5, 0.5], settle_step=2, detector=detector)
    assert row.alarm_step == 3 and row.delay == 1 and row.statistic == pytest.approx([0, 0, 0.6931, 1.3863, 2.0794],
                                                                                      abs=1e-4)
    # a NaN probe (nothing decoded) leaves the statistic where it was
    assert settling_row("q", [0.5, float("nan"), 0.5], 0, detector).statistic == pytest.approx([0.6931, 0.6931, 1.3863],
                                                                                            abs=1e-4)
    rows = [SettlingRow("a", 2, 5, 2, []), SettlingRow("b", 2, 5, 5, []), SettlingRow("c", 3, 5, 1, []),
            SettlingRow("d", 1, 3, None, [])]
    s = summarise_delays(rows, bound=2)
    # delays 0, 3, -2, none: one on time (0..2), one false alarm, one miss
    assert s["delay_counts"] == {"-2": 1, "0": 1, "3": 1} and s["no_alarm"] == 1
    assert (s["within_bound"]["estimate"], s["false_alarm_rate"]["estimate"], s["miss_rate"]["estimate"]) == (
        0.25, 0.25, 0.25)
    assert s["mean_delay_when_not_early"]["estimate"] == 1.5


@pytest.fixture(scope="module")
def organism():
    import torch

    from probes.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a width-64 model gains nothing from a second thread on a busy machine
    try:
        yield Engine.from_id("toy-reasoner:small")  # trained once (under a minute) and cached on first use
    finally:
        torch.set_num_threads(threads)


@pytest.mark.model
def test_the_cusum_alarm_lands_near_the_organisms_settling_step(organism):
    from analyses.cot_entropy.settling import evaluate_settling

    report = evaluate_settling(organism, None, n=40, n_calibration=30, n_dev=30, bound=2)
    s = report.summary
    assert report.task == "toy-reasoner:small" and s["n"] == 40
    # planted traces, teacher-forced: the probes before the settling step are unsure, after it sure
    assert s["within_bound"]["estimate"] >= 0.55, s  # most alarms land 0-2 steps after the settling step
    assert s["false_alarm_rate"]["estimate"] <= 0.3, s  # mostly at a planted wrong step the model is sure of
    delays = [r.delay for r in report.rows if r.delay is not None]
    assert delays.count(0) > len(report.rows) / 2  # the commonest alarm: the end of the settling step itself
    d = report.to_dict()
    assert [row["setting"] for row in d["choices"]["cusum"]["grid"]] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert d["provenance"]["command"] == "eval cot-settling"


def test_fit_detector_reports_progress_per_trace_and_matches_one_call():
    """A page's progress callback sees every trace; the fitted densities do not depend on it."""
    from analyses.cot_entropy import calibration_summary, fit_detector
    from analyses.tasks import load_task
    from probes import Engine

    engine = Engine.from_id("tiny-random:llama")
    problems = load_task("arith", 5, seed=3)
    family = cot_family_for(engine)
    seen: list[tuple[int, int]] = []
    batched, traces = fit_detector(engine, problems, family, max_new_tokens=12, batch_size=2,
                                   on_progress=lambda done, total: seen.append((done, total)))
    whole, _ = fit_detector(engine, problems, family, max_new_tokens=12, batch_size=2)
    # every trace is reported once it is done; between those, the same counts repeat after each decoding step
    # and before each probe (where a job's Stop takes effect)
    changes = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    assert changes == [(0, 5), (1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    assert len(seen) > len(changes)
    assert batched.to_dict() == whole.to_dict()
    summary = calibration_summary(traces)
    assert summary["steps"] == sum(len(t.calibration().entropies) for t in traces)
    assert summary["accuracy"] == np.mean([t.final_answer == p.answer for t, p in zip(traces, problems)])
