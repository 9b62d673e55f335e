"""`thoughtscope eval fuzzy-concepts`: the fuzzy rules against semi-NMF, k-means and PCA in one run, as JSON.

    thoughtscope eval fuzzy-concepts --model smollm2-135m --token water --k 20 --json
    thoughtscope eval fuzzy-concepts --server http://127.0.0.1:8765 --token money --source gsm8k --k 10 --json
    thoughtscope eval fuzzy-concepts --token have --source arith --k 8 --save rules/ --json

`--token` is the target word here, so the model server's bearer token is `--server-token` (or the
THOUGHTSCOPE_TOKEN environment variable). The output holds every metric for the fuzzy layer and each
baseline (mean and 95% interval over seeds), the development choices, the paired tests, the rules as
IF-THEN text with their grounded words, and a provenance record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from analyses.clikit import (MODEL_OPTION, SERVER_OPTION, TerminalProgress, backend, emit, eval_group, numbers,
                             path_check)
from analyses.fuzzy_concepts.harvest import WHERE
from analyses.fuzzy_concepts.rules import MEMBERSHIPS
from analyses.fuzzy_concepts.study import FuzzyOptions, run_study
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance

SERVER_TOKEN_OPTION = typer.Option(None, "--server-token", envvar="THOUGHTSCOPE_TOKEN",
                                   help="the model server's bearer token (--token is the target word here)")


def fuzzy_concepts_cmd(
    word: Optional[str] = typer.Option(None, "--token", "--word",
                                       help="the target word whose representations are decomposed (text sources)"),
    k: int = typer.Option(20, "--k", help="number of rules / concepts"),
    layer: Optional[int] = typer.Option(None, "--layer", help="layer (default: two thirds of the depth)"),
    source: str = typer.Option("generate", "--source",
                               help="generate, gsm8k, arith, texts, or toy-vlm-scenes (a VLM: images read at the "
                                    "answer mark, AMI against the asked object's colour and shape)"),
    texts: Optional[Path] = typer.Option(None, "--texts", help="a file of texts, one per line (--source texts)",
                                         callback=path_check("--texts")),
    n: int = typer.Option(200, "--n", help="samples to generate (or corpus texts to take)"),
    where: str = typer.Option("generated", "--where", help="generated: only occurrences in generated text; any",
                              callback=lambda v: checks.choice("--where", v, WHERE)),
    seeds: int = typer.Option(5, "--seeds", help="fits per method (intervals over seeds)"),
    membership: str = typer.Option("gaussian", "--membership", help="gaussian (one width per rule) or product",
                                   callback=lambda v: checks.choice("--membership", v, MEMBERSHIPS)),
    steps: int = typer.Option(400, "--steps", help="gradient steps of the fuzzy layer"),
    sparsity: Optional[str] = typer.Option(None, "--sparsity", help="development grid, e.g. 0.003,0.01,0.03,0.1"),
    features: Optional[str] = typer.Option(None, "--features", help="development grid of m, e.g. 8,16,32"),
    lr: Optional[str] = typer.Option(None, "--lr", help="development grid of learning rates, e.g. 0.01,0.03"),
    nmf_alpha: Optional[str] = typer.Option(None, "--nmf-alpha", help="development grid of semi-NMF's L1 weight"),
    max_active: float = typer.Option(2.0, "--max-active", help="the development rule's bound on active concepts"),
    max_new_tokens: int = typer.Option(40, "--max-new-tokens"),
    batch_size: int = typer.Option(16, "--batch-size"),
    seed: int = typer.Option(0, "--seed", min=0, max=checks.SEED_MAX),
    store: Optional[str] = typer.Option(None, "--store", help="activation store folder (default: user cache)",
                                        callback=path_check("--store", "folder")),
    save: Optional[Path] = typer.Option(None, "--save", help="save the seed-0 fuzzy rules here (safetensors + JSON)",
                                        callback=path_check("--save", "folder")),
    model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, server_token: Optional[str] = SERVER_TOKEN_OPTION,
    quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
) -> None:
    """Fuzzy rules vs semi-NMF / k-means / PCA on held-out representations of a target word."""
    if source == "toy-vlm-scenes":
        word = "answer"  # the row is read at the trace's answer mark (analyses.fuzzy_concepts.scenes)
    elif not word:
        raise BadInputError("give the target word with --token (e.g. --token water)")
    lines: tuple[str, ...] = ()
    if texts is not None:
        try:
            lines = tuple(line for line in texts.read_text(encoding="utf-8").splitlines() if line.strip())
        except OSError as err:
            raise BadInputError(f"could not read {texts}: {err}") from err
        source = "texts" if source == "generate" else source
    given = {name: tuple(numbers(raw, flag, integer=name == "features_grid"))
             for name, flag, raw in (("sparsity_grid", "--sparsity", sparsity), ("features_grid", "--features", features),
                                     ("lr_grid", "--lr", lr), ("nmf_alpha_grid", "--nmf-alpha", nmf_alpha))}
    grids = {name: grid for name, grid in given.items() if grid}
    options = FuzzyOptions(word=word, source=source, n=n, texts=lines, where=where, layer=layer, k=k, seeds=seeds,
                           membership=membership, steps=steps, max_active=max_active, max_new_tokens=max_new_tokens,
                           batch_size=batch_size, seed=seed, store=store, **grids)
    model_backend = backend(model, server, server_token)
    with TerminalProgress(enabled=not quiet) as progress:
        study = run_study(model_backend, options, on_progress=progress)
    payload = study.to_dict()
    payload.pop("representations")
    payload["representations"] = study.reps.to_dict(with_samples=False)
    if save is not None:
        study.fuzzy.save(save, metadata={"model": study.reps.model_id, "site": study.reps.site, "word": study.reps.word})
        payload["saved"] = str(save)
    record = provenance(model_backend.info(), data=f"{options.source}:{options.word}", split="eval", seed=options.seed,
                        settings=options.to_dict(), command="thoughtscope eval fuzzy-concepts",
                        site=study.reps.site, chosen={k: t.chosen for k, t in study.tuning.items()})
    emit(with_provenance(payload, record), as_json)


def register(cli: typer.Typer) -> None:
    eval_group(cli).command("fuzzy-concepts")(fuzzy_concepts_cmd)
