"""One provenance record for every figure, CLI JSON output and cache entry (DESIGN.md, Conventions).

A result carries it under a top-level `provenance` key, so a figure can be rebuilt and rerun:
model id and fingerprint, the prompt or data set and split, the seed, the settings, the
interventions, and the package version. A leaf module: it imports nothing of the project, and
takes plain values (a backend's `info()` dict, interventions as their descriptions or specs).

Example:
    >>> rec = provenance({"model_id": "tiny-random:llama", "fingerprint": "ab12"}, data="arith", split="eval",
    ...                  seed=3, settings={"n": 10})
    >>> rec["model"], rec["data"], rec["split"], rec["seed"], rec["settings"]
    ('tiny-random:llama', 'arith', 'eval', 3, {'n': 10})
    >>> with_provenance({"accuracy": 0.5}, rec)["provenance"]["fingerprint"]
    'ab12'
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

from thoughtscope import __version__

KEY = "provenance"


def provenance(model_info: Mapping[str, Any] | None = None, *, prompt: Any = None, data: str | None = None,
               split: str | None = None, seed: int | None = None, settings: Mapping[str, Any] | None = None,
               interventions: Sequence[Any] = (), command: str | None = None, **extra: Any) -> dict[str, Any]:
    """The record: what produced a result, in plain JSON values."""
    info = dict(model_info or {})
    return {
        "model": info.get("model_id"),
        "fingerprint": info.get("fingerprint"),
        "prompt": _plain(prompt),
        "data": data,
        "split": split,
        "seed": seed,
        "settings": _plain(dict(settings or {})),
        "interventions": [_describe(iv) for iv in interventions],
        "command": command,
        "version": __version__,
        # the correctness badge of the model as loaded (probes.validate), as the backend's info() reports it
        "validation": _plain(info.get("validation")),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **{k: _plain(v) for k, v in extra.items()},
    }


def with_provenance(payload: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """`payload` with the record under the top-level `provenance` key (a copy; the payload is not changed)."""
    return {**payload, KEY: dict(record)}


def _describe(iv: Any) -> Any:
    if hasattr(iv, "describe") and callable(iv.describe):
        return iv.describe()
    return _plain(iv)


def _plain(value: Any) -> Any:
    """JSON-ready: dicts, lists, strings, finite numbers (non-finite -> None), tensors and arrays as lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    return str(value)
