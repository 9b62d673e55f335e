"""The Steering page's default direction, layer, prompt and slider stops, chosen by a measurement.

For each candidate (prompt-set pair, layer) and each scale of a grid (units of the site's mean
activation norm, as the page uses), on every development prompt:

- **target shift**: the mean over the positions of a fixed continuation (the unsteered greedy text,
  teacher-forced, so steered and unsteered are scored on the same tokens) of
  log sum_{w in target words} p(w | prefix), steered minus unsteered (nats). Positive: steering moved
  probability towards the pair's concept words. The words' first tokens (with a leading space) are used.
- **fluency guard**: the steered greedy text (one batched `steering_grid`) scored by its perplexity
  under the unsteered model (the page's sweep measure) and by its distinct-bigram fraction (a text
  that loops on a few tokens can have a low perplexity under a model that copies).

Rule (fixed before the run, in `FLUENCY`): a scale is *fluent* on a prompt when the steered text's
perplexity is at most `max_perplexity` and its distinct-bigram fraction at least `min_distinct`;
a (pair, layer, scale) is *admissible* when it is fluent on at least `min_fluent_share` of the
development prompts. The default is the admissible triple with the largest mean target shift; its
held-out prompts are then measured the same way and reported beside it. The slider's stops are
fine (`FINE_STEP`) from 0 up to the first scale where the chosen pair fails the guard on the
development set, and coarse beyond.

Run (one thread, about 14 minutes on a 2-core machine; writes docs/steering_default.json):
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m analyses.steering_defaults --out docs/steering_default.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from analyses.steering import (continuation_perplexity, diff_of_means_direction, site_norm, steering_grid,
                               steering_vector)
from probes import Engine
from probes.backend import Backend
from probes.interventions import AddVector
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance

SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "steering_default.json"


@dataclass(frozen=True)
class SteeringDefaults:
    """What the Steering page opens on: the chosen pair's prompt sets, layer, scale, stops and prompt."""

    model: str
    pair: str
    set_a: tuple[str, ...]
    set_b: tuple[str, ...]
    layer: int
    scale: float
    stops: tuple[float, ...]
    prompt: str
    target_words: tuple[str, ...]


def load_defaults(path: Path | str = SHIPPED) -> SteeringDefaults:
    """The chosen defaults from the measurement's JSON; a missing or damaged file is a BadInputError."""
    try:
        record = json.loads(Path(path).read_text())
        c = record["chosen"]
        stops = tuple(float(x) for x in c["stops"])
        out = SteeringDefaults(str(record["provenance"]["model"]), str(c["pair"]), tuple(map(str, c["set_a"])),
                               tuple(map(str, c["set_b"])), int(c["layer"]), float(c["scale"]), stops,
                               str(c["prompt"]), tuple(map(str, c["target_words"])))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"the steering defaults {path} are missing or damaged ({exc}); rebuild them with "
                            "`python -m analyses.steering_defaults`") from exc
    if not out.set_a or not out.set_b or 0.0 not in stops or out.scale not in stops or list(stops) != sorted(stops):
        raise BadInputError(f"the steering defaults {path} are inconsistent (empty prompt sets, or a scale "
                            "outside the sorted stops); rebuild them with `python -m analyses.steering_defaults`")
    return out


@dataclass(frozen=True)
class Pair:
    """Two prompt sets for a difference-of-means direction, and the words of the concept set A stands for."""

    name: str
    set_a: tuple[str, ...]
    set_b: tuple[str, ...]
    target_words: tuple[str, ...]


PAIRS = (
    Pair("sentiment",  # the page's former default
         ("I love this, it is wonderful.", "What a happy, joyful day!", "This is great news, I am so glad."),
         ("I hate this, it is terrible.", "What a sad, miserable day.", "This is awful news, I am so upset."),
         ("happy", "love", "wonderful", "great", "joy", "glad", "beautiful", "amazing", "delighted", "excited")),
    Pair("weddings",  # the topic of activation addition's first example (Turner et al. 2023)
         ("I am talking about weddings.", "The bride and groom are getting married.",
          "The wedding ceremony was held in a church."),
         ("I am talking about things.", "The people are going somewhere.", "The meeting was held in a room."),
         ("wedding", "bride", "groom", "married", "marriage", "ceremony", "weddings", "bridal", "honeymoon",
          "couple")),
    Pair("ocean",
         ("The ocean waves crash on the beach.", "Fish swim deep in the blue sea.",
          "Sailors cross the ocean by ship."),
         ("The cars drive down the street.", "People walk in the busy city.", "Workers cross the town by bus."),
         ("ocean", "sea", "waves", "beach", "fish", "water", "ship", "sailing", "shore", "marine")),
)
LAYERS = (5, 10, 15)  # of SmolLM2-135M's 30: early, a third, the page's former default (the middle)
SCALES = tuple(round(0.1 * i, 6) for i in range(1, 11))  # 0.1 .. 1.0 x mean ||site||
DEV_PROMPTS = ("Write one sentence about your morning.", "Tell me about the weather today.",
               "Describe a walk in the city.", "What did you do last weekend?",
               "Write a short note to a friend.", "Describe your kitchen.")
HELD_OUT_PROMPTS = ("Tell me about your neighbour.", "Describe a train journey.",
                    "Write a sentence about a library.", "What is your favourite season?")
FLUENCY = {"max_perplexity": 20.0, "min_distinct": 0.6, "min_fluent_share": 0.67}
MAX_NEW_TOKENS = 32
SCORED_POSITIONS = 12  # target shift over the last prompt position and the first 11 continuation positions
FINE_STEP = 0.05
SITE_KIND = "resid_post"


def chat_input(prompt: str) -> list[dict[str, str]]:
    """The model input the page gives its own prompt: one user turn, no worked example."""
    return [{"role": "user", "content": prompt}]


def word_ids(backend: Backend, words: Sequence[str]) -> list[int]:
    """The first token of " word" for each word (duplicates dropped, order kept)."""
    ids: list[int] = []
    for w in words:
        first = backend.encode(" " + w, add_special_tokens=False)[0]
        if first not in ids:
            ids.append(int(first))
    return ids


def target_logmass(backend: Backend, ids: Sequence[int], n_prompt: int, targets: Sequence[int],
                   interventions: Sequence[Any] = (), n_positions: int = SCORED_POSITIONS) -> list[float]:
    """log sum_{t in targets} p(t | prefix) at the positions n_prompt - 1 .. n_prompt - 2 + n_positions
    of the teacher-forced sequence `ids` (under `interventions`)."""
    last = f"resid_post.{backend.arch().n_layers - 1}"
    trace = backend.trace(list(ids), capture=[last], interventions=list(interventions))
    rows = trace.activations[last][n_prompt - 1:min(len(ids), n_prompt - 1 + n_positions)].float()
    n = rows.shape[0]
    read = backend.readout(rows.repeat_interleave(len(targets), 0), norm=True, top_k=0,
                           token_ids=[int(t) for t in targets] * n)
    probs = torch.as_tensor(read.token_probs, dtype=torch.float64).view(n, len(targets))
    return [float(x) for x in torch.log(probs.sum(1).clamp_min(1e-300))]


def distinct_bigrams(token_ids: Sequence[int]) -> float:
    """Distinct bigrams / bigrams of a token sequence (1.0 for fewer than two tokens)."""
    grams = list(zip(token_ids, token_ids[1:]))
    return 1.0 if not grams else len(set(grams)) / len(grams)


def words_in_text(text: str, words: Sequence[str]) -> int:
    """How many of the text's words start with one of `words` (case-insensitive): "weddings" counts for "wedding"."""
    stems = tuple(w.lower() for w in words)
    return sum(w.startswith(stems) for w in re.findall(r"[a-z]+", text.lower()))


def measure_prompt(backend: Backend, prompt: str, site: str, direction: torch.Tensor, targets: Sequence[int],
                   scales: Sequence[float] = SCALES, max_new_tokens: int = MAX_NEW_TOKENS,
                   words: Sequence[str] = ()) -> dict[str, Any]:
    """Target shift, perplexity and distinct-bigram fraction at every scale on one prompt."""
    model_input = chat_input(prompt)
    norm = site_norm(backend, model_input, site, chat=True)
    grid = steering_grid(backend, model_input, site, direction, scales, max_new_tokens=max_new_tokens, chat=True,
                         unit="norm", reference_norm=norm)
    prompt_ids = backend.encode(model_input, chat=True)
    ids = prompt_ids + list(grid.unsteered.token_ids)
    base = target_logmass(backend, ids, len(prompt_ids), targets)
    vector = steering_vector(direction, "norm", norm)
    rows = []
    for s in scales:
        steered = target_logmass(backend, ids, len(prompt_ids), targets, [AddVector(site, vector, float(s))])
        text = grid.texts[float(s)]
        rows.append({"scale": float(s),
                     "target_shift": sum(a - b for a, b in zip(steered, base)) / len(base),
                     "perplexity": continuation_perplexity(backend, model_input, text.token_ids, chat=True),
                     "distinct_bigrams": distinct_bigrams(text.token_ids),
                     "target_words_in_text": words_in_text(text.text, words), "text": text.text})
    return {"prompt": prompt, "reference_norm": norm, "unsteered_text": grid.unsteered.text,
            "unsteered_perplexity": continuation_perplexity(backend, model_input, grid.unsteered.token_ids, True),
            "unsteered_target_logmass": sum(base) / len(base),
            "unsteered_target_words_in_text": words_in_text(grid.unsteered.text, words), "scales": rows}


def fluent(row: dict[str, Any], guard: dict[str, float] = FLUENCY) -> bool:
    ppl = row["perplexity"]
    return ppl is not None and ppl <= guard["max_perplexity"] and row["distinct_bigrams"] >= guard["min_distinct"]


def summarize(per_prompt: Sequence[dict[str, Any]], guard: dict[str, float] = FLUENCY) -> list[dict[str, Any]]:
    """Per scale over prompts: mean target shift with its standard error, median perplexity, fluent share."""
    out = []
    for i, s in enumerate(r["scale"] for r in per_prompt[0]["scales"]):
        rows = [p["scales"][i] for p in per_prompt]
        shifts = [r["target_shift"] for r in rows]
        mean = sum(shifts) / len(shifts)
        sd = math.sqrt(sum((x - mean) ** 2 for x in shifts) / max(1, len(shifts) - 1))
        ppls = sorted(r["perplexity"] for r in rows if r["perplexity"] is not None)
        out.append({"scale": s, "target_shift_mean": mean, "target_shift_se": sd / math.sqrt(len(shifts)),
                    "target_shift_min": min(shifts), "perplexity_median": ppls[len(ppls) // 2] if ppls else None,
                    "fluent_share": sum(fluent(r, guard) for r in rows) / len(rows),
                    "target_words_in_text_mean": sum(r.get("target_words_in_text", 0) for r in rows) / len(rows)})
    return out


def choose(candidates: Sequence[dict[str, Any]], guard: dict[str, float] = FLUENCY) -> dict[str, Any]:
    """The admissible (pair, layer, scale) with the largest mean development target shift."""
    best = None
    for c in candidates:
        for row in c["dev_summary"]:
            if row["fluent_share"] >= guard["min_fluent_share"] and (
                    best is None or row["target_shift_mean"] > best[1]["target_shift_mean"]):
                best = (c, row)
    if best is None:
        raise RuntimeError("no candidate scale passes the fluency guard on the development prompts")
    return {"pair": best[0]["pair"], "layer": best[0]["layer"], "scale": best[1]["scale"]}


def slider_stops(dev_summary: Sequence[dict[str, Any]], guard: dict[str, float] = FLUENCY) -> list[float]:
    """The slider's stops: every FINE_STEP from 0 up to the first development scale that is not admissible
    (where the text changes and then breaks), then 0.75, 1, 1.5 beyond it (the text derailing); towards set B
    (negative scales) -0.25, -0.5, -0.75, -1. About 18 rows of one batched generation, as before."""
    broken = next((r["scale"] for r in dev_summary if r["fluent_share"] < guard["min_fluent_share"]),
                  dev_summary[-1]["scale"])
    fine = [round(FINE_STEP * i, 6) for i in range(1, int(round(broken / FINE_STEP)) + 1)]
    coarse = [s for s in (0.75, 1.0, 1.5) if s > broken + 1e-9]
    return sorted({0.0, *fine, *coarse, -0.25, -0.5, -0.75, -1.0})


def choose_prompt(per_prompt: Sequence[dict[str, Any]], scale: float, guard: dict[str, float] = FLUENCY) -> str:
    """The development prompt the page opens on: fluent at the chosen scale, with the most target words in
    its steered text there (ties: the larger target shift)."""
    def at(p: dict[str, Any]) -> dict[str, Any]:
        return next(r for r in p["scales"] if r["scale"] == scale)

    ok = [p for p in per_prompt if fluent(at(p), guard)] or list(per_prompt)
    return max(ok, key=lambda p: (at(p).get("target_words_in_text", 0), at(p)["target_shift"]))["prompt"]


def run(backend: Backend, pairs: Sequence[Pair] | None = None, layers: Sequence[int] | None = None,
        dev: Sequence[str] | None = None, held_out: Sequence[str] | None = None,
        scales: Sequence[float] | None = None, log: Any = None, guard: dict[str, float] | None = None,
        max_new_tokens: int | None = None) -> dict[str, Any]:
    """The whole measurement: every candidate on the development prompts, the choice, the held-out check.
    Each setting left out is the module's (`PAIRS`, `LAYERS`, `DEV_PROMPTS`, `HELD_OUT_PROMPTS`, `SCALES`,
    `FLUENCY`, `MAX_NEW_TOKENS`), read when called."""
    pairs, layers = PAIRS if pairs is None else pairs, LAYERS if layers is None else layers
    dev, held_out = DEV_PROMPTS if dev is None else dev, HELD_OUT_PROMPTS if held_out is None else held_out
    scales, guard = SCALES if scales is None else scales, FLUENCY if guard is None else guard
    max_new_tokens = MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    log = log or (lambda *_: None)
    candidates = []
    directions: dict[tuple[str, int], torch.Tensor] = {}
    for pair in pairs:
        targets = word_ids(backend, pair.target_words)
        for layer in layers:
            site = f"{SITE_KIND}.{layer}"
            direction = diff_of_means_direction(backend, pair.set_a, pair.set_b, site, "mean")
            directions[(pair.name, layer)] = direction
            per_prompt = []
            for prompt in dev:
                started = time.perf_counter()
                per_prompt.append(measure_prompt(backend, prompt, site, direction, targets, scales, max_new_tokens,
                                                 words=pair.target_words))
                log(f"{pair.name} {site} {prompt!r}: {time.perf_counter() - started:.1f} s")
            candidates.append({"pair": pair.name, "layer": layer, "site": site, "target_token_ids": targets,
                               "dev_summary": summarize(per_prompt, guard), "dev": per_prompt})
    chosen = choose(candidates, guard)
    pair = next(p for p in pairs if p.name == chosen["pair"])
    site = f"{SITE_KIND}.{chosen['layer']}"
    targets = word_ids(backend, pair.target_words)
    held = [measure_prompt(backend, p, site, directions[(pair.name, chosen["layer"])], targets, scales,
                           max_new_tokens, words=pair.target_words) for p in held_out]
    winner = next(c for c in candidates if c["pair"] == pair.name and c["layer"] == chosen["layer"])
    return {
        "chosen": {**chosen, "site": site, "set_a": list(pair.set_a), "set_b": list(pair.set_b),
                   "target_words": list(pair.target_words), "target_token_ids": targets,
                   "reduce": "mean", "prompt": choose_prompt(winner["dev"], chosen["scale"], guard),
                   "stops": slider_stops(winner["dev_summary"], guard)},
        "rule": {**guard, "scored_positions": SCORED_POSITIONS, "max_new_tokens": max_new_tokens,
                 "chat": True, "one_shot": False, "decoding": "greedy"},
        "dev_prompts": list(dev), "held_out_prompts": list(held_out), "scales": list(scales),
        "held_out_summary": summarize(held, guard), "held_out": held, "candidates": candidates,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="docs/steering_default.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    backend = Engine.from_id(args.model)
    started = time.perf_counter()
    result = run(backend, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    result["provenance"] = provenance(
        backend.info(), seed=0, data="analyses.steering_defaults: PAIRS, DEV_PROMPTS, HELD_OUT_PROMPTS",
        split="development prompts for the choice, held-out prompts for the check",
        command=f"OMP_NUM_THREADS=1 python -m analyses.steering_defaults --model {args.model} --out {args.out}",
        seconds=round(time.perf_counter() - started, 1), threads=1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"chosen": result["chosen"], "seconds": result["provenance"]["seconds"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
