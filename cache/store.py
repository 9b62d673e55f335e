"""The on-disk store of traces and activations, so a trace recorded once is reused, not recomputed.

An entry is a set of named tensors (one safetensors shard per entry under `root/shards/`) plus
JSON metadata, found through a SQLite index (`root/index.sqlite`). It is keyed by the model
fingerprint, the prompt, the generation settings and the hook sites, so changing any of them
misses the cache instead of returning stale activations. Nothing is pickled.

Crash safety: a shard is written to a temporary file, fsynced and renamed into place before its
index row is inserted, so a killed writer leaves at worst an unindexed shard (an orphan) that
readers never see and `vacuum()` removes. An index row whose shard is missing reads as absent
and is dropped.

Damage: each index row holds the sha256 of its shard's bytes, checked on every read. A shard
that fails it, does not parse, or is not a plain file raises `CacheError` once; its row is
dropped (and a damaged file removed), so the next read is a plain miss and the entry is
recomputed. Shard names read from the index must be plain shard names that resolve inside
`root/shards/`: any other (a hand-edited absolute path, `..`, a link out of the store) is
refused and the path is never opened or deleted. A damaged index (`PRAGMA quick_check` on open)
raises `CacheError` and deletes nothing.

Size cap: with `max_bytes` set, each `put` evicts entries in order of oldest access first
(`get` counts as an access) until the store fits again. The entry just written is never evicted;
an entry that alone exceeds the cap is refused with `CacheError`. Capped writers hold a file
lock (`root/write.lock`) from writing their shard until the evicted shards are unlinked, so
the files under `root/shards/` never take more than `max_bytes` plus the one shard being
written, however many threads and processes write (leftovers of killed writers count until
`vacuum()` removes them; a writer with a larger cap, or none, is bound only by its own).

Any str can be a prompt, fingerprint, setting, site or metadata value, lone surrogates included
(they arrive from JSON and from non-UTF-8 bytes decoded with `surrogateescape`): keys hash the
UTF-8 bytes with `surrogatepass`, and a text column holds such a str as those bytes.

Several threads and processes may read while one writes: the index runs in SQLite's WAL mode
with a busy timeout, and each thread (and each process) uses its own connection. (WAL needs a
local disk, not a network file system.)

Example:
    >>> import tempfile, torch
    >>> store = ActivationStore(tempfile.mkdtemp(), max_bytes=10_000_000)
    >>> key = store.put("model@abc", "2 + 2 =", {"seed": 0}, ["resid_post.3"],
    ...                 {"resid_post.3": torch.ones(1, 4, 8)}, meta={"answer": "4"})
    >>> store.get("model@abc", "2 + 2 =", {"seed": 0}, ["resid_post.3"]).meta
    {'answer': '4'}
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import platformdirs
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_from_bytes  # safetensors only, never pickle
from safetensors.torch import save as safetensors_to_bytes
import torch

from thoughtscope import checks
from thoughtscope.errors import BadInputError, CacheError

log = logging.getLogger(__name__)

ENV_VAR = "THOUGHTSCOPE_CACHE_DIR"
INDEX_NAME = "index.sqlite"
SHARDS_DIR = "shards"
SHARD_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
WRITE_LOCK_NAME = "write.lock"
ORPHAN_MIN_AGE_S = 60.0
SCHEMA_VERSION = 2
# Long enough that a put waits out other writers' short transactions rather than failing.
BUSY_TIMEOUT_S = 30.0
# A capped put waits this long for other capped writers to finish writing their shards.
WRITE_LOCK_TIMEOUT_S = 300.0
# A read only records its access time if the index is free within this long.
TOUCH_TIMEOUT_S = 0.05

# The only shard names a row may hold: `<key>.<16 hex>.safetensors`, as `_write_shard` makes
# them. No separators and no `..`, so the name alone cannot leave `root/shards/`.
_SHARD_NAME = re.compile(r"(?P<key>[0-9a-f]{64})\.[0-9a-f]{16}\.safetensors")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
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
        meta_json TEXT NOT NULL,
        sha256 TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX IF NOT EXISTS entries_fingerprint ON entries (fingerprint)",
    "CREATE INDEX IF NOT EXISTS entries_last_access ON entries (last_access)",
)
# Statements that bring an index of version N to N + 1. Rows of version 1 have no checksum
# (''): their shard is checked for parsing, and its checksum recorded on the first good read.
_MIGRATIONS = {1: ("ALTER TABLE entries ADD COLUMN sha256 TEXT NOT NULL DEFAULT ''",)}
_COLUMN_NAMES = (
    "key", "fingerprint", "prompt_hash", "prompt", "settings_json", "sites_json",
    "created", "last_access", "nbytes", "shard", "meta_json", "sha256",
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
        checks.integer("max_bytes", max_bytes, low=1, none_ok=True)
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = max_bytes
        self.shards_dir = self.root / SHARDS_DIR
        self.index_path = self.root / INDEX_NAME
        self._local = threading.local()
        try:
            self.shards_dir.mkdir(parents=True, exist_ok=True)
            # Where shards really are, links followed: every shard path must resolve in here.
            self._real_shards_dir = self.shards_dir.resolve()
        except OSError as err:
            raise CacheError(
                f"Cannot create the cache folder {self.root}: {err}. "
                f"Set {ENV_VAR} to a writable folder."
            ) from err
        try:
            self._init_index()
            self.vacuum()
        except BaseException:
            self.close()  # hold no connection to an index we refused
            raise

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
        row = {
            "key": key, "fingerprint": _db_text(fingerprint), "prompt_hash": _sha256(prompt),
            "prompt": _db_text(prompt), "settings_json": _to_json(dict(settings), "settings"),
            "sites_json": json.dumps(_canonical_sites(sites)),
            "meta_json": _to_json(dict(_checked_meta(meta)), "meta"),
        }
        data = _serialize(tensors, key)
        self._refuse_if_over_cap(len(data))
        with self._write_lock():
            shard, checksum = self._write_shard(key, data)
            try:
                stale = self._index_entry(
                    {**row, "nbytes": len(data), "shard": shard, "sha256": checksum}
                )
            except BaseException:
                (self.shards_dir / shard).unlink(missing_ok=True)
                raise
            # Still under the lock: the next capped writer starts from a store within the cap.
            self._unlink_shards(stale)
        return key

    def _refuse_if_over_cap(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise CacheError(
                f"This entry needs {nbytes} bytes but the cache is capped at {self.max_bytes}; "
                "raise max_bytes (or capture fewer sites or tokens)."
            )

    @contextmanager
    def _write_lock(self) -> Iterator[None]:
        """Capped writers one at a time, across threads and processes; others go unhindered."""
        if self.max_bytes is None:
            yield
            return
        lock = filelock.FileLock(self.root / WRITE_LOCK_NAME, timeout=WRITE_LOCK_TIMEOUT_S)
        try:
            lock.acquire()
        except filelock.Timeout as err:
            raise CacheError(
                f"Another process has been writing to the cache in {self.root} for "
                f"{WRITE_LOCK_TIMEOUT_S:.0f} s; try again, or set {ENV_VAR} to another folder."
            ) from err
        except OSError as err:
            raise CacheError(f"Could not write to the cache in {self.root}: {err}.") from err
        try:
            yield
        finally:
            lock.release()

    def _write_shard(self, key: str, data: bytes) -> tuple[str, str]:
        """Write `data` as a new shard; return its file name and sha256."""
        # A fresh name per write: a reader that already holds the old row can still open the
        # old shard, and a replaced or evicted shard is never half-overwritten under a reader.
        shard = f"{key}.{secrets.token_hex(8)}{SHARD_SUFFIX}"
        final = self.shards_dir / shard
        temp = final.with_name(final.name + TEMP_SUFFIX)
        try:
            _write_temp(temp, data)
            os.replace(temp, final)
            _fsync_dir(self.shards_dir)
        except OSError as err:
            temp.unlink(missing_ok=True)
            raise CacheError(f"Could not write to the cache in {self.root}: {err}.") from err
        return shard, hashlib.sha256(data).hexdigest()

    def _index_entry(self, row: dict[str, Any]) -> builtins.list[tuple[str, str]]:
        """Insert the row and evict to fit the cap in one transaction; return shards to unlink."""
        key = row["key"]
        with self._transaction() as conn:
            # Stamped under the write lock, so access times follow the order of commits.
            now = time.time()
            row = {**row, "created": now, "last_access": now}
            old = conn.execute("SELECT shard FROM entries WHERE key = ?", (key,)).fetchall()
            stale = [(key, r[0]) for r in old]
            conn.execute(_INSERT, row)
            if self.max_bytes is not None:
                stale += self._evict(conn, keep=key, room=self.max_bytes - row["nbytes"])
        return stale

    @staticmethod
    def _evict(conn: sqlite3.Connection, keep: str, room: int) -> builtins.list[tuple[str, str]]:
        others = conn.execute(
            "SELECT key, shard, nbytes FROM entries WHERE key != ?"
            " ORDER BY last_access DESC, created DESC",
            (keep,),
        ).fetchall()
        # Keep the most recently used entries that fit beside the new one; the rest go.
        kept_bytes, evicted = 0, []
        for i, (_, _, nbytes) in enumerate(others):
            if kept_bytes + nbytes > room:
                evicted = others[i:]
                break
            kept_bytes += nbytes
        conn.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k, _, _ in evicted])
        return [(key, shard) for key, shard, _ in evicted]

    # ---- reading -------------------------------------------------------------------------

    def get(
        self,
        fingerprint: str,
        prompt: str,
        settings: Mapping[str, Any],
        sites: Sequence[str],
    ) -> Entry | None:
        """The entry stored under these key arguments, or None.

        Raises `CacheError` if the entry is damaged on disk; it is then dropped, so the next
        call returns None.
        """
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
            tensors = self._load_shard(key, row["shard"], row["sha256"])
            if tensors is not None:
                info = self._info_from_row(row)
                info.last_access = self._touch(key)
                return Entry(**vars(info), tensors=tensors)
        return None

    def _load_shard(self, key: str, shard: Any, checksum: Any) -> dict[str, torch.Tensor] | None:
        """The shard's tensors; None if it is gone. Damage drops the row and raises CacheError."""
        path = self._shard_path(key, shard)
        if path is None:
            self._drop_row(key, shard)
            raise CacheError(
                f"The cache index row of entry {key[:12]} names {shard!r}, which is not a shard "
                f"inside {self.shards_dir} (was the index edited by hand?). The row was dropped; "
                "nothing outside the store was read or deleted."
            )
        try:
            data = _read_plain_file(path)
        except FileNotFoundError:
            # Gone (a concurrent put replaced it, or removed by hand): a miss, not an error.
            self._drop_row(key, shard)
            return None
        except _NotAFileError as err:
            self._drop_row(key, shard)
            raise CacheError(
                f"The cached entry {key[:12]} was lost: {path} is {err}, not a file. Its index "
                f"row was dropped; remove {path} yourself (the store leaves it alone)."
            ) from err
        except OSError as err:
            raise CacheError(f"Could not read the cache shard {path}: {err}.") from err
        digest = hashlib.sha256(data).hexdigest()
        if checksum and digest != checksum:
            self._discard(key, shard, path)
            raise CacheError(
                f"The cached entry {key[:12]} was damaged on disk: {path} fails its sha256 "
                "checksum. It has been removed; run again to recompute it (and check the disk "
                "if this recurs)."
            )
        try:
            tensors = safetensors_from_bytes(data)
        except Exception as err:  # safetensors raises several kinds on bad bytes
            self._discard(key, shard, path)
            raise CacheError(
                f"The cached entry {key[:12]} was damaged on disk: {path} is not a readable "
                f"safetensors file ({err}). It has been removed; run again to recompute it."
            ) from err
        if not checksum:
            self._record_checksum(key, shard, digest)
        return tensors

    def _shard_path(self, key: Any, shard: Any) -> Path | None:
        """The path of a row's shard, or None if the row's name could lead out of the store."""
        match = _SHARD_NAME.fullmatch(shard) if isinstance(shard, str) else None
        if match is None or match["key"] != key:
            return None
        path = self.shards_dir / shard
        # A well-formed name can still be a link to elsewhere: follow links, then check.
        if path.resolve().parent != self._real_shards_dir:
            return None
        return path

    def _discard(self, key: str, shard: str, path: Path) -> None:
        self._drop_row(key, shard)
        path.unlink(missing_ok=True)

    def _record_checksum(self, key: str, shard: str, digest: str) -> None:
        # A row written before checksums existed: trust the bytes that just parsed.
        with contextlib.suppress(CacheError):  # a busy index only postpones it to a later read
            with self._transaction(TOUCH_TIMEOUT_S) as conn:
                conn.execute(
                    "UPDATE entries SET sha256 = ? WHERE key = ? AND shard = ? AND sha256 = ''",
                    (digest, key, shard),
                )

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
            query, args = query + " WHERE fingerprint = ?", (_db_text(fingerprint),)
        with self._connect() as conn:
            rows = conn.execute(query + " ORDER BY created, key", args).fetchall()
        infos = []
        for row in rows:
            path = self._shard_path(row["key"], row["shard"])
            if path is not None and path.exists():
                infos.append(self._info_from_row(row))
            else:
                if path is None:
                    log.warning("cache: dropped the index row of %s: its shard name %r is not "
                                "inside %s", row["key"], row["shard"], self.shards_dir)
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
        self._unlink_shards([(key, row[0])])
        return True

    def clear(self) -> None:
        """Remove every entry."""
        with self._transaction() as conn:
            shards = [(r[0], r[1]) for r in conn.execute("SELECT key, shard FROM entries")]
            conn.execute("DELETE FROM entries")
        self._unlink_shards(shards)

    def vacuum(self, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
        """Remove what crashed writers left: temp files and unindexed shards, and index rows
        whose shard is gone (or lies outside the store). Return how many files and rows were
        removed.

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
            path = self._shard_path(key, shard)
            if path is None or (shard not in names and not path.exists()):
                self._drop_row(key, shard)
                removed += 1
        return removed

    def _drop_row(self, key: str, shard: Any) -> None:
        # Match the shard too, so a row that a concurrent put just replaced survives.
        with self._transaction() as conn:
            conn.execute("DELETE FROM entries WHERE key = ? AND shard IS ?", (key, shard))

    def _unlink_shards(self, shards: Sequence[tuple[str, str]]) -> None:
        for key, shard in shards:
            path = self._shard_path(key, shard)
            if path is not None:  # never delete what a row names outside the store
                path.unlink(missing_ok=True)

    def _info_from_row(self, row: sqlite3.Row) -> EntryInfo:
        try:
            return EntryInfo(
                key=row["key"],
                fingerprint=_from_db_text(row["fingerprint"]),
                prompt=_from_db_text(row["prompt"]),
                settings=json.loads(row["settings_json"]),
                sites=json.loads(row["sites_json"]),
                created=float(row["created"]),
                last_access=float(row["last_access"]),
                nbytes=int(row["nbytes"]),
                meta=json.loads(row["meta_json"]),
            )
        except (TypeError, ValueError) as err:
            detail = f"a row of entry {row['key']!r} does not parse: {err}"
            raise self._damaged_index(detail) from err

    # ---- SQLite --------------------------------------------------------------------------

    def _init_index(self) -> None:
        existed = self.index_path.exists()
        with self._connect() as conn:
            if existed:
                self._check_index(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            with self._transaction() as conn:
                # Read under the write lock, so two processes never migrate the same index.
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, *_MIGRATIONS, SCHEMA_VERSION):
                    raise CacheError(
                        f"The cache index {self.index_path} has schema version {version}, this "
                        f"thoughtscope reads {SCHEMA_VERSION}; delete {self.root} or set {ENV_VAR}."
                    )
                statements = _SCHEMA if version == 0 else ()  # a new index: the latest schema
                for v in range(version or SCHEMA_VERSION, SCHEMA_VERSION):
                    statements += _MIGRATIONS[v]
                for statement in statements:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_index(self, conn: sqlite3.Connection) -> None:
        """Refuse a damaged index before anything (vacuum) acts on what it says."""
        problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise self._damaged_index(f"quick_check: {problems[0].splitlines()[-1]}")
        # An empty index beside stored shards lost its rows (it was cut to nothing, or its
        # write-ahead log was lost); a new index is created with its schema before any shard.
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            shards = [p for p in self.shards_dir.iterdir() if _SHARD_NAME.fullmatch(p.name)]
            if shards:
                raise self._damaged_index(
                    f"it is empty, but {len(shards)} shards are stored beside it"
                )

    def _damaged_index(self, detail: str) -> CacheError:
        return CacheError(
            f"The cache index {self.index_path} is damaged ({detail}). Nothing was deleted; "
            f"the entries it indexed cannot be read without it. To start an empty cache, "
            f"delete {self.root} (or just {self.index_path.name} and its -wal/-shm files; the "
            f"unindexed shards are then removed as orphans), or set {ENV_VAR} to another folder."
        )

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
        except sqlite3.DatabaseError as err:
            if "malformed" in str(err) or "not a database" in str(err):
                raise self._damaged_index(str(err)) from err
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


class _NotAFileError(OSError):
    """A shard path that is a folder, device or pipe."""


def _sha256(text: str) -> str:
    # surrogatepass: the same bytes as UTF-8 for any valid str (keys never change), and an
    # encoding for lone surrogates too; valid UTF-8 never holds those bytes, so no collisions.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _db_text(text: str) -> str | bytes:
    """`text` as SQLite can hold it: itself, or its surrogatepass bytes if it holds a lone
    surrogate (a BLOB, never equal to any TEXT, so lookups stay exact)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")
    return text


def _from_db_text(value: str | bytes) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value


def _to_json(value: Any, what: str) -> str:
    # ensure_ascii (the default) writes lone surrogates as \ud800 escapes: any str round-trips.
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


def _serialize(tensors: dict[str, torch.Tensor], key: str) -> bytes:
    """The shard's bytes; known before writing, so the cap is checked on the exact size."""
    try:
        return safetensors_to_bytes(tensors, metadata={"thoughtscope_cache_key": key})
    except (ValueError, TypeError, SafetensorError) as err:
        raise BadInputError(f"These tensors cannot be stored as safetensors: {err}.") from err


def _write_temp(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        # Flush the data before the rename publishes it, so a power cut cannot index a hole.
        f.flush()
        os.fsync(f.fileno())


def _read_plain_file(path: Path) -> bytes:
    """The bytes of a regular file; `_NotAFileError` for anything else (never blocks on a pipe)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a special file"
            raise _NotAFileError(kind)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
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
