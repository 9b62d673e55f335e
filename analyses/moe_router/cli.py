"""`thoughtscope eval expert-sample | active-experts` and `thoughtscope router profile`: the MoE router method.

`register(cli)` adds the commands. `--server URL` runs them against a model server instead of a model in
this process (router rules travel as intervention specs). Every JSON output carries a `provenance` record.

`expert-sample` follows the evaluation protocol (analyses.evaluation): Expert-Sample's k_h, m, T_e and tail
gates are chosen on the development split from `--grid` (default: `default_grid` for the model's k), the
token temperature of Expert-Sample + temperature too; then greedy, temperature sampling at each `--temperature`,
Expert-Sample and Expert-Sample + temperature run once on the evaluation split, with pass@1..N, best-of-n and
majority@n (95% bootstrap intervals) and paired tests against greedy and every temperature.

    thoughtscope eval expert-sample --model toy-moe --n 200 --n-dev 100 --samples 16 --json
    thoughtscope eval expert-sample --model toy-moe:small --grid 2:8:1,1:8:2:displaced --n 50
    thoughtscope eval active-experts --model toy-moe --n 300 --json
    thoughtscope router profile --model toy-moe --n 50 --json
"""

from __future__ import annotations

from typing import Optional

import typer

from analyses.clikit import (MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, eval_group,
                             group, number_check, numbers)
from analyses.distributed.options import RAY_OPTION, REPLICAS_OPTION, ray_runner
from analyses.moe_router.evaluate import ExpertSetting, evaluate_active_experts, evaluate_expert_sample
from analyses.moe_router.maps import profile_task
from analyses.moe_router.problems import resolve_task
from analyses.moe_router.stats import HeadTail
from analyses.tasks import canonical_task
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance

TASK_HELP = ("auto (the model's own task: toy-moe for the toy, else arith) | toy-moe | toy-moe:small | arith | gsm8k "
             "... | PROBLEMS.jsonl")


def _router_task(name: str) -> str:
    """--task, checked when the command line is read (`auto` needs the model, so it waits for it)."""
    task = canonical_task(name)
    return task if task == "auto" else resolve_task(task)


def parse_grid(values: list[str]) -> list:
    """`--grid 4:12:1,2:24:2:displaced` -> Expert-Sample settings (k_h:m:T_e[:tail_gates])."""
    out = [ExpertSetting.parse(part) for value in values for part in str(value).replace(" ", ",").split(",") if part]
    if values and not out:
        raise BadInputError("--grid takes settings such as 4:12:1,2:24:2:displaced")
    return out


def _provenance(b, command: str, split: str, seed: int, settings: dict, data: str):
    return provenance(b.info(), data=data, split=split, seed=seed, settings=settings, command=command)


def register(cli: typer.Typer) -> None:
    app = eval_group(cli)

    @app.command("expert-sample")
    def expert_sample(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("auto", help=TASK_HELP, callback=_router_task),
        n: int = typer.Option(100, help="evaluation problems (each method runs once on them)"),
        n_dev: int = typer.Option(40, "--n-dev", help="development problems (the settings are chosen on them)"),
        samples: int = typer.Option(16, "--samples", help="samples per problem (N of pass@N)"),
        grid: list[str] = typer.Option([], "--grid", help="Expert-Sample settings k_h:m:T_e[:tail_gates] to choose "
                                                          "from (default: a grid around the model's k)"),
        temperature: list[str] = typer.Option(["0.3,0.6,1.0"], "--temperature", help="token temperatures (baselines)"),
        combined: list[str] = typer.Option([], "--combined", help="token temperatures to choose from for "
                                                                  "Expert-Sample + temperature (default: --temperature)"),
        max_new_tokens: int = typer.Option(48, help="longest answer"),
        batch_rows: int = typer.Option(128, min=1, help="sequences generated together (whole problems of N samples)"),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        n_resamples: int = typer.Option(2000, min=10, max=100_000, help="bootstrap resamples"),
        per_problem: bool = typer.Option(False, help="include per-problem rows in the JSON"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        ray: Optional[str] = RAY_OPTION,
        replicas: Optional[int] = REPLICAS_OPTION,
    ) -> None:
        """Greedy, temperature sampling and Expert-Sample (chosen on development): pass@n and best-of-n on evaluation."""
        settings_grid = parse_grid(grid) or None
        temps = numbers(temperature, "--temperature")
        combined_temps = numbers(combined, "--combined") or None
        replicas_of = ray_runner(model, server, ray, replicas)
        b = backend(model, server, token)
        with replicas_of as runner, TerminalProgress(enabled=not as_json) as progress:
            report = evaluate_expert_sample(b, task, n, n_dev, samples, grid=settings_grid, temperatures=temps,
                                            combined_temperatures=combined_temps, max_new_tokens=max_new_tokens,
                                            seed=seed, batch_rows=batch_rows, n_resamples=n_resamples,
                                            progress=progress, runner=runner)
        payload = report.to_dict(per_problem=per_problem)
        record = _provenance(b, "thoughtscope eval expert-sample", "development+evaluation", seed,
                             payload["settings"], report.task)
        emit(with_provenance(payload, record), as_json)

    @app.command("active-experts")
    def active_experts(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("auto", help=TASK_HELP, callback=_router_task),
        n: int = typer.Option(100, help="evaluation problems"),
        ks: list[str] = typer.Option([], "--k", help="experts per token to try (default: the model's k down to 1)"),
        max_new_tokens: int = typer.Option(48, help="longest answer"),
        batch_rows: int = typer.Option(128, min=1, help="sequences generated together"),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        n_resamples: int = typer.Option(2000, min=10, max=100_000, help="bootstrap resamples"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Greedy accuracy as the number of active experts per token shrinks (top-k' at every MoE layer)."""
        k_list = numbers(ks, "--k", integer=True, low=1) or None  # refused before the model loads
        b = backend(model, server, token)
        with TerminalProgress(enabled=not as_json) as progress:
            report = evaluate_active_experts(b, task, n, k_list, max_new_tokens=max_new_tokens,
                                             seed=seed, batch_rows=batch_rows, n_resamples=n_resamples,
                                             progress=progress)
        payload = report.to_dict()
        emit(with_provenance(payload, _provenance(b, "thoughtscope eval active-experts", "evaluation", seed,
                                                  payload["settings"], report.task)), as_json)

    router = group(cli, "router", "Mixture-of-experts router statistics.")

    @router.command("profile")
    def profile(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("auto", help=TASK_HELP, callback=_router_task),
        n: int = typer.Option(50, min=1, help="development problems whose prompt + greedy answer are read"),
        k_h: int = typer.Option(2, "--k-h", min=1, help="head size of the fixed rule"),
        p: float = typer.Option(0.5, help="mass of the cumulative-probability rule",
                                callback=number_check("--p", low=0, high=1, low_open=True)),
        max_new_tokens: int = typer.Option(48, min=1, help="longest answer"),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Sorted router probabilities, entropy, gap and head sizes (fixed / cumulative / gap), per MoE layer."""
        rules = (HeadTail("fixed", k_h=k_h), HeadTail("cumulative", p=p), HeadTail("gap"))
        b = backend(model, server, token)
        with TerminalProgress(enabled=not as_json) as progress:
            fitted, task_name = profile_task(b, task, n, rules=rules, max_new_tokens=max_new_tokens, seed=seed,
                                             progress=progress)
        payload = fitted.to_dict()
        settings = {"n": n, "rules": [r.to_dict() for r in rules], "max_new_tokens": max_new_tokens}
        emit(with_provenance(payload, _provenance(b, "thoughtscope router profile", "development", seed, settings,
                                                  task_name)), as_json)
