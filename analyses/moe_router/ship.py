"""The shipped MoE-router result: what the page opens on for the toy MoE, made by `thoughtscope ship moe-router`
(toy-moe; `thoughtscope ship moe-router --model toy-moe:small` for the small toy).

Three files under docs/shipped/<model>/moe-router/, each made by this package's own code at the page's
defaults (seed 0, one thread):

- `profile.json`: `RouterProfile` over `PROFILE_N` development problems of the model's task (each prompt
  with its greedy answer, read teacher-forced): mean sorted router probabilities per layer, head sizes;
- `map.json`: the router map of the page's default generation (`MAP_SETTINGS`: the first development
  problem as the prompt, N = 4 samples under Expert-Sample with k_h = k/2, a tail pool m = 2k, T_e = 1,
  the displaced experts' gates, greedy tokens, 48 new tokens; toy-moe: k_h = 4 of 8, m = 16): with the
  model's own routing and greedy tokens every sample is the same, so "where the samples part" would be empty;
- `evaluation.json`: a small Expert-Sample evaluation (`EVAL_SETTINGS`: 12 evaluation and 6 development
  problems, 4 samples each, the default grid), with its choices, pass@n intervals and paired tests.

`map_from_dict` turns `map.json` back into a `RouterMap` for the page's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from analyses.moe_router.evaluate import ExpertSetting, evaluate_expert_sample
from analyses.moe_router.maps import RouterMap, generation_map, profile_task
from analyses.moe_router.problems import file_split_size, load_items, resolve_task
from analyses.tasks import is_task_file
from probes import Engine
from probes.backend import Backend
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "moe-router"
DEFAULT_MODEL = "toy-moe"  # `--model toy-moe:small` ships the small toy's too
PROFILE_N = 20
MAP_SETTINGS = {"prompt": "task problem 0", "n_samples": 4, "max_new_tokens": 48, "seed": 0, "sampling": "greedy"}
EVAL_SETTINGS = {"n": 12, "n_dev": 6, "samples": 4, "grid": "", "max_new_tokens": 48, "seed": 0}


def default_setting(k: int, n_experts: int) -> ExpertSetting:
    """The page's default Expert-Sample setting for a model with top-`k` of `n_experts` (the shipped one when
    it fits): keep half of k, sample from the next 2k, the displaced experts' gates."""
    k_h = max(0, k // 2)
    return ExpertSetting(k_h, max(1, min(n_experts - k_h, 2 * k)), 1.0, "displaced")


def task_prompt(backend: Backend, index: int = 0, seed: int = 0, task: str = "auto") -> tuple[Any, bool, str]:
    """(prompt, chat, answer) of development problem `index` of `task` (`auto`: the model's own task)."""
    items = load_items(resolve_task(task, backend), "development", index + 1, seed=seed, backend=backend)
    item = items[index]
    return item.prompt, bool(item.chat), str(getattr(item, "answer", ""))


def map_from_dict(d: dict[str, Any]) -> RouterMap:
    """A `RouterMap` from its `to_dict()` (None back to NaN)."""
    as_float = lambda x: np.array(x, dtype=object).astype(float).astype(np.float32)  # noqa: E731  None -> nan
    return RouterMap(list(d["layers"]), int(d["k"]), int(d["n_experts"]), [list(t) for t in d["tokens"]],
                     [list(t) for t in d["token_ids"]], as_float(d["logits"]), np.array(d["experts"], dtype=np.int64),
                     as_float(d["gates"]), d.get("rule"))


def router_profile(backend: Backend, progress: Callable[..., None] | None = None, task: str = "auto") -> dict[str, Any]:
    """The router profile the page draws and the shipped result stores: mean sorted router probabilities over
    PROFILE_N development problems of `task` (`auto`: the model's own; greedy answers, 48 new tokens, seed 0),
    with the task; a problem file with fewer development problems gives all it has."""
    n = PROFILE_N if not is_task_file(task) else max(1, min(PROFILE_N, file_split_size(task, "development")))
    profile, task = profile_task(backend, task, n, max_new_tokens=48, seed=0, progress=progress)
    return {**profile.to_dict(), "task": task, "n_problems": n}


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None, backend: Backend | None = None) -> Path:
    """Profile, default map and small evaluation of `model_id` (one thread, seed 0), written as a shipped result."""
    backend = backend if backend is not None else Engine.from_id(model_id)
    info = backend.info()
    arch = backend.arch()
    profile = router_profile(backend)
    task = profile["task"]
    setting = default_setting(int(arch.experts_top_k), int(arch.n_experts))
    prompt, chat, answer = task_prompt(backend)
    rmap = generation_map(backend, prompt, n_samples=MAP_SETTINGS["n_samples"], rule=setting.rule(0),
                          max_new_tokens=MAP_SETTINGS["max_new_tokens"], seed=0, chat=chat)
    e = EVAL_SETTINGS
    report = evaluate_expert_sample(backend, "auto", e["n"], n_dev=e["n_dev"], n_samples=e["samples"],
                                    max_new_tokens=e["max_new_tokens"], seed=e["seed"], n_resamples=500)
    evaluation = {**report.to_dict(), "provenance": provenance(info, data=task, split="evaluation", seed=0,
                                                                settings=report.settings)}
    files = {"profile.json": profile,
             "map.json": {**rmap.to_dict(), "prompt": prompt, "chat": chat, "answer": answer,
                          "setting": setting.to_dict()},
             "evaluation.json": evaluation}
    prov = provenance(info, data=task, split="development (profile, map) / evaluation", seed=0,
                      settings={"map": {**MAP_SETTINGS, "setting": setting.to_dict()}, "evaluation": EVAL_SETTINGS,
                                "profile_n": PROFILE_N})
    return shipped.write(NAME, model_id, info["fingerprint"], files, command=command, provenance=prov, root=root,
                         settings={"map": {**MAP_SETTINGS, "setting": setting.to_dict()}, "evaluation": EVAL_SETTINGS})


SHIPPED = {NAME: (DEFAULT_MODEL, build)}
