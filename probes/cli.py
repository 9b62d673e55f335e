"""The probes' own sub-commands of `thoughtscope`: models, sites, generate.

`register(cli)` adds them; the entry point (thoughtscope.cli) sits above every package and calls it
as it calls each method package's `cli.register`.
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from thoughtscope import checks


def register(cli: typer.Typer) -> None:
    cli.command()(models)
    cli.command()(sites)
    cli.command()(generate)


def models(
    action: Optional[str] = typer.Argument(None, help="`ship`: rebuild shipped toy models (then their ids)"),
    ids: list[str] = typer.Argument(None, help="with `ship`: toy model ids, e.g. toy-moe:small"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per model"),
    out: Optional[str] = typer.Option(None, "--out", help="with `ship`: root folder (default docs/shipped/models)"),
) -> None:
    """List the model zoo (and hf: models found in the local Hugging Face cache).

    `thoughtscope models ship ID...` trains each toy model ID from scratch with its seeded recipe (one
    thread, deterministic algorithms) and writes it to docs/shipped/models/ with its training report and
    a manifest (recipe hash, this command, a sha256 per file), where the zoo loads it from."""
    from probes.zoo import list_models

    if action is not None:
        _ship(action, ids or [], out)
        return
    if out is not None:
        from thoughtscope.errors import BadInputError

        raise BadInputError("--out applies to `thoughtscope models ship ID...` only; the listing prints to the terminal")
    rows = list_models()
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table("id", "what")
    for row in rows:
        table.add_row(row["id"], row["what"])
    Console().print(table)


def _ship(action: str, ids: list[str], out: Optional[str]) -> None:
    from pathlib import Path

    from probes.toys.shipped import ship
    from thoughtscope.errors import BadInputError

    if action != "ship":
        raise BadInputError(f"unknown models action {action!r}: `thoughtscope models` lists the zoo, "
                            "`thoughtscope models ship ID...` rebuilds shipped toy models")
    if not ids:
        raise BadInputError("`thoughtscope models ship` needs toy model ids, e.g. toy-moe:small")
    for model_id in ids:
        print(ship(model_id, Path(out) if out else None))


def sites(
    model: str = typer.Option("smollm2-135m", help="model id"),
    as_json: bool = typer.Option(False, "--json"),
    layer: Optional[int] = typer.Option(None, min=0, help="only this layer"),
) -> None:
    """List the hook sites of a model (one naming scheme across architectures)."""
    from probes.sites import list_sites
    from probes.zoo import load_model

    handle = load_model(model)
    if layer is not None:  # an empty table said nothing
        checks.integer("--layer", layer, low=0, high=handle.arch.n_layers - 1,
                       why=f"{model} has {handle.arch.n_layers} layers")
    rows = [r for r in list_sites(handle.arch) if layer is None or r["site"].endswith(f".{layer}")]
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table("site", "shape", "TransformerLens hook", "what")
    for row in rows:
        table.add_row(row["site"], row["shape"], row["tl_hook"] or "", row["doc"])
    Console().print(table)


def generate(
    prompt: str = typer.Option(..., help="prompt text"),
    model: str = typer.Option("smollm2-135m", help="model id"),
    max_new_tokens: int = typer.Option(64, help="tokens to generate"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
    chat: bool = typer.Option(True, help="wrap the prompt in the model's chat template"),
    capture: list[str] = typer.Option([], help="site to capture, e.g. resid_post.12 (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON record per token"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="let an hf: model folder run its own modeling code"),
) -> None:
    """Stream tokens with their entropy to the terminal (or JSON records with --json)."""
    from probes.engine import MAX_NEW_TOKENS_LIMIT, Engine, Sampling
    from thoughtscope.errors import BadInputError

    # what the command line alone decides, refused before the model loads
    if not prompt.strip():
        raise BadInputError("--prompt is empty; give the text to continue")
    checks.integer("--max-new-tokens", max_new_tokens, low=1, high=MAX_NEW_TOKENS_LIMIT)
    sampling = Sampling(temperature=temperature)
    engine = Engine.from_id(model, trust_remote_code=trust_remote_code)
    stream = engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                             seed=seed, capture=capture, chat=chat)
    out = Console(highlight=False)
    for rec in stream:
        if as_json:
            row = rec.to_dict()
            row["activations"] = {k: {"shape": list(v.shape), "norm": float(v.float().norm())}
                                  for k, v in rec.activations.items()}
            print(json.dumps(row), flush=True)
        else:
            shade = "green" if rec.entropy < 0.5 else "yellow" if rec.entropy < 1.5 else "red"
            out.print(f"[{shade}]{rec.text}[/{shade}]", end="")
    if not as_json:
        out.print("\n[dim](colour = entropy: green < 0.5 nats < yellow < 1.5 nats < red)[/dim]")
