"""`thoughtscope eval cot-exit|cot-vote|cot-settling`: the CoT entropy method against its baselines.

`register(cli)` adds the commands to the `eval` group. `--server URL` runs them against a model
server instead of a model in this process. Every JSON output carries a `provenance` record.

`cot-exit` follows the evaluation protocol (analyses.evaluation): calibration, development and
evaluation problems are disjoint (`--n-calibration`, `--n-dev`, `--n`); the KDE bandwidth, CUSUM's h
(`--h`), DEER's threshold (`--deer`) and Dynasor's k:m (`--dynasor`) are each chosen on development
from the grids given; then each method runs once on evaluation, with 95% bootstrap intervals and
paired tests against vanilla. `--task auto` takes the model's own task (toy-reasoner for the
organism), else arith. `cot-settling` scores the alarm against the organism's known settling step.

    thoughtscope eval cot-exit --model smollm2-135m --n 100 --n-dev 60 --n-calibration 60 --json
    thoughtscope eval cot-exit --model toy-reasoner --n 200 --h 0.5,1,2,4,8 --dynasor 4:2,8:2,8:3
    thoughtscope eval cot-settling --model toy-reasoner --n 200 --bound 2
    thoughtscope eval cot-vote --model smollm2-135m --task arith --n 20 --samples 8
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from analyses.clikit import (
    MODEL_OPTION,
    SERVER_OPTION,
    TOKEN_OPTION,
    TerminalProgress,
    backend,
    eval_group,
    number_check,
    numbers,
)
from analyses.cot_entropy import evaluate_cot_exit, evaluate_cot_vote
from analyses.cot_entropy.settling import evaluate_settling
from analyses.distributed.options import RAY_OPTION, REPLICAS_OPTION, ray_runner
from analyses.families import default_task, family_for
from analyses.tasks import canonical_task
from probes.backend import Backend
from thoughtscope import checks
from thoughtscope.errors import BadInputError


def parse_numbers(values: list[str], flag: str = "--h") -> list[float]:
    """`--h 1 --h 2` or `--h 1,2,4` -> [1.0, 2.0, 4.0]; at least one."""
    out = numbers(values, flag)
    if not out:
        raise BadInputError(f"give at least one value with {flag}")
    return out


parse_thresholds = parse_numbers


def parse_dynasor(values: list[str]) -> list[tuple[int, int]]:
    """`--dynasor 8:2,16:3` -> [(8, 2), (16, 3)]: probe every k tokens, exit when m answers agree."""
    out = []
    for value in values:
        for part in str(value).replace(" ", ",").split(","):
            if not part:
                continue
            try:
                k, m = (int(x) for x in part.split(":"))
            except ValueError as err:
                raise BadInputError(f"--dynasor takes k:m pairs such as 8:2,16:3; got {part!r}") from err
            if k < 1 or m < 1:
                raise BadInputError(f"--dynasor needs k >= 1 and m >= 1, got {part!r}")
            out.append((k, m))
    return out


def _density(value: str) -> str:
    from analyses.cot_entropy.detector import DENSITIES

    return checks.choice("--density", value, DENSITIES)  # at parse time: before calibration generates


def _family(engine: Backend, step_delimiter: Optional[str]):
    return family_for(engine).with_delimiter(step_delimiter)


def _task(engine: Backend, task: str) -> str:
    return default_task(engine) if task == "auto" else task


def _interval(d: dict, percent: bool = False) -> str:
    f = (lambda v: f"{100 * v:.1f}%") if percent else (lambda v: f"{v:.1f}")  # noqa: E731
    return f"{f(d['estimate'])} [{f(d['low'])}, {f(d['high'])}]"


def register(cli: typer.Typer) -> None:
    app = eval_group(cli)

    @app.command("cot-exit")
    def cot_exit(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("auto", help="auto (the model's own task, else arith) | arith | arith2 | "
                                              "arith-mixed | gsm8k | toy-reasoner | toy-reasoner:small | "
                                              "PROBLEMS.jsonl", callback=canonical_task),
        n: int = typer.Option(100, help="evaluation problems (each method runs once on them)"),
        n_calibration: int = typer.Option(60, help="calibration problems (f0/f1 are fitted on them)"),
        n_dev: int = typer.Option(60, help="development problems (every setting is chosen on them)"),
        h: list[str] = typer.Option(["0.5,1,2,4,8"], "--h", help="CUSUM thresholds h = log(gamma) to choose from"),
        deer: list[str] = typer.Option(["0.8,0.9,0.95,0.99"], "--deer",
                                       help="DEER confidence thresholds to choose from"),
        dynasor: list[str] = typer.Option([], "--dynasor", help="Dynasor k:m pairs to choose from, e.g. 4:2,8:2,8:3 "
                                                                "(default: around the family's k, m in {2, 3})"),
        density: str = typer.Option("kde", help="kde (bandwidth chosen on development) | histogram",
                                    callback=_density),
        bandwidth: list[str] = typer.Option([], "--bandwidth", help="KDE bandwidths (nats) to choose from "
                                                                    "(default: 1/4..4 x Silverman's)"),
        bins: int = typer.Option(10, min=2, help="histogram bins (with --density histogram)"),
        tolerance: float = typer.Option(0.02, help="development accuracy a setting may lose against vanilla",
                                        callback=number_check("--tolerance", low=0, high=1)),
        cost: str = typer.Option("generated", help="token count the choice minimises: generated | with_probes"),
        max_new_tokens: int = typer.Option(96, help="longest trace"),
        batch_size: int = typer.Option(16, help="traces generated together"),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        step_delimiter: Optional[str] = typer.Option(None, help="regex ending a step (default: per family)"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        per_problem: bool = typer.Option(True, help="include per-problem rows in the JSON"),
        ray: Optional[str] = RAY_OPTION,
        replicas: Optional[int] = REPLICAS_OPTION,
    ) -> None:
        """Vanilla, CUSUM early exit, DEER and Dynasor-CoT: settings chosen on development, run once on evaluation."""
        h_grid, deer_grid = parse_numbers(h, "--h"), parse_numbers(deer, "--deer")
        dynasor_grid = parse_dynasor(dynasor) or None
        bandwidths = parse_numbers(bandwidth, "--bandwidth") if bandwidth else None
        if bandwidths is not None and min(bandwidths) <= 0:
            raise BadInputError(f"--bandwidth takes bandwidths above 0 (nats); got {min(bandwidths):g}")
        replicas_of = ray_runner(model, server, ray, replicas)
        engine = backend(model, server, token)
        with replicas_of as runner, TerminalProgress() as progress:
            report = evaluate_cot_exit(engine, _task(engine, task), n, n_calibration, n_dev, h_grid=h_grid,
                                       deer_grid=deer_grid, dynasor_grid=dynasor_grid, density=density,
                                       bandwidths=bandwidths, bins=bins, tolerance=tolerance, cost=cost,
                                       family=_family(engine, step_delimiter), max_new_tokens=max_new_tokens,
                                       seed=seed, batch_size=batch_size, progress=progress, runner=runner)
        if as_json:
            print(json.dumps(report.to_dict(with_results=per_problem)))
            return
        console = Console()
        choices = Table("method", "grid (development)", "chosen", title="Settings chosen on the development split "
                        f"({report.n_dev} problems; vanilla {report.dev_vanilla['accuracy']:.1%})")
        for name, c in report.choices.items():
            choices.add_row(name, ", ".join(str(g) for g in c.grid), str(c.chosen))
        console.print(choices)
        table = Table("method", "setting", "accuracy [95% CI]", "generated tokens [95% CI]",
                      "tokens incl. probes [95% CI]", "exit rate", "McNemar p (+/-)", "tokens sign p",
                      title=f"{report.model} on {report.task}: evaluation split, {report.n_eval} problems")
        verdicts = []
        for m in report.methods:
            d = m.to_dict(with_results=False)
            vs = d.get("vs_vanilla")
            acc = tok = ""
            if vs:
                acc = f"{vs['accuracy']['p_value']:.2g} (+{vs['accuracy']['gains']}/-{vs['accuracy']['losses']})"
                tok = f"{vs['tokens']['generated'][0]['p_value']:.2g}"
                verdicts.append(f"{m.name}: accuracy: {vs['accuracy']['verdict']}; tokens: "
                                f"{vs['tokens']['generated'][0]['verdict']}")
            table.add_row(m.name, json.dumps({k: v for k, v in m.params.items() if k != "name"}),
                          _interval(d["accuracy_ci"], percent=True), _interval(d["generated_tokens_ci"]),
                          _interval(d["tokens_with_probes_ci"]), f"{m.exit_rate:.0%}", acc, tok)
        console.print(table)
        for line in verdicts:
            console.print(line)
        console.print(report.power)

    @app.command("cot-settling")
    def cot_settling(
        model: str = typer.Option("toy-reasoner", "--model", help="the organism: toy-reasoner or toy-reasoner:small"),
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        n: int = typer.Option(100, help="evaluation traces"),
        n_calibration: int = typer.Option(60, help="calibration traces (f0/f1)"),
        n_dev: int = typer.Option(60, help="development traces (bandwidth and h)"),
        h: list[str] = typer.Option(["0.5,1,2,4,8"], "--h", help="CUSUM thresholds to choose from"),
        bound: int = typer.Option(2, help="an alarm 0..bound steps after the settling step counts as on time"),
        density: str = typer.Option("kde", help="kde | histogram", callback=_density),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Detection delay of the CUSUM alarm against the organism's planted settling step."""
        engine = backend(model, server, token)
        with TerminalProgress() as progress:
            report = evaluate_settling(engine, None, n, n_calibration, n_dev, h_grid=parse_numbers(h, "--h"),
                                       bound=bound, density=density, seed=seed, progress=progress)
        if as_json:
            print(json.dumps(report.to_dict()))
            return
        s = report.summary
        table = Table("measure", "value [95% CI]", title=f"{report.model}: CUSUM alarm vs settling step, "
                      f"evaluation split, {s['n']} traces, h = {report.threshold:g} (chosen on development)")
        table.add_row(f"alarm 0..{report.bound} steps after settling", _interval(s["within_bound"], percent=True))
        table.add_row("false alarm (before settling)", _interval(s["false_alarm_rate"], percent=True))
        table.add_row("no alarm", _interval(s["miss_rate"], percent=True))
        if s["mean_delay_when_not_early"]:
            table.add_row("mean delay (steps, alarms at or after settling)",
                          _interval(s["mean_delay_when_not_early"]))
        table.add_row("delay distribution (steps: traces)",
                      ", ".join(f"{k}: {v}" for k, v in s["delay_counts"].items()))
        Console().print(table)

    @app.command("cot-vote")
    def cot_vote(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("auto", help="auto (the model's own task, else arith) | arith | arith2 | "
                                              "arith-mixed | gsm8k | toy-reasoner | toy-reasoner:small | "
                                              "PROBLEMS.jsonl", callback=canonical_task),
        n: int = typer.Option(20, help="evaluation problems"),
        n_calibration: int = typer.Option(20, help="calibration problems (disjoint)"),
        samples: int = typer.Option(8, help="sampled trajectories per problem"),
        temperature: float = typer.Option(0.7, callback=number_check("--temperature", low=0, low_open=True,
                                                                     why="voting needs sampled trajectories")),
        h: float = typer.Option(2.0, "--h", help="CUSUM threshold (the weights do not depend on it)",
                                callback=number_check("--h", low=0, low_open=True)),
        max_new_tokens: int = typer.Option(96),
        batch_size: int = typer.Option(16),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        step_delimiter: Optional[str] = typer.Option(None, help="regex ending a step (default: per family)"),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Self-consistency (majority) vs CUSUM-weighted voting over the same sampled trajectories."""
        engine = backend(model, server, token)
        with TerminalProgress() as progress:
            report = evaluate_cot_vote(engine, _task(engine, task), n, n_calibration, samples=samples,
                                       temperature=temperature,
                                       threshold=h, family=_family(engine, step_delimiter),
                                       max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                                       progress=progress)
        if as_json:
            print(json.dumps(report.to_dict()))
            return
        table = Table("vote", "accuracy [95% CI]", title=f"{report.model} on {report.task}: {report.n_eval} problems, "
                                                         f"{report.samples} samples at T={report.temperature:g}")
        table.add_row("single sample (mean)", _interval(report.intervals["single"], percent=True))
        table.add_row("majority (self-consistency)", _interval(report.intervals["majority"], percent=True))
        table.add_row("CUSUM-weighted", _interval(report.intervals["weighted"], percent=True))
        Console().print(table)
        Console().print(f"weighted vs majority: {report.weighted_vs_majority['verdict']}")
