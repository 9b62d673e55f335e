"""The on-disk store of traces and activations, so a trace recorded once is reused, not recomputed.

An entry is a set of named tensors (one safetensors shard per entry under `root/shards/`) plus
JSON metadata, found through a SQLite index (`root/index.sqlite`). It is keyed by the model
fingerprint, the prompt, the generation settings and the hook sites, so changing any of them
misses the cache instead of returning stale activations. Nothing is pickled.

Crash safety: a shard is written to a temporary file, fsynced and renamed into place before its
index row is inserted, so a killed writer leaves at worst an unindexed shard (an orphan) that
readers never see and `vacuum()` removes. An index row whose shard is missing or unreadable
reads as absent and is dropped.

Size cap: with `max_bytes` set, each `put` evicts entries in order of oldest access first
(`get` counts as an access) until the store fits again. The entry just written is never evicted;
an entry that alone exceeds the cap is refused with `CacheError`.

Several threads and processes may read while one writes: the index runs in SQLite's WAL mode
with a busy timeout, and each thread (and each process) uses its own connection. (WAL needs a
local disk, not a network file system.)
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import safetensors.torch
import torch

from thoughtscope.errors import BadInputError, CacheError

ENV_VAR = "THOUGHTSCOPE_CACHE_DIR"
INDEX_NAME = "index.sqlite"
SHARDS_DIR = "shards"
SHARD_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
ORPHAN_MIN_AGE_S = 60.0
SCHEMA_VERSION = 1
# Long enough that a put waits out other writers' short transactions rather than failing.
BUSY_TIMEOUT_S = 30.0
# A read only records its access time if the index is free within this long.
TOUCH_TIMEOUT_S = 0.05

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    prompt_hash TEXT NOT NULL,
    prompt TEXT NOT NULL,
    settings_json TEXT NOT NULL,
    sites_json TEXT NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    nbytes INTEGER NOT NULL,
    shard TEXT NOT NULL,
    meta_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_fingerprint ON entries (fingerprint);
CREATE INDEX IF NOT EXISTS entries_last_access ON entries (last_access);
"""
_COLUMN_NAMES = (
    "key", "fingerprint", "prompt_hash", "prompt", "settings_json", "sites_json",
    "created", "last_access", "nbytes", "shard", "meta_json",
)
_COLUMNS = ", ".join(_COLUMN_NAMES)
_INSERT = (
    f"INSERT OR REPLACE INTO entries ({_COLUMNS})"
    f" VALUES ({', '.join(':' + name for name in _COLUMN_NAMES)})"
)


@dataclass
class EntryInfo:
    """What the index knows about an entry, without loading its tensors."""

    key: str
    fingerprint: str
    prompt: str
    settings: dict[str, Any]
    sites: builtins.list[str]
    created: float
    last_access: float
    nbytes: int
    meta: dict[str, Any]


@dataclass
class Entry(EntryInfo):
    """A stored entry with its tensors loaded (on the CPU)."""

    tensors: dict[str, torch.Tensor]


def default_root() -> Path:
    """`$THOUGHTSCOPE_CACHE_DIR/store` if that is set, else `store` in the user cache directory."""
    base = os.environ.get(ENV_VAR) or platformdirs.user_cache_dir("thoughtscope")
    return Path(base) / "store"


def make_key(
    fingerprint: str, prompt: str, settings: Mapping[str, Any], sites: Sequence[str]
) -> str:
    """The sha256 hex key of an entry; settings key order and site order do not change it."""
    _check_key_args(fingerprint, prompt, settings, sites)
    canonical = {
        "fingerprint": fingerprint,
        "prompt_sha256": _sha256(prompt),
        "settings": dict(settings),
        "sites": _canonical_sites(sites),
    }
    return _sha256(_to_json(canonical, "the key"))


class ActivationStore:
    """Put and get named tensors keyed by (model fingerprint, prompt, settings, sites).

    `ActivationStore()` uses `default_root()`; `max_bytes` caps the shards' total size on disk.
    """

    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise BadInputError(f"max_bytes must be a positive int or None, got {max_bytes!r}.")
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = max_bytes
        self.shards_dir = self.root / SHARDS_DIR
        self.index_path = self.root / INDEX_NAME
        self._local = threading.local()
        try:
            self.shards_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CacheError(
                f"Cannot create the cache folder {self.root}: {err}. "
                f"Set {ENV_VAR} to a writable folder."
            ) from err
        self._init_index()
        self.vacuum()

    # ---- writing -------------------------------------------------------------------------

    def put(
        self,
        fingerprint: str,
        prompt: str,
        settings: Mapping[str, Any],
        sites: Sequence[str],
        tensors: Mapping[str, torch.Tensor] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Store `tensors` (may be empty for a metadata-only entry) and `meta`; return the key.

        Putting the same key again replaces the old entry. A failed put changes nothing.
        """
        key = make_key(fingerprint, prompt, settings, sites)
        tensors = _checked_tensors({} if tensors is None else tensors)
        meta_json = _to_json(dict(_checked_meta(meta)), "meta")
        self._refuse_if_over_cap(sum(t.nbytes for t in tensors.values()))
        shard = self._write_shard(key, tensors)
        shard_path = self.shards_dir / shard
        try:
            nbytes = shard_path.stat().st_size
            self._refuse_if_over_cap(nbytes)
            row = {
                "key": key, "fingerprint": fingerprint, "prompt_hash": _sha256(prompt),
                "prompt": prompt, "settings_json": _to_json(dict(settings), "settings"),
                "sites_json": json.dumps(_canonical_sites(sites)), "nbytes": nbytes,
                "shard": shard, "meta_json": meta_json,
            }
            stale_shards = self._index_entry(row)
        except BaseException:
            shard_path.unlink(missing_ok=True)
            raise
        self._unlink_shards(stale_shards)
        return key

    def _refuse_if_over_cap(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise CacheError(
                f"This entry needs {nbytes} bytes but the cache is capped at {self.max_bytes}; "
                "raise max_bytes (or capture fewer sites or tokens)."
            )

    def _write_shard(self, key: str, tensors: dict[str, torch.Tensor]) -> str:
        # A fresh name per write: a reader that already holds the old row can still open the
        # old shard, and a replaced or evicted shard is never half-overwritten under a reader.
        shard = f"{key}.{secrets.token_hex(8)}{SHARD_SUFFIX}"
        final = self.shards_dir / shard
        temp = final.with_name(final.name + TEMP_SUFFIX)
        try:
            _write_temp(temp, tensors, key)
            os.replace(temp, final)
            _fsync_dir(self.shards_dir)
        except OSError as err:
            temp.unlink(missing_ok=True)
            raise CacheError(f"Could not write to the cache in {self.root}: {err}.") from err
        return shard

    def _index_entry(self, row: dict[str, Any]) -> builtins.list[str]:
        """Insert the row and evict to fit the cap in one transaction; return shards to unlink."""
        key = row["key"]
        with self._transaction() as conn:
            # Stamped under the write lock, so access times follow the order of commits.
            now = time.time()
            row = {**row, "created": now, "last_access": now}
            stale = [r[0] for r in conn.execute("SELECT shard FROM entries WHERE key = ?", (key,))]
            conn.execute(_INSERT, row)
            if self.max_bytes is not None:
                stale += self._evict(conn, keep=key, room=self.max_bytes - row["nbytes"])
        return stale

    @staticmethod
    def _evict(conn: sqlite3.Connection, keep: str, room: int) -> builtins.list[str]:
        others = conn.execute(
            "SELECT key, shard, nbytes FROM entries WHERE key != ?"
            " ORDER BY last_access DESC, created DESC",
            (keep,),
        ).fetchall()
        # Keep the most recently used entries that fit beside the new one; the rest go.
        kept_bytes, evicted = 0, []
        for i, (key, shard, nbytes) in enumerate(others):
            if kept_bytes + nbytes > room:
                evicted = others[i:]
                break
            kept_bytes += nbytes
        conn.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k, _, _ in evicted])
        return [shard for _, shard, _ in evicted]

    # ---- reading -------------------------------------------------------------------------

    def get(
        self,
        fingerprint: str,
        prompt: str,
        settings: Mapping[str, Any],
        sites: Sequence[str],
    ) -> Entry | None:
        """The entry stored under these key arguments, or None."""
        return self.get_by_key(make_key(fingerprint, prompt, settings, sites))

    def get_by_key(self, key: str) -> Entry | None:
        """The entry stored under `key` (from `put` or `make_key`), or None."""
        # A second look: a concurrent put may have replaced the row (and unlinked its old
        # shard) between our reading the row and opening the shard.
        for _ in range(2):
            with self._connect() as conn:
                query = f"SELECT {_COLUMNS} FROM entries WHERE key = ?"
                row = conn.execute(query, (key,)).fetchone()
            if row is None:
                return None
            tensors = self._load_shard(key, row["shard"])
            if tensors is not None:
                info = _info_from_row(row)
                info.last_access = self._touch(key)
                return Entry(**vars(info), tensors=tensors)
        return None

    def _load_shard(self, key: str, shard: str) -> dict[str, torch.Tensor] | None:
        try:
            return safetensors.torch.load_file(self.shards_dir / shard)
        # safetensors reports a missing file as RuntimeError, a damaged one as SafetensorError.
        except (OSError, RuntimeError, safetensors.SafetensorError):
            # Missing or damaged shard: the entry is gone, not an error the user can fix.
            self._drop_row(key, shard)
            (self.shards_dir / shard).unlink(missing_ok=True)
            return None

    def _touch(self, key: str) -> float:
        now = time.time()
        try:
            with self._transaction(TOUCH_TIMEOUT_S) as conn:
                # Read the clock after waiting for the lock, and never move an access back in
                # time: a stale stamp would make a hot entry the first to be evicted.
                now = time.time()
                conn.execute(
                    "UPDATE entries SET last_access = MAX(last_access, ?) WHERE key = ?", (now, key)
                )
        except CacheError:
            pass  # the access time only orders eviction; a busy index must not fail a read
        return now

    def list(self, fingerprint: str | None = None) -> builtins.list[EntryInfo]:
        """Every entry (or those of one model), oldest first, without loading tensors."""
        query = f"SELECT {_COLUMNS} FROM entries"
        args: tuple = ()
        if fingerprint is not None:
            query, args = query + " WHERE fingerprint = ?", (fingerprint,)
        with self._connect() as conn:
            rows = conn.execute(query + " ORDER BY created, key", args).fetchall()
        infos = []
        for row in rows:
            if (self.shards_dir / row["shard"]).exists():
                infos.append(_info_from_row(row))
            else:
                self._drop_row(row["key"], row["shard"])
        return infos

    def total_bytes(self) -> int:
        """The shards' total size on disk, as the index records it."""
        with self._connect() as conn:
            return conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]

    def __contains__(self, key: str) -> bool:
        with self._connect() as conn:
            row = conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone()
        return row is not None

    # ---- removing ------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove one entry; False if there was none."""
        with self._transaction() as conn:
            row = conn.execute("SELECT shard FROM entries WHERE key = ?", (key,)).fetchone()
            if row is not None:
                conn.execute("DELETE FROM entries WHERE key = ?", (key,))
        if row is None:
            return False
        self._unlink_shards([row[0]])
        return True

    def clear(self) -> None:
        """Remove every entry."""
        with self._transaction() as conn:
            shards = [r[0] for r in conn.execute("SELECT shard FROM entries")]
            conn.execute("DELETE FROM entries")
        self._unlink_shards(shards)

    def vacuum(self, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
        """Remove what crashed writers left: temp files and unindexed shards, and index rows
        whose shard is gone. Return how many files and rows were removed.

        Any unindexed file counts, including the temporary files safetensors itself writes
        beside ours. Files younger than `min_age_s` are kept: they may belong to a put still in
        progress in another process. Runs on open with the default age.
        """
        # List files before reading the index, so a shard indexed in between is seen as indexed.
        files = [p for p in self.shards_dir.iterdir() if p.is_file()]
        with self._connect() as conn:
            rows = conn.execute("SELECT key, shard FROM entries").fetchall()
        indexed = {shard for _, shard in rows}
        removed = 0
        cutoff = time.time() - min_age_s
        for path in files:
            if path.name not in indexed and _mtime(path) <= cutoff:
                path.unlink(missing_ok=True)
                removed += 1
        names = {p.name for p in files}
        for key, shard in rows:
            if shard not in names and not (self.shards_dir / shard).exists():
                self._drop_row(key, shard)
                removed += 1
        return removed

    def _drop_row(self, key: str, shard: str) -> None:
        # Match the shard too, so a row that a concurrent put just replaced survives.
        with self._transaction() as conn:
            conn.execute("DELETE FROM entries WHERE key = ? AND shard = ?", (key, shard))

    def _unlink_shards(self, shards: Sequence[str]) -> None:
        for shard in shards:
            (self.shards_dir / shard).unlink(missing_ok=True)

    # ---- SQLite --------------------------------------------------------------------------

    def _init_index(self) -> None:
        with self._connect() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise CacheError(
                    f"The cache index {self.index_path} has schema version {version}, this "
                    f"thoughtscope reads {SCHEMA_VERSION}; delete {self.root} or set {ENV_VAR}."
                )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close this thread's index connection (others close when their threads end)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            conn.close()

    def _thread_connection(self) -> sqlite3.Connection:
        # One connection per thread, reopened after a fork: a sqlite3 connection must not
        # cross either. Kept open because closing the last one checkpoints the WAL (slow).
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        conn = sqlite3.connect(self.index_path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        conn.row_factory = sqlite3.Row
        # No fsync per commit, so the write lock is held briefly. A power cut can only lose
        # the last commits, which leaves shards without rows: orphans, not damage.
        conn.execute("PRAGMA synchronous=NORMAL")
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            yield self._thread_connection()
        except sqlite3.Error as err:
            raise CacheError(
                f"The cache index {self.index_path} failed: {err}. If it is damaged, "
                f"delete {self.root}."
            ) from err

    @contextmanager
    def _transaction(self, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Iterator[sqlite3.Connection]:
        with self._connect() as conn:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            try:
                # IMMEDIATE takes the write lock up front: two writers queue, never deadlock.
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")


# ---- helpers ---------------------------------------------------------------------------


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise BadInputError(
            f"{what} must be JSON-able (str, number, bool, None, list, dict with str keys; "
            f"no NaN): {err}."
        ) from err


def _check_key_args(fingerprint: Any, prompt: Any, settings: Any, sites: Any) -> None:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise BadInputError(f"The model fingerprint must be a non-empty str, got {fingerprint!r}.")
    if not isinstance(prompt, str):
        raise BadInputError(f"The prompt must be a str, got {type(prompt).__name__}.")
    if not isinstance(settings, Mapping):
        raise BadInputError(f"settings must be a dict, got {type(settings).__name__}.")
    # A bare str is a sequence of characters; accepting it would key on single letters.
    if isinstance(sites, str) or not isinstance(sites, Sequence):
        raise BadInputError(f"sites must be a list of site names, got {sites!r}.")
    for site in sites:
        if not isinstance(site, str) or not site:
            raise BadInputError(f"Every site must be a non-empty str, got {site!r}.")


def _canonical_sites(sites: Sequence[str]) -> builtins.list[str]:
    return sorted(set(sites))


def _checked_meta(meta: Any) -> Mapping[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise BadInputError(f"meta must be a dict or None, got {type(meta).__name__}.")
    return meta


def _checked_tensors(tensors: Any) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise BadInputError(
            f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}."
        )
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name:
            raise BadInputError(f"Every tensor name must be a non-empty str, got {name!r}.")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise BadInputError(
                f"tensors[{name!r}] must be a dense torch.Tensor, got {type(tensor).__name__}."
            )
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses tensors that share memory; views of one capture are common.
        if storage in seen_storages and tensor.numel():
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def _write_temp(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    try:
        safetensors.torch.save_file(tensors, path, metadata={"thoughtscope_cache_key": key})
    except (ValueError, TypeError, safetensors.SafetensorError) as err:
        path.unlink(missing_ok=True)
        raise BadInputError(f"These tensors cannot be stored as safetensors: {err}.") from err
    # Flush the data before the rename publishes it, so a power cut cannot index a hole.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")  # already gone: nothing to remove


def _info_from_row(row: sqlite3.Row) -> EntryInfo:
    return EntryInfo(
        key=row["key"],
        fingerprint=row["fingerprint"],
        prompt=row["prompt"],
        settings=json.loads(row["settings_json"]),
        sites=json.loads(row["sites_json"]),
        created=row["created"],
        last_access=row["last_access"],
        nbytes=row["nbytes"],
        meta=json.loads(row["meta_json"]),
    )
