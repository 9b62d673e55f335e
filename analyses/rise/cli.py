"""`thoughtscope rise ...`: the RISE stages from the command line, each printing JSON with --json.

Every command takes `--model` or `--server URL` (a model server) and runs `RisePipeline`, the same
orchestrator the page uses, so both share stored traces, SAEs and vectors.

    thoughtscope rise harvest --n 200 --layers 9 15 21 --json
    thoughtscope rise train   --n 200 --layers 9 15 21 --arch standard --json
    thoughtscope rise analyse --n 200 --layers 9 15 21 --json
    thoughtscope rise steer   --behaviour reflection --alpha -1.5 -1 0 1 1.5 --n 32 --json

Every stage reuses what the earlier ones stored: traces and step vectors in `cache/`, SAEs in
SAELens folders under `--saes` (default: the user cache), so `steer` alone runs the whole
pipeline the first time and only the steering the next. `--heldout` keeps a share of the traces
out of SAE training; the reported explained variance and L0 are on their steps. `thoughtscope rise
saved` lists the saved SAEs.

`thoughtscope eval rise-organism` checks RISE against the `toy-reasoner` organism's ground truth
(analyses.rise.evaluate): held-out SAE quality, latent AUROC per planted behaviour, and behaviour
rates while steering, with intervals:

    thoughtscope eval rise-organism --model toy-reasoner --n-harvest 400 --n-steer 150 --json
"""

from __future__ import annotations

from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from analyses.clikit import (MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, eval_group,
                             numbers, path_check)
from analyses.families import default_task
from analyses.rise.evaluate import DEFAULT_ALPHAS, DEFAULT_PROJECTION_ALPHAS, evaluate_rise_organism
from analyses.rise.labels import BEHAVIOURS
from analyses.rise.pipeline import RiseOptions, RisePipeline, saved_saes
from analyses.rise.steer import check_steering
from analyses.tasks import canonical_task
from thoughtscope import checks
from thoughtscope.provenance import provenance

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
    evals = eval_group(cli)
    evals.command("rise-organism", cls=_MultiValueCommand)(rise_organism_cmd)


# --------------------------------------------------------------------------- shared options


def _pipeline(model, server, token, task, n, seed, layers, max_new_tokens, batch_size, delimiter, prompt, augment,
              store, quiet, **extra):
    options = RiseOptions(task=task, n=n, seed=seed, layers=tuple(numbers(layers, "--layers", integer=True)),
                          max_new_tokens=max_new_tokens, batch_size=batch_size, delimiter=delimiter, prompt=prompt,
                          augment=augment, store=store, **extra)
    options.validate()  # every setting the command line alone decides, refused before the model loads
    engine = backend(model, server, token)
    if task == "auto":
        options.task = default_task(engine)
    progress = TerminalProgress(enabled=not quiet)
    return RisePipeline(engine, options, on_progress=progress), progress


_TASK = typer.Option("auto", "--task", help="auto (the model's own task, else arith), arith, arith2, arith-mixed, "
                                            "gsm8k, toy-reasoner, toy-reasoner:small, or a .jsonl problem file",
                     callback=canonical_task)
_N = typer.Option(200, "--n", help="problems to harvest")
_SEED = typer.Option(0, "--seed", min=0, max=checks.SEED_MAX)
_LAYERS = typer.Option(None, "--layers", help="layers, e.g. --layers 9 15 21 (default: 1/3, 1/2, 3/4 depth)")
_MAXNEW = typer.Option(64, "--max-new-tokens")
_BATCH = typer.Option(16, "--batch-size")
_DELIM = typer.Option("auto", "--delimiter", help="auto (the model family's), sentence, paragraph, or a regex")
_PROMPT = typer.Option("auto", "--prompt", help="auto (the model family's), one-shot, cot, chat or question")
_AUG = typer.Option("none", "--augment", help="none, or templated (splice reflection/backtracking sentences)")
_STORE = typer.Option(None, "--store", help="activation store folder (default: user cache)",
                      callback=path_check("--store", "folder"))
_SAES = typer.Option(None, "--saes", help="folder for the SAEs and vectors (SAELens format; default: user cache)",
                     callback=path_check("--saes", "folder"))
_ARCH = typer.Option("standard", "--arch", help="standard (ReLU + L1) or topk")
_QUIET = typer.Option(False, "--quiet", help="no progress bars")
_JSON = typer.Option(False, "--json", help="one JSON object on stdout")


@rise_app.command("harvest", cls=_MultiValueCommand)
def harvest_cmd(model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                task: str = _TASK, n: int = _N, seed: int = _SEED,
                layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
                delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
                quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Generate traces, cut them into steps and store the step vectors (resumable)."""
    run, progress = _pipeline(model, server, token, task, n, seed, layers, max_new_tokens, batch_size, delimiter,
                              prompt, augment, store, quiet)
    with progress:
        h = run.harvest()
    emit(h.to_dict(), as_json)


@rise_app.command("train", cls=_MultiValueCommand)
def train_cmd(model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
              task: str = _TASK, n: int = _N, seed: int = _SEED,
              layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
              delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
              arch: str = _ARCH, d_sae: Optional[int] = typer.Option(None, "--d-sae"),
              l1: Optional[float] = typer.Option(None, "--l1"), k: Optional[int] = typer.Option(None, "--k"),
              steps: Optional[int] = typer.Option(None, "--steps"), lr: Optional[float] = typer.Option(None, "--lr"),
              heldout: float = typer.Option(0.2, "--heldout", help="share of traces kept out of SAE training"),
              temperature: float = typer.Option(0.0, "--temperature", help="0: greedy traces; > 0: sampled"),
              saes: Optional[str] = _SAES, quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Train one SAE per layer on the training traces' step vectors; report explained variance, L0 and dead
    latents on the held-out traces' steps (as SAELens computes them)."""
    run, progress = _pipeline(model, server, token, task, n, seed, layers, max_new_tokens, batch_size, delimiter,
                              prompt, augment, store, quiet, arch=arch, d_sae=d_sae, l1=l1, k=k, sae_steps=steps,
                              lr=lr, saes=saes, heldout=heldout, temperature=temperature)
    with progress:
        h = run.harvest()
        _, stats = run.train(h, retrain=True)
    emit({"harvest": h.to_dict(), "saes": {site: s.to_dict() for site, s in stats.items()},
          "stats_split": "held-out traces" if run.heldout_rows(h) else "training traces (nothing held out)",
          "folder": str(run.folder),
          "provenance": provenance(run.info, data=run.options.task, split="harvest", seed=run.options.seed,
                                   settings=run.options.to_dict(), command="rise train")}, as_json)


@rise_app.command("analyse", cls=_MultiValueCommand)
def analyse_cmd(model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                task: str = _TASK, n: int = _N, seed: int = _SEED,
                layers: Optional[list[str]] = _LAYERS, max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH,
                delimiter: str = _DELIM, prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
                arch: str = _ARCH, saes: Optional[str] = _SAES,
                projection: str = typer.Option("umap", "--projection", help="umap or pca"),
                quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Column association, decoder UMAP, silhouette per layer and behaviour vectors."""
    run, progress = _pipeline(model, server, token, task, n, seed, layers, max_new_tokens, batch_size, delimiter,
                              prompt, augment, store, quiet, arch=arch, saes=saes, projection=projection)
    with progress:
        found = run.run()
    emit({"harvest": found["harvest"].to_dict(), "analysis": found["analysis"].to_dict(), "folder": found["folder"]},
         as_json)


@rise_app.command("steer", cls=_MultiValueCommand)
def steer_cmd(behaviour: str = typer.Option("reflection", "--behaviour"),
              alpha: Optional[list[str]] = typer.Option(None, "--alpha", help="e.g. --alpha -1.5 -1 0 1 1.5"),
              n: int = typer.Option(32, "--n", help="held-out problems per alpha"),
              n_harvest: int = typer.Option(200, "--n-harvest", help="problems the SAEs are trained on"),
              mode: str = typer.Option("projection", "--mode", help="projection (h - a w w.h) or add (h + a w)"),
              layer: Optional[int] = typer.Option(None, "--layer", help="steering layer (default: best silhouette)"),
              model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
              task: str = _TASK, seed: int = _SEED, layers: Optional[list[str]] = _LAYERS,
              max_new_tokens: int = _MAXNEW, batch_size: int = _BATCH, delimiter: str = _DELIM,
              prompt: str = _PROMPT, augment: str = _AUG, store: Optional[str] = _STORE,
              arch: str = _ARCH, saes: Optional[str] = _SAES, quiet: bool = _QUIET, as_json: bool = _JSON) -> None:
    """Per alpha: mean reflection and backtracking steps, mean length and accuracy on held-out problems."""
    alphas = check_steering(numbers(alpha, "--alpha") or [-1.5, -1.0, 0.0, 1.0, 1.5], mode)
    checks.choice("behaviour", behaviour, BEHAVIOURS)
    checks.integer("--n (held-out problems per alpha)", n, low=1)
    if layer is not None:
        checks.integer("--layer", layer, low=0)  # its range needs the model: RisePipeline.steer
    run, progress = _pipeline(model, server, token, task, n_harvest, seed, layers, max_new_tokens, batch_size,
                              delimiter, prompt, augment, store, quiet, arch=arch, saes=saes, projection="pca")
    with progress:
        payload = run.steer(behaviour, alphas, n, mode, layer)
    # the settings name the command's own flags: --n-harvest (the pipeline's n) and --n (held-out problems); the
    # held-out count once overwrote the harvest's under one key "n", so the record could not rebuild the SAEs
    options = run.options.to_dict()
    settings = {**{k: v for k, v in options.items() if k != "n"}, "n_harvest": options["n"], "n": n,
                "alphas": alphas, "mode": mode, "behaviour": behaviour, "layer": layer}
    payload["provenance"] = provenance(run.info, data=run.options.task, split=payload["steering"]["split"],
                                       seed=run.options.seed, settings=settings, command="rise steer")
    emit(payload, as_json)


@rise_app.command("saved")
def saved_cmd(model: Optional[str] = typer.Option(None, "--model", help="only SAEs of this model id"),
              site: Optional[str] = typer.Option(None, "--site", help="only SAEs at this site, e.g. resid_post.2"),
              as_json: bool = _JSON) -> None:
    """The SAEs the RISE pipeline saved (SAELens folders), newest first, with their held-out quality."""
    emit({"saved": [s.to_dict() for s in saved_saes(model, site)]}, as_json)


def rise_organism_cmd(
        model: str = typer.Option("toy-reasoner", "--model", help="toy-reasoner or toy-reasoner:small"),
        server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
        n_harvest: int = typer.Option(400, "--n-harvest", help="calibration-split problems harvested (sampled)"),
        n_steer: int = typer.Option(150, "--n-steer", help="eval-split problems sampled at each alpha"),
        alpha: Optional[list[str]] = typer.Option(None, "--alpha", help="alphas (add mode: fractions of the residual "
                                                                         "norm), e.g. --alpha -0.4 -0.2 0 0.2 0.4"),
        mode: str = typer.Option("add", "--mode", help="add (h + alpha |h| w) or projection (h - alpha w (w.h))"),
        layers: Optional[list[str]] = _LAYERS,
        layer: Optional[int] = typer.Option(None, "--layer", help="steering layer (default: best silhouette)"),
        temperature: float = typer.Option(1.0, "--temperature", help="sampling temperature of harvest and steering"),
        heldout: float = typer.Option(0.25, "--heldout", help="share of harvested traces kept out of SAE training"),
        steps: Optional[int] = typer.Option(None, "--steps", help="SAE training steps"),
        d_sae: Optional[int] = typer.Option(None, "--d-sae"), l1: Optional[float] = typer.Option(None, "--l1"),
        max_new_tokens: int = typer.Option(96, "--max-new-tokens"), batch_size: int = typer.Option(32, "--batch-size"),
        seed: int = _SEED, store: Optional[str] = _STORE, saes: Optional[str] = _SAES, quiet: bool = _QUIET,
        as_json: bool = _JSON) -> None:
    """RISE against the organism's ground truth: held-out SAE quality, latent AUROC per planted behaviour,
    behaviour rates while steering (95% intervals), accuracy beside them."""
    alphas = numbers(alpha, "--alpha") or list(DEFAULT_ALPHAS if mode == "add" else DEFAULT_PROJECTION_ALPHAS)
    check_steering(alphas, mode)
    chosen_layers = tuple(numbers(layers, "--layers", integer=True))
    # every setting the command line alone decides, refused before the model loads (the task is the organism's)
    RiseOptions(n=n_harvest, seed=seed, layers=chosen_layers, max_new_tokens=max_new_tokens, batch_size=batch_size,
                temperature=temperature, heldout=heldout, sae_steps=steps, d_sae=d_sae, l1=l1,
                projection="pca").validate()
    checks.integer("--n-steer", n_steer, low=1)
    if layer is not None:
        checks.integer("--layer", layer, low=0)  # its range needs the model: RisePipeline.check_layer
    engine = backend(model, server, token)
    with TerminalProgress(enabled=not quiet) as progress:
        report = evaluate_rise_organism(engine, n_harvest=n_harvest, n_steer=n_steer, alphas=alphas, mode=mode,
                                        layers=chosen_layers, layer=layer,
                                        temperature=temperature, heldout=heldout, sae_steps=steps, d_sae=d_sae, l1=l1,
                                        seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size, saes=saes,
                                        store=store, progress=progress)
    if as_json:
        emit(report.to_dict(), True)
        return
    console = Console()
    quality = Table("site", "EV train", "EV held-out", "L0 held-out", "step silhouette (held-out)",
                    *[f"AUROC {k}" for k in ("compute", "reflection", "backtrack", "redundant")],
                    title=f"{report.model}: SAEs on {report.harvest['n_steps']} harvested steps "
                          "(held-out traces measure them)")
    for row in report.layers:
        q = row["quality"]
        auroc = [row["auroc_kinds"][k]["heldout_auroc"] for k in ("compute", "reflection", "backtrack", "redundant")]
        sil = row["heldout_step_silhouette"]
        quality.add_row(row["site"], f"{q['train']['explained_variance']:.3f}",
                        f"{q['heldout']['explained_variance']:.3f}", f"{q['heldout']['l0']:.1f}",
                        "n/a" if sil is None else f"{sil:.3f}",
                        *["n/a" if a is None else f"{a:.3f}" for a in auroc])
    console.print(quality)
    for behaviour, result in report.steering.items():
        table = Table("alpha", "reflection / trace [95% CI]", "backtracking / trace [95% CI]", "accuracy [95% CI]",
                      "tokens", title=f"steering with the {behaviour} vector at {result.site} ({result.mode}, "
                                      f"T={result.temperature:g}, {result.rows[0].n} eval problems per alpha)")
        for r in result.rows:
            iv = r.intervals
            table.add_row(f"{r.alpha:g}", *[f"{iv[k]['estimate']:.2f} [{iv[k]['low']:.2f}, {iv[k]['high']:.2f}]"
                                            for k in ("reflection", "backtracking", "correct")],
                          f"{r.mean_tokens:.1f}")
        console.print(table)
        console.print(f"reflection rate {result.monotone('mean_reflection_steps')} in alpha; "
                      f"backtracking rate {result.monotone('mean_backtracking_steps')} in alpha")
