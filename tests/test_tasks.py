"""Task generators, GSM8K loader, answer extraction and pass@k: examples of use with real values."""

from __future__ import annotations

import itertools
import re

import pytest

from analyses.tasks import (
    TASK_NAMES,
    Problem,
    arithmetic_problems,
    cot_prompt,
    extract_answer,
    is_correct,
    load_gsm8k,
    load_task,
    mean_pass_at_k,
    mixed_arithmetic,
    normalize_answer,
    one_shot_messages,
    pass_at_k,
    split_problems,
)
from thoughtscope.errors import BadInputError

# --------------------------------------------------------------------------- arithmetic


def _recompute(problem: Problem) -> int:
    """Read the numbers back out of the question text and redo the sums with the stored ops."""
    numbers = [int(x) for x in re.findall(r"\d+", problem.question)]
    assert numbers == problem.meta["operands"]
    total = numbers[0]
    for op, number in zip(problem.meta["ops"], numbers[1:]):
        total = total + number if op == "+" else total - number
    return total


def test_the_same_seed_gives_the_same_problems_and_another_seed_does_not():
    assert arithmetic_problems(20, steps=1, seed=0) == arithmetic_problems(20, steps=1, seed=0)
    assert arithmetic_problems(20, steps=1, seed=0) != arithmetic_problems(20, steps=1, seed=1)
    # A shorter list is a prefix of a longer one, so growing n keeps earlier problems.
    assert arithmetic_problems(5, steps=2, seed=3) == arithmetic_problems(30, steps=2, seed=3)[:5]


def test_ids_name_the_generator_seed_and_position():
    problems = arithmetic_problems(12, steps=2, seed=4)
    assert problems[7].id == "arith2-s4-0007"
    assert {p.source for p in problems} == {"arith2"}
    assert len({p.id for p in problems}) == len({p.question for p in problems}) == 12


@pytest.mark.parametrize("steps", [1, 2])
def test_every_answer_matches_the_numbers_in_the_question(steps):
    for problem in arithmetic_problems(300, steps=steps, seed=7):
        assert problem.steps == steps
        assert len(problem.meta["ops"]) == steps
        assert problem.answer == str(_recompute(problem))
        assert all(2 <= x <= 50 for x in problem.meta["operands"])
        assert problem.question.endswith("have now?")


def test_subtraction_never_goes_negative_even_when_it_is_the_only_operation():
    for problem in arithmetic_problems(300, steps=2, seed=0, ops=("-",)):
        a, b, c = problem.meta["operands"]
        assert problem.meta["ops"] == ["-", "-"]
        assert a - b >= 1 and a - b - c >= 1
        assert int(problem.answer) == a - b - c


def test_both_operations_appear_and_only_the_chosen_ones():
    ops = {op for p in arithmetic_problems(100, seed=0) for op in p.meta["ops"]}
    assert ops == {"+", "-"}
    assert {op for p in arithmetic_problems(50, seed=0, ops=("+",)) for op in p.meta["ops"]} == {"+"}


def test_a_one_step_problem_reads_like_a_word_problem():
    problem = arithmetic_problems(1, steps=1, seed=0)[0]
    pattern = r"[A-Z][a-z]+ has \d+ [a-z ]+\. (He|She) [^.]+\. How many [a-z ]+ does [A-Z][a-z]+ have now\?"
    assert re.fullmatch(pattern, problem.question)


def test_mixed_arithmetic_holds_both_kinds_and_is_deterministic():
    problems = mixed_arithmetic(60, seed=2)
    assert problems == mixed_arithmetic(60, seed=2)
    assert {p.steps for p in problems} == {1, 2}
    assert {p.source for p in problems} == {"arith1", "arith2"}
    assert all(p.answer == str(_recompute(p)) for p in problems)


def test_problem_round_trips_through_a_dict():
    problem = arithmetic_problems(1, seed=0)[0]
    data = problem.to_dict()
    assert set(data) == {"id", "question", "answer", "source", "steps", "meta"}
    assert Problem.from_dict(data) == problem
    assert hash(problem) == hash(Problem.from_dict(data))


# --------------------------------------------------------------------------- GSM8K


def test_gsm8k_holds_the_whole_test_set_with_clean_answers():
    problems = load_gsm8k()
    assert len(problems) == 1319
    first = problems[0]
    assert (first.id, first.answer, first.source) == ("gsm8k-0000", "18", "gsm8k")
    assert first.question.startswith("Janet")
    assert first.steps == 2
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", p.answer) for p in problems)
    assert all("," not in p.answer for p in problems)


def test_gsm8k_seed_shuffles_but_keeps_ids_and_n_takes_a_prefix():
    shuffled = load_gsm8k(seed=0)
    assert [p.id for p in shuffled] != [p.id for p in load_gsm8k()]
    assert sorted(p.id for p in shuffled) == [p.id for p in load_gsm8k()]
    assert load_gsm8k(10, seed=0) == shuffled[:10]
    assert load_gsm8k(3) == load_gsm8k()[:3]


def test_gsm8k_refuses_more_problems_than_it_has():
    with pytest.raises(BadInputError, match="1319"):
        load_gsm8k(2000)


# --------------------------------------------------------------------------- task registry


@pytest.mark.parametrize("name, sources", [
    ("arith", {"arith1"}),
    ("arith2", {"arith2"}),
    ("arith-mixed", {"arith1", "arith2"}),
    ("gsm8k", {"gsm8k"}),
])
def test_load_task_by_name(name, sources):
    problems = load_task(name, 40, seed=1)
    assert len(problems) == 40
    assert {p.source for p in problems} == sources
    assert load_task(name, 40, seed=1) == problems


def test_an_unknown_task_name_lists_the_valid_ones():
    with pytest.raises(BadInputError) as info:
        load_task("mmlu", 5)
    assert all(name in str(info.value) for name in TASK_NAMES)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_a_bad_count_is_refused(n):
    with pytest.raises(BadInputError):
        load_task("arith", n)


def test_bad_generator_settings_are_refused():
    with pytest.raises(BadInputError):
        arithmetic_problems(5, steps=3)
    with pytest.raises(BadInputError):
        arithmetic_problems(5, ops=("*",))
    with pytest.raises(BadInputError):
        arithmetic_problems(5, ops=())


# --------------------------------------------------------------------------- splits


def test_split_gives_disjoint_parts_that_cover_the_problems():
    problems = load_task("arith-mixed", 50, seed=0)
    calibration, evaluation = split_problems(problems, 0.4, seed=0)
    assert (len(calibration), len(evaluation)) == (20, 30)
    assert not {p.id for p in calibration} & {p.id for p in evaluation}
    assert not {p.question for p in calibration} & {p.question for p in evaluation}
    assert {p.id for p in calibration} | {p.id for p in evaluation} == {p.id for p in problems}
    assert split_problems(problems, 0.4, seed=0) == (calibration, evaluation)
    assert split_problems(problems, 0.4, seed=1) != (calibration, evaluation)


def test_split_by_count_keeps_the_input_order():
    problems = load_task("gsm8k", 12, seed=None)
    calibration, evaluation = split_problems(problems, 5, seed=3)
    assert len(calibration) == 5
    order = [p.id for p in problems]
    assert [p.id for p in calibration] == sorted((p.id for p in calibration), key=order.index)
    assert [p.id for p in evaluation] == sorted((p.id for p in evaluation), key=order.index)


@pytest.mark.parametrize("n_calibration", [0, 10, 1.0, 0.0, "half"])
def test_a_split_that_leaves_a_part_empty_is_refused(n_calibration):
    with pytest.raises(BadInputError):
        split_problems(load_task("arith", 10), n_calibration)


def test_split_refuses_duplicate_problems():
    problem = load_task("arith", 1)[0]
    with pytest.raises(BadInputError, match="duplicate"):
        split_problems([problem, problem, problem], 1)


# --------------------------------------------------------------------------- prompts


def test_one_shot_messages_show_a_worked_example_before_the_problem():
    problem = load_task("arith", 1)[0]
    messages = one_shot_messages(problem)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "The answer is N" in messages[0]["content"]
    assert messages[2]["content"].endswith("The answer is 17.")
    assert extract_answer(messages[2]["content"]) == "17"
    assert messages[3]["content"] == problem.question


def test_two_step_problems_get_a_two_step_example():
    one_step = one_shot_messages(load_task("arith", 1)[0])
    two_step = one_shot_messages(load_task("arith2", 1)[0])
    assert one_step[1] != two_step[1]
    assert two_step[2]["content"].count("=") == 2


def test_cot_prompt_asks_to_think_step_by_step():
    problem = load_task("gsm8k", 1, seed=None)[0]
    prompt = cot_prompt(problem)
    assert prompt.startswith("Question: Janet")
    assert prompt.endswith("Answer: Let's think step by step.")
    with pytest.raises(BadInputError):
        cot_prompt("   ")


# --------------------------------------------------------------------------- answers


@pytest.mark.parametrize("text, expected", [
    ("The answer is 1,234.", "1234"),
    ("\\boxed{42}", "42"),
    ("so the result is \\boxed{\\$42}", "42"),
    ("#### 7", "7"),
    ("so 3.50 dollars", "3.5"),
    ("He has 18.0 apples", "18"),
    ("The answer is $18.", "18"),
    ("The answer is **25**.", "25"),
    ("Answer: -3", "-3"),
    ("The temperature is -3 degrees.", "-3"),
    ("16 - 3 - 4 = 9 eggs, and 9 * 2 = 18", "18"),
    ("5-3", "3"),
    ("10 - 4", "4"),
    ("It costs $ 12", "12"),
    # The first explicit answer wins over numbers the model rambles on with afterwards.
    ("9 + 8 = 17. The answer is 17. Question: Tom has 4 cats", "17"),
    # A marker beats a later bare number.
    ("#### 12\nThat took 3 steps.", "12"),
    ("I am not sure.", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("value, expected", [
    ("1,000,000", "1000000"), ("$5", "5"), ("7.", "7"), ("0.50", "0.5"), ("-0", "0"),
    (12, "12"), (2.0, "2"), ("abc", None),
])
def test_normalize_answer(value, expected):
    assert normalize_answer(value) == expected


def test_is_correct_compares_numbers_by_value():
    problem = load_gsm8k(1)[0]
    assert is_correct("She makes 9 * 2 = $18 a day. The answer is 18.", problem)
    assert is_correct("The answer is 18.00", "18")
    assert is_correct("18", problem)
    assert is_correct(18, "18.0")
    assert not is_correct("The answer is 9.", problem)
    assert not is_correct("I don't know", problem)
    assert not is_correct(None, problem)


def test_generated_answers_score_as_correct_against_their_own_problem():
    for problem in load_task("arith-mixed", 50):
        assert is_correct(f"The answer is {problem.answer}.", problem)
        assert not is_correct(f"The answer is {int(problem.answer) + 1}.", problem)


# --------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),
    (5, 2, 2, 0.7),
    (5, 0, 3, 0.0),
    (5, 4, 2, 1.0),   # n - c < k: every pair holds a correct sample
    (5, 5, 5, 1.0),
    (10, 3, 1, 0.3),  # pass@1 is the fraction correct
])
def test_pass_at_k_hand_worked(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _pass_at_k_by_counting(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_counting():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_counting(n, c, k), abs=1e-12)


def test_pass_at_k_stays_finite_for_many_samples():
    # C(1000, 500) overflows a float; the product form does not.
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert 0.0 < pass_at_k(10_000, 3, 10) < 1.0


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (0, 0, 1), (5.0, 2, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(BadInputError):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_averages_over_problems():
    assert mean_pass_at_k([(5, 2), (5, 0), (5, 5)], k=2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    with pytest.raises(BadInputError):
        mean_pass_at_k([], k=1)


# --------------------------------------------------------------------------- the organism's task and the splits


def test_the_organism_task_draws_from_its_generators_own_disjoint_splits():
    from analyses.families import default_task, family_for, task_prompt
    from analyses.tasks import load_splits

    splits = load_splits("toy-reasoner:small", 20, 20, 30, seed=0)
    assert splits.sizes() == {"calibration": 20, "development": 20, "evaluation": 30}
    questions = [{p.question for p in part} for part in splits]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    assert [p.meta["split"] for p in splits.evaluation] == ["eval"] * 30
    for p in splits.calibration:  # each problem carries its planted trace; the answer is left-to-right arithmetic
        tokens = p.question.split()
        value = int(tokens[0])
        for op, b in zip(tokens[1:-2:2], tokens[2:-2:2]):
            value = value + int(b) if op == "+" else value - int(b)
        assert p.answer == str(value) and p.meta["trace"].endswith(f"So the answer is {value} .")
        assert is_correct(p.meta["trace"], p)
    assert load_task("toy-reasoner:small", 5, split="eval") == splits.evaluation[:5]  # a prefix, seeded
    family = family_for("toy-reasoner:small")
    assert (family.step_delimiter, family.answer_suffix, family.labeller) == (";", " So the answer is", "toy-reasoner")
    assert task_prompt(splits.evaluation[0], family) == ([{"role": "user", "content": splits.evaluation[0].question}],
                                                         True)
    assert default_task("toy-reasoner:small") == "toy-reasoner:small" and default_task("toy-reasoner") == "toy-reasoner"
    assert default_task("smollm2-135m") == "arith"


def test_load_splits_cuts_a_pool_three_ways_for_the_other_tasks():
    from analyses.tasks import load_splits

    splits = load_splits("arith", 3, 4, 5, seed=2)
    pool = load_task("arith", 12, seed=2)
    assert sorted(p.id for part in splits for p in part) == sorted(p.id for p in pool)
    assert splits.to_dict()["sizes"] == {"calibration": 3, "development": 4, "evaluation": 5}
    with pytest.raises(BadInputError):
        load_task("toy-reasoner:tiny", 1)


# --------------------------------------------------------------------------- a problem file of the user's


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_a_problem_file_reads_like_gsm8k_and_is_named_by_its_content(tmp_path):
    """A copy of the shipped GSM8K test set as a problem file gives the same problems, in the same seeded order,
    as the `gsm8k` task; the command line's name for it carries the file's digest."""
    import hashlib
    from importlib.resources import files

    from analyses.tasks import DIGEST_MARK, GSM8K_FILE, canonical_task, load_task, task_size

    data = files("analyses.data").joinpath(GSM8K_FILE).read_bytes()
    path = tmp_path / "mine.jsonl"
    path.write_bytes(data)
    name = canonical_task(str(path))
    assert name == f"{path}{DIGEST_MARK}{hashlib.sha256(data).hexdigest()[:12]}" and canonical_task("arith") == "arith"
    mine, shipped = load_task(name, 7, seed=3), load_task("gsm8k", 7, seed=3)
    assert [(p.question, p.answer, p.steps) for p in mine] == [(p.question, p.answer, p.steps) for p in shipped]
    assert [p.id.replace("mine-", "gsm8k-") for p in mine] == [p.id for p in shipped]
    assert task_size(name) == task_size("gsm8k") == 1319


def test_plain_numeric_answers_and_a_changed_file(tmp_path):
    from analyses.tasks import canonical_task, is_correct, load_task

    path = _write(tmp_path / "two.jsonl", ['{"question": "What is 2 + 3?", "answer": 5}', "",
                                           '{"question": "Half of 9?", "answer": "4.5"}'])
    name = canonical_task(path)
    problems = load_task(name, 2, seed=None)
    assert [(p.id, p.answer, p.steps, p.source) for p in problems] == [("two-0000", "5", 1, "two"),
                                                                        ("two-0001", "4.5", 1, "two")]
    assert is_correct("so the answer is 4.50", problems[1])
    _write(tmp_path / "two.jsonl", ['{"question": "What is 2 + 3?", "answer": 6}'])
    with pytest.raises(BadInputError, match="has changed since this run was set up"):
        load_task(name, 1)  # a run keyed by the old content never reads the new one
    assert load_task(canonical_task(path), 1)[0].answer == "6"


@pytest.mark.parametrize("lines, says", [
    (['{"question": "a?", "answer": 1}', "{not json"], r"line 2 is not JSON"),
    (['{"answer": 1}'], r'line 1: each line is an object with a "question"'),
    (['["a?", 1]'], r'line 1: each line is an object'),
    (['{"question": "a?", "answer": "Paris"}'], r"line 1: the answer 'Paris' is not a number"),
    (['{"question": "a?", "answer": null}'], r'line 1: "answer" is a number or text'),
    (['{"question": "a?", "answer": true}'], r'line 1: "answer" is a number or text'),
    (["", "  "], r"holds no problem"),
])
def test_a_malformed_problem_file_is_refused_with_its_line(tmp_path, lines, says):
    from analyses.tasks import canonical_task

    with pytest.raises(BadInputError, match=says):
        canonical_task(_write(tmp_path / "bad.jsonl", lines))


def test_a_missing_binary_or_short_problem_file_is_a_clear_error(tmp_path):
    from analyses.tasks import canonical_task, load_task

    with pytest.raises(BadInputError, match="no problem file"):
        canonical_task(str(tmp_path / "absent.jsonl"))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(BadInputError, match="not UTF-8"):
        canonical_task(str(tmp_path / "bin.jsonl"))
    one = _write(tmp_path / "one.jsonl", ['{"question": "a?", "answer": 1}'])
    with pytest.raises(BadInputError, match="holds 1 problems; ask for at most that many"):
        load_task(canonical_task(one), 2)


def test_the_command_line_takes_a_problem_file_and_refuses_a_bad_one_before_the_model(tmp_path, monkeypatch, capsys):
    """`--task FILE.jsonl` on the methods' commands: RISE harvests the file's questions; a malformed file is
    refused by the option itself, naming the line, before any model loads."""
    import json

    from typer.testing import CliRunner

    from thoughtscope import cli as cli_module

    questions = [f"Tom has {k} apples. He buys 2 more. How many apples does Tom have now?" for k in range(3, 9)]
    path = _write(tmp_path / "apples.jsonl", [json.dumps({"question": q, "answer": k + 2})
                                              for q, k in zip(questions, range(3, 9))])
    app = cli_module.build()
    result = CliRunner().invoke(app, ["rise", "harvest", "--model", "tiny-random:llama", "--task", path, "--n", "4",
                                      "--max-new-tokens", "8", "--store", str(tmp_path / "store"), "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["n_traces"] == 4
    bad = _write(tmp_path / "bad.jsonl", ['{"question": "a?", "answer": "many"}'])
    monkeypatch.setattr("sys.argv", ["thoughtscope", "rise", "harvest", "--model", "no-such-model", "--task", bad])
    with pytest.raises(SystemExit):
        cli_module.main()
    err = " ".join(capsys.readouterr().err.split())
    assert "line 1: the answer 'many' is not a number" in err and "no-such-model" not in err  # rich wraps the path


def test_an_uploaded_problem_file_is_kept_once_under_its_digest_and_a_bad_one_not_at_all(tmp_path):
    from analyses.tasks import load_task, store_problem_file

    data = b'{"question": "What is 1 + 1?", "answer": 2}\n{"question": "What is 2 + 2?", "answer": 4}\n'
    name = store_problem_file(data, "../My Sums.jsonl", folder=tmp_path)
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith("My_Sums-") and kept.read_bytes() == data and name == f"{kept}#sha256={kept.stem[-12:]}"
    assert store_problem_file(data, "../My Sums.jsonl", folder=tmp_path) == name  # the same bytes: the same task
    assert [p.answer for p in load_task(name, 2, seed=None)] == ["2", "4"]
    with pytest.raises(BadInputError, match="more.jsonl line 3 is not JSON"):
        store_problem_file(data + b"{oops\n", "more.jsonl", folder=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]  # nothing kept of the malformed file


def test_a_figure_title_names_a_problem_file_by_its_file_name():
    from analyses.tasks import task_label

    assert task_label("/home/me/.cache/problems/six-e2953bbe3166.jsonl#sha256=e2953bbe3166") == "six-e2953bbe3166.jsonl"
    assert task_label("runs/mine.jsonl#sha256=e2953bbe3166") == "mine.jsonl (sha256 e2953bbe3166)"
    assert task_label("runs/mine.jsonl") == "mine.jsonl"
    assert task_label("gsm8k") == "gsm8k"
