"""The leaf modules that opened the import circles: what they hold, and that the old names still reach it."""

from __future__ import annotations

import pytest

from analyses import evaluation, organism, problem, tasks
from probes import paths, sampling, timing
from thoughtscope.errors import BadInputError


def test_problem_lives_in_a_leaf_and_tasks_and_organism_share_it():
    assert tasks.Problem is problem.Problem and organism.Problem is problem.Problem
    p = problem.Problem("q1", "What is 2 + 3?", "5", "arith", 1, meta={"operands": [2, 3]})
    assert problem.Problem.from_dict(p.to_dict()) == p
    assert p.to_dict() == {"id": "q1", "question": "What is 2 + 3?", "answer": "5", "source": "arith", "steps": 1,
                           "meta": {"operands": [2, 3]}}


def test_pass_at_k_moved_to_the_evaluation_protocol():
    assert tasks.pass_at_k is evaluation.pass_at_k and tasks.mean_pass_at_k is evaluation.mean_pass_at_k
    assert evaluation.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert evaluation.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert evaluation.mean_pass_at_k([(5, 2), (5, 0)], k=1) == pytest.approx(0.2)
    with pytest.raises(BadInputError, match=r"^pass@k's k must be an integer, got 1.0$"):
        evaluation.pass_at_k(5, 2, 1.0)


def test_timing_rounds_to_significant_digits_and_alternates():
    assert timing.sig(0.000123456) == 0.0001235
    assert timing.sig(1234.5678, 3) == 1230.0
    calls: list[str] = []
    ta, tb = timing.alternate_pair(lambda: calls.append("a"), lambda: calls.append("b"), repeats=2)
    assert calls == ["a", "b", "a", "b", "a", "b"] and len(ta) == len(tb) == 2  # one warm-up each, then A, B, ...
    calls.clear()
    times = timing.alternate({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, rounds=2)
    assert calls == ["x", "y", "x", "y", "x", "y"] and sorted(times) == ["x", "y"] and len(times["x"]) == 2


def test_sampling_is_one_class_with_its_checks():
    from probes.engine import Sampling

    assert Sampling is sampling.Sampling
    assert Sampling(temperature=0.7, top_p=0.9, top_k=5).describe() == "T=0.7, top_p=0.9, top_k=5"
    assert Sampling().describe() == "greedy"
    with pytest.raises(BadInputError, match=r"^top_p must be a finite number in \(0, 1\], got 0$"):
        Sampling(top_p=0)
    with pytest.raises(BadInputError, match=r"^temperature must be a finite number >= 0 \(0 is greedy\), got -1$"):
        Sampling(temperature=-1)


def test_the_cache_root_comes_from_the_environment(monkeypatch, tmp_path):
    from probes.zoo import user_cache_dir

    assert user_cache_dir is paths.user_cache_dir
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    assert paths.user_cache_dir() == tmp_path
