"""The activation store: round trips, keys, eviction, crash safety, damage and concurrency.

These double as examples of use: `ActivationStore(root).put(...)` returns a key,
`get(...)` with the same key arguments returns an `Entry` or None.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

from cache import ActivationStore, Entry, default_root, make_key
from thoughtscope.errors import BadInputError, CacheError

REPO = Path(__file__).resolve().parents[1]
FP = "smollm2-135m@sha256:abc123"
PROMPT = "What is 17 + 25? Think step by step."
SETTINGS = {"max_new_tokens": 32, "temperature": 0.0, "seed": 0}
SITES = ["resid_post.3", "attn.1"]


def shard_files(store: ActivationStore) -> list[Path]:
    return sorted(store.shards_dir.iterdir())


@pytest.fixture
def start_child():
    """Start Python children that import this repo (separate processes, not forks);
    any still running when the test ends are killed."""
    started: list[subprocess.Popen] = []

    def start(script: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        started.append(child)
        return child

    yield start
    for child in started:
        if child.poll() is None:
            child.kill()
            child.communicate()


# ---- round trips and keys ----------------------------------------------------------------


def test_round_trip_keeps_every_dtype_shape_and_meta(tmp_path):
    store = ActivationStore(tmp_path)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "resid_post.3": torch.randn(1, 7, 16, generator=gen),
        "attn.1": torch.rand(1, 4, 7, 7, generator=gen, dtype=torch.float64),
        "half": torch.randn(5, generator=gen).half(),
        "bf16": torch.randn(3, 2, generator=gen).bfloat16(),
        "token_ids": torch.tensor([[1, 15, 2042, 7]], dtype=torch.int64),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).T,  # not contiguous
        "with_nan": torch.tensor([1.0, float("nan"), -float("inf")]),  # stored as given
    }
    meta = {"tokens": ["What", " is"], "entropy": [1.25, 0.5], "model": {"layers": 30}}

    key = store.put(FP, PROMPT, SETTINGS, SITES, tensors, meta=meta)
    entry = store.get(FP, PROMPT, SETTINGS, SITES)

    assert isinstance(entry, Entry)
    assert entry.key == key == make_key(FP, PROMPT, SETTINGS, SITES)
    assert set(entry.tensors) == set(tensors)
    for name, want in tensors.items():
        got = entry.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert entry.meta == meta
    assert entry.prompt == PROMPT and entry.settings == SETTINGS
    assert entry.sites == ["attn.1", "resid_post.3"]
    assert entry.nbytes == shard_files(store)[0].stat().st_size == store.total_bytes()
    assert entry.nbytes > sum(t.nbytes for t in tensors.values())
    assert abs(entry.created - time.time()) < 60


def test_metadata_only_entry(tmp_path):
    store = ActivationStore(tmp_path)
    store.put(FP, PROMPT, SETTINGS, [], meta={"answer": "42", "correct": True})
    entry = store.get(FP, PROMPT, SETTINGS, [])
    assert entry.tensors == {}
    assert entry.meta == {"answer": "42", "correct": True}


def test_key_ignores_order_but_not_values(tmp_path):
    store = ActivationStore(tmp_path)
    key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(2)})

    reordered = dict(reversed(list(SETTINGS.items())))
    assert make_key(FP, PROMPT, reordered, list(reversed(SITES))) == key
    assert store.get(FP, PROMPT, reordered, list(reversed(SITES))).key == key

    hotter = {**SETTINGS, "temperature": 0.7}
    assert store.get(FP, PROMPT, hotter, SITES) is None
    assert store.get(FP, PROMPT + " ", SETTINGS, SITES) is None
    assert store.get("other-model", PROMPT, SETTINGS, SITES) is None
    assert store.get(FP, PROMPT, SETTINGS, SITES[:1]) is None

    other = store.put(FP, PROMPT, hotter, SITES, {"x": torch.zeros(2)})
    assert other != key
    assert torch.equal(store.get(FP, PROMPT, hotter, SITES).tensors["x"], torch.zeros(2))
    assert torch.equal(store.get(FP, PROMPT, SETTINGS, SITES).tensors["x"], torch.ones(2))


def test_putting_the_same_key_again_replaces_the_entry(tmp_path):
    store = ActivationStore(tmp_path)
    store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(100)}, meta={"v": 1})
    store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.full((10,), 2.0)}, meta={"v": 2})

    entry = store.get(FP, PROMPT, SETTINGS, SITES)
    assert entry.meta == {"v": 2}
    assert torch.equal(entry.tensors["x"], torch.full((10,), 2.0))
    assert len(store.list()) == 1
    assert len(shard_files(store)) == 1  # the old shard is gone
    assert store.total_bytes() == entry.nbytes


def test_list_delete_and_clear(tmp_path):
    store = ActivationStore(tmp_path)
    a = store.put(FP, "prompt a", SETTINGS, SITES, {"x": torch.ones(3)}, meta={"i": 0})
    b = store.put(FP, "prompt b", SETTINGS, SITES, {"x": torch.ones(3)}, meta={"i": 1})
    c = store.put("other-model", "prompt a", SETTINGS, SITES, {"x": torch.ones(3)})

    infos = store.list()
    assert [i.key for i in infos] == [a, b, c]  # oldest first
    assert [i.key for i in store.list(FP)] == [a, b]
    assert infos[1].prompt == "prompt b" and infos[1].meta == {"i": 1}
    assert infos[1].sites == sorted(SITES) and infos[1].settings == SETTINGS
    assert store.total_bytes() == sum(i.nbytes for i in infos)

    assert store.delete(b) is True
    assert store.delete(b) is False
    assert store.get_by_key(b) is None
    assert [i.key for i in store.list()] == [a, c]
    assert len(shard_files(store)) == 2

    store.clear()
    assert store.list() == [] and store.total_bytes() == 0
    assert shard_files(store) == []


def test_reopening_sees_what_was_stored(tmp_path):
    key = ActivationStore(tmp_path).put(FP, PROMPT, SETTINGS, SITES, {"x": torch.arange(4)})
    assert torch.equal(ActivationStore(tmp_path).get_by_key(key).tensors["x"], torch.arange(4))


def test_default_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_root() == tmp_path / "mine" / "store"
    store = ActivationStore()
    assert store.index_path == tmp_path / "mine" / "store" / "index.sqlite"
    assert store.index_path.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        ((FP, PROMPT, ["not", "a", "dict"], SITES, {}), "settings must be a dict"),
        ((FP, PROMPT, {"f": object()}, SITES, {}), "JSON-able"),
        ((FP, PROMPT, {"t": float("nan")}, SITES, {}), "JSON-able"),
        ((FP, PROMPT, SETTINGS, "resid_post.3", {}), "list of site names"),
        ((FP, PROMPT, SETTINGS, ["resid_post.3", ""], {}), "non-empty str"),
        (("", PROMPT, SETTINGS, SITES, {}), "fingerprint"),
        ((FP, None, SETTINGS, SITES, {}), "prompt must be a str"),
        ((FP, PROMPT, SETTINGS, SITES, {"x": [1.0, 2.0]}), "torch.Tensor"),
        ((FP, PROMPT, SETTINGS, SITES, {"": torch.ones(1)}), "tensor name"),
    ],
)
def test_bad_inputs_raise_bad_input_error_and_store_nothing(tmp_path, args, message):
    store = ActivationStore(tmp_path)
    with pytest.raises(BadInputError, match=message):
        store.put(*args)
    assert store.list() == [] and shard_files(store) == []


def test_a_bare_tensor_instead_of_a_dict_is_refused(tmp_path):
    store = ActivationStore(tmp_path)
    with pytest.raises(BadInputError, match="dict of name"):
        store.put(FP, PROMPT, SETTINGS, SITES, torch.ones(3))


def test_bad_meta_raises_bad_input_error(tmp_path):
    store = ActivationStore(tmp_path)
    with pytest.raises(BadInputError, match="meta"):
        store.put(FP, PROMPT, SETTINGS, SITES, {}, meta={"x": torch.ones(1)})
    with pytest.raises(BadInputError, match="meta must be a dict"):
        store.put(FP, PROMPT, SETTINGS, SITES, {}, meta=[1, 2])
    assert store.list() == [] and shard_files(store) == []


def test_shared_memory_tensors_are_stored_separately(tmp_path):
    store = ActivationStore(tmp_path)
    capture = torch.arange(10.0)
    store.put(FP, PROMPT, SETTINGS, SITES, {"all": capture, "head": capture[:4], "same": capture})
    got = store.get(FP, PROMPT, SETTINGS, SITES).tensors
    assert torch.equal(got["all"], capture) and torch.equal(got["same"], capture)
    assert torch.equal(got["head"], capture[:4])


# ---- size cap ----------------------------------------------------------------------------


def entry_size(tmp_path: Path, tensor: torch.Tensor) -> int:
    scratch = ActivationStore(tmp_path / "scratch")
    return scratch.get_by_key(scratch.put(FP, "p0", SETTINGS, SITES, {"x": tensor})).nbytes


def test_eviction_removes_the_oldest_access_first(tmp_path):
    one = entry_size(tmp_path, torch.zeros(1000))
    store = ActivationStore(tmp_path / "capped", max_bytes=3 * one + one // 2)
    keys = [
        store.put(FP, f"p{i}", SETTINGS, SITES, {"x": torch.full((1000,), float(i))})
        for i in range(3)
    ]
    assert store.get_by_key(keys[0]) is not None  # touching p0 makes p1 the oldest access

    keys.append(store.put(FP, "p3", SETTINGS, SITES, {"x": torch.full((1000,), 3.0)}))

    assert store.get_by_key(keys[1]) is None
    assert {i.key for i in store.list()} == {keys[0], keys[2], keys[3]}
    assert len(shard_files(store)) == 3
    assert store.total_bytes() == 3 * one <= store.max_bytes
    assert torch.equal(store.get_by_key(keys[0]).tensors["x"], torch.zeros(1000))

    # A bigger entry pushes out as many old ones as it needs, never itself; p0 was read
    # last, so it is the one that still fits beside it.
    big = store.put(FP, "big", SETTINGS, SITES, {"x": torch.ones(2500)})
    assert [i.key for i in store.list()] == [keys[0], big]
    assert store.total_bytes() <= store.max_bytes


def test_an_entry_larger_than_the_cap_raises_and_leaves_nothing(tmp_path):
    store = ActivationStore(tmp_path, max_bytes=4000)
    kept = store.put(FP, "small", SETTINGS, SITES, {"x": torch.ones(10)})

    with pytest.raises(CacheError, match="raise max_bytes"):
        store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(2000)})  # 8000 bytes of data
    # Exactly the cap in raw data: only the written file (with its header) is over it.
    with pytest.raises(CacheError, match="raise max_bytes"):
        store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(1000)})

    assert store.get(FP, PROMPT, SETTINGS, SITES) is None
    assert [i.key for i in store.list()] == [kept]
    assert len(shard_files(store)) == 1


def test_bad_cap_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="max_bytes"):
        ActivationStore(tmp_path, max_bytes=0)


# ---- damaged stores and crashed writers ----------------------------------------------------


def test_an_index_row_whose_shard_is_gone_reads_as_absent(tmp_path):
    store = ActivationStore(tmp_path)
    key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(3)})
    shard_files(store)[0].unlink()

    assert store.get(FP, PROMPT, SETTINGS, SITES) is None
    assert key not in store  # the dangling row was dropped
    assert store.list() == [] and store.total_bytes() == 0


def test_a_damaged_shard_raises_cache_error_once_and_is_removed(tmp_path):
    store = ActivationStore(tmp_path)
    store.put(FP, "damaged", SETTINGS, SITES, {"x": torch.ones(3)})
    store.put(FP, "fine", SETTINGS, SITES, {"x": torch.ones(3)})
    key = make_key(FP, "damaged", SETTINGS, SITES)
    damaged = next(p for p in shard_files(store) if p.name.startswith(key))
    damaged.write_bytes(damaged.read_bytes()[:-5])  # truncated, as by a full disk

    with pytest.raises(CacheError, match="removed"):
        store.get(FP, "damaged", SETTINGS, SITES)
    assert store.get(FP, "damaged", SETTINGS, SITES) is None
    assert not damaged.exists()
    assert [i.prompt for i in store.list()] == ["fine"]


def test_a_damaged_index_raises_cache_error_that_says_what_to_do(tmp_path):
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(CacheError, match="delete"):
        ActivationStore(tmp_path)


DIE_AT_STAGE = """
    import os, sys, torch
    import cache.store as cs
    root, stage = sys.argv[1], sys.argv[2]
    if stage == "before_rename":
        write_temp = cs._write_temp
        def write_then_die(*args):
            write_temp(*args)
            os._exit(3)
        cs._write_temp = write_then_die
    else:  # the shard is in place, its index row never comes
        cs.ActivationStore._index_entry = lambda self, row: os._exit(3)
    cs.ActivationStore(root).put("fp", "prompt", {}, ["resid_post.0"], {"x": torch.ones(1000)})
"""


@pytest.mark.parametrize(
    "stage, leftover_suffix", [("before_rename", ".tmp"), ("before_index", ".safetensors")]
)
def test_a_writer_that_dies_mid_put_leaves_no_entry(tmp_path, start_child, stage, leftover_suffix):
    child = start_child(DIE_AT_STAGE, str(tmp_path), stage)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 3, err

    store = ActivationStore(tmp_path)  # opening keeps files young enough to be a live put
    leftovers = shard_files(store)
    assert [p.suffix for p in leftovers] == [leftover_suffix]
    assert store.get("fp", "prompt", {}, ["resid_post.0"]) is None
    assert store.list() == [] and store.total_bytes() == 0

    assert store.vacuum(min_age_s=0) == 1
    assert shard_files(store) == []
    store.put("fp", "prompt", {}, ["resid_post.0"], {"x": torch.ones(1000)})
    entry = store.get("fp", "prompt", {}, ["resid_post.0"])
    assert torch.equal(entry.tensors["x"], torch.ones(1000))


WRITE_FOREVER = """
    import sys, torch
    from cache import ActivationStore
    store = ActivationStore(sys.argv[1], max_bytes=40_000_000)
    for i in range(10_000):
        x = torch.full((2_000_000,), float(i))
        store.put("fp", f"prompt {i}", {}, ["resid_post.0"], {"x": x}, meta={"i": i})
        print(i, flush=True)
"""


def test_a_writer_killed_at_any_moment_leaves_a_consistent_store(tmp_path, start_child):
    child = start_child(WRITE_FOREVER, str(tmp_path))
    for _ in range(2):  # two entries written, the third is in flight
        assert child.stdout.readline().strip(), child.stderr.read()
    time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL

    store = ActivationStore(tmp_path)
    infos = store.list()
    assert len(infos) >= 2
    for info in infos:
        entry = store.get_by_key(info.key)
        assert torch.equal(entry.tensors["x"], torch.full((2_000_000,), float(info.meta["i"])))
    store.vacuum(min_age_s=0)
    assert len(shard_files(store)) == len(infos)
    assert all(p.suffix == ".safetensors" for p in shard_files(store))


# ---- concurrency -------------------------------------------------------------------------


def check_read(entry: Entry | None) -> bool:
    """A read is either a miss or a complete, self-consistent entry; True if it was a hit."""
    if entry is None:
        return False
    v = entry.meta["v"]
    assert torch.equal(entry.tensors["x"], torch.full((4096,), float(v)))
    return True


READ_UNTIL_STOPPED = """
    import sys, time, torch
    from pathlib import Path
    from cache import ActivationStore
    root, stop = sys.argv[1], Path(sys.argv[2])
    store = ActivationStore(root)
    print("ready", flush=True)
    reads = hits = 0
    while reads == 0 or not stop.exists():
        entry = store.get("fp", "shared", {}, ["resid_post.0"])
        reads += 1
        if entry is not None:
            assert torch.equal(entry.tensors["x"], torch.full((4096,), float(entry.meta["v"])))
            hits += 1
    print(reads, hits, flush=True)
"""


def test_readers_in_threads_and_processes_see_whole_entries_while_one_writes(
    tmp_path, start_child
):
    one = entry_size(tmp_path, torch.zeros(4096))
    root, stop = tmp_path / "store", tmp_path / "stop"
    store = ActivationStore(root, max_bytes=4 * one)  # fillers keep evicting the shared entry
    readers = [start_child(READ_UNTIL_STOPPED, str(root), str(stop)) for _ in range(2)]
    for reader in readers:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()

    errors: list[BaseException] = []
    thread_hits = [0] * 4
    last_v = -1
    writing = threading.Event()
    writing.set()

    def write():
        nonlocal last_v
        # At least half a second, so the reader processes are surely reading meanwhile.
        until = time.monotonic() + 0.5
        try:
            for v in range(10_000):
                if v >= 20 and time.monotonic() > until:
                    break
                shared = {"x": torch.full((4096,), float(v))}
                store.put("fp", "shared", {}, ["resid_post.0"], shared, meta={"v": v})
                filler = {"x": torch.full((4096,), -1.0)}
                store.put("fp", f"filler {v}", {}, ["resid_post.0"], filler, meta={"v": -1})
                last_v = v
        except BaseException as err:  # surfaced by the assert below
            errors.append(err)
        finally:
            writing.clear()

    def read(slot: int):
        try:
            while writing.is_set():
                thread_hits[slot] += check_read(store.get("fp", "shared", {}, ["resid_post.0"]))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write)]
    threads += [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.touch()
    outputs = [reader.communicate(timeout=30) for reader in readers]

    assert errors == []
    assert sum(thread_hits) > 0
    for reader, (out, err) in zip(readers, outputs):
        assert reader.returncode == 0, err
        reads, hits = map(int, out.split())
        assert reads > 0
    final = store.get("fp", "shared", {}, ["resid_post.0"])
    assert last_v >= 19
    assert final.meta == {"v": last_v} and check_read(final)
    assert store.total_bytes() <= store.max_bytes
    assert len(shard_files(store)) == len(store.list())


# ---- damage and hostile edits (issue 10) ---------------------------------------------------
#
# A damaged store never hands back wrong data and never deletes anything outside its folder:
# a damaged index refuses to open (its shards stay), a damaged shard raises `CacheError` once
# and its entry is gone, an index row that names a file outside `root/shards/` is refused.


def fill(store: ActivationStore, n: int) -> list[str]:
    return [
        store.put(FP, f"p{i}", SETTINGS, SITES, {"x": torch.full((4,), float(i))}, meta={"i": i})
        for i in range(n)
    ]


def edit_index(store: ActivationStore, sql: str, *args) -> None:
    """Edit the index by hand, as a user with the sqlite3 shell would."""
    with closing(sqlite3.connect(store.index_path)) as conn, conn:
        conn.execute(sql, args)


def shard_of(store: ActivationStore, key: str) -> Path:
    return next(p for p in shard_files(store) if p.name.startswith(key))


def test_a_truncated_index_raises_cache_error_and_keeps_every_shard(tmp_path):
    store = ActivationStore(tmp_path)
    fill(store, 20)
    store.close()
    # Fold the write-ahead log into the index file, so cutting the file cuts stored rows.
    with closing(sqlite3.connect(store.index_path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    whole = store.index_path.read_bytes()
    shards = shard_files(store)
    assert len(shards) == 20

    # 0: emptied; 10%: most pages gone; the last page half cut (rows read back as NULLs).
    for cut in (0, len(whole) // 10, len(whole) - 512):
        for log in tmp_path.glob("index.sqlite-*"):  # -wal, -shm: no rows from earlier opens
            log.unlink()
        store.index_path.write_bytes(whole[:cut])
        with pytest.raises(CacheError, match="damaged") as err:
            ActivationStore(tmp_path)
        assert str(store.index_path) in str(err.value) and "delete" in str(err.value)
        assert shard_files(store) == shards, cut  # nothing was thrown away

    store.index_path.write_bytes(whole)
    assert len(ActivationStore(tmp_path).list()) == 20


def test_a_flipped_byte_in_a_shard_raises_cache_error_and_the_entry_is_gone(tmp_path):
    store = ActivationStore(tmp_path)
    key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(256)}, meta={"v": 1})
    fine = store.put(FP, "fine", SETTINGS, SITES, {"x": torch.ones(256)})
    shard = shard_of(store, key)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # the last float's exponent: 1.0 becomes inf, the header still parses
    shard.write_bytes(bytes(data))

    with pytest.raises(CacheError, match="checksum") as err:
        store.get(FP, PROMPT, SETTINGS, SITES)
    assert "removed" in str(err.value)
    assert store.get(FP, PROMPT, SETTINGS, SITES) is None  # never returned, not even later
    assert key not in store and not shard.exists()
    assert [i.key for i in store.list()] == [fine]
    assert torch.equal(store.get_by_key(fine).tensors["x"], torch.ones(256))


def test_a_directory_in_place_of_a_shard_raises_cache_error_and_the_entry_is_gone(tmp_path):
    store = ActivationStore(tmp_path)
    key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(3)})
    shard = shard_of(store, key)
    shard.unlink()
    shard.mkdir()

    with pytest.raises(CacheError, match="not a file"):
        store.get_by_key(key)
    assert key not in store and store.get_by_key(key) is None
    assert store.list() == [] and store.vacuum(min_age_s=0) == 0
    assert shard.is_dir()  # a folder is the user's to remove; the message names it


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink"])
def test_an_index_row_naming_a_file_outside_the_store_is_refused(tmp_path, how):
    store = ActivationStore(tmp_path / "store")
    precious = tmp_path / "precious.txt"
    precious.write_text("not yours")
    if how == "absolute":
        shard = str(precious)
    elif how == "relative":
        shard = "../../precious.txt"
    else:  # a well-formed shard name, but a link that leads out of the store
        shard = f"{make_key(FP, PROMPT, SETTINGS, SITES)}.{'0' * 16}.safetensors"

    for use in ("get", "list", "delete", "clear", "vacuum", "evict"):
        if how == "symlink" and not (store.shards_dir / shard).is_symlink():
            (store.shards_dir / shard).symlink_to(precious)  # vacuum removes the link itself
        key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(3)})
        edit_index(store, "UPDATE entries SET shard = ? WHERE key = ?", shard, key)
        if use == "get":
            with pytest.raises(CacheError, match="outside"):
                store.get_by_key(key)
            assert key not in store
        elif use == "list":
            assert store.list() == []
        elif use == "delete":
            store.delete(key)
        elif use == "clear":
            store.clear()
        elif use == "vacuum":
            store.vacuum(min_age_s=0)
        else:
            capped = ActivationStore(store.root, max_bytes=entry_size(tmp_path, torch.ones(3)))
            capped.put(FP, "newer", SETTINGS, SITES, {"x": torch.ones(3)})
            capped.clear()
        assert precious.read_text() == "not yours", use
        assert key not in store, use


def test_any_str_is_stored_even_a_lone_surrogate(tmp_path):
    # Lone surrogates come from JSON ("\ud800") and from non-UTF-8 bytes decoded with
    # surrogateescape (file names, argv). The store keeps them as they are.
    store = ActivationStore(tmp_path)
    prompt, fingerprint, settings = "half \ud800 a pair", "model-\udcff", {"stop": "\udc80"}
    key = store.put(fingerprint, prompt, settings, ["a\ud83d"], {"x": torch.ones(2)},
                    meta={"text": "\ud83d!"})

    entry = ActivationStore(tmp_path).get(fingerprint, prompt, settings, ["a\ud83d"])
    assert entry.key == key
    assert (entry.prompt, entry.fingerprint, entry.settings) == (prompt, fingerprint, settings)
    assert entry.sites == ["a\ud83d"] and entry.meta == {"text": "\ud83d!"}
    assert [i.key for i in store.list(fingerprint)] == [key]
    assert store.list("model-") == []
    assert store.get(fingerprint, "half \\ud800 a pair", settings, ["a\ud83d"]) is None
    # Tensor names go into the safetensors header, which must be UTF-8.
    with pytest.raises(BadInputError, match="safetensors"):
        store.put(FP, PROMPT, SETTINGS, SITES, {"x\ud800": torch.ones(1)})
    # Keys of ordinary text are what they always were, so existing stores keep their entries.
    assert make_key(FP, PROMPT, SETTINGS, SITES) == (
        "49d94aaa6326551f8e4053043bfec4cdca8ba63dec0879bc2021124619203013"
    )


def test_concurrent_writers_stay_within_the_cap_on_disk_plus_one_shard(tmp_path):
    # The bound: the bytes of every file under root/shards (shards and temporary files) never
    # exceed max_bytes plus the one shard being written, whatever the number of writers.
    one = entry_size(tmp_path, torch.zeros(65536))  # 256 KiB
    cap = 3 * one
    root = tmp_path / "capped"
    ActivationStore(root, max_bytes=cap)
    peak, writing, errors = 0, threading.Event(), []
    writing.set()

    def disk_bytes() -> int:
        total = 0
        for entry in os.scandir(root / "shards"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass  # evicted between listing and stat
        return total

    def watch():
        nonlocal peak
        while writing.is_set():
            peak = max(peak, disk_bytes())

    def write(w: int):
        store = ActivationStore(root, max_bytes=cap)  # one store per writer, as in processes
        try:
            for i in range(10):
                x = torch.full((65536,), float(i))
                store.put(FP, f"writer {w} prompt {i}", SETTINGS, SITES, {"x": x}, meta={"i": i})
        except BaseException as err:
            errors.append(err)

    watcher = threading.Thread(target=watch)
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    watcher.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    writing.clear()
    watcher.join()

    assert errors == []
    assert one < peak <= cap + one
    store = ActivationStore(root, max_bytes=cap)
    assert disk_bytes() == store.total_bytes() <= cap
    for info in store.list():
        want = torch.full((65536,), float(info.meta["i"]))
        assert torch.equal(store.get_by_key(info.key).tensors["x"], want)


V1_SCHEMA = """
CREATE TABLE entries (
    key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, prompt_hash TEXT NOT NULL,
    prompt TEXT NOT NULL, settings_json TEXT NOT NULL, sites_json TEXT NOT NULL,
    created REAL NOT NULL, last_access REAL NOT NULL, nbytes INTEGER NOT NULL,
    shard TEXT NOT NULL, meta_json TEXT NOT NULL
);
PRAGMA user_version = 1;
"""


def test_a_store_written_before_checksums_opens_and_is_checked_from_its_first_read(tmp_path):
    store = ActivationStore(tmp_path)
    key = store.put(FP, PROMPT, SETTINGS, SITES, {"x": torch.ones(8)}, meta={"v": 1})
    store.close()
    with closing(sqlite3.connect(store.index_path)) as conn:
        conn.row_factory = sqlite3.Row
        row = dict(conn.execute("SELECT * FROM entries").fetchone())
    # Rebuild the index as the first schema (no checksum column) held it.
    store.index_path.unlink()
    with closing(sqlite3.connect(store.index_path)) as conn, conn:
        conn.executescript(V1_SCHEMA)
        row.pop("sha256")
        conn.execute(f"INSERT INTO entries ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                     tuple(row.values()))

    old = ActivationStore(tmp_path)
    assert torch.equal(old.get_by_key(key).tensors["x"], torch.ones(8))  # records its checksum
    shard = shard_of(old, key)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        old.get_by_key(key)
