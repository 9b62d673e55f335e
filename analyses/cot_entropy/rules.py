"""Stopping rules (CUSUM, DEER, Dynasor-CoT, vanilla), probed traces, and generation with a rule watching.

Baselines [recon of their papers, same probe as ours]: DEER (Yang et al. 2025) exits when the
trial answer's geometric-mean token probability exceeds 0.95 at thought-switch points, which for us
are the step ends; Dynasor-CoT (Fu et al. 2025) probes every k tokens and exits when the last m
answers agree and none holds a hesitation word.

Evaluation replays each rule on one probed trace per problem: exiting only truncates a greedy trace
and a fork leaves its state as it was, so `replay` takes the same decisions as `run_with_rule`
(a test checks this) while one generation serves every method.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector
from analyses.cot_entropy.probing import LivePrefix, Probe, probe_answer, probe_positions
from analyses.families import ModelFamily, family_for, task_prompt
from analyses.steps import StepEnd, StepSegmenter, step_ends
from analyses.tasks import Problem, extract_answer, is_correct
from probes.backend import Backend
from thoughtscope import checks
from thoughtscope.errors import BadInputError

HESITATION_WORDS = ("wait", "hmm", "but", "however", "alternatively", "maybe", "not sure", "double-check")

# ----------------------------------------------------------------------------- stopping rules


@dataclass
class StoppingRule:
    """Where a method probes (step ends and/or every k tokens) and whether a probe ends the trace."""

    name: str = "vanilla"
    probe_step_ends: bool = False
    probe_every: int | None = None

    def reset(self) -> None:
        pass

    def points_at(self, n_generated: int, new_step_ends: Sequence[int]) -> list[int]:
        """The positions to probe now that `n_generated` tokens exist and these step ends appeared."""
        points = list(new_step_ends) if self.probe_step_ends else []
        if self.probe_every and n_generated % self.probe_every == 0 and n_generated not in points:
            points.append(n_generated)
        return points

    def observe(self, probe: Probe) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass
class CusumStop(StoppingRule):
    """Exit at the CUSUM alarm on the probes' mean answer entropies (Xu et al.)."""

    detector: CusumDetector | None = None
    name: str = "cusum"
    probe_step_ends: bool = True
    statistic: list[float] = field(default_factory=list)

    def reset(self) -> None:
        if self.detector is None:
            raise BadInputError("CusumStop needs a fitted CusumDetector")
        self.detector.reset()
        self.statistic = []

    def observe(self, probe: Probe) -> bool:
        if not probe.entropies:
            return False
        s, alarm = self.detector.update(probe.mean_entropy)
        self.statistic.append(s)
        return alarm

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "h": self.detector.threshold if self.detector else None}


@dataclass
class DeerStop(StoppingRule):
    """DEER: exit at a thought switch when the trial answer's geometric-mean probability > threshold."""

    threshold: float = 0.95
    name: str = "deer"
    probe_step_ends: bool = True

    def __post_init__(self) -> None:
        # a confidence is a probability: NaN, or a threshold of 1 or more, would never exit (silently vanilla)
        self.threshold = float(checks.number("the DEER threshold", self.threshold, low=0, high=1, high_open=True,
                                             why="an answer's geometric-mean probability must exceed it"))

    def observe(self, probe: Probe) -> bool:
        return probe.answer is not None and probe.confidence > self.threshold

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threshold": self.threshold}


@dataclass
class DynasorStop(StoppingRule):
    """Dynasor-CoT: probe every k tokens; exit when the last m answers agree and none hesitates."""

    probe_every: int | None = 8
    agree: int = 2
    hesitation: tuple[str, ...] = HESITATION_WORDS
    name: str = "dynasor"
    history: list[Probe] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.probe_every or self.probe_every < 1 or self.agree < 1:
            raise BadInputError("Dynasor needs a probe interval k >= 1 and m >= 1 agreeing answers")
        self._hesitant = re.compile(r"\b(" + "|".join(map(re.escape, self.hesitation)) + r")\b", re.IGNORECASE)

    def reset(self) -> None:
        self.history = []

    def observe(self, probe: Probe) -> bool:
        self.history.append(probe)
        last = self.history[-self.agree:]
        return (len(last) == self.agree and last[0].answer is not None
                and all(p.answer == last[0].answer for p in last)
                and not any(self._hesitant.search(p.answer_text) for p in last))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "every": self.probe_every, "agree": self.agree}


# ----------------------------------------------------------------------------- traces and exits


@dataclass
class ExitResult:
    """What one stopping rule did on one problem: its answer and what it cost."""

    method: str
    problem_id: str
    answer: str | None
    target: str | None
    correct: bool | None
    exited: bool  # stopped before the model finished
    generated_tokens: int
    probe_tokens: int
    exit_token: int | None  # the probe position whose answer was emitted
    text: str
    probes: list[Probe] = field(default_factory=list)
    statistic: list[float] = field(default_factory=list)  # CUSUM only

    @property
    def tokens_with_probes(self) -> int:
        return self.generated_tokens + self.probe_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "problem_id": self.problem_id, "answer": self.answer, "target": self.target,
                "correct": self.correct, "exited": self.exited, "generated_tokens": self.generated_tokens,
                "probe_tokens": self.probe_tokens, "tokens_with_probes": self.tokens_with_probes,
                "exit_token": self.exit_token, "text": self.text,
                "probes": [p.to_dict() for p in self.probes], "statistic": list(self.statistic)}


@dataclass
class ProbedTrace:
    """A full greedy (or sampled) trace with probes at every position some rule asked for."""

    problem_id: str
    target: str | None
    token_ids: list[int]
    token_texts: list[str]
    entropies: list[float]
    step_ends: list[StepEnd]
    probes: dict[int, Probe]
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        return "".join(self.token_texts)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def final_answer(self) -> str | None:
        return extract_answer(self.text)

    def step_probes(self) -> list[Probe]:
        """Probes at the step ends seen before the model finished (the ones CUSUM would use)."""
        return [self.probes[e.boundary] for e in self.step_ends
                if e.detected_at < self.n_tokens and e.boundary in self.probes]

    def calibration(self) -> CalibrationTrace:
        probes = [p for p in self.step_probes() if p.entropies]
        return CalibrationTrace([p.mean_entropy for p in probes], [p.answer for p in probes], self.final_answer)

    def to_dict(self) -> dict[str, Any]:
        return {"problem_id": self.problem_id, "target": self.target, "text": self.text,
                "token_ids": list(self.token_ids), "token_texts": list(self.token_texts),
                "entropies": list(self.entropies), "final_answer": self.final_answer,
                "step_ends": [[e.boundary, e.detected_at] for e in self.step_ends],
                "probes": [self.probes[b].to_dict() for b in sorted(self.probes)]}


def _correct(answer: str | None, target: str | None) -> bool | None:
    return None if target is None else is_correct(answer, target)


def plan_probes(step_ends: Sequence[StepEnd], n_tokens: int, rules: Iterable[StoppingRule]) -> set[int]:
    """Every position any of `rules` would probe on a trace of `n_tokens` with these step ends."""
    detected = defaultdict(list)
    for e in step_ends:
        detected[e.detected_at].append(e.boundary)
    positions: set[int] = set()
    for rule in rules:
        for n in range(1, n_tokens):  # the last token ends the generation: nothing left to save
            positions.update(rule.points_at(n, detected.get(n, [])))
    return positions


def replay(trace: ProbedTrace, rule: StoppingRule) -> ExitResult:
    """Run `rule` on a probed trace, taking the decisions it would take while generating."""
    rule.reset()
    detected = defaultdict(list)
    for e in trace.step_ends:
        detected[e.detected_at].append(e.boundary)
    used: list[Probe] = []
    for n in range(1, trace.n_tokens):
        for b in rule.points_at(n, detected.get(n, [])):
            if b not in trace.probes:
                raise BadInputError(f"the trace was not probed at {b} tokens; probe it with this rule in the plan")
            probe = trace.probes[b]
            used.append(probe)
            if rule.observe(probe):
                return _exit(rule, trace.problem_id, trace.target, probe.answer, True, n, used,
                             "".join(trace.token_texts[:n]), b)
    return _exit(rule, trace.problem_id, trace.target, trace.final_answer, False, trace.n_tokens, used,
                 trace.text, None)


def _exit(rule, problem_id, target, answer, exited, generated, used, text, exit_token) -> ExitResult:
    return ExitResult(rule.name, problem_id, answer, target, _correct(answer, target), exited, generated,
                      sum(p.tokens_computed for p in used), exit_token, text, list(used),
                      list(getattr(rule, "statistic", [])))


def _prompt_of(problem: Problem | Any, family: ModelFamily) -> tuple[Any, bool]:
    """(prompt, chat) for a task problem in the family's prompt style; other prompts go as chat."""
    return task_prompt(problem, family) if isinstance(problem, Problem) else (problem, True)


def run_with_rule(backend: Backend, prompt: Any, rule: StoppingRule, *, family: ModelFamily | None = None,
                  max_new_tokens: int = 96, sampling: Any = None, seed: int = 0, target: str | None = None,
                  problem_id: str = "", on_event: Callable[[str, Any], None] | None = None) -> ExitResult:
    """Generate while `rule` watches: at each probe point the prefix state is extended to that step end
    (only the new tokens are computed) and forked; stop at the rule's exit.

    `prompt` is a `Problem` (prompted in the family's style), chat messages or text (rendered as chat).
    `on_event("token", record)` / `on_event("probe", probe)` lets a page draw while it runs.
    """
    family = family or family_for(backend)
    if isinstance(prompt, Problem):
        target, problem_id = target or prompt.answer, problem_id or prompt.id
    rule.reset()
    messages, chat = _prompt_of(prompt, family)
    live = LivePrefix(backend, backend.encode(messages, chat=chat))
    stream = backend.generate(messages, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
                              top_k=0)
    segmenter = StepSegmenter(family.step_delimiter)
    texts: list[str] = []
    ids: list[int] = []
    used: list[Probe] = []
    try:
        for rec in stream:
            texts.append(rec.text)
            ids.append(rec.token_id)
            new_ends = segmenter.push(rec.text)
            if on_event:
                on_event("token", rec)
            if rec.finished:
                break
            for b in rule.points_at(len(texts), new_ends):
                probe = probe_answer(backend, live.at(ids[:b]), family, b)
                used.append(probe)
                if on_event:
                    on_event("probe", probe)
                if rule.observe(probe):
                    return _exit(rule, problem_id, target, probe.answer, True, len(texts), used, "".join(texts), b)
    finally:
        stream.close()
        live.close()
    text = "".join(texts)
    return _exit(rule, problem_id, target, extract_answer(text), False, len(texts), used, text, None)


def generate_with_early_exit(backend: Backend, problem: Problem | Any, detector: CusumDetector, *,
                             family: ModelFamily | None = None, max_new_tokens: int = 96, sampling: Any = None,
                             seed: int = 0, on_event: Callable[[str, Any], None] | None = None) -> ExitResult:
    """Generate with CUSUM watching the step-end probes; at the alarm, stop and emit that probe's answer."""
    return run_with_rule(backend, problem, CusumStop(detector=detector, name=f"cusum h={detector.threshold:g}"),
                         family=family, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         on_event=on_event)


def _trace_from_records(backend: Backend, prompt_ids, records, family, rules, problem_id, target,
                        between=None) -> ProbedTrace:
    texts = [r.text for r in records]
    ids = [r.token_id for r in records]
    ends = step_ends(texts, family.step_delimiter)
    probes = probe_positions(backend, prompt_ids, ids, plan_probes(ends, len(ids), rules), family, between=between)
    return ProbedTrace(problem_id, target, ids, texts, [float(r.entropy) for r in records], ends, probes,
                       list(prompt_ids))


def probe_traces(backend: Backend, problems: Sequence[Problem], family: ModelFamily, rules: Sequence[StoppingRule], *,
                 max_new_tokens: int = 96, sampling: Any = None, seed: int = 0, n_samples: int = 1,
                 batch_size: int = 8, on_progress: Callable[[int, int], None] | None = None,
                 runner: Any = None) -> list[ProbedTrace]:
    """Generate every problem's trace(s) in batches, then probe each where any of `rules` would.

    Returns `n_samples` traces per problem, problem by problem; `on_progress(done, total)` after each,
    and again (same counts) after every decoding step of a batch and before every probe, so a job's
    Stop (raised from the callback) ends the work within one model call. With a `runner`
    (`analyses.distributed.RayRunner`) the same batches, with the same seeds, run on its model replicas
    and `on_progress` follows finished batches: the traces are those of the serial run.
    """
    if not problems:
        raise BadInputError("no problems to run")
    checks.integer("batch_size", batch_size, low=1)
    total = len(problems) * n_samples
    per_batch = max(1, batch_size // n_samples)
    batches = [(list(problems[start:start + per_batch]), seed + start) for start in range(0, len(problems), per_batch)]
    settings = dict(family=family, rules=list(rules), max_new_tokens=max_new_tokens, sampling=sampling,
                    n_samples=n_samples)
    if runner is not None:
        done = runner.map(partial(probe_batch, **settings), batches, weights=[len(b) * n_samples for b, _ in batches],
                          on_progress=on_progress)
        return [trace for traces in done for trace in traces]
    out: list[ProbedTrace] = []
    between = (lambda: on_progress(len(out), total)) if on_progress else None
    for batch in batches:
        probe_batch(backend, batch, **settings, out=out, between=between)
    return out


def probe_batch(backend: Backend, batch: tuple[list[Problem], int], *, family: ModelFamily,
                rules: Sequence[StoppingRule], max_new_tokens: int, sampling: Any, n_samples: int,
                out: list[ProbedTrace] | None = None, between: Callable[[], None] | None = None) -> list[ProbedTrace]:
    """One batch of `probe_traces`: (problems, seed) -> their probed traces, appended to `out`;
    `between()` after every decoding step, before every probe and after every trace."""
    chunk, batch_seed = batch
    out = [] if out is None else out
    prompts = [_prompt_of(p, family) for p in chunk]
    chat = prompts[0][1]
    by_index: dict[int, list[Any]] = defaultdict(list)
    stream = backend.generate(prompts=[p for p, _ in prompts], n_samples=n_samples, max_new_tokens=max_new_tokens,
                              sampling=sampling, seed=batch_seed, chat=chat, top_k=0)
    rows = len(chunk) * n_samples
    try:
        for count, rec in enumerate(stream, 1):
            by_index[rec.batch_index].append(rec)
            if between and count % rows == 0:
                between()
    finally:  # a Stop raised mid-stream ends the generation here, in this thread (it holds the engine's lock)
        if hasattr(stream, "close"):
            stream.close()
    for i, problem in enumerate(chunk):
        prompt_ids = backend.encode(prompts[i][0], chat=chat)
        for s in range(n_samples):
            out.append(_trace_from_records(backend, prompt_ids, by_index[i * n_samples + s], family, rules,
                                           problem.id, problem.answer, between=between))
            if between:
                between()
    return out
