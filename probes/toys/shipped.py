"""Shipped toy models: trained copies that live in the repository, so `make demo` never trains them.

A shipped toy is a folder `docs/shipped/models/<id>/` (`toy-moe:small` -> `toy-moe_small`) holding the
weights (`model.safetensors`), the config and tokenizer JSON files, the training report
(`trained.json`) and a `manifest.json`: the model id, the hash of the recipe it was trained from (the
same hash that names the user-cache folder, `probes.toys.common.recipe_hash`), the recipe itself, the
exact command that rebuilds the folder, the library versions, and the sha256 of every file.

The zoo loads a shipped copy only when its manifest names the id, its recipe hash equals the hash of
the recipe the code would train now (a changed generator, config or schedule gives another hash) and
every file's sha256 matches. Anything else is reported (a `ShippedModelWarning`, once per problem)
and the copy is ignored: the toy is trained into the user cache as before.

Rebuild (one CPU thread, deterministic algorithms, the recipe's seed; `probes.toys.common.training`):

    thoughtscope models ship toy-moe:small          # or: python -m probes.toys.shipped toy-moe:small

Only `.json` and `.safetensors` files are shipped: tokenizers are saved with their chat template
inside `tokenizer_config.json` (no `chat_template.jinja`).

Example:
    >>> shipped_name("toy-moe:small")
    'toy-moe_small'
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thoughtscope.errors import BadInputError, UnknownModelError
from thoughtscope.shipped import ENV, model_folder_name, sha256_file, shipped_root  # noqa: F401 (ENV: tests set it)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
REPORT = "trained.json"  # probes.toys.common.DONE_MARKER
SHIPPED_SUFFIXES = (".json", ".safetensors")
COMMAND = "thoughtscope models ship {id}"
# The report's fields that measure the machine, not the model: a rebuild differs there and only there.
TIMING_KEYS = ("seconds", "cpu_seconds", "steps_per_second", "examples_per_second", "images_per_s",
               "images_per_cpu_s")

ProgressFn = Callable[[int, int, str], None]


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


def toy_module(model_id: str):
    """The `probes.toys` module of a toy id and its size (`toy-moe:small` -> (probes.toys.moe, 'small'))."""
    import importlib

    from probes.zoo import TOY_MODELS, toy_model_ids

    if not isinstance(model_id, str) or model_id.strip() not in toy_model_ids():
        raise UnknownModelError(f"{model_id!r} is not a toy model; toy models: {', '.join(toy_model_ids())}")
    name, _, size = model_id.strip().partition(":")
    return importlib.import_module(TOY_MODELS[name][0]), size or "full"


def ship(model_id: str, root: Path | None = None, on_progress: ProgressFn | None = None,
         progress: bool = True) -> Path:
    """Train `model_id` from scratch with the project's own training code (never from the user cache)
    and write it, with its training report and manifest, to its shipped folder. Returns the folder."""
    from probes.toys.common import recipe_hash

    module, size = toy_module(model_id)
    recipe = module.recipe(size)
    target = shipped_path(model_id, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="thoughtscope-ship-") as scratch:  # never inside the shipped root
        trained = Path(scratch) / "trained"
        trained.mkdir()
        report = module.train_into(size, trained, on_progress=on_progress, progress=progress)
        (trained / REPORT).write_text(json.dumps(report, indent=2, default=str))
        out = Path(scratch) / "out"
        out.mkdir()
        _copy_shipped_files(module, trained, out)
        files = {p.name: sha256_file(p) for p in sorted(out.iterdir())}
        import torch
        import transformers

        record = {
            "model_id": model_id, "recipe_hash": recipe_hash(recipe), "recipe": recipe,
            "command": COMMAND.format(id=model_id), "python_command": f"python -m probes.toys.shipped {model_id}",
            "training_report": REPORT, "files": files,
            "bytes": {name: (out / name).stat().st_size for name in files},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "machine": platform.machine(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        (out / MANIFEST).write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        staged = target.with_name(f".{target.name}.tmp{os.getpid()}")  # hidden; renamed into place whole
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(out, staged)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target


def _copy_shipped_files(module: Any, trained: Path, out: Path) -> None:
    """The shipped files of a trained folder: JSON and safetensors only, the tokenizer's chat template
    inside tokenizer_config.json."""
    if (trained / "chat_template.jinja").is_file():
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(trained)
        for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (trained / stale).unlink(missing_ok=True)
        tok.save_pretrained(trained, save_jinja_files=False)
    for path in sorted(trained.iterdir()):
        if path.is_file() and path.name.endswith(SHIPPED_SUFFIXES) and path.name != MANIFEST:
            shutil.copyfile(path, out / path.name)


def same_training(a: Path, b: Path) -> dict[str, Any]:
    """Compare two shipped folders: which files differ byte for byte, and whether the training reports
    agree once the machine's timings (`TIMING_KEYS`) are left out."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()} - {MANIFEST})
    names = [n for n in names if n != MANIFEST]
    differ = [n for n in names if n != REPORT and (not (a / n).is_file() or not (b / n).is_file()
                                                    or sha256_file(a / n) != sha256_file(b / n))]
    ra, rb = (json.loads((f / REPORT).read_text()) for f in (a, b))
    return {"files": names, "differ": differ, "report_equal": _untimed(ra) == _untimed(rb)}


def _untimed(report: Any) -> Any:
    if isinstance(report, dict):
        return {k: _untimed(v) for k, v in report.items() if k not in TIMING_KEYS}
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m probes.toys.shipped ID [ID ...] [--out ROOT]`: rebuild shipped toy models."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m probes.toys.shipped", description=main.__doc__)
    parser.add_argument("ids", nargs="+", help="toy model ids, e.g. toy-moe:small")
    parser.add_argument("--out", default=None, help="root folder (default docs/shipped/models)")
    args = parser.parse_args(argv)
    root = Path(args.out) if args.out else None
    for model_id in args.ids:
        try:
            folder = ship(model_id, root)
        except (BadInputError, UnknownModelError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
