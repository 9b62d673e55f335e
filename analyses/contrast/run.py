"""One contrast from plain settings (what the CLI, the page and the benchmark share): site specs parsed,
steps gathered (organism traces or two prompt files), split by the rule, contrasted.

Steps come from the organism's planted (or sampled) traces, from two prompt sets, or from a RISE harvest
(`harvest=TASK`: RISE's own traces of `harvest_n` problems, cut and labelled by the model family's judge and
scored by the task: `kind:reflection`, `kind:backtracking/other`, `correct` and `random` apply; stored in the
activation store, so a second contrast of the same harvest reads it back).

Site specs: `direction:resid_post.1`, `heads:1` (the head output norms of layer 1, read at `z.1`),
`sae:FOLDER` (its site from the SAE's `hook_name`) or `sae:FOLDER@resid_post.1`.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("toy-reasoner:small")
    >>> sites = parse_sites(["direction:resid_post.1", "heads:1"], engine)
    >>> [s.site for s in sites]
    ['resid_post.1', 'z.1']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from analyses.contrast.core import ContrastResult, ContrastSettings, ContrastSite, contrast
from analyses.contrast.steps import (StepSet, check_rule, harvest_steps, organism_alarms, organism_sampled_steps,
                                     organism_steps, prompt_lines_steps, questions_of, read_questions, select)
from analyses.feature_browser.token_latents import check_sae
from analyses.families import default_task
from analyses.organism import check_split, is_organism, organism_problems, size_of
from analyses.rise.labels import LABELS as HARVEST_KINDS
from probes.backend import Backend
from probes.toys.reasoner import KINDS as ORGANISM_KINDS
from saes.io import load_sae
from thoughtscope.errors import BadInputError

Progress = Callable[..., None]
N_CALIBRATION = 60  # organism calibration traces the CUSUM detector is fit on (the `alarm` rule)


def parse_sites(specs: Sequence[str], backend: Backend) -> list[ContrastSite]:
    """ContrastSites from `kind:where` specs, checked against the backend's sites (SAEs against the model)."""
    if not specs:
        raise BadInputError("choose at least one site, e.g. direction:resid_post.1, heads:1 or sae:FOLDER")
    known = {row["site"] for row in backend.sites()}
    out = []
    for spec in specs:
        kind, _, where = str(spec).strip().partition(":")
        if kind == "heads":
            site = where if where.startswith("z.") else f"z.{where}"
            out.append(ContrastSite("heads", site))
        elif kind == "direction":
            out.append(ContrastSite("direction", where))
        elif kind == "sae":
            folder, _, site = where.partition("@")
            sae = load_sae(folder)
            site = site or str(getattr(getattr(sae.cfg, "metadata", None), "hook_name", "") or "")
            if not site:
                raise BadInputError(f"say the site of the SAE in {folder}: sae:{folder}@resid_post.<layer>")
            check_sae(sae, backend, site)
            out.append(ContrastSite("sae", site, sae, folder))
        else:
            raise BadInputError(f"site {spec!r}: use direction:<site>, heads:<layer> or sae:<folder>[@<site>]")
        if out[-1].site not in known:
            raise BadInputError(f"{backend.info().get('model_id')} has no site {out[-1].site}")
    return out


HARVEST_RULES = ("kind", "correct", "random")  # a harvest has one source and no CUSUM alarms


def check_harvest(rule: str, sites: Sequence[ContrastSite], n: int) -> list[int]:
    """The layers a RISE harvest must read for `sites`, after checking that the rule and the sites suit a
    harvest (before any trace is generated)."""
    check_rule(rule, HARVEST_KINDS)
    if rule.strip().partition(":")[0] not in HARVEST_RULES:
        raise BadInputError(f"a RISE harvest's steps take the rules kind:<A>[/<B>], correct or random, not {rule!r} "
                            f"(its kinds: {', '.join(HARVEST_KINDS)})")
    other = sorted({s.site for s in sites if not s.site.startswith("resid_post.")})
    if other:
        raise BadInputError(f"a RISE harvest reads the residual stream only (resid_post.<layer>), not {', '.join(other)}: "
                            "choose direction:resid_post.<layer> or an SAE there")
    if not isinstance(n, int) or n < 4:
        raise BadInputError(f"harvest at least 4 problems, got {n!r}")
    return sorted({int(s.site.split(".")[1]) for s in sites})


def harvest_source(backend: Backend, layers: Sequence[int], task: str = "auto", n: int = 64,
                   store: str | None = None, on_progress: Progress | None = None) -> StepSet:
    """The closed steps of a RISE harvest of `n` problems of `task` (`auto`: the model's own task), read at
    `layers` (`analyses.contrast.steps.harvest_steps`); the activation store keeps it for the next contrast."""
    from analyses.rise.pipeline import RiseOptions, RisePipeline  # lazy: the RISE pipeline pulls in SAE training

    options = RiseOptions(task=default_task(backend) if task == "auto" else task, n=n, layers=tuple(layers),
                          store=store)
    tick = (lambda stage, done, total: on_progress("harvest", done, total)) if on_progress else None
    return harvest_steps(RisePipeline(backend, options, on_progress=tick).harvest())


def check_sources(organism: int = 60, split: str = "dev", prompts_a: Any = None, prompts_b: Any = None,
                  harvest: str | None = None) -> None:
    """Where the steps come from, checked before any model loads: one source, two prompt files that each hold
    enough questions, or an organism split that exists and enough of its traces.

    >>> check_sources(split="test")
    Traceback (most recent call last):
    ...
    thoughtscope.errors.BadInputError: split 'test'; use one of calibration, dev, eval
    """
    if harvest:
        if prompts_a or prompts_b:
            raise BadInputError("steps come from a RISE harvest or from two prompt sets, not both")
        return
    if isinstance(prompts_a, list) or isinstance(prompts_b, list):  # the page's two text boxes
        questions_of(prompts_a, "set A"), questions_of(prompts_b, "set B")
        return
    if prompts_a or prompts_b:
        if not (prompts_a and prompts_b):
            raise BadInputError("give two prompt files (--prompts-a and --prompts-b) to contrast them")
        read_questions(prompts_a), read_questions(prompts_b)
        return
    check_split(split)
    if organism < 4:
        raise BadInputError(f"ask for at least 4 organism traces, got {organism}")


def gather_steps(backend: Backend, sites: Sequence[ContrastSite], organism: int = 0, split: str = "dev",
                 prompts_a: Any = None, prompts_b: Any = None, max_new_tokens: int = 96,
                 on_progress: Progress | None = None, alarms: bool = False, sampled: bool = False) -> StepSet:
    """Steps at every captured site: `organism` planted traces of toy-reasoner's `split` (or, `sampled`, its
    own traces of those problems at temperature 1), or two prompt files."""
    captured = sorted({s.site for s in sites})
    tick = (lambda done, total: on_progress("steps", done, total)) if on_progress else None
    if isinstance(prompts_a, list) or isinstance(prompts_b, list):  # the page's two text boxes
        sets = [(questions_of(prompts_a, "set A"), "A"), (questions_of(prompts_b, "set B"), "B")]  # both, first
    elif prompts_a or prompts_b:
        if not (prompts_a and prompts_b):
            raise BadInputError("give two prompt files (--prompts-a and --prompts-b) to contrast them")
        sets = [read_questions(prompts_a), read_questions(prompts_b)]  # both checked before any model work
    else:
        sets = []
    if sets:
        first, second = [prompt_lines_steps(backend, questions, name, captured, max_new_tokens, on_progress=tick)
                         for questions, name in sets]
        return StepSet.concat(first, second)
    if not is_organism(backend):
        raise BadInputError("planted traces come from the toy-reasoner organism; for another model give two "
                            "prompt files")
    if organism < 4:
        raise BadInputError(f"ask for at least 4 organism traces, got {organism}")
    size = size_of(backend.info()["model_id"])
    problems = organism_problems(organism, split=split, size=size)
    if sampled:
        return organism_sampled_steps(backend, problems, captured, on_progress=tick)
    steps = organism_steps(backend, problems, captured, on_progress=tick)
    if alarms:  # the CoT-entropy CUSUM detector, fit on the calibration split, run over these traces
        steps.alarm = organism_alarms(backend, problems, organism_problems(N_CALIBRATION, split="calibration",
                                                                           size=size))
    return steps


def run_contrast(backend: Backend, site_specs: Sequence[str], rule: str, settings: ContrastSettings | None = None,
                 organism: int = 60, split: str = "dev", prompts_a: Any = None, prompts_b: Any = None,
                 on_progress: Progress | None = None, sampled: bool = False, harvest: str | None = None,
                 harvest_n: int = 64, store: str | None = None) -> tuple[ContrastResult, StepSet, list[ContrastSite]]:
    """One contrast; on the organism, `correct` reads its own sampled traces (planted ones are all correct).
    `harvest` (a task, or `auto`): the steps of a RISE harvest of `harvest_n` of its problems instead."""
    settings = settings or ContrastSettings()
    check_sources(organism, split, prompts_a, prompts_b, harvest)
    if harvest:
        sites = parse_sites(site_specs, backend)
        layers = check_harvest(rule, sites, harvest_n)
        steps = harvest_source(backend, layers, harvest, harvest_n, store, on_progress)
        in_a, in_b, described = select(steps, rule, seed=settings.seed)
        return contrast(steps.acts, steps.trace, in_a, in_b, sites, settings, rule=described,
                        contexts=steps.text), steps, sites
    if prompts_a and prompts_b and rule == "source":  # the two prompt sets' own names
        rule = ("source:A/B" if isinstance(prompts_a, list)
                else f"source:{Path(prompts_a).name}/{Path(prompts_b).name}")
    check_rule(rule)  # before any step is read; on planted traces, their step kinds too
    if is_organism(backend) and not (prompts_a or prompts_b) and not sampled and rule.strip() != "correct":
        check_rule(rule, ORGANISM_KINDS)
    sites = parse_sites(site_specs, backend)
    steps = gather_steps(backend, sites, organism, split, prompts_a, prompts_b, on_progress=on_progress,
                         alarms=rule.strip() == "alarm", sampled=sampled or rule.strip() == "correct")
    in_a, in_b, described = select(steps, rule, seed=settings.seed)
    result = contrast(steps.acts, steps.trace, in_a, in_b, sites, settings, rule=described, contexts=steps.text)
    return result, steps, sites
