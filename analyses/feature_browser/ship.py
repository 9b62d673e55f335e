"""Shipped results of the feature browser: the corpus index its first view needs (`thoughtscope ship feature-index`).

The page's default corpus (GSM8K test questions) indexed at its default site (`resid_post` at half
depth, 64 tokens per context) would be about 100,000 rows of d_model float16 values (over 100 MB for
SmolLM2), far past the shipped-files budget. So the shipped index holds the first `N_TEXTS`
questions only (about 2.5 MB), the page opens on that subset and says so, and indexing the whole
corpus runs as a job. Stored as `index.safetensors` (token ids, context lengths, activation rows:
exactly `CorpusIndex`'s tensors) and `index.json` (corpus, site, settings).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from analyses.feature_browser.corpus import load_corpus
from analyses.feature_browser.index import CorpusIndex, IndexSettings, build_index
from probes.engine import Engine
from safetensors.torch import load_file, save
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "feature-index"
CORPUS = "gsm8k-questions"
N_TEXTS = 40  # the shipped subset: its rows stay under ~3 MB for a 576-wide model


def default_site(n_layers: int) -> str:
    """The page's default site: the residual stream after the middle layer."""
    return f"resid_post.{n_layers // 2}"


def files_of(index: Any) -> dict[str, Any]:
    return {"index.safetensors": save({"ids": index.ids.contiguous(), "lengths": index.lengths.contiguous(),
                                       "acts": index.acts.contiguous()}),
            "index.json": {"corpus": index.corpus, "site": index.site, "model_id": index.model_id,
                           "fingerprint": index.fingerprint, "settings": asdict(index.settings)}}


def load(stored: Any) -> Any:
    """The `CorpusIndex` of a verified `thoughtscope.shipped.Shipped` of this name."""
    meta = stored.json("index.json")
    tensors = load_file(str(stored.path("index.safetensors")))
    return CorpusIndex(meta["corpus"], meta["site"], meta["model_id"], meta["fingerprint"],
                       IndexSettings(**meta["settings"]), tensors["ids"], tensors["lengths"], tensors["acts"])


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None) -> Path:
    engine = Engine.from_id(model_id)
    info = engine.info()
    corpus = load_corpus(CORPUS, n=N_TEXTS)
    site = default_site(engine.arch().n_layers)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"indexed {done}/{total} contexts", file=sys.stderr, flush=True)

    index = build_index(engine, corpus, site, IndexSettings(), store=None, on_progress=progress)
    record = provenance(info, data=corpus.name, split=corpus.split, seed=0, command=f"ship {NAME}",
                        settings={"site": site, "index": index.describe()})
    return shipped.write(NAME, model_id, info["fingerprint"], files_of(index), command=command, provenance=record,
                         root=root, build_seconds=round(time.perf_counter() - started, 1))


SHIPPED = {NAME: ("smollm2-135m", build)}
