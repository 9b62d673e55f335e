"""The one RISE orchestrator, used by the page and by `thoughtscope rise ...`: harvest -> SAEs -> analysis -> steering.

Every stage reuses what the earlier ones stored, whoever ran them: traces and step vectors in
`cache/` (per trace, resumable), SAEs in SAELens folders and behaviour vectors as safetensors under
one folder per configuration (default: the user cache, keyed by model fingerprint and settings).
So the page and the CLI share results, and `steer` alone runs the whole pipeline the first time.
A stored SAE is reused only when its `rise.json` says it is the one this run would train (same model
and weights, same training data, same settings where the run sets them); otherwise the run is refused
with what differs (`stored_sae_differences`), never served another model's or another size's SAE.
`saved_saes()` lists every SAE the pipeline saved (with its model, site and held-out quality), so
another page can offer them. Progress goes through `on_progress(stage, done, total)`; nothing here
prints.

Held-out steps (issue 11): a seeded fraction `heldout` of the harvested traces never trains the
SAEs; their steps measure the SAE (explained variance and L0 as SAELens computes them), the best
latent per behaviour (AUROC) and the held-out silhouette. For the `toy-reasoner` organism the
harvest draws from the generator's calibration split and steering from its eval split.

Example:
    >>> from probes import Engine
    >>> run = RisePipeline(Engine.from_id("tiny-random:llama"), RiseOptions(n=4, layers=(1,), sae_steps=20))
    >>> result = run.run()  # doctest: +SKIP
    >>> sorted(result)  # doctest: +SKIP
    ['analysis', 'folder', 'harvest', 'saes', 'stats']
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from analyses.rise.columns import RiseAnalysis, analyse
from analyses.rise.harvest import LABELLERS, PROMPTS, Harvest, HarvestSettings, harvest, resolve_delimiter
from analyses.rise.labels import BEHAVIOURS
from analyses.rise.quality import sae_quality
from analyses.rise.steer import check_steering, steer
from analyses.tasks import ORGANISM_TASKS, Problem, load_task
from cache.store import ActivationStore
from probes.backend import Backend
from probes.zoo import user_cache_dir
from saes.io import is_sae_folder, load_sae, save_sae
from saes.stats import sae_stats
from saes.train import ARCHITECTURES, SAETrainSettings, train_sae
from thoughtscope import checks
from thoughtscope.errors import BadInputError

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def default_layers(n_layers: int) -> tuple[int, ...]:
    """Three layers at 1/3, 1/2 and 3/4 depth (mid-to-late layers separate behaviours best)."""
    return tuple(sorted({max(0, min(n_layers - 1, round(n_layers * f))) for f in (1 / 3, 1 / 2, 3 / 4)}))


@dataclass
class RiseOptions:
    """Everything a RISE run depends on (its folder key). `layers=()` means `default_layers`."""

    task: str = "arith"
    n: int = 200
    seed: int = 0
    layers: tuple[int, ...] = ()
    max_new_tokens: int = 64
    batch_size: int = 16
    delimiter: str = "auto"
    prompt: str = "auto"
    augment: str = "none"
    arch: str = "standard"
    d_sae: int | None = None
    l1: float | None = None
    k: int | None = None
    sae_steps: int | None = None
    lr: float | None = None
    projection: str = "umap"
    saes: str | None = None  # folder for the SAEs and vectors (default: user cache, keyed)
    store: str | None = None  # activation store folder (default: user cache)
    heldout: float = 0.2  # share of harvested traces kept out of SAE training (measures the SAE)
    temperature: float = 0.0  # 0: greedy traces; > 0: sampled (seeded)
    labeller: str = "auto"  # auto (the family's), keywords, or toy-reasoner

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        """Every check that needs no model, so a caller can refuse a bad setting before the model loads and
        before any harvest or training (the layers' range and the task's problems need the model or the
        task; `RisePipeline` checks them)."""
        checks.integer("n (problems to harvest)", self.n, low=1)
        checks.integer("seed", self.seed, low=0, high=checks.SEED_MAX)
        checks.int_list("layers", list(self.layers), low=0, empty_ok=True)
        checks.integer("max_new_tokens", self.max_new_tokens, low=1)
        checks.integer("batch_size", self.batch_size, low=1)
        if self.delimiter != "auto":
            resolve_delimiter(self.delimiter)  # an invalid regex, or one matching the empty string
        checks.choice("prompt", self.prompt, PROMPTS)
        checks.choice("augment", self.augment, ("none", "templated"))
        checks.choice("labeller", self.labeller, LABELLERS)
        checks.choice("the SAE architecture", self.arch, ARCHITECTURES)
        # the SAE's training settings: None is the default scaled to the data (SAETrainSettings.scaled)
        if self.d_sae is not None:
            checks.integer("d_sae", self.d_sae, low=1, why="SAE latents")
        if self.l1 is not None:
            checks.number("l1", self.l1, low=0, why="the SAE's L1 coefficient")
        if self.k is not None:
            checks.integer("k", self.k, low=1, why="active latents per input, TopK")
            if self.arch == "topk" and self.d_sae is not None and self.k > self.d_sae:
                raise BadInputError(f"TopK needs k <= d_sae, got k={self.k}, d_sae={self.d_sae}")
        if self.sae_steps is not None:
            checks.integer("SAE training steps", self.sae_steps, low=1)
        if self.lr is not None:
            checks.number("lr", self.lr, low=0, low_open=True, why="the SAE's learning rate")
        checks.choice("projection", self.projection, PROJECTIONS)
        checks.number("heldout", self.heldout, low=0, high=1, high_open=True,
                      why="the share of traces kept out of SAE training")
        checks.number("temperature", self.temperature, low=0, why="0 = greedy")


PROJECTIONS = ("umap", "pca")
RISE_META = "rise.json"
# What a stored SAE was trained on, besides its model: the same settings give the same training steps and the
# same held-out traces. Layers (one folder per site), the labeller (labels never train) and the projection are
# not among them; the harvest's batch size only matters to sampled traces (as in the activation store's key).
SAE_DATA_SETTINGS = ("task", "n", "seed", "heldout", "max_new_tokens", "prompt", "delimiter", "augment",
                     "temperature")
# The training settings a run may leave unset (None: "the stored SAE's, else the scaled default"): a run that
# sets one must find it in the stored SAE. `analyse` and `steer` have no flags for them, so they take the SAEs
# that `train` made with any of them.
SAE_TRAIN_SETTINGS = {"d_sae": "d_sae", "l1": "l1_coefficient", "k": "k", "sae_steps": "steps", "lr": "lr"}


@dataclass
class SavedSAE:
    """An SAE the RISE pipeline saved (a SAELens folder), with what it was trained on and how well it does."""

    folder: str
    model_id: str
    site: str
    d_in: int
    d_sae: int
    heldout_explained_variance: float | None
    heldout_l0: float | None
    options: dict[str, Any]

    @property
    def label(self) -> str:
        ev = "?" if self.heldout_explained_variance is None else f"{self.heldout_explained_variance:.2f}"
        return f"{self.model_id} {self.site} d_sae={self.d_sae} held-out EV {ev} ({Path(self.folder).parent.name})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def saved_saes(model_id: str | None = None, site: str | None = None, root: str | Path | None = None) -> list[SavedSAE]:
    """Every SAE folder the RISE pipeline saved under `root` (default: the user cache's `rise/`), newest
    first; only those of `model_id` / `site` when given. Each folder loads with `saes.io.load_sae`
    (or SAELens' `SAE.load_from_disk`), and its decoder rows are steering directions.

    >>> saved_saes(root="/nonexistent")
    []
    """
    if root is None:
        root = user_cache_dir() / "rise"
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for meta_path in root.glob(f"*/*/{RISE_META}"):
        folder = meta_path.parent
        try:
            meta = json.loads(meta_path.read_text())
            cfg = json.loads((folder / "cfg.json").read_text())
            if model_id is not None and meta.get("model_id") != model_id:
                continue
            if site is not None and meta.get("site") != site:
                continue
            held = (meta.get("quality") or {}).get("heldout") or {}
            ev, l0 = held.get("explained_variance"), held.get("l0")
            found.append((meta_path.stat().st_mtime, SavedSAE(
                str(folder), meta.get("model_id", ""), meta.get("site", ""), int(cfg.get("d_in", 0)),
                int(cfg.get("d_sae", 0)),
                None if ev is None or ev != ev else float(ev), None if l0 is None or l0 != l0 else float(l0),
                meta.get("options", {}))))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # a folder being written, or damaged (a file that is not the JSON object it should be): not offered
    return [s for _, s in sorted(found, key=lambda x: -x[0])]


class TooFewStepsError(BadInputError):
    def __init__(self, site: str, n: int):
        super().__init__(f"only {n} step vector(s) at {site}: an SAE needs at least 2. Harvest more problems, "
                         "more tokens, or splice templated reflection/backtracking steps (--augment templated).")


class StoredSAEMismatchError(BadInputError):
    def __init__(self, path: Path, differences: list[str]):
        super().__init__(
            f"the SAE stored in {path} does not fit this run ({'; '.join(differences)}). Use a fresh --saes folder, "
            f"or retrain the SAEs there with `thoughtscope rise train` and this run's settings (it overwrites them).")


def stored_sae_differences(meta: dict[str, Any], sae: Any, options: RiseOptions, model_id: str,
                           fingerprint: str) -> list[str]:
    """How the SAE stored beside `meta` (its `rise.json`) differs from the one this run would train: its model
    (id and weights), the data it was trained on (`SAE_DATA_SETTINGS`, `auto` read as the model family's), its
    architecture, and each training setting this run sets. Empty when the stored SAE is this run's."""
    stored_model = meta.get("model_id")
    if stored_model != model_id:
        return [f"trained on {stored_model!r}, this run uses {model_id!r}"]
    if meta.get("fingerprint") != fingerprint:
        return [f"trained on other weights of {model_id} (fingerprint {meta.get('fingerprint')!r}, now {fingerprint!r})"]
    stored = meta.get("options") or {}
    differences = []

    def comparable(name: str, value: Any) -> Any:
        if name == "delimiter":
            return resolve_delimiter(value, model_id)
        if name == "prompt":
            return HarvestSettings(prompt=value).resolved(model_id).prompt
        return value

    data = list(SAE_DATA_SETTINGS) + (["batch_size"] if options.temperature else [])
    for name in data:
        mine, theirs = getattr(options, name), stored.get(name)
        try:
            differs = comparable(name, mine) != comparable(name, theirs)
        except (BadInputError, TypeError):  # a damaged record: not the same settings
            differs = True
        if differs:
            differences.append(f"{name}: stored {theirs!r}, this run {mine!r}")
    if stored.get("arch") != options.arch:
        differences.append(f"architecture: stored {stored.get('arch')!r}, this run {options.arch!r}")
    trained = meta.get("train_settings") or {}  # the values used, scaled defaults included (older records: options)
    for name, field in SAE_TRAIN_SETTINGS.items():
        mine = getattr(options, name)
        theirs = int(sae.cfg.d_sae) if name == "d_sae" else trained.get(field, stored.get(name))
        if mine is not None and mine != theirs:
            differences.append(f"{name}: stored {'default' if theirs is None else repr(theirs)}, this run {mine!r}")
    return differences


class RisePipeline:
    """One configuration of RISE on one backend; each stage loads what is stored before computing."""

    def __init__(self, backend: Backend, options: RiseOptions, on_progress: Progress | None = None):
        options.validate()
        self.backend, self.options, self.on_progress = backend, options, on_progress
        self.info = backend.info()
        layers = options.layers or default_layers(backend.arch().n_layers)
        self.settings = HarvestSettings(layers=tuple(layers), max_new_tokens=options.max_new_tokens,
                                        batch_size=options.batch_size, delimiter=options.delimiter,
                                        prompt=options.prompt, augment=options.augment, seed=options.seed,
                                        temperature=options.temperature,
                                        labeller=options.labeller).resolved(self.info["model_id"])
        self.settings.validate(backend.arch().n_layers)

    # ----- stages -----

    def problems(self, n_heldout: int = 0) -> tuple[list[Problem], list[Problem]]:
        """The harvest problems, then `n_heldout` more that none of them equals (for steering): the
        organism's calibration and eval splits, or the first and the next problems of the task."""
        o = self.options
        if o.task in ORGANISM_TASKS:
            return (load_task(o.task, o.n, seed=o.seed, split="calibration"),
                    load_task(o.task, n_heldout, seed=o.seed, split="eval") if n_heldout else [])
        problems = load_task(o.task, o.n + n_heldout, seed=o.seed)
        return problems[:o.n], problems[o.n:]

    def heldout_rows(self, h: Harvest) -> list[int]:
        """Rows (steps) of the seeded `heldout` share of traces: never used to train the SAEs."""
        n_traces = len(h.traces)
        k = int(round(self.options.heldout * n_traces))
        if self.options.heldout > 0 and n_traces >= 2:
            k = min(max(k, 1), n_traces - 1)
        held = set(random.Random(f"rise-heldout-{self.options.seed}").sample(range(n_traces), k)) if k else set()
        return [r for r, (t, _) in enumerate(h.step_rows) if t in held]

    def harvest(self) -> Harvest:
        store = ActivationStore(self.options.store) if self.options.store else ActivationStore()
        problems, _ = self.problems()
        return harvest(self.backend, problems, self.settings, store=store, on_progress=self._stage("harvest"))

    @property
    def folder(self) -> Path:
        if self.options.saes:
            return Path(self.options.saes)
        key = json.dumps({"fingerprint": self.info["fingerprint"], "model": self.info["model_id"],
                          "harvest": self.settings.to_dict(),
                          **{k: v for k, v in self.options.to_dict().items() if k not in ("saes", "store", "projection")}},
                         sort_keys=True)
        return user_cache_dir() / "rise" / hashlib.sha256(key.encode()).hexdigest()[:16]

    def train(self, h: Harvest, retrain: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """One SAE per site, loaded from the folder when it is there (unless `retrain`), else trained on the
        training traces' steps and saved (with a `rise.json` naming its model, site and held-out quality).
        Returns the SAEs and their stats on the held-out steps (on all steps when none is held out)."""
        o = self.options
        held = self.heldout_rows(h)
        train_rows = sorted(set(range(len(h.step_rows))) - set(held))
        saes, stats = {}, {}
        for i, (site, acts) in enumerate(h.acts.items()):
            path = self.folder / site
            if is_sae_folder(path) and not retrain:
                saes[site] = self._stored_sae(path)
            else:
                if len(train_rows) < 2:
                    raise TooFewStepsError(site, len(train_rows))
                overrides = {k: v for k, v in dict(d_sae=o.d_sae, l1_coefficient=o.l1, k=o.k, steps=o.sae_steps,
                                                    lr=o.lr).items() if v is not None}
                train_settings = SAETrainSettings.scaled(acts.shape[1], len(train_rows), architecture=o.arch,
                                                         seed=o.seed, progress=False, **overrides)
                saes[site], _ = train_sae(acts[train_rows], train_settings,
                                          metadata={"model_name": self.info["model_id"], "hook_name": site})
                save_sae(saes[site], path)
                quality = {"train": sae_quality(saes[site], acts[train_rows]),
                           "heldout": sae_quality(saes[site], acts[held])}
                (path / RISE_META).write_text(json.dumps(
                    {"model_id": self.info["model_id"], "fingerprint": self.info["fingerprint"], "site": site,
                     "options": o.to_dict(), "train_settings": train_settings.to_dict(),
                     "train_steps": len(train_rows), "heldout_steps": len(held),
                     "quality": quality}, default=str, indent=1))
            stats[site] = sae_stats(saes[site], acts[held] if held else acts)
            self._tick("train", i + 1, len(h.acts))
        return saes, stats

    def _stored_sae(self, path: Path) -> Any:
        """The SAE stored at `path`, when it is the one this run would train (`stored_sae_differences`). One that is
        not is refused rather than retrained: the folder is one the user named or another run's, and overwriting
        SAEs (and the behaviour vectors beside them) nobody asked to replace loses work; reusing them silently
        reports settings they were not trained with."""
        try:
            meta = json.loads((path / RISE_META).read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            raise StoredSAEMismatchError(path, [f"its {RISE_META}, which says which model and settings trained it, "
                                                f"is missing or unreadable ({err.__class__.__name__})"]) from err
        sae = load_sae(path)
        differences = stored_sae_differences(meta, sae, self.options, self.info["model_id"], self.info["fingerprint"])
        if differences:
            raise StoredSAEMismatchError(path, differences)
        return sae

    def analyse(self, h: Harvest, saes: dict[str, Any]) -> RiseAnalysis:
        """Column association, geometry and behaviour vectors; the vectors are saved beside the SAEs."""
        result = analyse(h, saes, method=self.options.projection, seed=self.options.seed,
                         heldout_rows=self.heldout_rows(h))
        vectors = {f"{la.site}/{label}": v.contiguous() for la in result.layers for label, v in la.vectors.items()}
        if vectors:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_file(vectors, str(self.folder / "behaviour_vectors.safetensors"))
        return result

    def run(self, retrain: bool = False) -> dict[str, Any]:
        h = self.harvest()
        saes, stats = self.train(h, retrain=retrain)
        return {"harvest": h, "saes": saes, "stats": stats, "analysis": self.analyse(h, saes),
                "folder": str(self.folder), "heldout_traces": len({h.step_rows[r][0] for r in self.heldout_rows(h)})}

    def steer(self, behaviour: str, alphas: list[float], n_heldout: int, mode: str = "projection",
              layer: int | None = None) -> dict[str, Any]:
        """The pipeline (stored stages reused), then the steering sweep on held-out problems."""
        checks.choice("behaviour", behaviour, BEHAVIOURS)
        alphas = check_steering(alphas, mode)
        if n_heldout < 1:
            raise BadInputError("steer on at least one held-out problem")
        self.check_layer(layer)
        found = self.run()
        h, result = found["harvest"], found["analysis"]
        site = f"resid_post.{layer}" if layer is not None else result.best_site
        vectors = result.layer(site).vectors
        if behaviour not in vectors:
            raise BadInputError(
                f"no {behaviour} vector at {site}: {h.label_counts()[behaviour]} harvested steps carry that label, "
                "too few for its own SAE columns. Harvest more problems, use a model that reflects, "
                "or add --augment templated")
        _, heldout = self.problems(n_heldout)
        table = steer(self.backend, heldout, vectors[behaviour], site, alphas, mode=mode, settings=h.settings,
                      behaviour=behaviour, seed=self.options.seed + 77, split=self._steer_split(),
                      on_progress=self._stage("steer"))
        return {"steering": table.to_dict(), "silhouette_per_layer": result.to_dict()["silhouette_per_layer"],
                "label_counts": h.label_counts(), "site": site, "folder": str(self.folder)}

    def check_layer(self, layer: int | None) -> None:
        """A steering layer is one the harvest reads (so it has an SAE and vectors): refused before the harvest."""
        if layer is not None and layer not in self.settings.layers:
            raise BadInputError(f"cannot steer at layer {layer}: this run reads layers "
                                f"{', '.join(map(str, self.settings.layers))} (the model has layers "
                                f"0..{self.backend.arch().n_layers - 1}); pick one of them, or add it with --layers")

    def _steer_split(self) -> str:
        return "eval (the generator's)" if self.options.task in ORGANISM_TASKS else "held-out (after the harvest)"

    # ----- progress -----

    def _tick(self, stage: str, done: int, total: int) -> None:
        if self.on_progress:
            self.on_progress(stage, done, total)

    def _stage(self, stage: str) -> Callable[[int, int], None]:
        return lambda done, total: self._tick(stage, done, total)
