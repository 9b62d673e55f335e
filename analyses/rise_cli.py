"""`thoughtscope rise ...`: the RISE stages from the command line, each printing JSON with --json.

    thoughtscope rise harvest --n 200 --layers 9 15 21 --json
    thoughtscope rise train   --n 200 --layers 9 15 21 --arch standard --json
    thoughtscope rise analyse --n 200 --layers 9 15 21 --json
    thoughtscope rise steer   --behaviour reflection --alpha -1.5 -1 0 1 1.5 --n 32 --json

Every stage reuses what the earlier ones stored: traces and step vectors in `cache/`, SAEs in
SAELens folders under `--saes` (default: the user cache), so `steer` alone runs the whole
pipeline the first time and only the steering the next. Also `bench_harvest` and
`bench_sae_throughput`, the measurements `thoughtscope bench` reports.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
import typer.core

from thoughtscope.errors import BadInputError

rise_app = typer.Typer(no_args_is_help=True, help="RISE: step-level SAEs, reasoning vectors and steering.")
MULTI_VALUE_FLAGS = ("--alpha", "--layers")


def expand_multi_value_flags(args: list[str], flags=MULTI_VALUE_FLAGS) -> list[str]:
    """`--alpha -1.5 -1 0` -> `--alpha -1.5 --alpha -1 --alpha 0`: click options take one value
    each, and the RISE commands read naturally with a list after the flag.

    >>> expand_multi_value_flags(["--alpha", "-1.5", "-1", "0", "--n", "8", "--layers", "6", "12"])
    ['--alpha', '-1.5', '--alpha', '-1', '--alpha', '0', '--n', '8', '--layers', '6', '--layers', '12']
    """
    out: list[str] = []
    flag, emitted = None, False
    for arg in args:
        if arg in flags:
            if flag is not None and not emitted:
                out.append(flag)
            flag, emitted = arg, False
            continue
        if flag is not None and _is_number_list(arg):
            out += [flag, arg]
            emitted = True
            continue
        if flag is not None and not emitted:
            out.append(flag)  # no number after the flag: click takes this value or reports it
        flag = None
        out.append(arg)
    if flag is not None and not emitted:
        out.append(flag)
    return out


def _is_number_list(arg: str) -> bool:
    parts = [p for p in arg.split(",") if p.strip()]
    try:
        return bool(parts) and all(isinstance(float(p), float) for p in parts)
    except ValueError:
        return False


class _MultiValueCommand(typer.core.TyperCommand):
    def parse_args(self, ctx, args):
        return super().parse_args(ctx, expand_multi_value_flags(list(args)))


def register(cli: typer.Typer) -> None:
    cli.add_typer(rise_app, name="rise")


# --------------------------------------------------------------------------- shared options


@dataclass
class PipelineOptions:
    model: str = "smollm2-135m"
    task: str = "arith"
    n: int = 200
    seed: int = 0
    layers: tuple[int, ...] = ()
    max_new_tokens: int = 64
    batch_size: int = 16
    delimiter: str = "auto"
    prompt: str = "one-shot"
    augment: str = "none"
    arch: str = "standard"
    d_sae: Optional[int] = None
    l1: Optional[float] = None
    k: Optional[int] = None
    steps: Optional[int] = None
    lr: Optional[float] = None
    saes: Optional[str] = None
    store: Optional[str] = None
    projection: str = "umap"
    retrain: bool = False
    progress: bool = True


def _numbers(values: list[str] | None, cast=float) -> list[Any]:
    """The values of a repeated option (`--alpha -1.5 --alpha 0` or `--alpha -1.5,0`) as numbers."""
    out = []
    for raw in values or []:
        for part in str(raw).split(","):
            if part.strip():
                try:
                    out.append(cast(part))
                except ValueError as err:
                    raise BadInputError(f"{part!r} is not a number") from err
    return out


def default_layers(n_layers: int) -> tuple[int, ...]:
    """Three layers at 1/3, 1/2 and 3/4 depth (mid-to-late layers separate behaviours best)."""
    return tuple(sorted({max(0, min(n_layers - 1, round(n_layers * f))) for f in (1 / 3, 1 / 2, 3 / 4)}))


def _engine(opts: PipelineOptions):
    from probes.engine import Engine

    return Engine.from_id(opts.model)


def _harvest_settings(opts: PipelineOptions, n_layers: int):
    from analyses.rise import HarvestSettings

    layers = opts.layers or default_layers(n_layers)
    return HarvestSettings(layers=tuple(layers), max_new_tokens=opts.max_new_tokens, batch_size=opts.batch_size,
                           delimiter=opts.delimiter, prompt=opts.prompt, augment=opts.augment, seed=opts.seed)


def _problems(opts: PipelineOptions, n_heldout: int = 0):
    """The harvest problems, then `n_heldout` more that none of them equals (for steering)."""
    from analyses.tasks import load_task

    problems = load_task(opts.task, opts.n + n_heldout, seed=opts.seed)
    return problems[:opts.n], problems[opts.n:]


def _store(opts: PipelineOptions):
    from cache.store import ActivationStore

    return ActivationStore(opts.store) if opts.store else ActivationStore()


def run_harvest(opts: PipelineOptions, engine=None):
    from analyses.rise import harvest

    engine = engine or _engine(opts)
    settings = _harvest_settings(opts, engine.info()["arch"]["n_layers"])
    problems, _ = _problems(opts)
    return engine, harvest(engine, problems, settings, store=_store(opts), progress=opts.progress)


def _sae_folder(opts: PipelineOptions, harvest) -> Path:
    if opts.saes:
        return Path(opts.saes)
    from probes.zoo import user_cache_dir

    key = json.dumps({"model": opts.model, "task": opts.task, "n": opts.n, "seed": opts.seed,
                      "harvest": harvest.settings.to_dict(), "arch": opts.arch, "d_sae": opts.d_sae, "l1": opts.l1,
                      "k": opts.k, "steps": opts.steps, "lr": opts.lr}, sort_keys=True)
    return user_cache_dir() / "rise" / hashlib.sha256(key.encode()).hexdigest()[:16]


def run_train(opts: PipelineOptions, harvest) -> tuple[dict[str, Any], dict[str, Any]]:
    """SAEs per site (loaded when the folder already has them and not --retrain) and their stats."""
    from saes.io import is_sae_folder, load_sae, save_sae
    from saes.stats import sae_stats
    from saes.train import SAETrainSettings, train_sae

    folder = _sae_folder(opts, harvest)
    saes, stats = {}, {}
    for site, acts in harvest.acts.items():
        path = folder / site
        if is_sae_folder(path) and not opts.retrain:
            saes[site] = load_sae(path)
            stats[site] = sae_stats(saes[site], acts).to_dict() | {"loaded_from": str(path)}
            continue
        overrides = {k: v for k, v in dict(d_sae=opts.d_sae, l1_coefficient=opts.l1, k=opts.k, steps=opts.steps,
                                            lr=opts.lr).items() if v is not None}
        settings = SAETrainSettings.scaled(acts.shape[1], acts.shape[0], architecture=opts.arch, seed=opts.seed,
                                           progress=opts.progress, **overrides)
        sae, st = train_sae(acts, settings, metadata={"model_name": opts.model, "hook_name": site})
        save_sae(sae, path)
        saes[site], stats[site] = sae, st.to_dict() | {"saved_to": str(path)}
    return saes, stats


def run_analyse(opts: PipelineOptions, harvest, saes):
    from safetensors.torch import save_file

    from analyses.rise import analyse

    result = analyse(harvest, saes, method=opts.projection, seed=opts.seed)
    folder = _sae_folder(opts, harvest)
    vectors = {f"{la.site}/{label}": v.contiguous() for la in result.layers for label, v in la.vectors.items()}
    if vectors:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(vectors, str(folder / "behaviour_vectors.safetensors"))
    return result


def _emit(payload: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(payload, default=_jsonable))
    else:
        from rich.console import Console

        Console().print_json(json.dumps(payload, default=_jsonable))


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "to_dict"):
        return x.to_dict()
    return str(x)


# --------------------------------------------------------------------------- commands


def _common(model, task, n, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment,
            store, quiet, **extra) -> PipelineOptions:
    layer_list = _numbers(layers, cast=int)
    return PipelineOptions(model=model, task=task, n=n, seed=seed, layers=tuple(layer_list),
                           max_new_tokens=max_new_tokens, batch_size=batch_size, delimiter=delimiter, prompt=prompt,
                           augment=augment, store=store, progress=not quiet, **extra)


_M = typer.Option("smollm2-135m", "--model", help="model id")
_TASK = typer.Option("arith", "--task", help="arith, arith2, arith-mixed or gsm8k")
_N = typer.Option(200, "--n", help="problems to harvest")
_SEED = typer.Option(0, "--seed")
_LAYERS = typer.Option(None, "--layers", help="layers, e.g. --layers 9 15 21 (default: 1/3, 1/2, 3/4 depth)")
_MAXNEW = typer.Option(64, "--max-new-tokens")
_BATCH = typer.Option(16, "--batch-size")
_DELIM = typer.Option("auto", "--delimiter", help="auto, sentence, or a string such as '\\n\\n'")
_PROMPT = typer.Option("one-shot", "--prompt", help="one-shot, cot or chat")
_AUG = typer.Option("none", "--augment", help="none, or templated (splice reflection/backtracking sentences)")
_STORE = typer.Option(None, "--store", help="activation store folder (default: user cache)")
_QUIET = typer.Option(False, "--quiet", help="no progress bars")
_JSON = typer.Option(False, "--json", help="one JSON object on stdout")


@rise_app.command("harvest", cls=_MultiValueCommand)
def harvest_cmd(model: str = _M, task: str = _TASK, n: int = _N, seed: int = _SEED,
                layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
                delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
                quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Generate traces, cut them into steps and store the step vectors (resumable)."""
    opts = _common(model, task, n, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment, store, quiet)
    _, h = run_harvest(opts)
    _emit(h.to_dict(), as_json)


@rise_app.command("train", cls=_MultiValueCommand)
def train_cmd(model: str = _M, task: str = _TASK, n: int = _N, seed: int = _SEED,
              layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
              delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
              arch: str = typer.Option("standard", "--arch", help="standard (ReLU + L1) or topk"),
              d_sae: Optional[int] = typer.Option(None, "--d-sae"), l1: Optional[float] = typer.Option(None, "--l1"),
              k: Optional[int] = typer.Option(None, "--k"), steps: Optional[int] = typer.Option(None, "--steps"),
              lr: Optional[float] = typer.Option(None, "--lr"),
              saes: Optional[str] = typer.Option(None, "--saes", help="folder for the SAEs (SAELens format)"),
              quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Train one SAE per layer on the harvested step vectors; report explained variance, L0, dead latents."""
    opts = _common(model, task, n, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment, store,
                   quiet, arch=arch, d_sae=d_sae, l1=l1, k=k, steps=steps, lr=lr, saes=saes, retrain=True)
    _, h = run_harvest(opts)
    _, stats = run_train(opts, h)
    _emit({"harvest": h.to_dict(), "saes": stats}, as_json)


@rise_app.command("analyse", cls=_MultiValueCommand)
def analyse_cmd(model: str = _M, task: str = _TASK, n: int = _N, seed: int = _SEED,
                layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
                delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
                arch: str = typer.Option("standard", "--arch"),
                saes: Optional[str] = typer.Option(None, "--saes", help="SAE folder (trained there if missing)"),
                projection: str = typer.Option("umap", "--projection", help="umap or pca"),
                quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Column association, decoder UMAP, silhouette per layer and behaviour vectors."""
    opts = _common(model, task, n, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment, store,
                   quiet, arch=arch, saes=saes, projection=projection)
    _, h = run_harvest(opts)
    sae_map, stats = run_train(opts, h)
    result = run_analyse(opts, h, sae_map)
    _emit({"harvest": h.to_dict(), "analysis": result.to_dict()}, as_json)


@rise_app.command("steer", cls=_MultiValueCommand)
def steer_cmd(behaviour: str = typer.Option("reflection", "--behaviour"),
              alpha: Optional[list[str]] = typer.Option(None, "--alpha", help="e.g. --alpha -1.5 -1 0 1 1.5"),
              n: int = typer.Option(32, "--n", help="held-out problems per alpha"),
              n_harvest: int = typer.Option(200, "--n-harvest", help="problems the SAEs are trained on"),
              mode: str = typer.Option("projection", "--mode", help="projection (h - a w w.h) or add (h + a w)"),
              layer: Optional[int] = typer.Option(None, "--layer", help="steering layer (default: best silhouette)"),
              model: str = _M, task: str = _TASK, seed: int = _SEED, layers: Optional[list[str]] = _LAYERS,
              max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH, delimiter: str = _DELIM,
              prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
              arch: str = typer.Option("standard", "--arch"), saes: Optional[str] = typer.Option(None, "--saes"),
              quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Per alpha: mean reflection and backtracking steps, mean length and accuracy on held-out problems."""
    alphas = _numbers(alpha) or [-1.5, -1.0, 0.0, 1.0, 1.5]
    opts = _common(model, task, n_harvest, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment,
                   store, quiet, arch=arch, saes=saes, projection="pca")
    payload = run_steer(opts, behaviour, alphas, n, mode, layer)
    _emit(payload, as_json)


def run_steer(opts: PipelineOptions, behaviour: str, alphas: list[float], n_heldout: int, mode: str = "projection",
              layer: int | None = None, engine=None) -> dict[str, Any]:
    """The whole pipeline (cached stages reused), then the steering sweep on held-out problems."""
    from analyses.rise import BEHAVIOURS, steer

    if behaviour not in BEHAVIOURS:
        raise BadInputError(f"behaviour {behaviour!r}; use one of {BEHAVIOURS}")
    if n_heldout < 1:
        raise BadInputError("--n must be at least 1")
    engine, h = run_harvest(opts, engine)
    sae_map, _ = run_train(opts, h)
    result = run_analyse(opts, h, sae_map)
    site = f"resid_post.{layer}" if layer is not None else result.best_site
    vectors = result.layer(site).vectors
    if behaviour not in vectors:
        raise BadInputError(
            f"no {behaviour} vector at {site}: {h.label_counts()[behaviour]} harvested steps carry that label, "
            "too few for its own SAE columns. Harvest more problems, use a model that reflects, "
            "or add --augment templated")
    _, heldout = _problems(opts, n_heldout)
    table = steer(engine, heldout, vectors[behaviour], site, alphas, mode=mode, settings=h.settings,
                  behaviour=behaviour, progress=opts.progress)
    return {"steering": table.to_dict(), "silhouette_per_layer": result.to_dict()["silhouette_per_layer"],
            "label_counts": h.label_counts(), "site": site}


# --------------------------------------------------------------------------- benchmarks


def bench_harvest(engine: Any, n: int = 16, layers: tuple[int, ...] | None = None, batch_size: int = 16,
                  max_new_tokens: int = 64) -> dict[str, Any]:
    """Reading the step vectors vs generating the traces, same traces, one process (target <= 0.25)."""
    from analyses.rise import HarvestSettings, generate_traces, resolve_delimiter, step_residuals
    from analyses.tasks import load_task

    info = engine.info()
    layers = layers or default_layers(info["arch"]["n_layers"])
    settings = HarvestSettings(layers=layers, batch_size=batch_size, max_new_tokens=max_new_tokens)
    delimiter = resolve_delimiter("auto", info["model_id"])
    problems = load_task("arith", n, seed=12345)
    started = time.perf_counter()
    traces = []
    for lo in range(0, n, batch_size):
        traces += generate_traces(engine, problems[lo:lo + batch_size], settings, delimiter)
    generation = time.perf_counter() - started
    started = time.perf_counter()
    step_residuals(engine, [t.prompt_ids + t.gen_ids for t in traces],
                   [[len(t.prompt_ids) + s.token for s in t.steps] for t in traces], layers, batch_size=batch_size)
    reading = time.perf_counter() - started
    return {"bench": "rise_harvest", "ratio": reading / generation, "target": 0.25, "model": info["model_id"],
            "n_traces": n, "layers": list(layers), "batch_size": batch_size,
            "n_steps": sum(len(t.steps) for t in traces), "generated_tokens": sum(t.n_tokens for t in traces),
            "generation_s": generation, "harvest_s": reading}


def bench_sae_throughput(d_in: int = 576, n: int = 8192, steps: int = 100, device: str = "cpu") -> dict[str, Any]:
    """SAELens training loop throughput (activations/s) at the embedded model's width."""
    from saes.train import sae_throughput

    row = sae_throughput(d_in=d_in, n=n, steps=steps, device=device)
    return {"bench": "rise_sae_throughput", **row}
