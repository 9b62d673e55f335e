"""Verification of shipped toy models (`probes.toys.shipped`): is the copy in `docs/shipped/models` the one
the code would train now, byte for byte?

A leaf of `probes.toys` (the standard library and `thoughtscope.shipped` only): the loaders in
`probes.toys.common` ask it before they train, and `probes.toys.shipped`, which trains and writes
shipped copies through the toy modules, imports it, so loading and shipping never import each other
in a circle.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from thoughtscope.shipped import ENV, model_folder_name, sha256_file, shipped_root  # noqa: F401 (ENV: tests set it)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
REPORT = "trained.json"  # probes.toys.common.DONE_MARKER
SHIPPED_SUFFIXES = (".json", ".safetensors")
COMMAND = "thoughtscope models ship {id}"


class ShippedModelWarning(UserWarning):
    """A shipped toy model was found but not used (damaged, or trained from another recipe)."""


def models_root() -> Path:
    """Where shipped toy models live: `$THOUGHTSCOPE_SHIPPED_DIR/models`, else `docs/shipped/models`."""
    return shipped_root() / "models"


def shipped_name(model_id: str) -> str:
    return model_folder_name(model_id)


def shipped_path(model_id: str, root: Path | None = None) -> Path:
    return (root or models_root()) / shipped_name(model_id)


_reported: set[tuple[str, str]] = set()


def _report(folder: Path, problem: str) -> None:
    """Warn once per process about one problem of one shipped folder."""
    if (str(folder), problem) in _reported:
        return
    _reported.add((str(folder), problem))
    message = f"thoughtscope: the shipped toy model in {folder} is not used: {problem}"
    log.warning(message)
    warnings.warn(message, ShippedModelWarning, stacklevel=3)


def problem_of(folder: Path, model_id: str, recipe_hash: str) -> str | None:
    """Why the shipped folder cannot be trusted for `model_id` trained from `recipe_hash` (None: it can)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = dict(manifest["files"])
        shipped_id, shipped_hash = manifest["model_id"], manifest["recipe_hash"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its manifest is unreadable ({err.__class__.__name__}: {err})"
    if shipped_id != model_id:
        return f"it holds {shipped_id!r}, not {model_id!r}"
    if shipped_hash != recipe_hash:
        return (f"it was trained from recipe {shipped_hash}, and the code now trains recipe {recipe_hash} "
                f"(rebuild it with `{COMMAND.format(id=model_id)}`)")
    for need in ("model.safetensors", "config.json", REPORT):
        if need not in files:
            return f"its manifest lists no {need}"
    bad = sorted(name for name, digest in files.items()
                 if "/" in name or not (folder / name).is_file() or sha256_file(folder / name) != digest)
    if bad:
        return f"{', '.join(bad)} does not match its sha256 in the manifest (damaged or edited)"
    return None


def verified(model_id: str, recipe_hash: str, root: Path | None = None) -> Path | None:
    """The shipped folder of `model_id` when its manifest matches `recipe_hash` and every sha256
    checks; None when there is none, or (with a `ShippedModelWarning`) when it is damaged or stale."""
    folder = shipped_path(model_id, root)
    if not folder.exists():
        return None
    # hashing ~10 MB on every app rerun would cost tens of ms: a verdict holds while no file changes
    state = (str(folder), model_id, recipe_hash, _stat(folder))
    if state not in _verdicts:
        if len(_verdicts) > 64:
            _verdicts.clear()
        _verdicts[state] = problem_of(folder, model_id, recipe_hash)
    problem = _verdicts[state]
    if problem is not None:
        _report(folder, problem)
        return None
    return folder


_verdicts: dict[tuple, str | None] = {}


def _stat(folder: Path) -> tuple:
    """(name, size, mtime) of every file: any write or replacement changes it."""
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()))
    except OSError:
        return ()


def manifest(model_id: str, root: Path | None = None) -> dict[str, Any] | None:
    try:
        return json.loads((shipped_path(model_id, root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
