"""Evaluation sweeps on Ray model replicas (analyses.distributed, issue 26 item 3).

The evaluations split their work into batches whose results depend only on the batch and its seed;
`RayRunner.map` runs those batches on replicas (Ray actors, one model each), so a sweep with
`runner=` gives exactly the serial report, and a replica killed mid-run loses no problem. One
local Ray cluster (2 CPUs) and one pair of replicas serve the whole module: each start costs seconds.
"""

from __future__ import annotations

import socket

import pytest

from analyses.cot_entropy import evaluate_cot_exit
from analyses.cot_entropy.rules import StoppingRule, probe_traces
from analyses.distributed import RayRunner
from analyses.distributed.options import ray_runner
from analyses.families import family_for
from analyses.moe_router.evaluate import ExpertSetting, evaluate_expert_sample
from analyses.tasks import load_splits
from thoughtscope.errors import BadInputError, ClusterError

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'thoughtscope[ray]', installed by make setup)")

MODEL = "tiny-random:qwen3_moe"  # both evaluations run on it: one pair of replicas for the module


def without_timings(value):
    """A report's dict without what differs between any two runs: wall times and the provenance's clock."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items()
                if k not in ("seconds", "tokens_per_second", "created")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- bad input: these need no cluster


def test_an_unreachable_cluster_address_is_a_clear_error_not_a_hang():
    started = ray.is_initialized()  # (a cluster this process already holds does not hide a wrong address)
    runner = RayRunner(MODEL, address=f"127.0.0.1:{free_port()}", replicas=2, connect_timeout_s=1.0)
    with pytest.raises(ClusterError, match=r"no Ray cluster answered at 127\.0\.0\.1:\d+ within 1 s.*ray start --head"):
        runner.start()
    assert ray.is_initialized() == started  # nothing was started for it
    with pytest.raises(BadInputError, match="--ray takes auto or a cluster address"):
        RayRunner(MODEL, address="head:port").start()


def test_ray_options_without_a_model_replica_to_hold_are_refused():
    with pytest.raises(BadInputError, match="--replicas needs --ray"):
        ray_runner(MODEL, None, None, 2)
    with pytest.raises(BadInputError, match="give --model, not --server"):
        ray_runner(MODEL, "http://127.0.0.1:1", "auto", 2)
    with pytest.raises(BadInputError, match="--replicas must be an integer >= 1 or None, got 0"):
        RayRunner(MODEL, replicas=0)


def test_both_eval_commands_take_the_ray_options_and_check_them_before_loading_a_model():
    from typer.testing import CliRunner

    from thoughtscope import cli as cli_module

    app = cli_module.build()
    for command in ("cot-exit", "expert-sample"):
        result = CliRunner().invoke(app, ["eval", command, "--model", MODEL, "--replicas", "2"])
        assert isinstance(result.exception, BadInputError), result.output
        assert str(result.exception) == "--replicas needs --ray (auto or a cluster address)"
        result = CliRunner().invoke(app, ["eval", command, "--server", "http://127.0.0.1:1", "--ray", "auto"])
        assert "give --model, not --server" in str(result.exception)


# ----- one local cluster, one pair of replicas


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(cluster):
    """Two replicas of one torch thread each; the serial runs here use one thread too (CPU float sums depend
    on the thread count, so "identical" holds between runs at the same count)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with RayRunner(MODEL, replicas=2, threads=1) as runner:
        yield runner
    torch.set_num_threads(threads)


def test_more_replicas_than_the_cluster_holds_is_a_clear_error(cluster):
    with pytest.raises(ClusterError, match=r"3 replica\(s\) of 1 CPU each asked for, but the Ray cluster has room "
                                           r"for 2 now .*give --replicas 2 or fewer"):
        RayRunner(MODEL, replicas=3).start()


def test_cot_exit_on_two_replicas_equals_the_serial_run(moe, replicas):
    kw = dict(max_new_tokens=10, batch_size=2, n_resamples=200)
    serial = evaluate_cot_exit(moe, "arith", 4, 2, 2, **kw)
    seen = []
    sharded = evaluate_cot_exit(moe, "arith", 4, 2, 2, runner=replicas, progress=lambda *a: seen.append(a), **kw)
    assert without_timings(sharded.to_dict()) == without_timings(serial.to_dict())
    assert [m.results for m in sharded.methods] == [m.results for m in serial.methods]
    # one bar per stage, counting problems over both replicas: 2 batches of 2 on evaluation
    assert seen == [("calibration", 2, 2), ("development", 2, 2), ("evaluation", 2, 4), ("evaluation", 4, 4)]
    assert replicas.describe() == {"ray": "auto", "replicas": 2, "threads": 1, "lost_replicas": 0, "reruns": 0}


def test_expert_sample_on_two_replicas_equals_the_serial_run(moe, replicas):
    kw = dict(grid=[ExpertSetting(1, 3, 1.0)], temperatures=[1.0], max_new_tokens=6, batch_rows=2, n_resamples=100)
    serial = evaluate_expert_sample(moe, "arith", n=3, n_dev=2, n_samples=2, **kw)
    sharded = evaluate_expert_sample(moe, "arith", n=3, n_dev=2, n_samples=2, runner=replicas, **kw)
    assert without_timings(sharded.to_dict(per_problem=True)) == without_timings(serial.to_dict(per_problem=True))
    for name, samples in serial.samples.items():
        assert sharded.samples[name].answers == samples.answers
        assert (sharded.samples[name].mean_logprob == samples.mean_logprob).all()


def test_a_replica_killed_mid_run_loses_no_problem(moe, replicas):
    """Kill one replica when the first batch is back: its batch (in flight or next) re-runs on the other."""
    problems = load_splits("arith", 0, 0, 5, seed=3).evaluation
    family, rules = family_for(moe), [StoppingRule(probe_step_ends=True)]
    serial = probe_traces(moe, problems, family, rules, max_new_tokens=8, batch_size=1, seed=3)
    victim = replicas.actors[1]

    def kill_once(done, total):
        if done == 1:
            ray.kill(victim)

    traces = probe_traces(moe, problems, family, rules, max_new_tokens=8, batch_size=1, seed=3, runner=replicas,
                          on_progress=kill_once)
    assert [t.to_dict() for t in traces] == [t.to_dict() for t in serial]
    assert replicas.lost == [victim] and len(replicas.actors) == 1 and victim not in replicas.actors
    assert replicas.reruns >= 1
    assert replicas.describe()["lost_replicas"] == 1
