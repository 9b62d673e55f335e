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

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedTokenizerFast

from probes.toys.common import recipe_hash
from probes.toys.verify import (  # noqa: F401  (re-exported: `shipped.verified` and friends read as before)
    COMMAND, ENV, MANIFEST, REPORT, SHIPPED_SUFFIXES, ShippedModelWarning, manifest, models_root, problem_of,
    sha256_file, shipped_name, shipped_path, shipped_root, verified)
from probes.zoo import TOY_MODELS, toy_model_ids
from thoughtscope import numerics
from thoughtscope.errors import BadInputError, UnknownModelError

# The report's fields that measure the machine, not the model: a rebuild differs there and only there.
TIMING_KEYS = ("seconds", "cpu_seconds", "steps_per_second", "examples_per_second", "images_per_s",
               "images_per_cpu_s")

ProgressFn = Callable[[int, int, str], None]


def toy_module(model_id: str):
    """The `probes.toys` module of a toy id and its size (`toy-moe:small` -> (probes.toys.moe, 'small'))."""
    if not isinstance(model_id, str) or model_id.strip() not in toy_model_ids():
        raise UnknownModelError(f"{model_id!r} is not a toy model; toy models: {', '.join(toy_model_ids())}")
    name, _, size = model_id.strip().partition(":")
    return importlib.import_module(TOY_MODELS[name][0]), size or "full"


def ship(model_id: str, root: Path | None = None, on_progress: ProgressFn | None = None,
         progress: bool = True) -> Path:
    """Train `model_id` from scratch with the project's own training code (never from the user cache)
    and write it, with its training report and manifest, to its shipped folder. Returns the folder."""
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
        record = {
            "model_id": model_id, "recipe_hash": recipe_hash(recipe), "recipe": recipe,
            "command": COMMAND.format(id=model_id), "python_command": f"python -m probes.toys.shipped {model_id}",
            "training_report": REPORT, "files": files,
            "bytes": {name: (out / name).stat().st_size for name in files},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "machine": platform.machine(), **numerics.describe(),
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
