"""`python -m benchmarks.gpu` (issue 26 item 5): what it would run on a GPU, and its refusal without one.

The run itself needs CUDA (none here); these tests check the plan it follows and that it refuses
cleanly, before loading any model, where torch sees no GPU.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu


def test_without_cuda_it_refuses_with_one_line_and_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "run", lambda *a, **k: pytest.fail("no benchmark may start without CUDA"))
    assert gpu.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("benchmarks.gpu: benchmarks.gpu needs a CUDA GPU and torch.cuda.is_available() is False")
    assert "python -m benchmarks` for the CPU ratios" in err and err.count("\n") == 1


def test_an_unknown_group_is_refused_by_name(capsys):
    assert gpu.main(["--groups", "hooks,gpus"]) == 2
    assert capsys.readouterr().err == "benchmarks.gpu: unknown group(s) gpus; groups: hooks, server, validation\n"


def test_the_plan_covers_hooks_server_and_validator_per_model_and_the_split_with_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    steps = [(g, m, b) for g, m, b, _ in gpu.plan(["smollm2-135m", "toy-moe"], gpu.GROUPS)]
    per_model = ["capture_forward", "stream_generate", "steer_generate", "fork_probe", "ndif_local_overhead",
                 "validate_s", "server_stream", "server_fork_probe"]
    groups = ["hooks"] * 5 + ["validation"] + ["server"] * 2
    assert steps == [(g, m, b) for m in ("smollm2-135m", "toy-moe") for g, b in zip(groups, per_model)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [(g, m, b) for g, m, b, _ in gpu.plan(["toy-moe"], ["server"])] == [
        ("server", "toy-moe", "server_stream"), ("server", "toy-moe", "server_fork_probe"),
        ("sharded", "toy-moe", "sharded_2gpu_exact")]
