"""Site captures through nnsight: the same site names read inside an nnsight trace, locally or on NDIF.

`ndif:` models have no weights here, so the engine's own hooks cannot run; nnsight's remote
execution runs the trace on NDIF instead. The same function with `remote=False` runs locally,
which is how the tests check that nnsight reads exactly what the engine's hooks read.
"""

from __future__ import annotations

from typing import Any

import torch

from probes.hooks import to_canonical
from probes.sites import Site

# Execution order of the parts inside one decoder layer: nnsight wants modules read in the
# order the forward pass reaches them.
_PART_ORDER = {("layer", "input"): 0, ("q_proj", "output"): 1, ("k_proj", "output"): 2, ("v_proj", "output"): 3,
               ("o_proj", "input"): 4, ("attn", "output"): 5, ("router", "output"): 6, ("mlp", "output"): 7,
               ("layer", "output"): 8, ("lm_head", "output"): 9}


def _envoy(lm: Any, path: str) -> Any:
    env = lm
    for part in path.split("."):
        env = env[int(part)] if part.isdigit() else getattr(env, part)
    return env


def _read_order(site: Site) -> tuple[int, int]:
    layer = -1 if site.layer is None else site.layer
    key = (site.spec.part, site.spec.read)
    return (layer if site.layer is not None else 10**6, _PART_ORDER[key])


def nnsight_capture(handle: Any, ids: list[int], sites: list[Site], remote: bool = False) -> dict[str, torch.Tensor]:
    """{site: [seq, ...]} for one sequence, plus `logits`, read through `handle.nnsight` (NDIF if `remote`)."""
    from thoughtscope.errors import BadInputError

    lm = handle.nnsight
    family = handle.family
    needs_eager = any(s.spec.needs_eager_attention for s in sites)
    if needs_eager and remote:
        raise BadInputError("attention patterns need eager attention, which a remote NDIF model does not run; "
                            "capture attn_out/q/k/v remotely, or load the model locally with hf:")
    saved_impl = handle.model.config._attn_implementation if needs_eager else None
    if needs_eager and saved_impl != "eager":
        handle.model.set_attn_implementation("eager")
    try:
        return _capture(lm, handle, ids, sites, family, remote)
    finally:
        if needs_eager and saved_impl != "eager":
            handle.model.set_attn_implementation(saved_impl)


def _capture(lm: Any, handle: Any, ids: list[int], sites: list[Site], family: str, remote: bool):
    wanted = sorted({(s.module_path(family), s.spec.read, _read_order(s)) for s in sites}, key=lambda r: r[2])
    head = (Site("logits", None).module_path(family), "output", (10**6, 9))
    if head not in wanted:
        wanted.append(head)
    saved: dict[tuple[str, str], Any] = {}
    with lm.trace(torch.tensor([ids]), remote=remote):
        for path, read, _ in wanted:
            env = _envoy(lm, path)
            saved[(path, read)] = (env.input if read == "input" else env.output).save()
    out: dict[str, torch.Tensor] = {}
    for site in [*sites, Site("logits", None)]:
        value = saved[(site.module_path(family), site.spec.read)]
        if isinstance(value, tuple):
            value = value[site.spec.index or 0]
        out[site.name] = to_canonical(site, value, handle.arch, 1)[0].detach()
    return out
