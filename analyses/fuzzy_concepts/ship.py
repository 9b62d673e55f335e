"""The shipped fuzzy-concepts result: the page's default study on the embedded model, made by `thoughtscope ship`.

`thoughtscope ship fuzzy-concepts` runs `run_study` at the page's default settings (`PAGE_OPTIONS`: the
word "water" in the model's own generations, 48 samples, K = 6 rules, 3 seeds, 300 steps, the default
layer, sidebar defaults of 48 new tokens and seed 0) on one thread and writes docs/shipped/<model>/fuzzy-concepts/:

- `study.json`: `FuzzyStudy.to_dict()` (samples, splits, development choices, metrics with intervals,
  paired tests, grounded words, overlap matrices, rules) plus the options it was run with;
- `rules.safetensors` + `rules.json`: the seed-0 fuzzy layer (`FuzzyRuleLayer.save`);
- `representations.safetensors`: Z, the harvested hidden states (48 x d float32), so a sample's firing
  and explanation are computed from the shipped files.

`load_study(shipped)` turns those files back into a `FuzzyStudy` the page draws as if it had just run
(the baselines' fitted models are not shipped: the page only reads their summaries and words).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from analyses.evaluation import Choice
from analyses.fuzzy_concepts.harvest import Representations, Sample
from analyses.fuzzy_concepts.rules import CONFIG_FILE, WEIGHTS_FILE, FuzzyRuleLayer
from analyses.fuzzy_concepts.study import FuzzyOptions, FuzzyStudy, run_study
from cache.store import ActivationStore
from probes import Engine
from probes.backend import Backend
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "fuzzy-concepts"
DEFAULT_MODEL = "smollm2-135m"
FILES = ("study.json", "rules.safetensors", "rules.json", "representations.safetensors")


def page_options(max_new_tokens: int = 48, seed: int = 0) -> FuzzyOptions:
    """The page's default settings (app/views/fuzzy_concepts.py `settings_section` with its defaults)."""
    return FuzzyOptions(word="water", source="generate", n=48, texts=(), where="generated", layer=None, k=6,
                        seeds=3, steps=300, max_new_tokens=max_new_tokens, batch_size=16, seed=seed)


def comparable(options: FuzzyOptions, n_layers: int) -> dict[str, Any]:
    """The settings a study's result depends on, with the layer resolved (so `None` and the default match)."""
    d = options.to_dict()
    d["layer"] = options.resolved_layer(n_layers)
    d.pop("store", None)
    return json.loads(json.dumps(d))  # as the manifest holds it (tuples become lists)


def study_files(study: FuzzyStudy, tmp: Path) -> dict[str, Any]:
    """The files of a shipped study (see the module docstring), written under `tmp` where they are tensors."""
    study.fuzzy.save(tmp / "rules")
    save_file({"Z": study.reps.Z.contiguous()}, str(tmp / "representations.safetensors"))
    data = study.to_dict()
    data["options_full"] = {**study.options.to_dict(), "texts": list(study.options.texts)}
    data["per_seed_full"] = study.per_seed
    return {"study.json": data, "rules.safetensors": tmp / "rules" / WEIGHTS_FILE, "rules.json": tmp / "rules" / CONFIG_FILE, "representations.safetensors": tmp / "representations.safetensors"}


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None, backend: Backend | None = None,
          options: FuzzyOptions | None = None) -> Path:
    """Run the page's default study on `model_id` (one thread, seeded) and write it as a shipped result."""
    backend = backend if backend is not None else Engine.from_id(model_id)
    options = options or page_options()
    info = backend.info()
    with tempfile.TemporaryDirectory() as tmp:
        # a private store: the shipped harvest is made from scratch, never from rows a user cached
        study = run_study(backend, options, store=ActivationStore(Path(tmp) / "store"))
        files = study_files(study, Path(tmp))
        prov = provenance(info, data=f"{options.source}:{options.word}", split="eval", seed=options.seed,
                          settings=options.to_dict(), site=study.reps.site)
        return shipped.write(NAME, model_id, info["fingerprint"], files, command=command, provenance=prov,
                             root=root, settings=comparable(options, backend.arch().n_layers))


def _rules_layer(shipped: Any) -> FuzzyRuleLayer:
    with tempfile.TemporaryDirectory() as tmp:  # `load` reads a folder holding rules.json + rules.safetensors
        for file, saved_as in (("rules.json", CONFIG_FILE), ("rules.safetensors", WEIGHTS_FILE)):
            shutil.copyfile(shipped.path(file), Path(tmp) / saved_as)
        return FuzzyRuleLayer.load(tmp)


def _choice(d: dict[str, Any]) -> Any:
    grid = [row["setting"] for row in d["grid"]]
    rows = [{k: v for k, v in row.items() if k not in ("setting", "score")} for row in d["grid"]]
    return Choice(d["name"], grid, rows, [row["score"] for row in d["grid"]], int(d["chosen_index"]), d["objective"],
                  d.get("split", "development"))


def load_study(shipped: Any) -> FuzzyStudy:
    """The shipped study as a `FuzzyStudy` (models: the fuzzy layer only)."""
    data = shipped.json("study.json")
    opts = dict(data["options_full"])
    for name in ("texts", "sparsity_grid", "features_grid", "lr_grid", "nmf_alpha_grid"):
        opts[name] = tuple(opts[name])
    options = FuzzyOptions(**opts)
    rep = data["representations"]
    samples = [Sample(s["id"], s["key"], [], int(s["position"]), s["text"], tuple(s["span"]), int(s["prompt_chars"]),
                      dict(s["labels"])) for s in rep["samples"]]
    Z = load_file(str(shipped.path("representations.safetensors")))["Z"]
    reps = Representations(rep["model_id"], rep["fingerprint"], rep["site"], rep["word"], rep["source"], samples, Z,
                           rep.get("n_from_cache", 0), rep.get("seconds", {}))
    fuzzy = _rules_layer(shipped)
    feature_names = list(data["feature_names"])
    rules = fuzzy.rules(feature_names=feature_names)
    for rule, words in zip(rules, data["words"]["fuzzy"]):
        rule.words = list(words)
    return FuzzyStudy(options=options, reps=reps, splits={k: list(v) for k, v in data["splits"].items()},
                      tuning={k: _choice(v) for k, v in data["tuning"].items()}, per_seed=data["per_seed_full"],
                      summary=data["summary"], paired=data["paired_tests"], models={"fuzzy": fuzzy},
                      words=data["words"], overlap_matrix=data["overlap_matrix"], top_samples=data["top_samples"],
                      rules=rules, feature_names=feature_names, seconds=data.get("seconds", {}))


SHIPPED = {NAME: (DEFAULT_MODEL, build)}


if __name__ == "__main__":  # pragma: no cover - `thoughtscope ship fuzzy-concepts` is the entry point
    print(json.dumps(str(build(DEFAULT_MODEL, f"thoughtscope ship {NAME}"))))
