"""toy-reasoner, the reasoning model organism: its generator's ground truth (unit tier) and the small
trained model end to end through the engine (model tier)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from probes import Engine, Sampling
from probes.toys import reasoner
from probes.toys.reasoner import (
    ANSWER_SUFFIX,
    STEP_DELIMITER,
    ModelConfig,
    TaskConfig,
    behaviour_rates,
    examples,
    extract_answer,
    is_hard,
    label_steps,
    prompt_text,
    step_is_correct,
)
from thoughtscope.errors import BadInputError, UnknownModelError

SMALL = reasoner.task_config("small")


# ----------------------------------------------------------------------------- the generator


def test_same_seed_same_data_and_prefixes_agree():
    a = examples(40, seed=3, split="dev")
    assert [ex.to_dict() for ex in a] == [ex.to_dict() for ex in examples(40, seed=3, split="dev")]
    assert [ex.trace for ex in examples(10, seed=3, split="dev")] == [ex.trace for ex in a[:10]]
    assert [ex.trace for ex in examples(40, seed=4, split="dev")] != [ex.trace for ex in a]


@pytest.mark.parametrize("config", [TaskConfig(), SMALL], ids=["full", "small"])
def test_splits_are_disjoint_by_problem(config):
    keys = {}
    for split in reasoner.SPLITS:
        exs = examples(300, seed=0, split=split, config=config)
        assert {ex.split for ex in exs} == {split}
        keys[split] = {ex.problem.key for ex in exs}
        if split != "train":
            assert len(keys[split]) == 300  # held-out splits never repeat a problem
    splits = list(keys)
    for i, a in enumerate(splits):
        for b in splits[i + 1:]:
            assert not keys[a] & keys[b], (a, b)
    # a different seed draws other problems, still inside the same split
    assert {ex.split for ex in examples(100, seed=9, split="eval", config=config)} == {"eval"}


@pytest.mark.parametrize("config", [TaskConfig(), SMALL], ids=["full", "small"])
def test_labeller_recovers_every_planted_kind(config):
    exs = examples(600, seed=1, split="train", config=config)
    for ex in exs:
        planted = [(s.text, s.kind) for s in ex.steps]
        assert label_steps(ex.trace) == planted
        assert label_steps(ex.text) == planted  # the prompt is skipped
        assert label_steps(ex.trace + " <eos>") == planted
    seen = Counter(s.kind for ex in exs for s in ex.steps)
    assert set(seen) == set(reasoner.KINDS)


def test_spans_and_delimiters_are_exact():
    tok = reasoner.build_tokenizer(TaskConfig())
    assert len(tok(STEP_DELIMITER, add_special_tokens=False)["input_ids"]) == 1
    for ex in examples(100, seed=2, split="calibration"):
        for step in ex.steps:
            assert ex.trace[step.start:step.end] == step.text
            assert step.text.endswith(" " + STEP_DELIMITER)
            assert ex.trace[step.start - 1] == " "
        assert ex.trace.endswith(f"{ANSWER_SUFFIX} {ex.answer} .")
        # every word is one token, so the decoded ids give the text back
        ids = tok(ex.text)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == ex.text


def test_answers_and_each_step_compute_correctly_except_planted_errors():
    for ex in examples(800, seed=5, split="train"):
        value = ex.problem.start
        for op, b in ex.problem.ops:
            value = value + b if op == "+" else value - b
            assert 0 <= value <= 99
        assert ex.answer == ex.problem.answer == value
        assert extract_answer(ex.trace) == str(value)
        for step in ex.steps:
            if step.kind == "redundant" and step.text.startswith(reasoner.RESTATE_PREFIX):
                assert step.text == f"{reasoner.RESTATE_PREFIX} {value} {STEP_DELIMITER}"
                continue
            assert step_is_correct(step.text) is (not step.wrong), step.text
            if step.wrong:  # a dropped or doubled carry
                a, op, b = _operation(step.text)
                assert step.kind == "compute"
                assert step.value - (int(a) + int(b) if op == "+" else int(a) - int(b)) in reasoner.WRONG_OFFSETS
        for prev, step in zip(ex.steps, ex.steps[1:]):
            # a planted error is always rejected at once and redone with the same operation
            if prev.wrong:
                assert step.kind == "backtrack" and _operation(step.text) == _operation(prev.text)
            # a reflection re-checks the step before it, equation and result
            if step.kind == "reflection":
                assert prev.kind in ("compute", "backtrack") and _equation(step.text) == _equation(prev.text)


def _equation(step_text: str) -> list[str]:
    return step_text.split()[-6:]  # "a op b = c ;"


def _operation(step_text: str) -> list[str]:
    return step_text.split()[-6:-3]  # "a op b"


def test_settling_step_fixes_the_answer():
    for ex in examples(800, seed=6, split="train"):
        settle = ex.steps[ex.settle_step]
        assert settle.kind in ("compute", "backtrack") and not settle.wrong
        assert settle.value == ex.answer
        # it completes the last operation: every operation is computed by then, none after it
        done = [s for s in ex.steps[:ex.settle_step + 1] if s.kind in ("compute", "backtrack") and not s.wrong]
        assert len(done) == len(ex.problem.ops)
        assert all(s.kind in ("reflection", "redundant") for s in ex.steps[ex.settle_step + 1:])
        assert sum(s.kind == "redundant" for s in ex.steps) in reasoner.REDUNDANT_COUNTS


def test_hard_steps_are_carries_and_borrows():
    assert is_hard(17, "+", 8) and not is_hard(12, "+", 7)
    assert is_hard(23, "-", 9) and not is_hard(29, "-", 13)
    for ex in examples(300, seed=7, split="train"):
        for step in ex.steps:
            if step.kind in ("compute", "backtrack"):
                a, op, b = step.text.split(" = ")[0].split()[-3:]
                assert step.hard == is_hard(int(a), op, int(b))
        assert ex.hard_steps == [s.index for s in ex.steps if s.hard and s.kind in ("compute", "backtrack")]


def test_planted_rates_depend_on_hardness():
    rates = behaviour_rates([ex.trace for ex in examples(4000, seed=8, split="train")])
    # 95% binomial margins at these counts (~4000 hard and ~5500 easy steps) are about 0.015 / 0.008
    assert abs(rates["reflection_after_hard"] - reasoner.REFLECTION_RATE_HARD) < 0.03
    assert abs(rates["reflection_after_easy"] - reasoner.REFLECTION_RATE_EASY) < 0.02
    assert rates["backtrack_after_wrong"] == 1.0 and rates["backtrack_after_right"] == 0.0
    assert rates["per_trace_other"] == 0.0
    assert abs(rates["per_trace_redundant"] - 1.0) < 0.05  # uniform over 0, 1, 2
    wrong_share = rates["n_wrong"] / (rates["n_wrong"] + rates["n_right"])
    assert 0.1 < wrong_share < 0.2  # between the easy and the hard backtrack rates


def test_labeller_reads_model_like_text():
    text = (" 9 + 8 = 17 ; No , that is wrong . 9 + 8 = 17 ; Wait , let me check : 9 + 8 = 16 ; 17 + 3 = ; "
            "banana ; The result is 20 ; So the answer is 20 . <eos> 1 + 1 = 2 ;")
    assert label_steps(text) == [
        ("9 + 8 = 17 ;", "compute"), ("No , that is wrong . 9 + 8 = 17 ;", "backtrack"),
        ("Wait , let me check : 9 + 8 = 16 ;", "reflection"), ("17 + 3 = ;", "other"), ("banana ;", "other"),
        ("The result is 20 ;", "redundant"),
    ]
    assert label_steps(" 4 + 5 = 9 ; 9 - 2") == [("4 + 5 = 9 ;", "compute")]  # an unfinished step is no step
    assert step_is_correct("Wait , let me check : 9 + 8 = 16 ;") is False
    assert step_is_correct("The result is 20 ;") is None
    assert extract_answer(" 4 + 5 = 9 ; So the answer is") is None
    assert extract_answer(text) == "20"


def test_cut_training_traces_answer_at_once_without_loss_on_the_marker():
    tok = reasoner.build_tokenizer(TaskConfig())
    vocab = tok.get_vocab()
    ex = next(e for e in examples(50, seed=0, split="train") if len(e.steps) >= 4)
    ids, loss = reasoner.training_sequence(ex, vocab, tok.eos_token_id)
    n_prompt = len(ex.prompt.split())
    assert tok.decode(ids) == ex.text + " <eos>"
    assert loss == [False] * n_prompt + [True] * (len(ids) - n_prompt)
    ids, loss = reasoner.training_sequence(ex, vocab, tok.eos_token_id, cut_at=2)
    kept = " ".join(s.text for s in ex.steps[:2])
    assert tok.decode(ids) == f"{ex.prompt} {kept}{ANSWER_SUFFIX} {ex.answer} . <eos>"
    n_marker = len(ANSWER_SUFFIX.split())
    marker_at = n_prompt + len(kept.split())
    assert loss[:n_prompt] == [False] * n_prompt
    assert loss[marker_at:marker_at + n_marker] == [False] * n_marker
    assert all(loss[n_prompt:marker_at]) and all(loss[marker_at + n_marker:])


def test_chat_prompts_render_to_the_organism_prompt():
    tok = reasoner.build_tokenizer(TaskConfig())
    problem = examples(1, seed=0, split="eval")[0].problem
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": problem.question}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == prompt_text(problem)
    assert all(len(tok(str(n), add_special_tokens=False)["input_ids"]) == 1 for n in range(110))


def test_mistakes_raise_errors_that_say_what_to_do():
    with pytest.raises(BadInputError, match="unknown split"):
        examples(3, split="test")
    with pytest.raises(BadInputError, match="holds only"):
        examples(50, split="eval", config=TaskConfig(min_operand=1, max_operand=2, min_ops=2, max_ops=2))
    with pytest.raises(BadInputError, match="non-negative"):
        examples(-1)
    from probes import load_model

    with pytest.raises(UnknownModelError, match="sizes"):
        load_model("toy-reasoner:huge")


# ----------------------------------------------------------------------------- the trained model

# What a model that knew the answer distribution but could not compute would score on held-out
# problems: always answering the commonest training answer. Measured in the test, not assumed.


def _majority_baseline(n_eval: int) -> float:
    train_answers = Counter(ex.answer for ex in examples(3000, seed=0, split="train", config=SMALL))
    commonest = train_answers.most_common(1)[0][0]
    return sum(ex.answer == commonest for ex in examples(n_eval, seed=11, split="eval", config=SMALL)) / n_eval


@pytest.fixture(scope="module")
def organism():
    # A width-64 model gains nothing from a second thread, and on a busy machine two spinning
    # OpenMP threads ran it about ten times slower than one (measured while other jobs ran).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Engine.from_id("toy-reasoner:small")
    finally:
        torch.set_num_threads(threads)


def _texts(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for rec in stream:
        texts[rec.batch_index] = texts.get(rec.batch_index, "") + rec.text
    return texts


@pytest.mark.model
def test_small_organism_reports_itself(organism):
    from probes.toys.common import training_report
    from probes.zoo import list_models

    report = training_report(reasoner.folder_for("small"))
    assert report["steps"] == reasoner.SIZES["small"][0].steps
    # its CPU seconds are in the report (38 on a quiet core); a test never asserts a duration (issue 20)
    assert report["torch_threads"] == 1 and "cpu_seconds" in report
    assert report["greedy_n"] == 200 and report["greedy_accuracy"] > 0.8  # 0.965 when measured
    assert report["planted_rates"]["reflection_after_hard"] > report["planted_rates"]["reflection_after_easy"]
    assert "toy-reasoner" in {row["id"] for row in list_models()}
    assert organism.handle.model.__class__.__name__ == "LlamaForCausalLM"
    assert not list(reasoner.folder_for("small").glob("*.bin"))  # safetensors only


@pytest.mark.model
def test_greedy_traces_parse_and_beat_the_baseline(organism):
    n = 60
    exs = examples(n, seed=11, split="eval", config=SMALL)
    texts = _texts(organism.generate(prompts=[ex.prompt for ex in exs], max_new_tokens=100, top_k=0))
    answers = [extract_answer(texts[b]) for b in range(n)]
    assert sum(a is not None for a in answers) >= 0.95 * n
    steps = [kind for b in range(n) for _, kind in label_steps(texts[b])]
    assert Counter(steps)["other"] <= 0.05 * len(steps)
    accuracy = sum(a == str(ex.answer) for a, ex in zip(answers, exs)) / n
    baseline = _majority_baseline(n)
    assert baseline < 0.15
    assert accuracy > max(0.8, 5 * baseline), (accuracy, baseline)


@pytest.mark.model
def test_behaviours_follow_the_state_they_were_planted_on(organism):
    # Teacher-forced on the generator's traces, at every step end: P(the next step opens with
    # "Wait") after a correct computation, by its hardness (planted 0.6 vs 0.1), and P(it opens with
    # "No") after a planted wrong computation and after a right one (planted 1 vs 0).
    wait, no = organism.tok.convert_tokens_to_ids(["Wait", "No"])
    p_wait: dict[bool, list[float]] = {True: [], False: []}
    p_no: dict[bool, list[float]] = {True: [], False: []}
    for ex in examples(60, seed=12, split="eval", config=SMALL):
        probs = organism.trace(ex.text, capture=["logits"]).activations["logits"].float().softmax(-1)
        n_prompt = len(ex.prompt.split())
        for step in ex.steps:
            end = n_prompt - 1 + len(ex.trace[:step.end].split())  # the step's delimiter token
            if step.kind in ("compute", "backtrack") and not step.wrong:
                p_wait[step.hard].append(float(probs[end, wait]))
            if step.kind == "compute":
                p_no[step.wrong].append(float(probs[end, no]))
    hard, easy = (sum(v) / len(v) for v in (p_wait[True], p_wait[False]))
    after_wrong, after_right = (sum(v) / len(v) for v in (p_no[True], p_no[False]))
    assert min(len(p_wait[True]), len(p_wait[False])) > 50 and len(p_no[True]) > 15
    assert hard > easy + 0.15 and easy < 0.2, (hard, easy)
    assert after_wrong > after_right + 0.4 and after_right < 0.1, (after_wrong, after_right)
    # Sampled (T=1) generations counted by the labeller, as the analyses count them.
    texts = _texts(organism.generate(prompts=[ex.prompt for ex in examples(80, seed=12, split="eval", config=SMALL)],
                                     n_samples=2, max_new_tokens=100, sampling=Sampling(temperature=1.0), seed=0,
                                     top_k=0))
    rates = behaviour_rates(list(texts.values()))
    assert rates["n_hard"] > 50 and rates["n_easy"] > 50
    assert rates["reflection_after_hard"] > rates["reflection_after_easy"] + 0.2, rates
    assert rates["n_wrong"] > 20 and rates["backtrack_after_wrong"] > rates["backtrack_after_right"] + 0.2, rates
    assert rates["per_trace_reflection"] > 0.2 and rates["per_trace_backtrack"] > 0.05


@pytest.mark.model
def test_forced_answer_entropy_is_high_before_the_settling_step_and_low_after(organism):
    before, after = [], []
    for ex in examples(15, seed=13, split="eval", config=SMALL):
        for k in range(len(ex.steps) + 1):
            prefix = ex.trace[:ex.steps[k - 1].end] if k else ""
            # the entropy at the last position is that of the forced answer's (single) token
            entropy = float(organism.trace(ex.prompt + prefix + ANSWER_SUFFIX).entropies[-1])
            (after if k > ex.settle_step else before).append(entropy)
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    assert mean_before > 1.5 and mean_after < 0.6 and mean_before - mean_after > 1.0, (mean_before, mean_after)


@pytest.mark.model
def test_engine_reads_the_organism_like_any_model(organism):
    ex = examples(1, seed=14, split="eval", config=SMALL)[0]
    assert organism.encode(ex.problem.question, chat=True) == organism.encode(ex.prompt)
    records = list(organism.generate(ex.problem.question, chat=True, max_new_tokens=100, capture=["resid_post.1"]))
    assert records[-1].token_id == organism.tok.eos_token_id
    assert records[0].activations["resid_post.1"].shape == (64,)
    text = "".join(r.text for r in records)
    assert extract_answer(text) is not None
    trace = organism.trace(ex.text, capture=["resid_post.0", "resid_post.1"])
    assert trace.activations["resid_post.1"].shape == (len(ex.text.split()), 64)
    assert trace.tokens[-1].strip() == "."
    assert math.isfinite(float(trace.entropies.mean()))


@pytest.mark.model
def test_training_is_seeded_and_deterministic(tmp_path):
    from safetensors.torch import load_file

    micro = ModelConfig(layers=1, width=32, heads=2, mlp=64, steps=6, batch=8, warmup=2, eval_problems=4,
                        rate_problems=2)
    reports = [reasoner.train(tmp_path / name, micro, SMALL, progress=False, label="micro") for name in "ab"]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert reports[0]["steps"] == 6 and reports[0]["greedy_n"] == 4
    assert reports[0]["final_loss"] == reports[1]["final_loss"]


@pytest.mark.model
@pytest.mark.slow
def test_full_organism_reaches_its_targets():
    """The full toy-reasoner (trained once on first use, about 14 CPU-minutes on one thread, then cached):
    its training report, and greedy accuracy and planted behaviours on held-out problems measured here."""
    from probes.toys.common import training_report

    engine = Engine.from_id("toy-reasoner")
    report = training_report(reasoner.folder_for("full"))
    assert report["steps"] == reasoner.SIZES["full"][0].steps and report["torch_threads"] == 1
    assert "cpu_seconds" in report  # reported (830 on one loaded core), never asserted: no timed tests
    rates = report["planted_rates"]
    assert rates["reflection_after_hard"] > 2 * rates["reflection_after_easy"]
    assert rates["backtrack_after_wrong"] > 0.8 > 0.2 > rates["backtrack_after_right"]
    full = reasoner.task_config("full")
    n = 100
    exs = examples(n, seed=21, split="eval", config=full)
    texts = _texts(engine.generate(prompts=[ex.prompt for ex in exs], max_new_tokens=160, top_k=0))
    accuracy = sum(extract_answer(texts[b]) == str(ex.answer) for b, ex in enumerate(exs)) / n
    assert accuracy >= 0.9, accuracy  # 0.987 on 300 eval problems in the training report
    kinds = Counter(kind for b in range(n) for _, kind in label_steps(texts[b]))
    assert kinds["other"] <= 0.05 * sum(kinds.values()) and kinds["reflection"] > 0
