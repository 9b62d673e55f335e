"""Visual attribution's benchmarks (`thoughtscope bench vis-attr`), measured side by side on the same scenes:
exhaustive ablation cost / amortized cost per span, and streaming attribution / plain generation per token.

- `vis_attr_speedup` (the issue's figure, K = 16 regions): toy-vlm has 9 visual tokens, so this runs on
  toy-vlm's architecture with a 64-pixel input (4 x 4 = 16 visual tokens), **randomly initialised and
  never trained** (`probes.toys.vlm.build_model(..., grid=4)`): the ratio is a cost ratio, which the
  weights do not change; the spans are toy scenes' description phrases.
- `vis_attr_speedup_k36` (reported): the same architecture with a 96-pixel input, 36 visual tokens and
  regions: how the ratio grows with K (the exhaustive side runs K + 1 rows, the amortized side one).
- `vis_attr_speedup_toy_k9` (reported): the trained toy-vlm at its 9 cells.
- `vis_attr_speedup_k16_wide` (reported): K = 16 regions again, on a wider random model where the forward's
  own compute dominates: toy-vlm's architecture at SmolLM2-135M's text width (576, 4 layers, 9 heads; vision
  tower 2 layers of 256) with a 256-pixel input, so 256 visual tokens cut into 4 x 4 blocks of 16 tokens.
  It shows what bounds the K = 16 row: the fixed cost of a small model's forward, not the method (measured
  2026-12-05, two runs: 25.6 and 20.1 here, against 5.35-5.7 at toy width; batching the exhaustive side no
  longer pays here, 0.83-1.02x).

Both sides get the same row budget a forward (`batch_size`, 32 rows, `exhaustive_effects`' default):
- exhaustive ablation fills it with one scene's K masked rows + the unmasked row (17 rows at K = 16); its
  unbatched cost (K + 1 sequential passes) is reported beside it. Packing two scenes (34 rows) would exceed
  the budget, and here it would not pay either: a bare forward costs 0.99 ms a row at 17 rows, 1.14 at 34
  and 1.20 at 51 (two threads, 2026-12-07);
- the amortized side fills it with one row per scene (`attention_features_batch`, right-padded scenes, each
  scene's features equal to its own pass), so the bench attributes 32 scenes: the K = 16 row's ratio is
  exhaustive cost / amortized cost per span at 32 scenes a forward, and `per_scene_ratio` beside it the
  same against one scene a forward (the protocol up to 2026-12-07, which stayed at 4-6.4: that one-row
  forward is mostly a small model's fixed per-forward cost).
Each amortized pass computes only the attention rows the features read (the queries predicting the spans,
over every key: probes.attention_rows), tokenises each text once and ends inside the last layer's
attention; then the per-(span, region) features and one dot product. The in-stream cost beside it leaves
the pass out (during generation the attention rows exist already). An eager-built model (toy-vlm) runs
both sides on SDPA (`_fastest_attention`): the masked passes are ~9% faster there than on eager.
Exhaustive, unbatched exhaustive, the one-scene amortized pass and the whole amortized batch alternate per
scene (the batch's time divided by the scenes). Beside the wall-clock ratio, `cpu_ratio` is the same ratio
in this process's CPU seconds, and `load` the 1-minute load average at start and end: on the shared machine
the wall clock also counts waiting for a core.

Why the one-scene ratio stays under 10 at K = 16 (profiled 2026-12-02, thread CPU time per scene, medians,
load 3-7): the amortized side is one one-row forward of ~46 tokens, and that forward is mostly fixed cost:
the vision tower (2 CLIP layers over 17 patches, 1.4-2.1 ms, nearly all per-call) and the language model's
per-forward cost (a 1-token forward of its 3 layers: 1.8-2.7 ms) against ~1.9 ms of per-token work. The
exhaustive side runs 17 rows in one forward, paying those fixed costs once (36-48 ms). Batching the
amortized side's scenes pays them once per 32 scenes. The ratio also grows with K (K = 36: ~19 at one scene
a forward, K = 64: ~70), and with sequence length, where the rows matter.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from analyses.visual_attribution.attribution import attention_features, attention_features_batch, exhaustive_effects
from analyses.visual_attribution.estimator import AmortizedAttribution
from analyses.visual_attribution.evaluate import toy_scene
from analyses.visual_attribution.regions import grid_regions
from analyses.visual_attribution.stream import stream_attribution
from probes.backend import Backend
from probes.engine import Engine
from probes.toys import vlm
from probes.vision import spec_of
from probes.zoo import ModelHandle, arch_from_config


def _scene(backend: Backend, example: Any, grid: int,
           region_grid: int | None = None) -> tuple[str, Any, list[tuple[int, int]], list[Any]]:
    """(text, image, description spans, regions) of a toy example on a model with grid x grid tokens: one
    region per token, or `region_grid` x `region_grid` blocks of tokens."""
    text = f"{vlm.prompt_text(example.question)} {example.trace} <eos>"
    shift = grid * grid - vlm.N_IMAGE_TOKENS  # the spans move with the extra image tokens
    spans = [(example.input_positions(s).start + shift, example.input_positions(s).stop + shift)
             for s in example.spans]
    blocks = region_grid or grid
    return text, example.image, spans, grid_regions(spec_of(backend), blocks, blocks)


def _fit(backend: Backend, scenes: list[tuple], seed: int) -> Any:
    X = [f.reshape(-1, f.shape[-1]) for f in attention_features_batch(backend, scenes)]
    y = [exhaustive_effects(backend, text, image, spans, regions).reshape(-1) for text, image, spans, regions in scenes]
    return AmortizedAttribution(epochs=50, seed=seed).fit(np.concatenate(X), np.concatenate(y))


@contextmanager
def _fastest_attention(backend: Backend) -> Iterator[str]:
    """Inside: an in-process model built with eager attention (toy-vlm is) runs on SDPA, the faster kernel
    the exhaustive side's masked passes take (the attention masks edit SDPA's 4D mask as they do eager's;
    effects equal to ~1e-6); the amortized rows pass runs its own attention function either way, and a
    pattern capture switches to eager by itself. Yields the implementation the passes run on."""
    model = getattr(backend, "model", None)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "eager":
        yield impl or "the server's"
        return
    model.set_attn_implementation("sdpa")
    try:
        yield "sdpa"
    finally:
        model.set_attn_implementation(impl)


def bench_speedup(backend: Backend, grid: int, n_scenes: int = 32, seed: int = 0, name: str = "vis_attr_speedup",
                  note: str = "", target: float | None = 10.0, region_grid: int | None = None,
                  batch_size: int = 32) -> dict[str, Any]:
    """Seconds per span of exhaustive ablation (batched over regions, and unbatched) / of the amortized
    estimate, over `n_scenes` toy eval scenes on a model with grid x grid visual tokens, one region per token
    or `region_grid` x `region_grid` blocks (`target` None: a reported row). Both sides get `batch_size`
    rows a forward: the exhaustive side's K + 1 rows of one scene, the amortized side's one row per scene
    (`attention_features_batch`); the amortized side's cost at one scene a forward is reported beside it."""
    with _fastest_attention(backend) as attention:
        row = _bench_speedup(backend, grid, n_scenes, seed, name, note, target, region_grid, batch_size)
    return {**row, "attention": attention}


def _bench_speedup(backend: Backend, grid: int, n_scenes: int, seed: int, name: str, note: str,
                   target: float | None, region_grid: int | None, batch_size: int) -> dict[str, Any]:
    est = _fit(backend, [_scene(backend, ex, grid, region_grid) for ex in vlm.examples("train", 2, seed=seed)], seed)
    scenes = [_scene(backend, ex, grid, region_grid) for ex in vlm.examples("eval", n_scenes, seed=seed)]
    text, image, spans, regions = scenes[0]
    for rows in (batch_size, 1):  # warm-up of every side
        exhaustive_effects(backend, text, image, spans, regions, batch_size=rows)
    attention_features(backend, text, image, spans, regions)
    # wall seconds (the ratio) and this process's CPU seconds beside them: on a loaded shared machine
    # the wall clock also counts time spent waiting for a core, the CPU clock mostly does not
    seconds = {"exhaustive": 0.0, "exhaustive_unbatched": 0.0, "amortized": 0.0, "amortized_per_scene": 0.0,
               "in_stream": 0.0}
    cpu = dict.fromkeys(seconds, 0.0)
    sites = [f"attn_pattern.{layer}" for layer in range(backend.arch().n_layers)]
    load = os.getloadavg()[0]

    def timed(key: str, fn: Any) -> None:
        t, c = time.perf_counter(), time.process_time()
        fn()
        seconds[key] += time.perf_counter() - t
        cpu[key] += time.process_time() - c

    def amortized(text: Any, image: Any, spans: Any, regions: Any, trace: Any = None) -> None:
        feats = attention_features(backend, text, image, spans, regions, trace=trace)
        est.predict(feats.reshape(-1, feats.shape[-1]))

    def amortized_batch() -> None:  # every scene, `batch_size` scenes a forward, one prediction call
        feats = attention_features_batch(backend, scenes, batch_size=batch_size)
        est.predict(np.concatenate([f.reshape(-1, f.shape[-1]) for f in feats]))

    amortized_batch()  # warm-up at the batch's shape
    n_spans = 0
    for text, image, spans, regions in scenes:
        timed("exhaustive", lambda: exhaustive_effects(backend, text, image, spans, regions, batch_size=batch_size))
        timed("exhaustive_unbatched", lambda: exhaustive_effects(backend, text, image, spans, regions, batch_size=1))
        timed("amortized_per_scene", lambda: amortized(text, image, spans, regions))
        # the whole batch once per scene, so that it runs beside every scene's exhaustive side (divided below)
        timed("amortized", amortized_batch)
        # in a stream the attention rows exist already: only the features and the dot product remain
        trace = backend.trace(text, capture=sites, images=[image])
        timed("in_stream", lambda: amortized(text, image, spans, regions, trace))
        n_spans += len(spans)
    seconds["amortized"] /= len(scenes)
    cpu["amortized"] /= len(scenes)
    per_span = {k: v / n_spans for k, v in seconds.items()}
    return {"bench": name, "ratio": per_span["exhaustive"] / per_span["amortized"], "target": target,
            "higher_is_better": True, "exhaustive_s_per_span": per_span["exhaustive"],
            "exhaustive_unbatched_s_per_span": per_span["exhaustive_unbatched"],
            "amortized_s_per_span": per_span["amortized"],
            "amortized_per_scene_s_per_span": per_span["amortized_per_scene"],
            "per_scene_ratio": per_span["exhaustive"] / per_span["amortized_per_scene"],
            # one row a forward on both sides
            "unbatched_ratio": per_span["exhaustive_unbatched"] / per_span["amortized_per_scene"],
            "amortized_in_stream_s_per_span": per_span["in_stream"],
            "in_stream_ratio": per_span["exhaustive"] / per_span["in_stream"],
            "batching_gain": per_span["exhaustive_unbatched"] / per_span["exhaustive"],
            "cpu_ratio": cpu["exhaustive"] / cpu["amortized"],
            "cpu_per_scene_ratio": cpu["exhaustive"] / cpu["amortized_per_scene"],
            "cpu_unbatched_ratio": cpu["exhaustive_unbatched"] / cpu["amortized_per_scene"],
            "load": [round(load, 2), round(os.getloadavg()[0], 2)],  # 1-minute load average at start and end
            "batch_rows": batch_size, "scenes_per_amortized_forward": min(batch_size, len(scenes)),
            "regions": len(regions), "visual_tokens": grid * grid, "scenes": n_scenes, "spans": n_spans,
            "model": backend.info()["model_id"], "note": note}


def random_toy_vlm(grid: int = 4, config: Any = None, label: str = "toy-vlm-architecture") -> Any:
    """An engine over toy-vlm's full architecture (or `config`'s) with grid x grid visual tokens, random weights
    (seeded)."""
    tok = vlm.make_tokenizer()
    model = vlm.build_model(config or vlm.CONFIGS["full"], tok, grid=grid).eval()
    return Engine(ModelHandle(f"{label}:random-{grid}x{grid}", model, tok,
                              arch_from_config(model.config), "random", torch.device("cpu"), torch.float32))


def bench_stream_overhead(backend: Backend, n_scenes: int = 4, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """vis_attr_stream_overhead: seconds per token of streaming attribution (attention captured in every
    layer, per-span features and amortized predictions) / of plain greedy generation (target <= 1.3);
    the two alternate on the same scenes."""
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


# vis_attr_speedup_k16_wide's model: toy-vlm's architecture at SmolLM2-135M's text width (random weights)
WIDE = vlm.ToyVLMConfig(vision_layers=2, vision_width=256, vision_heads=4, text_layers=4, text_width=576, text_heads=9)


def run_vis_attr(model_id: str = "toy-vlm") -> Iterator[dict[str, Any]]:
    """Each row as soon as it is measured (`thoughtscope bench` prints it then)."""
    engine = Engine.from_id(model_id, device="cpu")
    yield bench_speedup(random_toy_vlm(4), 4, note="K = 16: toy-vlm's architecture with 16 visual tokens, random "
                        "weights (a cost ratio; the weights do not change the compute)")
    yield bench_speedup(random_toy_vlm(6), 6, name="vis_attr_speedup_k36", target=None,
                        note="K = 36: the same architecture with 36 visual tokens (how the ratio grows with K)")
    yield bench_speedup(engine, vlm.GRID, name="vis_attr_speedup_toy_k9", note=f"trained {model_id}, its 9 cells",
                        target=None)
    yield bench_speedup(random_toy_vlm(16, WIDE, label="toy-vlm-wide"), 16, n_scenes=4, region_grid=4,
                        name="vis_attr_speedup_k16_wide", target=None,
                        note="K = 16 regions of 4 x 4 visual tokens (256) on a random model of SmolLM2-135M's "
                             "text width: where the forward's compute, not its fixed cost, dominates")
    yield bench_stream_overhead(engine)


BENCHMARKS = {"vis-attr": run_vis_attr}
