"""RLKV's benchmarks (`thoughtscope bench rlkv`): the compressed cache against the full one, side by side.

- `rlkv_kv_bytes`: KV bytes held at the last token with half the KV heads local (sparsity 0.5,
  sink 4 + recent 32, the evaluation window used on the embedded model) / the full cache's, on a
  sequence of about 500 tokens (a ~360-token prompt and up to 160 new ones; target <= 0.55; with L
  tokens the ideal is 0.5 + 0.5 * 36 / L). Which heads are local does not change the bytes, so a seeded
  random half is used and no gates file is needed.
- `rlkv_tokens_per_s`: greedy tokens/s with that compressed cache / with the plain cache, the two
  alternated over a few rounds in one worker thread (best round each; higher is better).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from analyses.rlkv.heads import kv_fraction, random_full_heads
from analyses.tasks import load_gsm8k
from probes.backend import Backend
from probes.engine import Engine
from probes.kv_policy import HeadBudget
from probes.server_bench import alternate

SPARSITY, SINK, RECENT = 0.5, 4, 32


def bench_prompt(backend: Backend, context_tokens: int = 240) -> list[int]:
    """A long prompt that asks for a long answer: GSM8K questions as context (about `context_tokens` tokens),
    then a story to write, in the chat template."""
    story = "\n\nIgnore the problems above. Write a long story about a lighthouse keeper who finds a message in a bottle."
    questions = []
    for p in load_gsm8k(40):
        questions.append(p.question)
        if len(backend.encode("\n\n".join(questions), add_special_tokens=False)) >= context_tokens:
            break
    return backend.encode([{"role": "user", "content": "\n\n".join(questions) + story}], chat=True)


def bench_kv_bytes(backend: Backend, tokens: int = 160, rounds: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    arch = backend.arch()
    full = random_full_heads((arch.n_layers, arch.n_kv_heads), SPARSITY, seed=seed)
    policy = HeadBudget(full_heads=torch.as_tensor(full), sink=SINK, recent=RECENT)
    prompt = bench_prompt(backend)
    last: dict[str, Any] = {}

    def run(name: str, interventions: list) -> None:
        recs = list(backend.generate(prompt, max_new_tokens=tokens, top_k=0, interventions=interventions))
        last[name] = recs

    times = alternate({"full": lambda: run("full", []), "compressed": lambda: run("compressed", [policy])}, rounds)
    full_recs, comp_recs = last["full"], last["compressed"]
    n = min(len(full_recs), len(comp_recs))
    length = len(prompt) + n - 1  # tokens in the cache when the n-th token was made
    ratio = comp_recs[n - 1].kv_bytes / full_recs[n - 1].kv_bytes
    tps = {k: [len(last[k]) / t for t in v] for k, v in times.items()}
    model = backend.info()["model_id"]
    return [
        {"bench": "rlkv_kv_bytes", "ratio": round(ratio, 4), "target": 0.55, "model": model, "sparsity": SPARSITY,
         "sink": SINK, "recent": RECENT, "sequence_tokens": length,
         "ideal": round(kv_fraction(full, length, SINK, RECENT), 4),
         "full_bytes": full_recs[n - 1].kv_bytes, "compressed_bytes": comp_recs[n - 1].kv_bytes},
        {"bench": "rlkv_tokens_per_s", "ratio": round(max(tps["compressed"]) / max(tps["full"]), 3),
         "ratio_median": round(statistics.median(tps["compressed"]) / statistics.median(tps["full"]), 3),
         "target": 0.9, "higher_is_better": True, "model": model, "full_tps": round(max(tps["full"]), 2),
         "compressed_tps": round(max(tps["compressed"]), 2), "rounds": rounds, "new_tokens": n,
         "prompt_tokens": len(prompt)},
    ]


def run_rlkv(model_id: str = "smollm2-135m") -> list[dict[str, Any]]:
    return bench_kv_bytes(Engine.from_id(model_id))


BENCHMARKS = {"rlkv": run_rlkv}
