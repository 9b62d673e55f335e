"""`ndif_local_overhead`: what the NDIF path costs over the engine's hooks, rehearsed here.

A capture of 3 sites through nnsight `remote="local"` (the request serialised as NDIF would receive it,
deserialised and run with this project unimportable; probes.ndif) / the same capture by the
in-process engine, on the same weights, timed in alternation and compared by medians. The ratio is what
serialisation and nnsight's interleaving add; a real NDIF run adds the network and the queue on top.

The rehearsal is strict (probes.ndif.StrictRehearsal): each request ships probes/thoughtscope by value and
is deserialised with the project unimportable, so the ratio includes serialising the shipped project code
and rebuilding its classes from source per request (as a server would), not a re-import of the project.
"""

from __future__ import annotations

import statistics
from typing import Any

from probes.engine import Engine
from probes.ndif import rehearse
from probes.timing import STORY, alternate_pair, sig


def bench_ndif_local_overhead(engine: Engine, repeats: int = 9, tokens: int = 128) -> dict[str, Any]:
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
            "note": "nnsight remote='local', strict: serialisation (the project's code by value) + rebuilding "
                    "it from source + interleaving, no network"}
