"""The `--ray` and `--replicas` options of the eval commands, and the runner they open (or none)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import typer

from thoughtscope.errors import BadInputError

RAY_OPTION = typer.Option(None, "--ray", help="run the evaluation on Ray model replicas: auto (RAY_ADDRESS, else a "
                                              "local cluster on this machine) or a cluster address host:port")
REPLICAS_OPTION = typer.Option(None, "--replicas", help="model replicas (Ray actors; default: as many as the "
                                                        "cluster has room for, one per GPU or per CPU)")


def ray_runner(model: str, server: str | None, ray: str | None, replicas: int | None) -> Any:
    """A started `RayRunner` (its replicas loaded) as a context manager when `--ray` is given, else a context
    yielding None. Started before the command loads its own model, so a cluster that is not there, or too
    small, is said within seconds."""
    if ray is None:
        if replicas is not None:
            raise BadInputError("--replicas needs --ray (auto or a cluster address)")
        return nullcontext(None)
    if server:
        raise BadInputError("--ray runs one model replica per Ray actor; give --model, not --server")
    from analyses.distributed.runner import RayRunner

    return RayRunner(model, address=ray, replicas=replicas).start()
