"""The benchmark harness runs and reports ratios (on a tiny model: the figures themselves are the README's)."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from probes import bench


def test_each_hook_benchmark_reports_a_positive_ratio(llama):
    rows = [
        bench.bench_capture_forward(llama, repeats=2, tokens=32),
        bench.bench_generate(llama, steer=False, tokens=8, repeats=1),
        bench.bench_generate(llama, steer=True, tokens=8, repeats=1),
        bench.bench_fork_probe(llama, prefix_tokens=128, probe_tokens=16, repeats=2),
    ]
    assert [r["bench"] for r in rows] == ["capture_forward", "stream_generate", "steer_generate", "fork_probe"]
    # each ratio is the ratio of the times (or rates) the row reports beside it, the way the README reads it
    capture, stream, steer, fork = rows
    assert capture["ratio"] == pytest.approx(capture["capture_s"] / capture["plain_s"], rel=0.02)
    for row in (stream, steer):
        assert row["ratio"] == pytest.approx(row["hf_tokens_per_s"] / row["engine_tokens_per_s"], rel=0.02)
    assert fork["ratio"] == pytest.approx(fork["fork_s"] / fork["scratch_s"], rel=0.02)
    assert [r["target"] for r in rows] == [1.05, 1.10, 1.10, 2.0]
    for row in rows:
        json.dumps(row)
    assert rows[1]["engine_tokens"] <= 8


def test_bench_cli_prints_one_json_object_per_line(monkeypatch, llama):
    from thoughtscope import cli

    monkeypatch.setitem(bench.BENCHMARKS, "hooks", lambda model: [bench.bench_capture_forward(llama, repeats=1, tokens=16)])
    result = CliRunner().invoke(cli.build(), ["bench", "hooks", "--model", "tiny-random:llama", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert rows[0]["bench"] == "capture_forward" and "device" in rows[0]
