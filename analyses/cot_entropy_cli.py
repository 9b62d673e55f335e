"""`thoughtscope eval cot-exit` and `thoughtscope eval cot-vote`: the CoT entropy method against its baselines.

`register(cli)` adds (or reuses) the `eval` sub-app. Examples:

    thoughtscope eval cot-exit --model smollm2-135m --task arith --n 100 --n-calibration 60 --h 0.5,1,2,4 --json
    thoughtscope eval cot-vote --model smollm2-135m --task arith --n 20 --samples 8
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from thoughtscope.errors import BadInputError


def _eval_app(cli: typer.Typer) -> typer.Typer:
    """The `eval` group of `cli`, created on first use so other modules can add commands to it."""
    for group in cli.registered_groups:
        if group.name == "eval":
            return group.typer_instance
    app = typer.Typer(no_args_is_help=True, help="Evaluate methods on reasoning tasks (accuracy and tokens).")
    cli.add_typer(app, name="eval")
    return app


def parse_thresholds(values: list[str]) -> list[float]:
    """`--h 1 --h 2` or `--h 1,2,4` -> [1.0, 2.0, 4.0]."""
    out = []
    for value in values:
        for part in str(value).replace(" ", ",").split(","):
            if not part:
                continue
            try:
                out.append(float(part))
            except ValueError as err:
                raise BadInputError(f"--h takes numbers such as 1,2,4; got {part!r}") from err
    if not out:
        raise BadInputError("give at least one CUSUM threshold with --h")
    return out


def _family(engine, step_delimiter: Optional[str]):
    from analyses.cot_entropy import cot_family_for

    return cot_family_for(engine).with_delimiter(step_delimiter)


def register(cli: typer.Typer) -> None:
    app = _eval_app(cli)

    @app.command("cot-exit")
    def cot_exit(
        model: str = typer.Option("smollm2-135m", help="model id"),
        task: str = typer.Option("arith", help="arith | arith2 | arith-mixed | gsm8k"),
        n: int = typer.Option(100, help="evaluation problems"),
        n_calibration: int = typer.Option(60, help="calibration problems (disjoint from the evaluation ones)"),
        h: list[str] = typer.Option(["0.5,1,2,4"], "--h", help="CUSUM thresholds h = log(gamma): --h 1,2,4 or repeat"),
        max_new_tokens: int = typer.Option(96, help="longest trace"),
        batch_size: int = typer.Option(16, help="traces generated together"),
        seed: int = typer.Option(0),
        bins: int = typer.Option(10, help="histogram bins of f0/f1"),
        deer_threshold: float = typer.Option(0.95, help="DEER's trial-answer confidence threshold"),
        dynasor_every: Optional[int] = typer.Option(None, help="Dynasor probe interval k (default: per family)"),
        dynasor_agree: Optional[int] = typer.Option(None, help="Dynasor agreeing answers m (default: per family)"),
        step_delimiter: Optional[str] = typer.Option(None, help="regex ending a step (default: per family)"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        per_problem: bool = typer.Option(True, help="include per-problem rows in the JSON"),
    ) -> None:
        """Accuracy and tokens of vanilla, CUSUM early exit at each h, DEER and Dynasor-CoT."""
        from analyses.cot_entropy import evaluate_cot_exit
        from probes.engine import Engine

        thresholds = parse_thresholds(h)
        engine = Engine.from_id(model)
        report = evaluate_cot_exit(engine, task, n, n_calibration, thresholds=thresholds,
                                   family=_family(engine, step_delimiter), max_new_tokens=max_new_tokens, seed=seed,
                                   batch_size=batch_size, bins=bins, deer_threshold=deer_threshold,
                                   dynasor_every=dynasor_every, dynasor_agree=dynasor_agree)
        if as_json:
            print(json.dumps(report.to_dict(with_results=per_problem)))
            return
        pareto = report.pareto()
        table = Table("method", "accuracy", "generated tokens", "tokens incl. probes", "exit rate",
                      "vs DEER+Dynasor (gen / +probes)", "vs all baselines",
                      title=f"{report.model} on {report.task}: {report.n_eval} problems "
                            f"({report.n_calibration} for calibration)")
        for m in report.methods:
            status = pareto.get(m.name, {})
            cells = [f"{v['generated']} / {v['with_probes']}" for v in status.values()] or ["", ""]
            table.add_row(m.name, f"{m.accuracy:.1%}", f"{m.mean_generated_tokens:.1f}",
                          f"{m.mean_tokens_with_probes:.1f}", f"{m.exit_rate:.0%}", *cells)
        Console().print(table)

    @app.command("cot-vote")
    def cot_vote(
        model: str = typer.Option("smollm2-135m", help="model id"),
        task: str = typer.Option("arith", help="arith | arith2 | arith-mixed | gsm8k"),
        n: int = typer.Option(20, help="evaluation problems"),
        n_calibration: int = typer.Option(20, help="calibration problems (disjoint)"),
        samples: int = typer.Option(8, help="sampled trajectories per problem"),
        temperature: float = typer.Option(0.7),
        h: float = typer.Option(2.0, "--h", help="CUSUM threshold (the weights do not depend on it)"),
        max_new_tokens: int = typer.Option(96),
        batch_size: int = typer.Option(16),
        seed: int = typer.Option(0),
        step_delimiter: Optional[str] = typer.Option(None, help="regex ending a step (default: per family)"),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Self-consistency (majority) vs CUSUM-weighted voting over the same sampled trajectories."""
        from analyses.cot_entropy import evaluate_cot_vote
        from probes.engine import Engine

        engine = Engine.from_id(model)
        report = evaluate_cot_vote(engine, task, n, n_calibration, samples=samples, temperature=temperature,
                                   threshold=h, family=_family(engine, step_delimiter),
                                   max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)
        if as_json:
            print(json.dumps(report.to_dict()))
            return
        table = Table("vote", "accuracy", title=f"{report.model} on {report.task}: {report.n_eval} problems, "
                                                f"{report.samples} samples at T={report.temperature:g}")
        table.add_row("single sample (mean)", f"{report.sample_accuracy:.1%}")
        table.add_row("majority (self-consistency)", f"{report.majority_accuracy:.1%}")
        table.add_row("CUSUM-weighted", f"{report.weighted_accuracy:.1%}")
        Console().print(table)
