"""Shipped result of the contrast page (`thoughtscope ship contrast`): reflection steps against the rest on
`toy-reasoner:small`'s planted dev traces, at the difference of means of both layers and the head
norms of layer 1 (no SAE: it would have to ship too). Stored as `contrast.json` (the result) and
`direction.safetensors` (the top direction, for the Steering page): a few kB.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from analyses.contrast.core import ContrastSettings, export_direction, save_direction
from analyses.contrast.run import run_contrast
from probes.engine import Engine
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "contrast"
MODEL = "toy-reasoner:small"
SITES = ("direction:resid_post.0", "direction:resid_post.1", "heads:1")
RULE = "kind:reflection"
N_TRACES = 60


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None) -> Path:
    engine = Engine.from_id(model_id)
    info = engine.info()
    started = time.perf_counter()
    settings = ContrastSettings(seed=0)
    result, steps, sites = run_contrast(engine, list(SITES), RULE, settings, organism=N_TRACES, split="dev")
    row = next(r for r in result.top if r["kind"] == "direction")
    vector, site = export_direction(result, row, sites)
    record = provenance(info, data=f"toy-reasoner dev x{N_TRACES}", split="dev", seed=0, command=f"ship {NAME}",
                        settings={"rule": RULE, "sites": list(SITES), **settings.__dict__})
    files: dict[str, Any] = {"contrast.json": {"result": result.to_dict(), "steps": steps.describe()},
                             "direction.safetensors": save_direction(vector, site, None, meta={"row": row["site"]})}
    return shipped.write(NAME, model_id, info["fingerprint"], files, command=command, provenance=record, root=root,
                         build_seconds=round(time.perf_counter() - started, 1))


SHIPPED = {NAME: (MODEL, build)}
