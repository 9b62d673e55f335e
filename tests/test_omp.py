"""OpenMP's wait between parallel regions (thoughtscope/omp.py): set by the `thoughtscope` command before
torch loads and never over a user's own choice (the processes it starts inherit `os.environ`; that the
Streamlit child has it was checked by hand in /proc, not here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from thoughtscope.omp import SPIN, spin_between_regions

ROOT = Path(__file__).resolve().parents[1]


def test_sets_the_spin_before_torch_and_says_whether_it_took():
    env: dict[str, str] = {"PATH": "/bin"}
    assert spin_between_regions(env, torch_loaded=False) is True
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
    late: dict[str, str] = {}
    assert spin_between_regions(late, torch_loaded=True) is False  # children still get it; this process not
    assert late == SPIN


def test_a_users_own_setting_wins():
    for mine in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": ""}):
        env = dict(mine)
        assert spin_between_regions(env, torch_loaded=False) is False
        assert env == mine


CHILD = """
import os, sys
from thoughtscope import cli
took = []
real = cli.spin_between_regions
cli.spin_between_regions = lambda: took.append(real()) or took[-1]
sys.argv = ["thoughtscope", "bench", "list"]
try:
    cli.main()
except SystemExit:
    pass
print(took, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def _run(extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in SPIN} | {"HF_HUB_OFFLINE": "1"} | extra
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_command_sets_it_before_torch_loads():
    # `bench list` imports every benchmark module, torch with them; the setting came first
    assert _run({}) == "[True] ACTIVE 300000 True"
    assert _run({"OMP_WAIT_POLICY": "PASSIVE"}) == "[False] PASSIVE None True"
