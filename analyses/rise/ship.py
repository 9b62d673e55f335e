"""Shipped results of RISE: the harvest and SAEs the page opens on (`thoughtscope ship rise-saes`).

The page's default run for a model (`page_options`: 12 arith problems, greedy, 48 tokens, templated
reflection/backtracking steps spliced in for small models, one SAE per default layer, 300 steps,
UMAP) made by `RisePipeline` in private folders, seeded, on one thread. Stored as plain files:

- `harvest.json`: the traces (problem, prompt and generated token ids, token texts), settings, rows;
- `acts.safetensors`: one step vector per row and site;
- `sae.<site>.safetensors` + `sae.<site>.cfg.json`: each SAE in SAELens' format (its folder's two
  files under one name each; `load` puts them back into a folder SAELens reads);
- `analysis.json`: the decoder map of each SAE (UMAP coordinates, silhouettes), the held-out rows,
  and the analysis summary as the page shows it.

`load` rebuilds the page's result from them: steps re-cut and re-labelled by the harvest's own code,
the analysis recomputed except the projection (UMAP is the slow part, so its coordinates are read).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from analyses.families import default_task
from analyses.organism import is_organism
from analyses.rise.columns import analyse
from analyses.rise.harvest import Harvest, HarvestSettings, _make_trace, judge_for
from analyses.rise.labels import label_step
from analyses.rise.pipeline import RiseOptions, RisePipeline, default_layers
from analyses.tasks import Problem
from probes.engine import Engine
from probes.zoo import user_cache_dir
from saes.io import load_sae
from saes.stats import sae_stats
from safetensors.torch import load_file, save
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance
import torch

NAME = "rise-saes"
SMALL_MODELS = ("smollm2-135m", "tiny-random:")  # never reflect on their own: splice templated steps by default


def page_options(model_id: str, n_layers: int, max_new_tokens: int = 48, seed: int = 0):
    """The RISE page's default options for a model (what the page opens on)."""
    organism = is_organism(model_id)
    n = 40 if organism else 12
    return RiseOptions(task=default_task(model_id), n=n, seed=seed, layers=tuple(default_layers(n_layers)),
                       max_new_tokens=max_new_tokens, batch_size=max(1, min(16, n)),
                       augment="templated" if any(model_id.startswith(m) for m in SMALL_MODELS) else "none",
                       sae_steps=300, projection="umap", d_sae=None, l1=None, heldout=0.25,
                       temperature=1.0 if organism else 0.0)


def comparable(options: Any) -> dict[str, Any]:
    """The options a stored run is matched on (its private folders left out)."""
    plain = json.loads(json.dumps(options.to_dict(), default=str))  # as stored: tuples read back as lists
    return {k: v for k, v in plain.items() if k not in ("saes", "store")}


def files_of(found: dict[str, Any], options: Any, heldout_rows: list[int]) -> dict[str, Any]:
    """The shipped files of a finished pipeline run (`RisePipeline.run()`)."""
    h, analysis = found["harvest"], found["analysis"]
    files: dict[str, Any] = {
        "harvest.json": {"model_id": h.model_id, "settings": h.settings.to_dict(), "delimiter": h.delimiter,
                         "step_rows": [list(r) for r in h.step_rows], "options": comparable(options),
                         "traces": [{"problem": t.problem.to_dict(), "prompt_ids": t.prompt_ids, "gen_ids": t.gen_ids,
                                     "pieces": t.pieces, "augmented": t.augmented} for t in h.traces]},
        "acts.safetensors": save({site: a.contiguous().float() for site, a in h.acts.items()}),
        "analysis.json": {"heldout_rows": heldout_rows, "projection": options.projection,
                          "geometry": {la.site: {"coords": la.coords.tolist(), "silhouette": la.silhouette,
                                                 "silhouette_map": la.silhouette_map} for la in analysis.layers},
                          "summary": analysis.to_dict()},
    }
    folder = Path(found["folder"])
    for site in found["saes"]:
        files[f"sae.{site}.safetensors"] = folder / site / "sae_weights.safetensors"
        files[f"sae.{site}.cfg.json"] = json.loads((folder / site / "cfg.json").read_text())
    return files


def default_sae_root(stored: Any) -> Path:
    return user_cache_dir() / "rise-shipped" / stored.manifest["files"]["acts.safetensors"][:16]


def shipped_sites(stored: Any) -> list[str]:
    return [f[len("sae."):-len(".safetensors")] for f in stored.manifest["files"]
            if f.startswith("sae.") and f.endswith(".safetensors")]


def sae_folder(stored: Any, site: str, sae_root: Path | None = None) -> Path:
    """The shipped SAE at `site` as a SAELens folder (`cfg.json` + `sae_weights.safetensors`) under
    `sae_root` (default: the user cache), copied from the verified shipped files."""
    folder = Path(sae_root if sae_root is not None else default_sae_root(stored)) / site
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in (("sae_weights.safetensors", f"sae.{site}.safetensors"), ("cfg.json", f"sae.{site}.cfg.json")):
        shutil.copyfile(stored.path(source), folder / name)  # the verified copy, every time
    return folder


def load(stored: Any, sae_root: Path | None = None) -> dict[str, Any]:
    """The page's result (`harvest`, `saes`, `stats`, `analysis`, `folder`, `heldout_traces`) from a
    verified `thoughtscope.shipped.Shipped` of this name. The SAEs are put back into SAELens folders
    under `sae_root` (default: the user cache, one folder per shipped file set)."""
    meta = stored.json("harvest.json")
    settings = HarvestSettings(**{**meta["settings"], "layers": tuple(meta["settings"]["layers"])})
    judge = judge_for(settings.labeller, meta["model_id"])
    traces = []
    for t in meta["traces"]:
        trace = _make_trace(Problem.from_dict(t["problem"]), t["prompt_ids"], t["gen_ids"], t["pieces"],
                            meta["delimiter"], augmented=t["augmented"])
        for step in trace.steps:
            step.label = label_step(step.text, judge)
        traces.append(trace)
    acts = {site: torch.as_tensor(a) for site, a in load_file(str(stored.path("acts.safetensors"))).items()}
    rows = [tuple(r) for r in meta["step_rows"]]
    h = Harvest(meta["model_id"], settings, meta["delimiter"], traces, acts, rows)
    sae_root = Path(sae_root) if sae_root is not None else default_sae_root(stored)
    saes = {site: load_sae(sae_folder(stored, site, sae_root)) for site in settings.sites}
    stored_analysis = stored.json("analysis.json")
    held = [int(r) for r in stored_analysis["heldout_rows"]]
    analysis = analyse(h, saes, method=stored_analysis["projection"], seed=settings.seed, heldout_rows=held,
                       geometry=stored_analysis["geometry"])
    stats = {site: sae_stats(sae, acts[site][held] if held else acts[site]) for site, sae in saes.items()}
    heldout_traces = len({rows[r][0] for r in held})
    return {"harvest": h, "saes": saes, "stats": stats, "analysis": analysis, "folder": str(sae_root),
            "heldout_traces": heldout_traces, "analysis_projection": stored_analysis["projection"]}


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None) -> Path:
    torch.manual_seed(0)
    engine = Engine.from_id(model_id)
    info = engine.info()
    options = page_options(model_id, engine.arch().n_layers)
    work = Path(tempfile.mkdtemp(prefix="thoughtscope-ship-rise-"))
    options.saes, options.store = str(work / "saes"), str(work / "store")
    started = time.perf_counter()

    def progress(stage: str, done: int, total: int) -> None:
        print(f"{stage}: {done}/{total}", file=sys.stderr, flush=True)

    try:
        pipeline = RisePipeline(engine, options, on_progress=progress)
        found = pipeline.run()
        held = pipeline.heldout_rows(found["harvest"])
        files = files_of(found, options, held)
        record = provenance(info, data=options.task, split="harvest (held-out traces measure the SAEs)",
                            seed=options.seed, settings=comparable(options), command=f"ship {NAME}")
        return shipped.write(NAME, model_id, info["fingerprint"], files, command=command, provenance=record,
                             root=root, build_seconds=round(time.perf_counter() - started, 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


SHIPPED = {NAME: ("smollm2-135m", build)}
