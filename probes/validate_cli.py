"""`thoughtscope validate`: the engine's numbers against independent readers (probes.validate), as a table.

`register(cli)` adds the command; the entry point (thoughtscope.cli) calls it as it calls `probes.cli`.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from thoughtscope.errors import BadInputError


def register(cli: typer.Typer) -> None:
    cli.command()(validate)


def validate(
    model: str = typer.Option("smollm2-135m", help="model id"),
    sites: list[str] = typer.Option([], "--sites", help="site kinds (resid_post) or sites (resid_post.3); repeatable; "
                                                        "default: every site of the model"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: the device's)"),
    per_site: bool = typer.Option(False, "--per-site", help="one row per site instead of per site kind"),
    no_generation: bool = typer.Option(False, "--no-generation", help="skip the streamed-generation check"),
    as_json: bool = typer.Option(False, "--json", help="the whole report as one JSON object"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="let an hf: model folder run its own modeling code"),
) -> None:
    """Check every site the engine reads against a plain HF forward, nnsight and the TransformerLens bridge.

    Exit status 1 when a site fails its dtype's tolerance (docs/validation.md), so CI can gate on it.
    A full run (no --sites) is cached as the model's correctness badge."""
    from probes.validate import format_table  # torch: imported when the command runs, not for --help

    kwargs = {"device": device, "dtype": dtype, "sites": [s for part in sites for s in part.split(",") if s.strip()],
              "generation": not no_generation}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    report = validate_model_id(model, **kwargs)
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_table(report, per_site=per_site))
    if report.verdict == "fail":
        raise typer.Exit(1)


def validate_model_id(model_id: str, **kwargs: Any) -> Any:
    """`thoughtscope validate`: refuse ndif: before anything loads, then load and validate."""
    from probes import validate as V  # torch and transformers: loaded when the command runs, not for --help
    from probes.engine import Engine

    if model_id.strip().startswith("ndif:"):
        raise BadInputError(V.remote_message(model_id.strip()))
    load = {k: kwargs.pop(k) for k in ("device", "dtype", "trust_remote_code") if k in kwargs}
    return V.validate(Engine.from_id(model_id, **load), **kwargs)
