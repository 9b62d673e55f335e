"""`thoughtscope rlkv train|map` and `thoughtscope eval rlkv`: RLKV head maps from the command line.

`rlkv train` learns the gates in this process (the model must be here: `--model`), saving gates,
optimiser state and the per-step log to `--out` as it goes; rerun the same command to resume.
`rlkv map` prints a head map: learned (`--gates FILE`) or from attention statistics (no training).
`eval rlkv` compares full cache, RLKV and every baseline at each sparsity on evaluation problems
(settings tuned on a development split); `--server URL` runs it against a model server. Every JSON
output carries a `provenance` record.

    thoughtscope rlkv train --model smollm2-135m --task arith --ops + --steps 24 --out runs/rlkv
    thoughtscope rlkv map --gates runs/rlkv --json
    thoughtscope eval rlkv --model smollm2-135m --task arith --ops + --gates runs/rlkv \\
        --sparsity 0.2 0.4 0.6 0.8 --json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from analyses.clikit import (MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, eval_group,
                             group, number_check, numbers, path_check)
from analyses.rlkv.data import task_problems, training_task
from analyses.rlkv.evaluate import evaluate_rlkv, report_table
from analyses.rlkv.head_map import HeadMap
from analyses.rlkv.probe import HeadGateProbe
from analyses.tasks import canonical_task
from probes.backend import Backend
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance


def parse_sparsities(values: list[str], extra: list[str]) -> list[float]:
    """`--sparsity 0.2 0.4` (extra words after the flag), `--sparsity 0.2 --sparsity 0.4` or `0.2,0.4`."""
    out = []
    for value in [*values, *extra]:
        for part in str(value).replace(",", " ").split():
            try:
                s = float(part)
            except ValueError as err:
                raise BadInputError(f"--sparsity takes numbers in [0, 1), got {part!r}") from err
            if not 0 <= s < 1:
                raise BadInputError(f"sparsity {s:g} is outside [0, 1): it is the fraction of heads made local")
            out.append(s)
    if not out:
        raise BadInputError("give at least one --sparsity")
    return sorted(dict.fromkeys(out))


def _provenance(engine: Backend, **kw):
    return provenance(engine.info(), **kw)


def register(cli: typer.Typer) -> None:
    app = group(cli, "rlkv", "RLKV: which KV heads matter for reasoning (gates learned with RL, compressed caches).")

    @app.command("train")
    def train(
        model: str = MODEL_OPTION,
        task: str = typer.Option("arith", help="arith | arith2 | arith-mixed | gsm8k | PROBLEMS.jsonl (analyses.tasks)",
                                 callback=canonical_task),
        ops: Optional[str] = typer.Option(None, help="arithmetic operators only, e.g. '+' (arith, arith2)"),
        n_train: int = typer.Option(96, help="training problems (disjoint from evaluation: `eval rlkv` drops them)"),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX, help="problems and rollouts"),
        steps: int = typer.Option(24),
        prompts_per_step: int = typer.Option(8),
        group_size: int = typer.Option(4, help="G samples per prompt"),
        max_new_tokens: int = typer.Option(48),
        temperature: float = typer.Option(0.7),
        lr: float = typer.Option(1e-2, help="AdamW learning rate (paper 1e-2)",
                                 callback=number_check("--lr", low=0, high=10, low_open=True)),
        beta: float = typer.Option(1e-3, help="L1 weight (paper 1e-3)"),
        tau: float = typer.Option(0.5, help="reward above which the L1 penalty applies (paper 0.5)"),
        sink: int = typer.Option(4, min=0, help="local attention's sink tokens in training"),
        recent: int = typer.Option(32, min=1, help="local attention's recent tokens in training"),
        micro_batch: int = typer.Option(8, help="sequences per backward pass (memory)"),
        out: Path = typer.Option(..., help="folder for gates.safetensors and log.json (resumed if present)",
                                 callback=path_check("--out", "folder")),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Learn RLKV gates with GRPO (in this process); saves and resumes in --out."""
        probe = HeadGateProbe(sink=sink, recent=recent, beta=beta, tau=tau, group_size=group_size, lr=lr, steps=steps,
                              prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens,
                              temperature=temperature, micro_batch=micro_batch, seed=seed)
        problems = task_problems(task, n_train, seed=seed, ops=ops)
        probe._check(problems)
        engine = backend(model, None, None)
        with TerminalProgress() as progress:
            progress("GRPO steps", 0, steps)  # the bar starts now, so its rate counts the first step

            def on_step(done: int, total: int, row: dict) -> None:
                progress("GRPO steps", done, total)
                print(json.dumps({k: v for k, v in row.items() if k != "problems"}), file=sys.stderr, flush=True)

            probe.fit(engine, problems, on_step=on_step, checkpoint_dir=out, task=training_task(task, ops))
        last = probe.log_[-1] if probe.log_ else {}
        payload = {"gates_file": str(Path(out) / "gates.safetensors"), "steps": len(probe.log_),
                   "gates": probe.gates_.tolist(), "last_step": last,
                   "provenance": _provenance(engine, data=f"{task}{' ops=' + ops if ops else ''}", split="train",
                                             seed=seed, settings=probe.settings(), command="thoughtscope rlkv train")}
        emit(payload, as_json)

    @app.command("map")
    def head_map(
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        gates: Optional[Path] = typer.Option(None, help="a gates file or folder (learned map)",
                                             callback=path_check("--gates")),
        task: str = typer.Option("arith", help="problems whose traces give the attention statistics",
                                 callback=canonical_task),
        ops: Optional[str] = typer.Option(None),
        n: int = typer.Option(8, help="traces for the attention statistics"),
        sink: int = typer.Option(4),
        recent: int = typer.Option(32),
        seed: int = typer.Option(0, min=0, max=checks.SEED_MAX),
        sparsity: Optional[float] = typer.Option(None, help="also give the heads kept full at this sparsity and "
                                                            "their KV bytes at 4,096 tokens"),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """The layer x KV-head map: learned gates (--gates), else long-range attention from attention statistics."""
        if sparsity is not None:
            parse_sparsities([str(sparsity)], [])  # refused before the model loads
        engine = backend(model, server, token)
        if gates is not None:
            hm = HeadMap.from_gates(gates, engine, sink, recent)
        else:
            with TerminalProgress() as progress:
                hm = HeadMap.from_attention(engine, task_problems(task, n, seed=seed, ops=ops), sink, recent,
                                            max_new_tokens=48, progress=progress, task=task)
        payload = hm.to_dict(sparsity)
        if sparsity is not None:
            payload.update(kv_bytes_4096=hm.kv_bytes(sparsity, 4096), full_kv_bytes_4096=hm.kv_bytes(0.0, 4096))
        payload["provenance"] = _provenance(engine, data=task, seed=seed, settings={"sink": sink, "recent": recent},
                                            command="thoughtscope rlkv map")
        emit(payload, as_json)

    ev = eval_group(cli)

    @ev.command("rlkv", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def eval_rlkv(
        ctx: typer.Context,
        model: str = MODEL_OPTION,
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        task: str = typer.Option("arith", callback=canonical_task),
        ops: Optional[str] = typer.Option(None, help="arithmetic operators only, e.g. '+'"),
        gates: Optional[Path] = typer.Option(None, help="learned gates (file or folder); without: RLKV is skipped",
                                             callback=path_check("--gates")),
        sparsity: list[str] = typer.Option(["0.2", "0.4", "0.6", "0.8"], "--sparsity",
                                           help="fractions of heads made local: --sparsity 0.2 0.4 0.6 0.8"),
        n: int = typer.Option(60, help="evaluation problems"),
        n_dev: int = typer.Option(16, help="development problems (budget, SnapKV window)"),
        n_calibration: int = typer.Option(8, help="calibration problems (attention-statistics head scores)"),
        seed: int = typer.Option(1, min=0, max=checks.SEED_MAX,
                                 help="problem pool (training used --seed 0 by default; its problems are dropped)"),
        sink: int = typer.Option(4, help="local heads' sink tokens"),
        recent: int = typer.Option(32, help="local heads' recent tokens"),
        random_seeds: int = typer.Option(3, help="random head choices per sparsity"),
        snapkv_windows: str = typer.Option("4,16", help="SnapKV observation windows to choose from (development)"),
        max_new_tokens: int = typer.Option(64),
        batch_size: int = typer.Option(16),
        methods: str = typer.Option("all", help="comma list of: rlkv, attention, random, streaming, snapkv, knorm (all), and the control rlkv-inverse"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        per_problem: bool = typer.Option(False, help="include per-problem rows in the JSON"),
    ) -> None:
        """Full cache vs RLKV vs baselines on the same KV budget: accuracy [95% CI], McNemar, KV bytes, tokens/s."""
        levels = parse_sparsities(sparsity, list(ctx.args))
        windows = numbers(snapkv_windows, "--snapkv-windows", integer=True, low=1)
        engine = backend(model, server, token)
        with TerminalProgress() as progress:
            report = evaluate_rlkv(engine, task, levels, gates=gates, ops=ops, n=n, n_dev=n_dev,
                                   n_calibration=n_calibration, seed=seed, sink=sink, recent=recent,
                                   random_seeds=random_seeds, snapkv_windows=windows, max_new_tokens=max_new_tokens,
                                   batch_size=batch_size, methods=methods, progress=progress)
        payload = report.to_dict(per_problem=per_problem)
        if as_json:
            print(json.dumps(payload))
            return
        console = Console()
        console.print(report_table(report))
        for line in report.notes():
            console.print(line)
