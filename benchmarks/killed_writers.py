"""`python -m benchmarks.killed_writers [--trials N]`: the activation store under writers killed mid-write.

Each trial starts two writer processes on one capped store (so the write lock and eviction are in
play), lets them write a random number of 8 MB entries, then SIGKILLs each at a random moment,
usually inside a put. The store is then reopened and every entry read back: a *corruption* is an
entry whose tensor differs from what was written, or a read that raises; an *orphan* is a file under
`shards/` that no index row names (a killed put's temp file or unindexed shard). Orphans are counted
as the kill leaves them, then after `vacuum(min_age_s=0)` (the default age keeps them 60 s, in case
a put is still running). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cache import ActivationStore
from thoughtscope.errors import CacheError

N_FLOATS = 2_000_000  # 8 MB a shard: a put takes long enough to be killed inside it
CAP = 6 * 4 * N_FLOATS  # six entries: eviction runs on most puts

WRITER = """
import sys, torch
from cache import ActivationStore
root, w = sys.argv[1], int(sys.argv[2])
store = ActivationStore(root, max_bytes=int(sys.argv[3]))
for i in range(10_000):
    v = w * 100_000 + i
    print("start", v, flush=True)
    store.put("fp", f"writer {w} prompt {i}", {}, ["resid_post.0"], {"x": torch.full((%d,), float(v))},
              meta={"v": v})
    print("done", v, flush=True)
""" % N_FLOATS


def run_trial(root: Path, rng: random.Random, repo: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(w), str(CAP)], cwd=repo, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w in range(2)
    ]
    mid_put = 0
    for child in writers:
        for _ in range(rng.randint(1, 4)):  # wait for this many puts to start
            if not child.stdout.readline():
                raise RuntimeError(child.stderr.read())
        time.sleep(rng.uniform(0.0, 0.08))  # 8 MB puts take ~20-100 ms here
        child.send_signal(signal.SIGKILL)
    for child in writers:
        out, _ = child.communicate(timeout=60)
        mid_put += out.strip().splitlines()[-1].startswith("start") if out.strip() else 1

    store = ActivationStore(root, max_bytes=CAP)
    orphans_left = len({p.name for p in store.shards_dir.iterdir()} - _indexed_shards(store))
    corrupt = reads = 0
    for info in store.list():
        reads += 1
        try:
            entry = store.get_by_key(info.key)
        except CacheError:
            corrupt += 1
            continue
        if entry is None or not torch.equal(entry.tensors["x"], torch.full((N_FLOATS,), float(info.meta["v"]))):
            corrupt += 1
    store.vacuum(min_age_s=0)
    orphans_after_vacuum = len({p.name for p in store.shards_dir.iterdir()} - _indexed_shards(store))
    disk = sum(p.stat().st_size for p in store.shards_dir.iterdir())
    store.close()
    return dict(mid_put=mid_put, reads=reads, corrupt=corrupt, orphans_left=orphans_left,
                orphans_after_vacuum=orphans_after_vacuum, over_cap=disk > CAP)


def _indexed_shards(store: ActivationStore) -> set[str]:
    with store._connect() as conn:
        return {row[0] for row in conn.execute("SELECT shard FROM entries")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="killed-writers-"))
    totals = dict(trials=0, kills=0, kills_mid_put=0, reads=0, corrupt_reads=0, orphans_left_by_kills=0,
                  orphans_after_vacuum=0, trials_over_cap_after_vacuum=0)
    started = time.perf_counter()
    try:
        root = base / "store"  # one store for all trials: damage would accumulate and show
        for _ in range(args.trials):
            r = run_trial(root, rng, repo)
            totals["trials"] += 1
            totals["kills"] += 2
            totals["kills_mid_put"] += r["mid_put"]
            totals["reads"] += r["reads"]
            totals["corrupt_reads"] += r["corrupt"]
            totals["orphans_left_by_kills"] += r["orphans_left"]
            totals["orphans_after_vacuum"] += r["orphans_after_vacuum"]
            totals["trials_over_cap_after_vacuum"] += r["over_cap"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    totals["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(totals))
    return 0 if totals["corrupt_reads"] == 0 and totals["orphans_after_vacuum"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
