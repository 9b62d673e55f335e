"""`thoughtscope contrast run`: which features separate two sets of reasoning steps, and do they hold out.

    thoughtscope contrast run --model toy-reasoner:small --rule kind:reflection \
        --site direction:resid_post.1 --site heads:1 --site sae:FOLDER@resid_post.1 --json
    thoughtscope contrast run --prompts-a easy.txt --prompts-b hard.txt --rule source --site direction:resid_post.15
    thoughtscope contrast run --model smollm2-135m --harvest auto --harvest-n 64 --rule kind:reflection \
        --site direction:resid_post.15       # RISE's own traces, cut and labelled by the family's judge
    thoughtscope contrast run ... --export reflection.safetensors   # the top direction, for the Steering page

Rules: kind:<A>[/<B>], correct, alarm, source (two prompt files), random (the null); a RISE harvest's steps
(kinds reflection, backtracking, other) take kind, correct and random. Output (JSON
with --json) carries the provenance record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from analyses.clikit import MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, group, path_check
from analyses.contrast.core import ContrastSettings, export_direction, save_direction
from analyses.contrast.run import check_sources, run_contrast
from analyses.tasks import canonical_task
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance


def register(cli: typer.Typer) -> None:
    app = group(cli, "contrast", "Contrast two sets of reasoning steps: effect sizes, FDR, held-out AUROC.")

    @app.command("run")
    def run_cmd(rule: str = typer.Option("kind:reflection", "--rule", help="kind:<A> or kind:<A>/<B>, correct, alarm, "
                                                                           "source, random"),
                site: list[str] = typer.Option(["direction:resid_post.1"], "--site",
                                               help="direction:<site>, heads:<layer>, sae:<folder> or sae:<folder>@<site>"),
                organism: int = typer.Option(60, "--organism", help="planted toy-reasoner traces to read"),
                split: str = typer.Option("dev", "--split", help="the organism split the traces come from"),
                prompts_a: Optional[str] = typer.Option(None, "--prompts-a", help="a prompt file (one a line)",
                                                        callback=path_check("--prompts-a")),
                prompts_b: Optional[str] = typer.Option(None, "--prompts-b", callback=path_check("--prompts-b")),
                harvest: Optional[str] = typer.Option(None, "--harvest", help="steps of a RISE harvest of this task "
                                                      "(auto: the model's own; or a .jsonl problem file) instead "
                                                      "of the organism's or two prompt files",
                                                      callback=canonical_task),
                harvest_n: int = typer.Option(64, "--harvest-n", help="problems the RISE harvest generates traces for"),
                store: Optional[str] = typer.Option(None, "--store", help="the harvest's activation store folder "
                                                                          "(default: user cache)",
                                                    callback=path_check("--store", "folder")),
                top_k: int = typer.Option(20, "--top-k"), n_resamples: int = typer.Option(1000, "--resamples"),
                seed: int = typer.Option(0, "--seed", min=0, max=checks.SEED_MAX),
                export: Optional[Path] = typer.Option(None, "--export", help="write the top exportable direction "
                                                                             "here (.safetensors)",
                                                      callback=path_check("--export", "file")),
                model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                as_json: bool = typer.Option(False, "--json")) -> None:
        """Contrast the steps of set A against set B at the chosen sites."""
        settings = ContrastSettings(top_k=top_k, n_resamples=n_resamples, seed=seed)
        settings.validate()  # before the model loads and the traces are read
        check_sources(organism, split, prompts_a, prompts_b, harvest)
        b = backend(model, server, token)
        with TerminalProgress() as progress:
            result, steps, sites = run_contrast(b, site, rule, settings, organism, split, prompts_a, prompts_b,
                                                on_progress=progress, harvest=harvest, harvest_n=harvest_n,
                                                store=store)
        out = result.to_dict()
        out.pop("features")  # every feature's numbers: the page's volcano plot; the CLI prints the top
        out["steps"] = steps.describe()
        if export is not None:
            row = next((r for r in result.top if r["kind"] != "heads"), None)
            if row is None:
                raise BadInputError("no exportable direction among the top results (head norms are not directions)")
            vector, at = export_direction(result, row, sites)
            save_direction(vector, at, export, meta={"rule": result.rule, "row": row["site"], "feature": row["feature"]})
            out["exported"] = {"path": str(export), "site": at, "from": row["site"], "feature": row["feature"]}
        if harvest:
            data, data_split = f"RISE harvest: {harvest} x{harvest_n}", None
        elif prompts_a:
            data, data_split = f"{prompts_a} | {prompts_b}", None
        else:
            data, data_split = f"toy-reasoner {split} x{organism}", split
        record = provenance(b.info(), data=data, split=data_split, seed=seed, command="thoughtscope contrast run",
                            settings={"rule": rule, "sites": list(site), **settings.__dict__,
                                      **({"harvest": harvest, "harvest_n": harvest_n} if harvest else {})})
        emit(with_provenance(out, record), as_json)
