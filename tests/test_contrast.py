"""Contrast between sets of reasoning steps (issue 25 item 4).

Unit tests check the statistics against hand-worked numbers and the rules' bad input. The model
tests run on `toy-reasoner:small` (its weights ship under docs/shipped/models/), whose planted
traces say which steps are reflections. The planted reflection direction is the difference of
means of reflection steps against the rest over 400 traces of the generator's train split, which
no contrast below sees (they read the dev split).

Why cosine >= 0.85 (measured, seed 0): two disjoint halves of the 400 reference traces give
directions at cosine 0.98 at resid_post.1 (the ceiling an estimate can reach), while 200
label-permuted contrasts of the same 60 dev traces reach at most 0.72 (99th percentile 0.56): the
step vectors are anisotropic, so even a random split's difference of means leans on the
high-variance directions. 0.85 lies above every permuted contrast and below the ceiling; the
contrast's own direction measured 0.953. The test re-measures the ceiling and a null band.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from analyses.contrast import (ContrastSettings, ContrastSite, StepSet, auroc, contrast, export_direction,
                               organism_steps, save_direction, select, smd)
from thoughtscope.errors import BadInputError

SITES = ["resid_post.0", "resid_post.1", "z.1"]
COSINE_THRESHOLD = 0.85


def test_smd_and_auroc_by_hand():
    a = np.array([[1.0], [2.0], [3.0]])
    b = np.array([[0.0], [1.0], [2.0]])
    # means 2 and 1, both variances 1 (ddof 1): pooled sd 1
    assert smd(a, b).tolist() == [1.0]
    # pairs (a > b): 1>0; 2>0,2>1; 3>0,3>1,3>2 = 6, ties 1=1, 2=2 count half: (6 + 1) / 9
    assert auroc(a, b).tolist() == pytest.approx([7 / 9])
    assert smd(np.ones((3, 1)), np.ones((2, 1))).tolist() == [0.0]  # constant: no effect, not NaN


def _toy_steps(n_traces: int = 8, per: int = 4, shift: float = 0.0, seed: int = 0) -> StepSet:
    g = torch.Generator().manual_seed(seed)
    n = n_traces * per
    kind = ["reflection" if i % 2 else "compute" for i in range(n)]
    x = torch.randn(n, 6, generator=g)
    x[torch.tensor([k == "reflection" for k in kind]), 0] += shift
    return StepSet({"resid_post.0": x}, np.repeat(np.arange(n_traces), per), np.tile(np.arange(per), n_traces), kind,
                   [f"step {i}" for i in range(n)], np.ones(n, dtype=bool), ["a.txt"] * n)


def test_a_planted_shift_is_found_and_held_out():
    steps = _toy_steps(n_traces=40, shift=3.0)
    in_a, in_b, rule = select(steps, "kind:reflection")
    result = contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("direction", "resid_post.0")],
                      ContrastSettings(n_resamples=200), rule=rule)
    top = result.top[0]
    assert top["significant"] and top["heldout_auroc"]["estimate"] > 0.9
    assert top["heldout_auroc"]["low"] <= top["heldout_auroc"]["estimate"] <= top["heldout_auroc"]["high"]
    v, site = export_direction(result, top, [ContrastSite("direction", "resid_post.0")])
    assert site == "resid_post.0" and int(torch.argmax(v.abs())) == 0  # the planted coordinate


@pytest.mark.parametrize("rule, message", [
    ("kind:backtrack", r"no step is 'backtrack': these 32 steps are compute 16, reflection 16; pick a rule"),
    ("kind:reflection/backtrack", r"no step is 'backtrack'"),
    ("alarm", "no CUSUM alarms"),
    ("source:a.txt/b.txt", "set B is empty"),
    ("", "give a rule"),
    ("nonsense", "unknown rule"),
])
def test_bad_rules_are_clear_errors(rule, message):
    steps = _toy_steps()
    with pytest.raises(BadInputError, match=message):
        in_a, in_b, _ = select(steps, rule)
        contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("direction", "resid_post.0")])


def test_single_trace_sets_and_missing_sites_are_clear_errors():
    steps = _toy_steps()
    in_a = steps.trace == 0
    with pytest.raises(BadInputError, match="single trace"):
        contrast(steps.acts, steps.trace, in_a, ~in_a, [ContrastSite("direction", "resid_post.0")])
    in_a, in_b, _ = select(steps, "kind:reflection")
    with pytest.raises(BadInputError, match="no activations at resid_post.5"):
        contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("direction", "resid_post.5")])
    with pytest.raises(BadInputError, match="z.<layer>"):
        contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("heads", "resid_post.0")])


def test_alarm_and_source_rules_split_as_described():
    first, second = _toy_steps(seed=0), _toy_steps(seed=1)
    second.source = ["b.txt"] * len(second)
    both = StepSet.concat(first, second)
    in_a, in_b, _ = select(both, "source:a.txt/b.txt")
    assert in_a.tolist() == [True] * len(first) + [False] * len(second) and (in_b == ~in_a).all()
    first.alarm = {0: 1, 1: 2}
    in_a, in_b, _ = select(first, "alarm")
    assert np.flatnonzero(in_a).tolist() == [2, 3, 7] and np.flatnonzero(in_b).tolist() == [0, 1, 4, 5, 6]


@pytest.fixture(scope="module")
def reasoner():
    from probes import Engine

    return Engine.from_id("toy-reasoner:small")


@pytest.fixture(scope="module")
def reference(reasoner):
    from analyses.organism import organism_problems

    return organism_steps(reasoner, organism_problems(400, split="train", size="small"), ["resid_post.1"])


@pytest.fixture(scope="module")
def dev_steps(reasoner):
    from analyses.organism import organism_problems

    return organism_steps(reasoner, organism_problems(60, split="dev", size="small"), SITES)


def _dom(x: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    m = torch.as_tensor(mask)
    return x[m].mean(0) - x[~m].mean(0)


@pytest.mark.model
def test_contrast_recovers_the_planted_reflection_direction(reference, dev_steps):
    from saes.train import SAETrainSettings, train_sae

    planted_mask = np.array(reference.kind) == "reflection"
    planted = _dom(reference.acts["resid_post.1"], planted_mask)
    halves = reference.trace < 200
    ceiling = torch.cosine_similarity(_dom(reference.acts["resid_post.1"][torch.as_tensor(halves)], planted_mask[halves]),
                                      _dom(reference.acts["resid_post.1"][torch.as_tensor(~halves)],
                                           planted_mask[~halves]), 0)
    assert ceiling > 0.95  # the reference reproduces itself: the threshold has room below it

    sae, _ = train_sae(reference.acts["resid_post.1"], SAETrainSettings(d_sae=64, steps=300, batch_size=64,
                                                                       progress=False),
                       metadata={"model_name": "toy-reasoner:small", "hook_name": "resid_post.1"})
    sites = [ContrastSite("direction", "resid_post.0"), ContrastSite("direction", "resid_post.1"),
             ContrastSite("heads", "z.1"), ContrastSite("sae", "resid_post.1", sae)]
    in_a, in_b, rule = select(dev_steps, "kind:reflection")
    result = contrast(dev_steps.acts, dev_steps.trace, in_a, in_b, sites, ContrastSettings(n_resamples=300),
                      rule=rule, contexts=dev_steps.text)
    best_direction = next(r for r in result.top if r["kind"] == "direction")
    assert best_direction["site"] == "direction:resid_post.1"
    cosine = float(torch.cosine_similarity(result.directions["resid_post.1"], planted, 0))
    assert cosine >= COSINE_THRESHOLD
    nulls = [float(torch.cosine_similarity(_dom(dev_steps.acts["resid_post.1"],
                                                np.random.default_rng(i).permutation(in_a)), planted, 0))
             for i in range(50)]
    assert max(nulls) < COSINE_THRESHOLD  # a label-blind contrast does not reach the threshold
    top_latent = next(r for r in result.top if r["kind"] == "sae")
    held = top_latent["heldout_auroc"]
    assert held["low"] <= held["estimate"] <= held["high"] and held["n"] == result.n["heldout_a"] + result.n["heldout_b"]
    assert all(c["text"].endswith(";") for c in top_latent["contexts"])
    print(f"\ncosine {cosine:.3f}; top latent {top_latent['feature']} held-out AUROC "
          f"{held['estimate']:.3f} [{held['low']:.3f}, {held['high']:.3f}]; significant {result.n_significant}")


@pytest.mark.model
def test_two_random_halves_find_nothing_after_fdr(dev_steps):
    sites = [ContrastSite("direction", "resid_post.0"), ContrastSite("direction", "resid_post.1"),
             ContrastSite("heads", "z.1")]
    found = []
    for seed in range(20):
        in_a, in_b, rule = select(dev_steps, "random", seed=seed)
        result = contrast(dev_steps.acts, dev_steps.trace, in_a, in_b, sites, ContrastSettings(n_resamples=20),
                          rule=rule)
        found.append(result.n_significant)
    assert found[0] == 0  # the default random split
    # Under the null Benjamini-Hochberg keeps P(any discovery) <= 0.05 per split; 4 or more of 20 splits with
    # a discovery would have probability 0.016 (binomial), so it would mean the p-values are not calibrated.
    assert sum(n > 0 for n in found) <= 3, found


@pytest.mark.model
def test_use_as_direction_exports_a_vector_the_steering_page_loads(dev_steps, tmp_path):
    from probes.interventions import load_vector

    in_a, in_b, rule = select(dev_steps, "kind:reflection")
    sites = [ContrastSite("direction", "resid_post.1")]
    result = contrast(dev_steps.acts, dev_steps.trace, in_a, in_b, sites, ContrastSettings(n_resamples=20))
    vector, site = export_direction(result, result.top[0], sites)
    save_direction(vector, site, tmp_path / "reflection.safetensors", meta=rule)
    assert torch.equal(load_vector(tmp_path / "reflection.safetensors"), result.directions["resid_post.1"])
    with pytest.raises(BadInputError, match="not a direction"):
        export_direction(result, {**result.top[0], "kind": "heads", "site": "heads:z.1"}, sites)


@pytest.mark.model
def test_contrast_through_the_server_equals_in_process(reasoner, dev_steps):
    from analyses.contrast.run import run_contrast
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    specs = ["direction:resid_post.1", "heads:1"]
    settings = ContrastSettings(n_resamples=50)
    here, _, _ = run_contrast(reasoner, specs, "kind:reflection", settings, organism=24)
    with serving_in_thread(create_app(reasoner)) as url, RemoteBackend(url, timeout=30) as remote:
        there, steps, _ = run_contrast(remote, specs, "kind:reflection", settings, organism=24)
    assert steps.describe()["n_traces"] == 24
    assert [(r["site"], r["feature"]) for r in there.top] == [(r["site"], r["feature"]) for r in here.top]
    assert [r["smd"] for r in there.top] == pytest.approx([r["smd"] for r in here.top], abs=1e-4)
    assert [r["heldout_auroc"]["estimate"] for r in there.top] == pytest.approx(
        [r["heldout_auroc"]["estimate"] for r in here.top], abs=1e-6)


@pytest.mark.model
def test_the_alarm_rule_splits_at_the_cusum_alarm_which_finds_the_planted_settling_step(reasoner):
    from analyses.contrast.steps import forced_answer_probes, organism_alarms
    from analyses.organism import organism_problems
    from probes.toys.reasoner import ANSWER_SUFFIX, STEP_DELIMITER

    problems = organism_problems(30, split="dev", size="small")
    probes = forced_answer_probes(reasoner, problems[:1])
    p, trace = problems[0], problems[0].meta["trace"]
    end = trace.index(STEP_DELIMITER) + len(STEP_DELIMITER)
    direct = reasoner.trace(f"Q : {p.question} A :" + trace[:end] + ANSWER_SUFFIX).entropies[-1]
    assert probes[0][0][0] == pytest.approx(float(direct), abs=1e-4)  # the batched readout is the model's own
    alarms = organism_alarms(reasoner, problems, organism_problems(60, split="calibration", size="small"))
    offsets = [alarms[t] - p.meta["settle_step"] for t, p in enumerate(problems) if t in alarms]
    assert len(offsets) >= len(problems) // 2 and np.median(offsets) == 0  # the typical alarm: the settling step
    steps = organism_steps(reasoner, problems, ["resid_post.1"])
    steps.alarm = alarms
    in_a, in_b, _ = select(steps, "alarm")
    t0 = next(iter(alarms))
    rows = np.flatnonzero(steps.trace == t0)
    assert in_a[rows].tolist() == [s > alarms[t0] for s in steps.step[rows]]
    assert in_b[rows].tolist() == [s <= alarms[t0] for s in steps.step[rows]]


@pytest.mark.model
def test_the_correct_rule_reads_the_organisms_own_sampled_traces(reasoner):
    from analyses.contrast.steps import organism_sampled_steps
    from analyses.organism import organism_problems

    problems = organism_problems(40, split="dev", size="small")
    steps = organism_sampled_steps(reasoner, problems, ["resid_post.1"], temperature=1.0, seed=0)
    in_a, in_b, rule = select(steps, "correct")
    assert in_a.any() and in_b.any() and (in_a == steps.correct).all()  # sampling makes some traces wrong
    again = organism_sampled_steps(reasoner, problems, ["resid_post.1"], temperature=1.0, seed=0)
    assert again.text == steps.text and torch.equal(again.acts["resid_post.1"], steps.acts["resid_post.1"])  # seeded


@pytest.mark.model
def test_the_command_line_contrasts_and_exports_with_provenance(tmp_path):
    import json

    import typer
    from typer.testing import CliRunner

    from analyses.contrast.cli import register
    from probes.interventions import load_vector

    cli = typer.Typer()
    register(cli)
    out_file = tmp_path / "top.safetensors"
    result = CliRunner().invoke(cli, ["contrast", "run", "--model", "toy-reasoner:small", "--organism", "24",
                                      "--site", "direction:resid_post.1", "--site", "heads:1", "--resamples", "50",
                                      "--export", str(out_file), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["rule"]["rule"] == "kind:reflection" and out["steps"]["n_traces"] == 24
    assert out["provenance"]["model"] == "toy-reasoner:small" and out["provenance"]["settings"]["rule"] == "kind:reflection"
    assert out["exported"]["site"] == "resid_post.1" and load_vector(out_file).numel() == 64
    bad = CliRunner().invoke(cli, ["contrast", "run", "--model", "toy-reasoner:small", "--organism", "8",
                                   "--rule", "kind:nothing"])
    assert bad.exit_code != 0 and "no step kind 'nothing'" in str(bad.exception)  # before any step is read


GENERATED_COSINE = 0.7  # own greedy traces (below), seed 0: measured 0.79 and 0.82; 50 label-permuted contrasts reach at most 0.57


def _planted(reference) -> torch.Tensor:
    return _dom(reference.acts["resid_post.1"], np.array(reference.kind) == "reflection")


def _permuted_cosines(steps, in_a: np.ndarray, planted: torch.Tensor, n: int = 50) -> list[float]:
    return [float(torch.cosine_similarity(_dom(steps.acts["resid_post.1"], np.random.default_rng(i).permutation(in_a)),
                                          planted, 0)) for i in range(n)]


@pytest.mark.model
def test_two_prompt_files_contrast_end_to_end_on_the_command_line(tmp_path, reasoner, reference):
    """The CLI's two-prompt-file route: the organism answers the questions of each file greedily, its steps are
    cut and labelled by its own judge, read at their closing tokens and contrasted. Two halves of the dev
    questions are exchangeable, so `source` finds nothing; `kind:reflection` over the same generated steps
    exports a direction aligned with the planted reflection direction of the reference traces (train split),
    above every label-permuted contrast of the same steps."""
    import json

    import typer
    from typer.testing import CliRunner

    from analyses.contrast.cli import register
    from analyses.contrast.steps import prompt_lines_steps, read_questions
    from analyses.organism import organism_problems
    from probes.interventions import load_vector

    dev = organism_problems(60, split="dev", size="small")
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(p.question for p in dev[0::2]) + "\n")
    b.write_text("\n\n".join(f"  {p.question} " for p in dev[1::2]))  # blank lines and spaces are skipped
    cli = typer.Typer()
    register(cli)

    def run(*args: str) -> dict:
        result = CliRunner().invoke(cli, ["contrast", "run", "--model", "toy-reasoner:small", "--prompts-a", str(a),
                                          "--prompts-b", str(b), "--site", "direction:resid_post.1",
                                          "--resamples", "200", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    null = run("--rule", "source")
    assert null["rule"]["rule"] == "source:a.txt/b.txt" and null["steps"]["n_traces"] == 60
    assert null["steps"]["sources"] == ["a.txt", "b.txt"]
    n = null["n"]
    assert n["dev_a"] + n["dev_b"] + n["heldout_a"] + n["heldout_b"] == null["steps"]["n_steps"]  # each in A or B
    assert n["dev_traces"] + n["heldout_traces"] == 60  # held out by whole traces
    assert null["n_significant"] == 0  # exchangeable halves of one question set
    print(f"\nsource null: smallest q {min(r['q'] for r in null['top']):.3f}")
    assert null["provenance"]["data"] == f"{a} | {b}"

    out_file = tmp_path / "reflection.safetensors"
    found = run("--rule", "kind:reflection", "--export", str(out_file))
    assert found["rule"]["rule"] == "kind:reflection" and found["steps"]["kinds"]["reflection"] >= 20
    assert found["n_significant"] >= 1 and found["top"][0]["heldout_auroc"]["low"] > 0.9
    planted = _planted(reference)
    cosine = float(torch.cosine_similarity(load_vector(out_file), planted, 0))
    steps = StepSet.concat(prompt_lines_steps(reasoner, *read_questions(str(a)), ["resid_post.1"]),
                           prompt_lines_steps(reasoner, *read_questions(str(b)), ["resid_post.1"]))
    assert len(steps) == found["steps"]["n_steps"]
    nulls = _permuted_cosines(steps, np.array(steps.kind) == "reflection", planted)
    print(f"\nprompt files: cosine with the planted direction {cosine:.3f}; permuted at most {max(nulls):.3f}")
    assert cosine >= GENERATED_COSINE > max(nulls)


@pytest.mark.model
def test_a_rise_harvest_is_a_step_source_with_the_same_rows_as_its_traces(reasoner, reference):
    """`harvest_steps`: a RISE harvest's closed steps are the rows `traces_steps` reads from the same traces
    (RISE's own reader, equal values), with the judge's labels; the harvest's unclosed answer pieces stay out;
    a reflection contrast on them finds the planted direction."""
    from analyses.contrast import harvest_steps
    from analyses.contrast.steps import traces_steps
    from analyses.organism import organism_problems
    from analyses.rise.harvest import HarvestSettings, harvest

    got = harvest(reasoner, organism_problems(60, split="dev", size="small"), HarvestSettings(layers=(1,), prompt="auto"))
    unclosed = [r for r in range(len(got.step_rows)) if not got.step(r).closed]
    assert unclosed  # the organism ends every trace with "So the answer is N ." after its last delimiter
    steps = harvest_steps(got)
    same = traces_steps(reasoner, got.traces, ["resid_post.1"], "dev")
    assert len(steps) == len(got.step_rows) - len(unclosed) == len(same)
    assert torch.allclose(steps.acts["resid_post.1"], same.acts["resid_post.1"], atol=1e-5)
    assert steps.kind == same.kind and steps.text == same.text and steps.trace.tolist() == same.trace.tolist()
    assert steps.step.tolist() == same.step.tolist() and all(t.endswith(";") for t in steps.text)
    in_a, in_b, rule = select(steps, "kind:reflection")
    result = contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("direction", "resid_post.1")],
                      ContrastSettings(n_resamples=100), rule=rule)
    planted = _planted(reference)
    cosine = float(torch.cosine_similarity(result.directions["resid_post.1"], planted, 0))
    nulls = _permuted_cosines(steps, in_a, planted)
    print(f"\nharvest: cosine with the planted direction {cosine:.3f}; permuted at most {max(nulls):.3f}")
    assert result.n_significant >= 1 and cosine >= GENERATED_COSINE > max(nulls)
    got.step_rows = [(t, s) for t, s in got.step_rows if not got.traces[t].steps[s].closed]
    with pytest.raises(BadInputError, match="no closed step"):
        harvest_steps(got)


@pytest.mark.model
def test_run_contrast_reads_a_rise_harvest_of_the_models_own_task(reasoner, reference, tmp_path, monkeypatch):
    """`run_contrast(..., harvest="auto")` (the CLI's `--harvest`, the page's "a RISE harvest" source): RISE's
    own traces of the organism's task (its calibration split), cut and labelled by the organism's judge; the
    reflection contrast finds the planted direction (cosine 0.68 on these 60 calibration traces, against 0.80 on
    the dev traces of the test above; the permutation null is the bar), and a second contrast of the same harvest reads it back from
    the activation store without generating."""
    import importlib

    from analyses.contrast.run import run_contrast
    from analyses.rise.labels import LABELS

    harvest_module = importlib.import_module("analyses.rise.harvest")  # the package's `harvest` is the function

    settings = ContrastSettings(n_resamples=100)
    result, steps, sites = run_contrast(reasoner, ["direction:resid_post.1"], "kind:reflection", settings,
                                        harvest="auto", harvest_n=60, store=str(tmp_path))
    assert set(steps.kind) <= set(LABELS) and steps.kind.count("reflection") >= 10
    assert steps.source[0] == "toy-reasoner:small" and len(np.unique(steps.trace)) == 60
    assert result.rule["A"] == "reflection steps" and result.n_significant >= 1
    planted = _planted(reference)
    cosine = float(torch.cosine_similarity(result.directions["resid_post.1"], planted, 0))
    nulls = _permuted_cosines(steps, np.array(steps.kind) == "reflection", planted)
    print(f"\nharvest source: cosine with the planted direction {cosine:.3f}; permuted at most {max(nulls):.3f}")
    assert cosine > max(nulls)  # the planted direction, beyond 50 label-permuted contrasts of the same steps

    def no_generation(*args, **kwargs):
        raise AssertionError("the stored harvest was generated again")

    monkeypatch.setattr(harvest_module, "generate_traces", no_generation)
    again, same, _ = run_contrast(reasoner, ["direction:resid_post.1"], "random", settings, harvest="auto",
                                  harvest_n=60, store=str(tmp_path))
    assert torch.equal(same.acts["resid_post.1"], steps.acts["resid_post.1"]) and same.kind == steps.kind
    assert again.rule["A"] != result.rule["A"]


@pytest.mark.parametrize("rule, sites, n, says", [
    ("alarm", ["direction:resid_post.1"], 40, "take the rules kind"),
    ("source:a/b", ["direction:resid_post.1"], 40, "take the rules kind"),
    ("kind:compute", ["direction:resid_post.1"], 40, "no step kind 'compute'; these steps are reflection"),
    ("kind:reflection", ["heads:1"], 40, "reads the residual stream only"),
    ("kind:reflection", ["direction:resid_post.1"], 2, "at least 4 problems"),
    ("kind:reflection", ["direction:resid_post.9"], 40, "has no site resid_post.9"),
])
def test_a_harvest_source_refuses_what_it_cannot_contrast_before_any_trace(rule, sites, n, says, monkeypatch):
    from analyses.contrast.run import run_contrast
    from analyses.rise import pipeline
    from probes import Engine

    def no_harvest(self):
        raise AssertionError("harvested before the settings were checked")

    monkeypatch.setattr(pipeline.RisePipeline, "harvest", no_harvest)
    with pytest.raises(BadInputError, match=says):
        run_contrast(Engine.from_id("tiny-random:llama"), sites, rule, harvest="auto", harvest_n=n)
    with pytest.raises(BadInputError, match="not both"):
        run_contrast(Engine.from_id("tiny-random:llama"), sites, rule, harvest="auto", prompts_a=["a"], prompts_b=["b"])


@pytest.mark.model
def test_the_pages_two_question_boxes_contrast_the_same_through_the_server(reasoner):
    """The page's A and B text boxes (lists of questions): greedy traces, steps and contrast through a server
    equal the in-process ones."""
    from analyses.contrast.run import run_contrast
    from analyses.organism import organism_problems
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    dev = organism_problems(24, split="dev", size="small")
    box_a, box_b = [p.question for p in dev[:12]], [p.question for p in dev[12:]] + ["", "   "]
    settings = ContrastSettings(n_resamples=50)
    here, here_steps, _ = run_contrast(reasoner, ["direction:resid_post.1"], "kind:reflection", settings,
                                       prompts_a=box_a, prompts_b=box_b)
    with serving_in_thread(create_app(reasoner)) as url, RemoteBackend(url, timeout=30) as remote:
        there, steps, _ = run_contrast(remote, ["direction:resid_post.1"], "kind:reflection", settings,
                                       prompts_a=box_a, prompts_b=box_b)
    assert steps.describe()["n_traces"] == 24 and steps.describe()["sources"] == ["A", "B"]
    assert steps.text == here_steps.text and steps.kind == here_steps.kind
    assert torch.allclose(steps.acts["resid_post.1"], here_steps.acts["resid_post.1"], atol=1e-5)
    assert [r["smd"] for r in there.top] == pytest.approx([r["smd"] for r in here.top], abs=1e-4)
    assert there.n_significant == here.n_significant >= 1
    with pytest.raises(BadInputError, match="B holds no question"):
        run_contrast(reasoner, ["direction:resid_post.1"], "source", settings, prompts_a=box_a, prompts_b=["  "])


def test_too_few_questions_are_refused_before_any_model_work(tmp_path, monkeypatch):
    """Two questions a set can never be split into development and held-out traces: the page's first defaults
    were two a set and failed after generating. Both sets are checked before the first generation."""
    from analyses.contrast.run import run_contrast
    from analyses.contrast.steps import MIN_QUESTIONS, default_question_sets
    from probes import Engine

    engine = Engine.from_id("tiny-random:llama")
    monkeypatch.setattr(engine, "generate", lambda *a, **k: pytest.fail("generated before checking the sets"))
    a, b = default_question_sets()
    with pytest.raises(BadInputError, match=f"set B holds 2 question\\(s\\).*at least {MIN_QUESTIONS}"):
        run_contrast(engine, ["direction:resid_post.1"], "source", prompts_a=a, prompts_b=["q one?", "", " q two? "])
    (tmp_path / "a.txt").write_text("\n".join(a))
    (tmp_path / "b.txt").write_text("only one question?\n\n")
    with pytest.raises(BadInputError, match="b.txt holds 1 question"):
        run_contrast(engine, ["direction:resid_post.1"], "source", prompts_a=str(tmp_path / "a.txt"),
                     prompts_b=str(tmp_path / "b.txt"))
    with pytest.raises(BadInputError, match="does not exist"):
        run_contrast(engine, ["direction:resid_post.1"], "source", prompts_a=str(tmp_path / "a.txt"),
                     prompts_b=str(tmp_path / "missing.txt"))


def test_the_default_question_sets_are_seeded_word_problems_adding_against_taking_away():
    from analyses.contrast.steps import default_question_sets
    from analyses.tasks import arithmetic_problems

    a, b = default_question_sets()
    assert len(a) == len(b) == 16 and (a, b) == default_question_sets()
    plus, minus = arithmetic_problems(16, ops=("+",)), arithmetic_problems(16, ops=("-",))
    assert a == [p.question for p in plus] and b == [p.question for p in minus]
    assert {p.meta["ops"][0] for p in plus} == {"+"} and {p.meta["ops"][0] for p in minus} == {"-"}
    assert a[0].split(". ")[0] == b[0].split(". ")[0] == "Anna has 17 shells"  # the same seed: the same start


@pytest.mark.model
@pytest.mark.parametrize("rule, says", [
    ("kind:nonsense", "no step kind 'nonsense'; these steps are compute, reflection, backtrack, redundant"),
    ("kind:reflection/computee", "no step kind 'computee'"),
    ("kinds:reflection", "unknown rule 'kinds:reflection'"),
    ("source:a.txt", "source: needs two sources"),
    ("kind:", "kind: needs a step kind"),
])
def test_a_bad_rule_is_refused_before_any_step_is_read(monkeypatch, reasoner, rule, says):
    """`kind:nonsense` was said as "set A is empty" after every trace had been read."""
    from analyses.contrast import run as contrast_run

    read = []
    monkeypatch.setattr(contrast_run, "gather_steps", lambda *a, **k: read.append(a))
    with pytest.raises(BadInputError, match=re.escape(says)):
        contrast_run.run_contrast(reasoner, ["direction:resid_post.1"], rule)
    assert read == []


@pytest.mark.parametrize("box_a, box_b, says", [
    ([], [], "set A holds no question (one a line)"),
    (["2 + 2?"] * 4, [], "set B holds no question (one a line)"),
    (["2 + 2?"] * 4, ["", "3 + 3?"], "set B holds 1 question(s)"),
])
def test_the_pages_emptied_question_boxes_are_named_before_any_model_work(box_a, box_b, says):
    """Both boxes emptied on the page said "source: needs two sources, e.g. source:a.txt/b.txt", the command
    line's rule syntax (the fuzzing pass of 2026-12-07). No backend is given: nothing may reach one."""
    from analyses.contrast.run import run_contrast

    with pytest.raises(BadInputError) as refused:
        run_contrast(None, ["direction:resid_post.1"], "source", prompts_a=box_a, prompts_b=box_b)
    assert str(refused.value).startswith(says)
