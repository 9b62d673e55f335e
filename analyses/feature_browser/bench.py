"""Benchmarks of finding latents (`thoughtscope bench features`), issue 25.

- `feature_search_s`: one text query over the labels of a 16,384-latent SAE (labels built once
  over a 40-question corpus index; TF-IDF index built once). Ratio: median query seconds / the 0.1 s
  target. The SAE is seeded random (its width, not its training, sets the cost).
- `token_features_s`: clicking a token of a ~55-token trace to its latent list with that SAE, as the
  trace explorer does it: the first click encodes the rows its one pass already holds (ratio: those
  seconds / the 0.3 s target); every later click reads a row of that encode (`later_click_s`); a
  trace without stored rows also runs one capture pass (`with_capture_pass_s`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from analyses.feature_browser import build_index, load_corpus
from analyses.feature_browser.labels import build_labels
from analyses.feature_browser.search import LabelSearch
from analyses.feature_browser.token_latents import trace_latents
from probes.backend import Backend
from probes.engine import Engine

D_SAE = 16_384
QUERIES = ("many", "apples", "she", "how much", "dollars", "each day", "total", "?", "minutes", "price")
TRACE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May.")


def _random_sae(d_in: int, d_sae: int = D_SAE, seed: int = 0) -> Any:
    from sae_lens import StandardSAE, StandardSAEConfig  # lazy: sae_lens takes seconds to import

    g = torch.Generator().manual_seed(seed)
    sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=d_sae, dtype="float32", device="cpu"))
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        sae.b_enc.copy_(-torch.rand(d_sae, generator=g))
        w = torch.randn(d_sae, d_in, generator=g)
        sae.W_dec.copy_(w / w.norm(dim=1, keepdim=True))
        sae.b_dec.zero_()
    return sae


def bench_features(backend: Backend, n_texts: int = 40, rounds: int = 3) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    arch = backend.arch()
    site = f"resid_post.{arch.n_layers // 2}"
    index = build_index(backend, load_corpus("gsm8k-questions", n=n_texts), site, store=None)
    sae = _random_sae(arch.d_model)
    started = time.perf_counter()
    labels = build_labels(index, sae, backend)
    labels_s = time.perf_counter() - started
    started = time.perf_counter()
    search = LabelSearch(labels)
    tfidf_s = time.perf_counter() - started
    times = []
    for _ in range(rounds):
        for q in QUERIES:
            started = time.perf_counter()
            search.search(q, k=20)
            times.append(time.perf_counter() - started)
    ids = backend.encode(TRACE)
    stored = backend.capture(ids, [site])[site]  # what the trace explorer's one pass already holds
    first, captured, later = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        trace_latents(backend, ids, sae, site).at_token(len(ids) // 2)
        captured.append(time.perf_counter() - started)
        started = time.perf_counter()
        found = trace_latents(backend, ids, sae, site, rows=stored)
        found.at_token(len(ids) // 2)
        first.append(time.perf_counter() - started)
        for p in range(1, len(ids)):
            started = time.perf_counter()
            found.at_token(p)
            later.append(time.perf_counter() - started)
    common = {"model": backend.info()["model_id"], "site": site, "d_sae": D_SAE, "corpus_rows": index.n_rows}
    search_s = statistics.median(times)
    first_s = statistics.median(first)
    return [
        {"bench": "feature_search_s", "ratio": round(search_s / 0.1, 4), "seconds": round(search_s, 5),
         "target": 0.1, "max_s": round(max(times), 5), "queries": len(times), "labels_build_s": round(labels_s, 2),
         "tfidf_build_s": round(tfidf_s, 3), "labels": labels.counts(), **common},
        {"bench": "token_features_s", "ratio": round(first_s / 0.3, 4), "seconds": round(first_s, 4), "target": 0.3,
         "later_click_s": round(statistics.median(later), 6), "with_capture_pass_s": round(statistics.median(captured), 4),
         "trace_tokens": len(ids), **common},
    ]


def run_features(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return bench_features(Engine.from_id(model_id))


BENCHMARKS = {"features": run_features}
