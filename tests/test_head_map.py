"""The RLKV head map (analyses/rlkv/head_map.py): binarised by a sparsity, its KV policy and bytes, worked by
hand; `thoughtscope rlkv map` prints exactly what the page draws from."""

from __future__ import annotations

import json
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from analyses.rlkv.head_map import HeadMap, bytes_per_entry  # noqa: E402
from analyses.rlkv.probe import save_checkpoint  # noqa: E402


def test_a_head_map_binarises_and_costs_what_it_keeps():
    hm = HeadMap("learned", np.array([[0.9, 0.1], [0.4, 0.7]], np.float32), sink=1, recent=2, bytes_per_entry=8)
    assert hm.full_heads(0.5).tolist() == [[True, False], [False, True]]  # the top half by score: 0.9 and 0.7
    assert hm.full_heads(0.75).tolist() == [[True, False], [False, False]]
    policy = hm.policy(0.5)
    assert (policy.full_heads, policy.sink, policy.recent) == ([[True, False], [False, True]], 1, 2)
    # 10 tokens: two full heads keep 10 entries each, two local heads 1 + 2; 8 bytes an entry
    assert hm.kv_bytes(0.5, 10) == (2 * 10 + 2 * 3) * 8 == 208
    assert hm.kv_bytes(0.0, 10) == 4 * 10 * 8
    assert hm.kv_fraction(0.5, 10) == 26 / 40
    assert hm.memory(0.5, 64) == {"full_heads": [[True, False], [False, True]], "sink": 1, "recent": 2,
                                  "bytes_per_entry": 8, "max_length": 64}
    d = hm.to_dict(0.5)
    assert (d["kind"], d["scores"], d["full_heads"], d["sparsity"]) == (
        "learned", [[0.8999999761581421, 0.10000000149011612], [0.4000000059604645, 0.699999988079071]],
        [[True, False], [False, True]], 0.5)
    assert "log" not in d and "full_heads" not in hm.to_dict()


def test_the_cli_map_prints_the_head_map_the_page_draws(tmp_path, llama):
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    gates = np.array([[0.9, 0.1], [0.4, 0.7]], np.float32)
    save_checkpoint(tmp_path, gates, None, [{"step": 1}], {"model": "tiny-random:llama", "fingerprint": "x",
                                                          "shape": [2, 2], "settings": {}, "problems": []})
    result = CliRunner().invoke(build(), ["rlkv", "map", "--model", "tiny-random:llama", "--gates", str(tmp_path),
                                          "--sink", "1", "--recent", "2", "--sparsity", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    hm = HeadMap.from_gates(tmp_path, llama, sink=1, recent=2)
    per_entry = 2 * llama.arch().head_dim * 4  # float32 keys and values
    assert bytes_per_entry(llama) == per_entry and hm.log == [{"step": 1}]
    assert {k: v for k, v in payload.items() if k != "provenance"} == {
        **hm.to_dict(0.5), "kv_bytes_4096": (2 * 4096 + 2 * 3) * per_entry, "full_kv_bytes_4096": 4 * 4096 * per_entry}
    assert payload["full_heads"] == [[True, False], [False, True]]
