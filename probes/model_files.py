"""Model folders this project builds in the user cache, and how a damaged or half-built one is found.

The zoo (SmolLM2 dequantized from its GGUF) and the toy models (trained on first use) build a folder
`<name>` the same way: under the file lock `<name>.lock`, into `<name>.tmp<pid>`, renamed into place
when whole. A build killed midway leaves its `.tmp<pid>` folder (SmolLM2's is 477 MB); the next load
removes it (`remove_stale_temps`). A cached folder can still be damaged afterwards (a full disk, a
copy cut short): `safetensors_problem` finds weights that are cut short or whose header is bad, by
reading only the header, so the caller rebuilds instead of failing with a traceback.

Example:
    >>> import tempfile, torch, safetensors.torch
    >>> path = Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> safetensors.torch.save_file({"w": torch.ones(4)}, path)
    >>> safetensors_problem(path) is None
    True
    >>> _ = path.write_bytes(path.read_bytes()[:-4])
    >>> safetensors_problem(path)
    '76 bytes, where its header describes 80 (cut short?)'
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
TEMP_INFIX = ".tmp"
# safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000
_TEMP_PID = re.compile(re.escape(TEMP_INFIX) + r"(\d+)")


def build_lock(folder: Path, timeout: float = -1):
    """The file lock every build of `folder` holds, across processes (`timeout=-1` waits)."""
    from filelock import FileLock

    return FileLock(str(folder) + LOCK_SUFFIX, timeout=timeout)


def temp_folder(folder: Path) -> Path:
    """Where this process builds `folder` before renaming it into place."""
    return folder.with_name(f"{folder.name}{TEMP_INFIX}{os.getpid()}")


def remove_stale_temps(folder: Path, locked: bool = False) -> list[Path]:
    """Remove the temporary folders that killed builds of `folder` left; return them.

    Only with the build lock: builds hold it throughout, so once we have it no build is writing.
    Unless `locked` (the caller holds it), the lock is tried without waiting; a build in progress
    keeps its folder, and a later load removes it if that build dies. A folder whose pid is a live
    process other than this one is kept too (a build by a version that did not lock).
    """
    stale = sorted(folder.parent.glob(folder.name + TEMP_INFIX + "*"))
    if not stale:
        return []
    if not locked:
        from filelock import Timeout

        try:
            with build_lock(folder, timeout=0):
                return remove_stale_temps(folder, locked=True)
        except Timeout:
            return []
    removed = []
    for path in stale:
        match = _TEMP_PID.match(path.name, len(folder.name))
        pid = int(match[1]) if match else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        log.warning("thoughtscope: removing %s, left by a build that was killed", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def replace_folder(built: Path, folder: Path) -> None:
    """Move the finished `built` folder to `folder`, replacing a damaged one (hold the lock)."""
    if folder.exists():
        # Aside under a temp name first: if we die between the renames, the next load removes it.
        aside = folder.with_name(f"{folder.name}{TEMP_INFIX}{os.getpid()}-damaged")
        folder.rename(aside)
        built.rename(folder)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        built.rename(folder)


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (missing, cut short, bad header), or None.

    Reads the header only: the file must be exactly 8 bytes + header + the tensors it describes.
    """
    path = Path(path)
    try:
        if not path.exists():
            return "missing"
        if not path.is_file():
            return "not a file"
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, too short for a header"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                return f"{size} bytes, but its header claims {n} bytes of header"
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except OSError as err:
        return f"unreadable ({err})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        return f"bad header ({err.__class__.__name__}: {err})"
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{size} bytes, where its header describes {expected} (cut short?)"
    return None


def folder_problem(folder: Path, weights: str = "model.safetensors", json_files: tuple[str, ...] = ()) -> str | None:
    """Why a cached model folder cannot be used (weights not whole, a JSON file missing or cut), or None.

    JSON files are checked for their closing brace, not parsed: a cut-short file lacks it, and a
    tokenizer.json takes 0.1 s to parse, paid by every process that loads a model.
    """
    problem = safetensors_problem(folder / weights)
    if problem is not None:
        return f"{weights}: {problem}"
    for name in json_files:
        try:
            with open(folder / name, "rb") as f:
                f.seek(max(0, (folder / name).stat().st_size - 64))
                tail = f.read().rstrip()
        except OSError as err:
            return f"{name}: {err.__class__.__name__}: {err}"
        if not tail.endswith(b"}"):
            return f"{name}: cut short (no closing brace)"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OverflowError:
        return False
    return True
