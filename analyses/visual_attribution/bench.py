"""Visual attribution's benchmarks (`thoughtscope bench vis-attr`), measured side by side on the same toy-vlm
scenes: exhaustive ablation cost / amortized cost per span, and streaming attribution / plain generation
per token.

The issue's target (>= 10) is stated at K = 16 regions; toy-vlm has 9 visual tokens, so K = 9 here
(one region per token): exhaustive ablation costs K + 1 teacher-forced passes per scene, the amortized
estimate one pass capturing attention plus a dot product per (span, region).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from analyses.visual_attribution.evaluate import toy_scene


def bench_speedup(backend: Any, n_scenes: int = 6, seed: int = 0) -> dict[str, Any]:
    """vis_attr_speedup: seconds per span of exhaustive ablation / of the amortized estimate."""
    from analyses.visual_attribution.estimator import AmortizedAttribution
    from probes.toys import vlm

    train = [toy_scene(backend, ex) for ex in vlm.examples("train", 2, seed=seed)]
    est = AmortizedAttribution(epochs=50, seed=seed).fit(
        np.concatenate([s.features.reshape(-1, s.features.shape[-1]) for s in train]),
        np.concatenate([s.effects.reshape(-1) for s in train]))
    exhaustive, amortized, spans = 0.0, 0.0, 0
    for ex in vlm.examples("eval", n_scenes, seed=seed):
        scene = toy_scene(backend, ex)  # times the exhaustive passes and the attention pass
        t = time.perf_counter()
        est.predict(scene.features.reshape(-1, scene.features.shape[-1]))
        amortized += scene.seconds_features + time.perf_counter() - t
        exhaustive += scene.seconds_exhaustive
        spans += len(scene.true_cells)
    return {"bench": "vis_attr_speedup", "ratio": exhaustive / amortized, "target": 10.0, "higher_is_better": True,
            "exhaustive_s_per_span": exhaustive / spans, "amortized_s_per_span": amortized / spans,
            "regions": vlm.GRID * vlm.GRID, "scenes": n_scenes, "spans": spans,
            "model": backend.info()["model_id"]}


def bench_stream_overhead(backend: Any, n_scenes: int = 4, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """vis_attr_stream_overhead: seconds per token of streaming attribution (attention captured in every
    layer, per-span features and amortized predictions) / of plain greedy generation (target <= 1.3);
    the two alternate on the same scenes."""
    from analyses.visual_attribution.estimator import AmortizedAttribution
    from analyses.visual_attribution.regions import grid_regions
    from analyses.visual_attribution.stream import stream_attribution
    from probes.toys import vlm
    from probes.vision import spec_of

    regions = grid_regions(spec_of(backend), vlm.GRID, vlm.GRID)
    train = [toy_scene(backend, ex) for ex in vlm.examples("train", 2, seed=seed)]
    est = AmortizedAttribution(epochs=50, seed=seed).fit(
        np.concatenate([s.features.reshape(-1, s.features.shape[-1]) for s in train]),
        np.concatenate([s.effects.reshape(-1) for s in train]))
    scenes = vlm.examples("eval", n_scenes, seed=seed)

    def plain(ex: Any) -> int:
        return sum(1 for _ in backend.generate(vlm.prompt_text(ex.question), images=[ex.image], max_new_tokens=32,
                                               top_k=0))

    def streamed(ex: Any) -> int:
        return sum(1 for _ in stream_attribution(backend, vlm.prompt_text(ex.question), ex.image, regions, est,
                                                 max_new_tokens=32))

    plain(scenes[0]), streamed(scenes[0])  # warm-up
    totals = {"plain": [0.0, 0], "streamed": [0.0, 0]}
    for _ in range(repeats):
        for ex in scenes:
            for name, fn in (("plain", plain), ("streamed", streamed)):
                t = time.perf_counter()
                n = fn(ex)
                totals[name][0] += time.perf_counter() - t
                totals[name][1] += n
    per_token = {k: s / n for k, (s, n) in totals.items()}
    return {"bench": "vis_attr_stream_overhead", "ratio": per_token["streamed"] / per_token["plain"], "target": 1.3,
            "plain_tokens_per_s": 1 / per_token["plain"], "streamed_tokens_per_s": 1 / per_token["streamed"],
            "tokens": totals["plain"][1], "scenes": n_scenes, "repeats": repeats, "model": backend.info()["model_id"]}


def run_vis_attr(model_id: str = "toy-vlm") -> list[dict[str, Any]]:
    from probes.engine import Engine

    engine = Engine.from_id(model_id, device="cpu")
    return [bench_speedup(engine), bench_stream_overhead(engine)]


BENCHMARKS = {"vis-attr": run_vis_attr}
