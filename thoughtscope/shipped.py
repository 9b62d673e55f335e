"""Shipped results: small files the pages open on, made once by the project's own commands.

A shipped result is a folder `docs/shipped/<model>/<name>/` holding its files (safetensors and JSON
only) and a `manifest.json`: the model id and fingerprint it was made on, the exact command that
rebuilds it, the provenance record of the run, and the sha256 of every file. A page asks
`find(name, model_id, fingerprint)` and gets the result only when

- the manifest names the loaded model and its fingerprint (a result of another model, or of other
  weights under the same id, is never shown as this model's), and
- every file's sha256 matches (a damaged file is reported, never trusted).

Otherwise it gets a `Missing` that says why, so the page can say so and offer to run the work
itself. A leaf module: it imports nothing of the project but `thoughtscope.errors` and `thoughtscope.numerics`.

Each manifest records `numerics`, the fingerprint of the float arithmetic it was made on
(`thoughtscope.numerics`): a rebuild on the same numerics gives the same bytes, one made on another kind of
CPU the same result within float tolerance.

Budget: everything under `docs/shipped/` together stays under `BUDGET_BYTES` (checked by a test).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thoughtscope import numerics
from thoughtscope.errors import BadInputError

ROOT = Path(__file__).resolve().parents[1] / "docs" / "shipped"
ENV = "THOUGHTSCOPE_SHIPPED_DIR"  # tests point it at a private folder
BUDGET_BYTES = 30 * 1024 * 1024
ALLOWED_SUFFIXES = (".safetensors", ".json")
MANIFEST = "manifest.json"


def shipped_root() -> Path:
    env = os.environ.get(ENV)
    return Path(env) if env else ROOT


def model_folder_name(model_id: str) -> str:
    """A model id as a folder name (`toy-moe:small` -> `toy-moe_small`)."""
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in model_id)


def folder_for(name: str, model_id: str, root: Path | None = None) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise BadInputError(f"a shipped result's name is one plain word, not {name!r}")
    return (root or shipped_root()) / model_folder_name(model_id) / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Shipped:
    """A verified shipped result: read its files with `path(name)` / `json(name)`."""

    folder: Path
    manifest: dict[str, Any]

    @property
    def command(self) -> str:
        return self.manifest["command"]

    @property
    def provenance(self) -> dict[str, Any]:
        """The result's provenance record, its `command` the manifest's: the command that rebuilds this stored
        result (`thoughtscope ship NAME`; a record written by the build may name none, or a shorter form)."""
        record = dict(self.manifest.get("provenance", {}))
        if self.manifest.get("command"):
            record["command"] = self.manifest["command"]
        return record

    @property
    def created(self) -> str:
        return self.manifest.get("created", "")

    def path(self, name: str) -> Path:
        if name not in self.manifest["files"]:
            raise BadInputError(f"the shipped result {self.folder.name} has no file {name!r}")
        return self.folder / name

    def json(self, name: str) -> Any:
        return json.loads(self.path(name).read_text())

    def label(self) -> str:
        """One line for the page: what this is and how to rebuild it. The model id is code: in Streamlit's
        Markdown a bare `toy-vlm:small` reads as a text directive (`:small`) and is drawn as "toy-vlm"."""
        return (f"A stored result, made on {self.manifest.get('created', '?')[:10]} by `{self.command}` "
                f"on `{self.manifest['model_id']}` (fingerprint {self.manifest['fingerprint']}).")


@dataclass(frozen=True)
class Missing:
    """Why no shipped result can be shown: `reason` is for the user; `damaged` marks a broken file."""

    reason: str
    damaged: bool = False
    files: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:  # `if found:` reads naturally
        return False


def find(name: str, model_id: str, fingerprint: str | None, root: Path | None = None) -> Shipped | Missing:
    """The shipped result `name` of `model_id`, verified; or a `Missing` saying why not."""
    folder = folder_for(name, model_id, root)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return Missing(f"no stored {name} result ships for {model_id}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = dict(manifest["files"])
        shipped_fp = manifest["fingerprint"]
        manifest["command"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return Missing(f"the stored {name} result of {model_id} has a damaged manifest ({err}); it is not used",
                       damaged=True, files=(MANIFEST,))
    if manifest.get("model_id") != model_id:
        return Missing(f"the stored {name} result in {folder} was made on {manifest.get('model_id')!r}, "
                       f"not {model_id!r}")
    if fingerprint is not None and shipped_fp != fingerprint:
        return Missing(f"the stored {name} result was made on other weights of {model_id} (fingerprint "
                       f"{shipped_fp}; loaded {fingerprint}), so it is not shown as this model's")
    bad = []
    for file, digest in files.items():
        path = folder / file
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(file)
    if bad:
        return Missing(f"the stored {name} result of {model_id} is damaged ({', '.join(sorted(bad))} does not match "
                       "its checksum); it is not used and can be rebuilt", damaged=True, files=tuple(sorted(bad)))
    return Shipped(folder, manifest)


def write(name: str, model_id: str, fingerprint: str, files: dict[str, Path | bytes | Any], *, command: str,
          provenance: dict[str, Any] | None = None, root: Path | None = None, **extra: Any) -> Path:
    """Write a shipped result (replacing an older one): `files` maps a file name (`.json` or
    `.safetensors`) to a path to copy, raw bytes, or (for `.json`) a JSON-able value."""
    folder = folder_for(name, model_id, root)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    digests = {}
    for file, content in files.items():
        if not file.endswith(ALLOWED_SUFFIXES) or "/" in file or file == MANIFEST:
            raise BadInputError(f"a shipped file is safetensors or JSON with a plain name, not {file!r}")
        target = tmp / file
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(json.dumps(content, indent=1, sort_keys=True, default=_plain_default))
        digests[file] = sha256_file(target)
    manifest = {"name": name, "model_id": model_id, "fingerprint": fingerprint, "command": command,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "files": digests, "provenance": provenance or {}, **numerics.describe(), **extra}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=_plain_default))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def total_bytes(root: Path | None = None) -> int:
    base = root or shipped_root()
    return sum(p.stat().st_size for p in base.rglob("*") if p.is_file()) if base.exists() else 0


def _plain_default(value: Any) -> Any:
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def rebuild_differences(new: Shipped, old: Shipped, ignore: dict[str, set[str]] | None = None,
                        exact: bool | None = None, atol: dict[str, float] | None = None) -> list[str]:
    """How a rebuilt result `new` differs from the shipped `old`: empty when they agree.

    On the float arithmetic `old` was made on (`numerics.same_numerics`, or `exact=True`) every file must be
    the same bytes; made elsewhere, JSON files must agree within `numerics.RTOL`/`ATOL` on floats and exactly
    on everything else, and safetensors files must hold the same names, dtypes, shapes and metadata with
    values within the same tolerance (float16 files: one float16 step). `ignore` names top-level JSON fields
    left out per file (wall-clock timings); `atol` widens the absolute tolerance of one JSON file's floats made
    elsewhere (rank statistics over near-tied values move by more than the last bits)."""
    ignore = ignore or {}
    exact = numerics.same_numerics(old.manifest) if exact is None else exact
    out: list[str] = []
    if set(new.manifest["files"]) != set(old.manifest["files"]):
        return [f"files: {sorted(set(new.manifest['files']) ^ set(old.manifest['files']))} in one only"]
    for name in sorted(old.manifest["files"]):
        a, b = new.path(name), old.path(name)
        if name.endswith(".json"):
            ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
            if isinstance(ja, dict) and isinstance(jb, dict):
                ja, jb = ({k: v for k, v in j.items() if k not in ignore.get(name, set())} for j in (ja, jb))
            out += [f"{name}: {m}" for m in (([] if ja == jb else ["differs"]) if exact
                                             else numerics.mismatches(ja, jb, atol=(atol or {}).get(
                                                 name, numerics.ATOL)))]
        elif not _same_tensors(a, b, exact=exact):
            out.append(f"{name}: " + ("not the same tensors and metadata" if exact
                                      else "tensors differ beyond float tolerance (or names, shapes, metadata)"))
    return out


def _same_tensors(a: Path, b: Path, exact: bool) -> bool:
    """Safetensors files compared by content: a header's metadata order varies between writes."""
    import torch
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        if fa.metadata() != fb.metadata() or set(fa.keys()) != set(fb.keys()):
            return False
        for key in fa.keys():
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if exact or not x.is_floating_point():  # integer tensors (token ids, counts) never drift
                if not torch.equal(x, y):
                    return False
                continue
            step = torch.finfo(y.dtype).eps if y.dtype in (torch.float16, torch.bfloat16) else numerics.RTOL
            # the last bits of a float32 sum scale with its largest terms: near-zero entries of a tensor whose
            # entries reach 165 move by 2e-5 on another CPU kind, hence an absolute tolerance by the tensor's size
            scale = max(1.0, float(y.double().abs().max())) if y.numel() else 1.0
            if not torch.allclose(x.double(), y.double(), rtol=step, atol=numerics.ATOL * scale):
                return False
    return True
