"""The shipped visual-attribution result: the fitted estimator and a small study on the toy VLM.

`thoughtscope ship visual-attribution` runs the page's default faithfulness study (`STUDY_SETTINGS`: 10
training and 10 held-out toy-vlm scenes, 8 LDS cell sets per scene, seed 0, the estimator's default
300 epochs, no development choice) on one thread and writes docs/shipped/<model>/visual-attribution/:

- `estimator.safetensors` + `estimator.json`: the study's fitted `AmortizedAttribution` (`save`), which is
  also what the page's "Fit the estimator" makes (`fit_estimator` on the same 10 training scenes);
- `study.json`: `StudyResult.to_dict()`: metrics with intervals, costs, paired comparisons and, for the
  first held-out scene (the page's default scene, seed 0), every span's amortized, attention and
  exhaustive scores per grid cell.

The toy is the full toy-vlm (`DEFAULT_MODEL`, whose weights ship in docs/shipped/models/: 0.993 held-out
answer accuracy); `thoughtscope ship visual-attribution --model toy-vlm:small` builds the same result on the
small toy (also shipped).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from analyses.visual_attribution.estimator import AmortizedAttribution
from analyses.visual_attribution.evaluate import run_study
from probes import Engine
from probes.backend import Backend
from thoughtscope import shipped
from thoughtscope.numerics import one_thread
from thoughtscope.provenance import provenance

NAME = "visual-attribution"
DEFAULT_MODEL = "toy-vlm"
STUDY_SETTINGS = {"n_train": 10, "n_eval": 10, "subsets": 8, "seed": 0}
EPOCHS = 300


@one_thread()  # the caller's torch threads come back after the build
def build(model_id: str, command: str, root: Path | None = None, backend: Backend | None = None) -> Path:
    """The page's default study on `model_id` (one thread, seed 0), with its estimator, as a shipped result."""
    backend = backend if backend is not None else Engine.from_id(model_id)
    info = backend.info()
    s = STUDY_SETTINGS
    study = run_study(backend, n_train=s["n_train"], n_eval=s["n_eval"], seed=s["seed"], epochs=EPOCHS,
                      n_subsets=s["subsets"])
    with tempfile.TemporaryDirectory() as tmp:
        saved = study.estimator.save(Path(tmp) / "estimator")
        files = {"estimator.json": saved, "estimator.safetensors": saved.with_suffix(".safetensors"),
                 "study.json": study.to_dict()}
        prov = provenance(info, data="probes.toys.vlm scenes", split="train (estimator) / eval (scores)",
                          seed=s["seed"], settings=study.settings)
        return shipped.write(NAME, model_id, info["fingerprint"], files, command=command, provenance=prov,
                             root=root, settings=STUDY_SETTINGS, epochs=EPOCHS)


def load_estimator(found: Any) -> Any:
    """The shipped estimator (`AmortizedAttribution.load` reads `<stem>.json` + `<stem>.safetensors`)."""
    return AmortizedAttribution.load(found.path("estimator.json"))


SHIPPED = {NAME: (DEFAULT_MODEL, build)}
