"""Sharded models: a model placed by a `device_map` (accelerate's dispatch hooks), checked before any work.

`--device-map` (the zoo's `device_map=`) takes accelerate's strategies (`auto`, `balanced`,
`balanced_low_0`, `sequential`: layers over this machine's GPUs, the rest offloaded to the CPU), or an
explicit map, module name -> device (`0`, `"cuda:1"`, `"cpu"`, `"disk"`), as JSON text or a `.json`
file. An explicit map must place every parameter and buffer of the model, name only modules the
model has, and only devices this machine has; otherwise a `BadInputError` says which modules are
missing or wrong, before anything is loaded onto a device.

A zoo model (smollm2-135m, the toys, tiny-random) is loaded whole, fingerprinted, then dispatched;
an `hf:` model is dispatched by transformers' `from_pretrained(device_map=...)`. accelerate moves
each module's inputs to its device in a forward pre-hook and leaves module outputs where they were
computed, so the engine's site reads and interventions (which follow the tensor they edit) and its
KV policies see the same numbers as on one device (tests/test_sharded.py; on GPUs
`probes.sharding_bench.check_split`, run by benchmarks.gpu).

    map = parse_device_map('{"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",'
                           ' "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}')
    engine = Engine.from_id("tiny-random:llama", device_map=map)
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from thoughtscope.errors import BadInputError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOAD_DEVICES = ("cpu", "disk")



def parse_device_map(spec: Any) -> str | dict[str, Any] | None:
    """None, a strategy name, or an explicit map (a dict, JSON text or a .json file) with its devices checked."""
    if spec is None or isinstance(spec, dict):
        return None if spec is None else {str(k): check_device(v, str(k)) for k, v in spec.items()}
    text = str(spec).strip()
    if text in STRATEGIES:
        return text
    if text.endswith(".json") and not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise BadInputError(f"--device-map {text}: no such file (give a strategy {', '.join(STRATEGIES)}, "
                                "JSON text or a .json file)")
        text = path.read_text()
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadInputError(f"--device-map takes {', '.join(STRATEGIES)}, a JSON object module -> device or a .json "
                            f"file; got {str(spec)[:80]!r} ({err.msg})") from None
    if not isinstance(mapping, dict) or not mapping:
        raise BadInputError("--device-map JSON must be a non-empty object, module name -> device, e.g. "
                            '{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}')
    return {str(k): check_device(v, str(k)) for k, v in mapping.items()}


def check_device(device: Any, module: str) -> Any:
    """A device this machine has: a GPU index or "cuda:N" (N < the GPU count), "cpu" or "disk"."""
    if isinstance(device, str) and device in OFFLOAD_DEVICES:
        return device
    index = device
    if isinstance(device, str) and device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if device[4:5] == ":" and device[5:].isascii() and device[5:].isdigit() else (
            0 if device == "cuda" else None)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BadInputError(f"device map: {module!r} -> {device!r} is not a device; use a GPU index (0, 1, ...), "
                            "'cuda:N', 'cpu' or 'disk'")
    if index >= torch.cuda.device_count():
        raise BadInputError(f"device map: {module!r} -> {device!r}, but this machine has "
                            f"{torch.cuda.device_count()} CUDA GPU(s); map it to 'cpu' or 'disk', or to a GPU it has")
    return index


def covers(key: str, name: str) -> bool:
    return key == "" or name == key or name.startswith(key + ".")


def check_coverage(model: torch.nn.Module, device_map: dict[str, Any]) -> None:
    """Refuse a map that names a module the model lacks, or leaves a parameter or buffer unplaced."""
    modules = dict(model.named_modules())
    unknown = [key for key in device_map if key and key not in modules]
    if unknown:
        near = sorted(n for n in modules if n.count(".") <= 2 and n)[:12]
        raise BadInputError(f"the device map names {', '.join(map(repr, unknown[:5]))}, which this model does not have; "
                            f"its modules include {', '.join(near)}")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    missing = [n for n in names if not any(covers(k, n) for k in device_map)]
    if missing:
        owners = sorted(uncovered_modules(names, set(missing)))
        raise BadInputError(f"the device map does not cover the model: {len(missing)} parameters/buffers have no "
                            f"device, in {', '.join(owners[:8])}{' ...' if len(owners) > 8 else ''}; add these "
                            "modules (or a prefix of them, '' for the rest) to the map")


def uncovered_modules(names: list[str], missing: set[str]) -> set[str]:
    """The largest modules whose parameters and buffers are all in `missing` (what to add to the map)."""
    out = set()
    for name in missing:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if all(n in missing for n in names if covers(prefix, n)):
                out.add(prefix if depth < len(parts) else name.rsplit(".", 1)[0])
                break
    return out


def resolve(model: torch.nn.Module, spec: str | dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """An explicit map for `model`: a strategy worked out by accelerate, or the given map checked."""
    if isinstance(spec, dict):
        check_coverage(model, spec)
        return spec
    if torch.cuda.device_count() == 0:
        return {"": "cpu"}  # no GPU: every strategy places the whole model on the CPU
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    max_memory = None
    if spec != "sequential":
        max_memory = get_balanced_memory(model, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=spec == "balanced_low_0")
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)


def dispatch(model: torch.nn.Module, spec: str | dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """`model` (loaded whole, on the CPU) placed by `spec` with accelerate's hooks; `hf_device_map` records it."""
    from accelerate import dispatch_model

    device_map = resolve(model, spec, dtype)
    offload_dir = None
    if "disk" in device_map.values():
        offload_dir = tempfile.mkdtemp(prefix="thoughtscope-offload-")
    gpus = [d for d in device_map.values() if d not in OFFLOAD_DEVICES]
    main = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
    model = dispatch_model(model, device_map=device_map, main_device=main, offload_dir=offload_dir,
                           offload_buffers=False, force_hooks=True)
    model.hf_device_map = dict(device_map)
    if offload_dir is not None:
        weakref.finalize(model, shutil.rmtree, offload_dir, ignore_errors=True)
    return model


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the input embedding's execution device for a dispatched model (its weights
    may sit on the CPU, on disk or on meta), else the device of its first parameter."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return next(model.parameters()).device
    emb = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is emb)
    key = max((k for k in device_map if covers(k, name)), key=len, default=None)
    device = device_map.get(key, "cpu") if key is not None else "cpu"
    if device in OFFLOAD_DEVICES:
        gpus = [d for d in device_map.values() if d not in OFFLOAD_DEVICES]
        return torch.device("cuda", _index(gpus[0])) if gpus else torch.device("cpu")
    return torch.device("cuda", _index(device))


def _index(device: Any) -> int:
    return int(str(device).split(":")[-1]) if not isinstance(device, int) else device

