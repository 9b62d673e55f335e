"""Steps to contrast: one row per reasoning step (the activations at the token that closes it), with what
the rules split on (its kind, its trace's correctness, its index, its source, the trace's CUSUM alarm).

- `organism_steps`: the `toy-reasoner` organism's planted traces, teacher-forced (ground truth known:
  every step's planted kind, and each trace is correct by construction unless a planted wrong
  step stays uncorrected);
- `harvest_steps`: the closed steps of a RISE harvest (`analyses.rise.harvest.Harvest`: stored
  traces of any model, labelled by its judge, correct or wrong by the task's scorer);
- `StepSet.concat`: two step sets as one (each row keeps its source: two prompt files).

Captures go through `Backend.capture_batch` with `positions` (a server ships only the step rows).
`organism_alarms` runs the CoT-entropy CUSUM detector over the organism's traces (forced-answer
entropy after every step, the detector fit on the calibration split): where each trace alarms.

Rules (`select`): `kind:reflection` (reflection steps against every other), `kind:reflection/compute`,
`correct` (steps of correct traces against wrong ones), `alarm` (after the trace's CUSUM alarm step
against before), `source:a.txt/b.txt`, `random` (two random halves of all steps, seeded: the null).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector
from analyses.organism import rise_label
from analyses.problem import Problem
from analyses.rise.harvest import HarvestSettings, generate_traces, judge_for, resolve_delimiter
from analyses.rise.labels import label_step
from probes.backend import Backend
from probes.toys.reasoner import ANSWER_SUFFIX, PROMPT_END, PROMPT_START, STEP_DELIMITER, extract_answer
from thoughtscope import checks
from thoughtscope.errors import BadInputError

RULES = ("kind:<A>[/<B>]", "correct", "alarm", "source:<A>/<B>", "random")


@dataclass
class StepSet:
    """Rows of step activations `acts[site]` [n, ...] with, per row, its trace, step index, kind, text,
    correctness and source; `alarm` maps a trace to its CUSUM alarm step (where known)."""

    acts: dict[str, torch.Tensor]
    trace: np.ndarray
    step: np.ndarray
    kind: list[str]
    text: list[str]
    correct: np.ndarray
    source: list[str]
    alarm: dict[int, int] = field(default_factory=dict)
    model_id: str = ""

    def __len__(self) -> int:
        return len(self.kind)

    def describe(self) -> dict[str, Any]:
        kinds = {k: self.kind.count(k) for k in sorted(set(self.kind))}
        return {"n_steps": len(self), "n_traces": len(np.unique(self.trace)), "sites": sorted(self.acts),
                "kinds": kinds, "sources": sorted(set(self.source)), "model_id": self.model_id,
                "n_alarms": len(self.alarm)}

    @classmethod
    def concat(cls, first: "StepSet", second: "StepSet") -> "StepSet":
        """Both sets' rows (traces renumbered apart); only the sites both hold."""
        sites = sorted(set(first.acts) & set(second.acts))
        offset = int(first.trace.max()) + 1 if len(first) else 0
        return cls({s: torch.cat([first.acts[s], second.acts[s]]) for s in sites},
                   np.concatenate([first.trace, second.trace + offset]), np.concatenate([first.step, second.step]),
                   first.kind + second.kind, first.text + second.text,
                   np.concatenate([first.correct, second.correct]), first.source + second.source,
                   {**first.alarm, **{t + offset: s for t, s in second.alarm.items()}}, first.model_id)


def check_rule(rule: str, kinds: Sequence[str] | None = None) -> None:
    """A rule's form (one of `RULES`) and, with `kinds`, the step kinds it names: checked before any step is
    read (`kind:nonsense` once surfaced as an empty set A after every trace had been generated)."""
    if not isinstance(rule, str) or not rule.strip():
        raise BadInputError(f"give a rule: one of {', '.join(RULES)}")
    name, _, arg = rule.strip().partition(":")
    if name not in {r.split(":")[0] for r in RULES}:
        raise BadInputError(f"unknown rule {rule!r}; use one of {', '.join(RULES)}")
    if name == "kind":
        a_kind, _, b_kind = arg.partition("/")
        if not a_kind:
            raise BadInputError("kind: needs a step kind, e.g. kind:reflection or kind:reflection/compute")
        unknown = [k for k in (a_kind, b_kind) if k and kinds is not None and k not in kinds]
        if unknown:
            raise BadInputError(f"no step kind {', '.join(map(repr, unknown))}; these steps are {', '.join(kinds or [])}")
    if name == "source":
        a_src, _, b_src = arg.partition("/")
        if not (a_src and b_src):
            raise BadInputError("source: needs two sources, e.g. source:a.txt/b.txt")


def select(steps: StepSet, rule: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(in A, in B, the rule described) for one of `RULES`."""
    check_rule(rule)
    name, _, arg = rule.strip().partition(":")
    n = len(steps)
    if n == 0:
        raise BadInputError("there are no stored steps to contrast: harvest some first")
    kinds = np.array(steps.kind)
    if name == "kind":
        a_kind, _, b_kind = arg.partition("/")
        in_a = kinds == a_kind
        in_b = (kinds == b_kind) if b_kind else ~in_a
        for kind, chosen in ((a_kind, in_a), (b_kind or "other", in_b)):
            if not chosen.any():  # say what the steps are (a RISE harvest of SmolLM2's arithmetic: all "other")
                counts = ", ".join(f"{k} {v:,}" for k, v in steps.describe()["kinds"].items())
                raise BadInputError(f"no step is {kind!r}: these {n:,} steps are {counts}; pick a rule that splits "
                                    "them (correct, or random for the null)")
        return in_a, in_b, {"rule": rule, "A": f"{a_kind} steps", "B": f"{b_kind} steps" if b_kind else "other steps"}
    if name == "correct":
        return steps.correct.copy(), ~steps.correct, {"rule": rule, "A": "steps of correct traces",
                                                      "B": "steps of wrong traces"}
    if name == "alarm":
        if not steps.alarm:
            raise BadInputError("these steps carry no CUSUM alarms; harvest them with the CoT-entropy detector's "
                                "alarm steps")
        alarm = np.array([steps.alarm.get(int(t), -1) for t in steps.trace])
        known = alarm >= 0
        return known & (steps.step > alarm), known & (steps.step <= alarm), {
            "rule": rule, "A": "steps after the alarm", "B": "steps up to the alarm"}
    if name == "source":
        a_src, _, b_src = arg.partition("/")
        sources = np.array(steps.source)
        return sources == a_src, sources == b_src, {"rule": rule, "A": a_src, "B": b_src}
    if name == "random":
        in_a = np.zeros(n, dtype=bool)
        in_a[np.random.default_rng(seed).permutation(n)[: n // 2]] = True
        return in_a, ~in_a, {"rule": rule, "A": "a random half of the steps", "B": "the other half", "seed": seed}
    raise BadInputError(f"unknown rule {rule!r}; use one of {', '.join(RULES)}")


def _step_rows(backend: Backend, sequences: list[list[int]], positions: list[list[int]], sites: Sequence[str],
               batch_size: int, on_progress: Callable[[int, int], None] | None) -> dict[str, torch.Tensor]:
    parts: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
    for lo in range(0, len(sequences), batch_size):
        hi = min(lo + batch_size, len(sequences))
        got = backend.capture_batch(sequences[lo:hi], list(sites), positions=positions[lo:hi])
        for s in sites:
            parts[s].append(got[s].float().cpu())
        if on_progress:
            on_progress(hi, len(sequences))
    return {s: torch.cat(v) for s, v in parts.items()}


def organism_steps(backend: Backend, problems: Sequence[Any], sites: Sequence[str], batch_size: int = 32,
                   on_progress: Callable[[int, int], None] | None = None) -> StepSet:
    """The planted traces of organism problems (`analyses.organism.organism_problems`), teacher-forced:
    one row per step, read at the delimiter token closing it."""
    if not problems:
        raise BadInputError("no problems: ask for at least 4 organism problems")
    known = {row["site"] for row in backend.sites()}
    missing = [s for s in sites if s not in known]
    if missing:
        raise BadInputError(f"{backend.info().get('model_id')} has no site {', '.join(missing)}")
    (delim,) = backend.encode(STEP_DELIMITER, add_special_tokens=False)
    sequences, positions, traces, steps, kinds, texts, correct = [], [], [], [], [], [], []
    for t, p in enumerate(problems):
        prompt = f"{PROMPT_START} {p.question} {PROMPT_END}"  # the organism's prompt (reasoner.prompt_text)
        trace = p.meta["trace"]
        ids = backend.encode(prompt + trace)
        start = len(backend.encode(prompt))
        ends = [i for i in range(start, len(ids)) if ids[i] == delim]
        planted = p.meta["kinds"]
        if len(ends) != len(planted):
            raise BadInputError(f"trace {p.id}: {len(ends)} step ends for {len(planted)} planted steps")
        pieces = trace.split(STEP_DELIMITER)
        sequences.append(ids)
        positions.append(ends)
        traces += [t] * len(ends)
        steps += list(range(len(ends)))
        kinds += planted
        texts += [piece.strip() + " " + STEP_DELIMITER for piece in pieces[:len(ends)]]
        correct += [extract_answer(trace) == str(p.answer)] * len(ends)
    acts = _step_rows(backend, sequences, positions, sites, batch_size, on_progress)
    source = problems[0].source if problems else ""
    return StepSet(acts, np.array(traces), np.array(steps), kinds, texts, np.array(correct, dtype=bool),
                   [source] * len(kinds), model_id=backend.info().get("model_id", ""))


def harvest_steps(harvest: Any) -> StepSet:
    """A RISE harvest's closed steps (every layer it read) as a step set: the same rows, at the same closing
    tokens, as `traces_steps` reads from the harvest's traces (tested equal). A harvest also holds each
    trace's unclosed last piece ("So the answer is 14 ."), which RISE's dictionary trains on; it is left out
    here, as in every other step source: in `kind:reflection` it would join the "other" set and pull the
    contrast towards answer tokens (on the organism the direction's cosine with the planted one fell from
    0.80 to 0.35 with those rows in)."""
    rows = [r for r in range(len(harvest.step_rows)) if harvest.step(r).closed and harvest.step(r).token >= 0]
    if not rows:
        raise BadInputError("the harvest has no closed step: generate longer traces or pick another step delimiter")
    at = [harvest.step_rows[r] for r in rows]
    index = torch.tensor(rows, dtype=torch.long)
    return StepSet({site: acts.index_select(0, index) for site, acts in harvest.acts.items()},
                   np.array([t for t, _ in at]), np.array([harvest.step(r).index for r in rows]),
                   [harvest.step(r).label for r in rows], [harvest.step(r).text for r in rows],
                   np.array([harvest.traces[t].correct for t, _ in at], dtype=bool),
                   [harvest.traces[t].problem.source for t, _ in at], model_id=harvest.model_id)


def traces_steps(backend: Backend, traces: Sequence[Any], sites: Sequence[str], source: str, batch_size: int = 16,
                 on_progress: Callable[[int, int], None] | None = None) -> StepSet:
    """Stored or generated traces (`analyses.rise.harvest.TraceRecord`: tokens, labelled steps, correctness)
    as a step set: one row per closed step, read at its closing token."""
    sequences, positions, rows = [], [], []
    for t, trace in enumerate(traces):
        closed = [s for s in trace.steps if s.closed and s.token >= 0]
        if not closed:
            continue
        sequences.append(list(trace.prompt_ids) + list(trace.gen_ids))
        positions.append([len(trace.prompt_ids) + s.token for s in closed])
        rows += [(t, s, trace.correct) for s in closed]
    if not rows:
        raise BadInputError(f"no trace of {source} has a closed step: generate longer traces or pick another "
                            "step delimiter")
    acts = _step_rows(backend, sequences, positions, sites, batch_size, on_progress)
    return StepSet(acts, np.array([t for t, _, _ in rows]), np.array([s.index for _, s, _ in rows]),
                   [s.label for _, s, _ in rows], [s.text for _, s, _ in rows],
                   np.array([c for _, _, c in rows], dtype=bool), [source] * len(rows),
                   model_id=backend.info().get("model_id", ""))


MIN_QUESTIONS = 4  # per set: its traces are split into development and held-out parts, two or more on each side


def questions_of(lines: Sequence[str] | None, name: str) -> list[str]:
    """The questions of a prompt file or text box (one a line, blank lines skipped), refused before any model
    work when too few to contrast (each set's traces are split by trace into development and held-out parts)."""
    questions = [q.strip() for q in (lines or []) if q and q.strip()]
    if not questions:
        raise BadInputError(f"{name} holds no question (one a line)")
    if len(questions) < MIN_QUESTIONS:
        raise BadInputError(f"{name} holds {len(questions)} question(s); a contrast splits each set's traces into "
                            f"development and held-out parts, so give at least {MIN_QUESTIONS} a set (16 or more "
                            "show more: a trace may close no step)")
    return questions


def read_questions(path: str) -> tuple[list[str], str]:
    """(the questions of a prompt file, its name), checked as `questions_of` does."""
    file = checks.user_path("prompt file", path)
    if not file.is_file():
        raise BadInputError(f"prompt file {path} does not exist (one question a line)")
    return questions_of(file.read_text(encoding="utf-8", errors="replace").splitlines(), file.name), file.name


def prompt_lines_steps(backend: Backend, lines: Sequence[str], name: str, sites: Sequence[str], max_new_tokens: int = 96,
                       on_progress: Callable[[int, int], None] | None = None) -> StepSet:
    """Generate a greedy trace for every question in `lines`, cut it into the model family's steps,
    label them with its judge and read the step rows; every row's `source` is `name`."""
    questions = questions_of(lines, name)
    model_id = backend.info()["model_id"]
    settings = HarvestSettings(max_new_tokens=max_new_tokens, prompt="auto", labeller="auto").resolved(model_id)
    delimiter = resolve_delimiter("auto", model_id)
    judge = judge_for(settings.labeller, model_id)
    problems = [Problem(f"{name}-{i}", q, "", name, 0) for i, q in enumerate(questions)]
    traces = generate_traces(backend, problems, settings, delimiter)
    for trace in traces:
        for step in trace.steps:
            step.label = label_step(step.text, judge)
    return traces_steps(backend, traces, sites, name, on_progress=on_progress)


def default_question_sets(n: int = 16, seed: int = 0) -> tuple[list[str], list[str]]:
    """Two sets of `n` one-step word problems from the seeded arithmetic generator (`analyses.tasks`): set A adds
    ("Anna has 17 shells. She wins 3 more."), set B takes away ("Anna has 17 shells. She trades away 3 shells.").
    Same seed, so the sets begin with the same names and numbers; they drift apart where the generator redraws
    a subtraction that would go below 1. What the contrast page offers on a model other than the organism
    (16 a set: two questions a set could not be split into development and held-out traces)."""
    from analyses.tasks import arithmetic_problems

    return ([p.question for p in arithmetic_problems(n, seed=seed, ops=("+",))],
            [p.question for p in arithmetic_problems(n, seed=seed, ops=("-",))])


def forced_answer_probes(backend: Any, problems: Sequence[Any], batch_size: int = 64) -> list[tuple[list[float], list[str]]]:
    """For each organism trace, the answer forced after every step (" So the answer is" appended): the
    entropy of the model's next-token distribution there and its most likely answer, per step.

    One batched pass reads the last layer's residual at the forced position; `Backend.readout` with the
    final norm over the whole vocabulary gives exactly the model's logits there."""
    arch = backend.arch()
    last = f"resid_post.{arch.n_layers - 1}"
    sequences, owner = [], []
    for t, p in enumerate(problems):
        prompt, trace, end = f"{PROMPT_START} {p.question} {PROMPT_END}", p.meta["trace"], 0
        for _ in p.meta["kinds"]:
            end = trace.index(STEP_DELIMITER, end) + len(STEP_DELIMITER)
            sequences.append(backend.encode(prompt + trace[:end] + ANSWER_SUFFIX))
            owner.append(t)
    rows = _step_rows(backend, sequences, [[len(s) - 1] for s in sequences], [last], batch_size, None)[last]
    read = backend.readout(rows, norm=True, top_k=arch.vocab_size)
    logp = read.top_logits.float().log_softmax(-1)
    entropies = (-(logp.exp() * logp).sum(-1)).tolist()
    answers = [s.strip() for s in backend.token_texts([int(i) for i in read.top_ids[:, 0]])]
    out: list[tuple[list[float], list[str]]] = [([], []) for _ in problems]
    for t, h, a in zip(owner, entropies, answers):
        out[t][0].append(float(h))
        out[t][1].append(a)
    return out


def organism_alarms(backend: Any, problems: Sequence[Any], calibration: Sequence[Any],
                    threshold: float = 2.0) -> dict[int, int]:
    """{trace index: step of its CUSUM alarm} for organism traces (`analyses.cot_entropy.detector.CusumDetector`
    fit on the forced-answer entropies of the `calibration` traces, labelled by when their answer settles)."""
    if not calibration:
        raise BadInputError("the CUSUM alarm needs calibration traces to fit its detector")
    cal = [CalibrationTrace(h, a, str(p.answer)) for p, (h, a) in zip(calibration, forced_answer_probes(backend,
                                                                                                        calibration))]
    detector = CusumDetector(threshold=threshold).fit(cal)
    alarms = {}
    for t, (h, _) in enumerate(forced_answer_probes(backend, problems)):
        at = detector.alarm_index(h)
        if at is not None:
            alarms[t] = int(at)
    return alarms


def organism_sampled_steps(backend: Backend, problems: Sequence[Any], sites: Sequence[str], temperature: float = 1.0,
                           seed: int = 0, max_new_tokens: int = 64,
                           on_progress: Callable[[int, int], None] | None = None) -> StepSet:
    """The organism's own traces of `problems`, sampled at `temperature` (seeded): steps labelled by its
    labeller (reflection / backtracking / other), traces correct or wrong by their final answer, so the
    `correct` rule has both sides."""
    settings = HarvestSettings(layers=(0,), prompt="question", labeller="toy-reasoner", temperature=temperature,
                               max_new_tokens=max_new_tokens, seed=seed)
    traces = generate_traces(backend, list(problems), settings, STEP_DELIMITER, seed=seed)
    for trace in traces:
        for step in trace.steps:
            step.label = rise_label(step.text)
    return traces_steps(backend, traces, sites, f"{problems[0].source} sampled T={temperature}" if problems else "",
                        on_progress=on_progress)
