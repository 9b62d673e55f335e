"""The leaf modules that opened the import circles: what they hold, and that the old names still reach it."""

from __future__ import annotations

import os

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


def test_a_killed_runs_private_cache_is_removed_by_the_next_run_and_a_running_ones_kept(tmp_path):
    import subprocess
    import sys

    from tests.conftest import CACHE_PREFIX, sweep_stale_caches

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # its id now names no process (reaped)
    killed = tmp_path / f"{CACHE_PREFIX}{ended.pid}-k1l2"
    running = tmp_path / f"{CACHE_PREFIX}{os.getpid()}-r3n4"
    other = tmp_path / "thoughtscope-tests-cache-notapid"  # not this scheme's: left alone
    for folder in (killed, running, other):
        (folder / "app").mkdir(parents=True)
    (killed / "models").symlink_to(tmp_path / "users-models")  # the user's models: the link goes, not them
    (tmp_path / "users-models").mkdir()
    (tmp_path / "users-models" / "w.safetensors").write_text("w")
    assert sweep_stale_caches(str(tmp_path)) == [killed.name]
    assert not killed.exists() and running.exists() and other.exists()
    assert (tmp_path / "users-models" / "w.safetensors").read_text() == "w"


def test_a_test_run_uses_a_private_cache_with_the_users_models(tmp_path):
    """tests/conftest.py: a run without THOUGHTSCOPE_CACHE_DIR gets a private cache folder whose `models` is the
    user's; what the run writes elsewhere in the cache never reaches the user's folder, and the private folder
    is gone when the run ends. Here the "user's cache" is a temporary XDG cache home."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "THOUGHTSCOPE_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    script = ("import json, tests.conftest; from probes.paths import user_cache_dir; d = user_cache_dir(); "
              "(d / 'store').mkdir(); (d / 'store' / 'a-trace').write_text('x'); "
              "print(json.dumps([str(d), str((d / 'models').resolve())]))")
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    private, models = json.loads(out.stdout.strip().splitlines()[-1])
    users = tmp_path / "xdg" / "thoughtscope"
    assert Path(private).name.startswith("thoughtscope-tests-cache-") and Path(models) == users / "models"
    assert Path(private).name.split("-")[3].isdigit()  # the creating process's id, for the next run's sweep
    assert not Path(private).exists()  # removed at the end of the run
    assert sorted(p.name for p in users.iterdir()) == ["models"]  # the store went to the private folder only
    # a folder the caller names is used as it is
    named = tmp_path / "named"
    env["THOUGHTSCOPE_CACHE_DIR"] = str(named)
    out = subprocess.run([sys.executable, "-c", "import tests.conftest; from probes.paths import user_cache_dir; "
                          "print(user_cache_dir())"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(named), out.stderr
