"""`thoughtscope eval vis-attr`: faithfulness of visual attribution on toy-vlm's held-out scenes, on any
supported VLM family (the toy's own model, or an LLaVA / Idefics3 / SmolVLM / Qwen2-VL / Qwen2.5-VL / Qwen3-VL
one fed the same scenes).

The estimator is trained on `--n-train` training scenes (exhaustive effects as targets), its settings
chosen on `--n-dev` development scenes (the choice is in the JSON's settings), and every
method is scored on `--n` evaluation scenes (disjoint layouts: probes.toys.vlm splits) against the
exhaustive effects: Pearson / Spearman over each span's regions, ground-truth hit rate, R^2, the
linear datamodeling score, top-k deletion, per-span cost; 95% bootstrap intervals over spans and sign
tests of amortized vs raw attention. `--server URL`
runs it against a model server (images travel as PNG bytes). The JSON carries a `provenance` record.

    thoughtscope eval vis-attr --model toy-vlm --n 40 --n-train 40 --json
    thoughtscope eval vis-attr --model toy-vlm --k 4 --save estimators/toy-vlm-k4
    thoughtscope eval vis-attr --model toy-vlm:small --regions objects --json
"""

from __future__ import annotations

from typing import Optional

import typer

from analyses.clikit import SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, eval_group, path_check
from analyses.visual_attribution.evaluate import REGION_KINDS, run_study
from thoughtscope import checks
from thoughtscope.provenance import provenance, with_provenance


def register(cli: typer.Typer) -> None:
    ev = eval_group(cli)

    @ev.command("vis-attr")
    def vis_attr(
        model: str = typer.Option("toy-vlm", "--model", help="a vision-language model: toy-vlm, toy-vlm:small, an "
                                  "hf: LLaVA / Idefics3 / SmolVLM / Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder, tiny-random:<llava|"
                                  "smolvlm|qwen2_vl|qwen2_5_vl|qwen3_vl> (code paths only); the toy scenes are "
                                  "resized to its input"),
        server: Optional[str] = SERVER_OPTION,
        token: Optional[str] = TOKEN_OPTION,
        n: int = typer.Option(40, "--n", min=1, help="held-out (eval split) scenes"),
        n_train: int = typer.Option(40, "--n-train", min=1, help="training scenes for the estimator"),
        n_dev: int = typer.Option(20, "--n-dev", help="development scenes on which the estimator's settings are "
                                  "chosen (features, epochs, l2); 0 = no choice, the defaults with --epochs"),
        epochs: int = typer.Option(300, "--epochs", min=1, help="estimator epochs when --n-dev 0 (full batch, Adam)"),
        lds_subsets: int = typer.Option(8, "--lds-subsets", help="random half-size cell sets per scene for the LDS "
                                        "(0 skips it)"),
        k: int = typer.Option(0, "--k", help="regions: 0 = --regions; K = K Ward clusters of the visual tokens"),
        regions: str = typer.Option("grid", "--regions", help="grid: the scene's 9 cells; objects: each object's "
                                    "true box and the background (the same table)"),
        seed: int = typer.Option(0, "--seed", min=0, max=checks.SEED_MAX),
        save: Optional[str] = typer.Option(None, "--save", help="write the fitted estimator to PATH.safetensors + "
                                           "PATH.json (AmortizedAttribution.load reads it back)",
                                           callback=path_check("--save", "file")),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Amortized attribution, raw attention and exhaustive ablation against the true regions."""
        checks.choice("regions", regions, REGION_KINDS)  # before the model loads
        b = backend(model, server, token)
        with TerminalProgress(enabled=not as_json) as progress:
            result = run_study(b, n_train=n_train, n_eval=n, seed=seed, epochs=epochs, n_subsets=lds_subsets,
                               k=k or None, progress=progress, n_dev=n_dev, regions=regions)
        record = provenance(b.info(), data="probes.toys.vlm scenes",
                            split="train (estimator) / dev (its settings) / eval (scores)",
                            seed=seed, settings=result.settings, command="eval vis-attr")
        payload = result.to_dict()
        if save:
            payload["estimator"] = str(result.estimator.save(save))
        emit(with_provenance(payload, record), as_json)
