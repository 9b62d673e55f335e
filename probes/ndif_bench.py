"""`ndif_local_overhead`: what the NDIF path costs over the engine's hooks, rehearsed here.

A capture of 3 sites through nnsight `remote="local"` (the request serialised as NDIF would receive it,
deserialised with this project's modules hidden, run here; probes.ndif) / the same capture by the
in-process engine, on the same weights, timed in alternation and compared by medians. The ratio is what
serialisation and nnsight's interleaving add; a real NDIF run adds the network and the queue on top.

The rehearsal deserialises each request with this project's modules hidden from sys.modules, so every
request re-imports them (a real server imports once); `byte_compile_project` runs first so that re-import
reads bytecode rather than recompiling source (PYTHONDONTWRITEBYTECODE leaves none on disk), which would
otherwise double the ratio on the tiny model.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from probes.engine import Engine
from probes.ndif import rehearse
from probes.timing import STORY, alternate_pair, sig


def byte_compile_project(packages: tuple[str, ...] = ("probes", "thoughtscope")) -> None:
    """Byte-compile the project's packages into their (git-ignored) __pycache__; an import still recompiles a
    module whose source changed since. A file that does not compile, or a read-only tree, is left alone."""
    import py_compile

    root = Path(__file__).resolve().parent.parent
    for package in packages:
        for path in (root / package).rglob("*.py"):
            try:
                py_compile.compile(str(path), doraise=True)
            except (py_compile.PyCompileError, OSError):
                pass


def bench_ndif_local_overhead(engine: Engine, repeats: int = 9, tokens: int = 128) -> dict[str, Any]:
    byte_compile_project()
    rehearsal = Engine(rehearse(engine.handle))
    ids = (engine.encode(STORY) * 20)[:tokens]
    n = engine.handle.arch.n_layers
    sites = [f"resid_post.{n // 2}", f"mlp_out.{n // 2}", f"attn_out.{n - 1}"]

    def local() -> None:
        engine.capture(ids, sites)

    def through_nnsight() -> None:
        rehearsal.capture(ids, sites)

    te, tn = alternate_pair(local, through_nnsight, repeats)
    ratio = statistics.median(tn) / statistics.median(te)
    return {"bench": "ndif_local_overhead", "ratio": round(ratio, 3), "sites": sites, "tokens": tokens,
            "engine_s": sig(statistics.median(te)), "ndif_local_s": sig(statistics.median(tn)),
            "note": "nnsight remote='local': serialisation + interleaving + the rehearsal's re-import of this "
                    "project per request (bytecode), no network"}
