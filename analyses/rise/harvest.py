"""RISE step-level harvest: traces cut into steps, one residual vector per step (Zhang et al., arXiv 2512.23988).

The model writes chain-of-thought traces; each trace is cut at the model family's step delimiter
(analyses.families) and one batched teacher-forced pass reads `resid_post.L` at the token that
closes each step [summary]. Traces and vectors are stored in `cache/` per trace as soon as a batch
is done, so an interrupted harvest resumes and a change of layers reruns only the reading pass.
Everything goes through the `Backend`: in this process or on the model server.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from analyses.families import family_for
from analyses.organism import rise_label
from analyses.rise.labels import LABELS, Judge, label_step
from analyses.steps import NAMED, Step, compile_delimiter, locate_step_tokens, split_steps
from analyses.tasks import SYSTEM_PROMPT, Problem, cot_prompt, is_correct, one_shot_messages
from probes.backend import Backend
from probes.sampling import Sampling  # a plain dataclass (the backend may live elsewhere)
from thoughtscope import checks
from thoughtscope.errors import BadInputError

# --------------------------------------------------------------------------- harvest


PROMPTS = ("auto", "one-shot", "cot", "chat", "question")
LABELLERS = ("auto", "keywords", "toy-reasoner")


@dataclass
class HarvestSettings:
    """How traces are made, cut and labelled. `prompt`: `auto` (the model family's), `one-shot`
    (tasks.one_shot_messages, chat), `cot` (tasks.cot_prompt, plain text), `chat` (the question and
    "Please reason step by step." as one user turn) or `question` (the bare question as one user turn,
    the organism's format). `temperature`: 0 for greedy traces, else sampled (seeded by `seed`).
    `labeller`: `auto` (the family's), `keywords` (RISE's keyword list) or `toy-reasoner` (the
    organism's own labeller); labels colour and evaluate, they never train."""

    layers: tuple[int, ...] = (15,)
    max_new_tokens: int = 96
    batch_size: int = 16
    delimiter: str = "auto"  # the model family's (analyses.families), `sentence`, `paragraph` or a regex
    prompt: str = "one-shot"
    system: str = SYSTEM_PROMPT
    augment: str = "none"  # or "templated" [recon]
    seed: int = 0
    temperature: float = 0.0
    labeller: str = "auto"

    def resolved(self, model_id: str) -> "HarvestSettings":
        """A copy with `auto` prompt and labeller replaced by the model family's."""
        family = family_for(model_id)
        return replace(self, prompt=family.prompt if self.prompt == "auto" else self.prompt,
                       labeller=family.labeller if self.labeller == "auto" else self.labeller)

    def validate(self, n_layers: int) -> None:
        if not self.layers:
            raise BadInputError("choose at least one layer, e.g. --layers 15")
        bad = [layer for layer in self.layers if not 0 <= layer < n_layers]
        if bad:
            raise BadInputError(f"layers {bad} out of range; this model has layers 0..{n_layers - 1}")
        checks.choice("prompt", self.prompt, PROMPTS)
        checks.choice("labeller", self.labeller, LABELLERS)
        checks.number("temperature", self.temperature, low=0, why="0 = greedy")
        checks.choice("augment", self.augment, ("none", "templated"))
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise BadInputError("batch_size and max_new_tokens must be positive")
        # the user's seed, before the generator's seeds are derived from it (seed * 100003 + batch start)
        checks.integer("seed", self.seed, low=0, high=checks.SEED_MAX)

    @property
    def sites(self) -> list[str]:
        return [f"resid_post.{layer}" for layer in self.layers]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceRecord:
    """One generated trace: problem, text, tokens, steps (labelled), correctness."""

    problem: Problem
    text: str
    prompt_ids: list[int]
    gen_ids: list[int]
    pieces: list[str]
    steps: list[Step]
    correct: bool
    augmented: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.gen_ids)

    def to_dict(self) -> dict[str, Any]:
        return {"problem_id": self.problem.id, "question": self.problem.question, "answer": self.problem.answer,
                "text": self.text, "n_tokens": self.n_tokens, "correct": self.correct, "augmented": self.augmented,
                "steps": [s.to_dict() for s in self.steps]}


@dataclass
class Harvest:
    """Step vectors of a problem set: `acts[site]` is [n_steps, d_model], rows in `step_rows` order."""

    model_id: str
    settings: HarvestSettings
    delimiter: str
    traces: list[TraceRecord]
    acts: dict[str, torch.Tensor]
    step_rows: list[tuple[int, int]]  # (trace index, step index) per row
    generation_seconds: float = 0.0
    harvest_seconds: float = 0.0
    n_from_cache: int = 0

    def step(self, row: int) -> Step:
        t, s = self.step_rows[row]
        return self.traces[t].steps[s]

    @property
    def labels(self) -> list[str]:
        return [self.step(r).label for r in range(len(self.step_rows))]

    def label_counts(self) -> dict[str, int]:
        counts = Counter(self.labels)
        return {label: counts.get(label, 0) for label in LABELS}

    def to_dict(self, with_traces: bool = False) -> dict[str, Any]:
        out = {
            "model_id": self.model_id, "settings": self.settings.to_dict(), "delimiter": self.delimiter,
            "n_traces": len(self.traces), "n_steps": len(self.step_rows),
            "n_augmented": sum(t.augmented for t in self.traces),
            "accuracy": float(np.mean([t.correct for t in self.traces])) if self.traces else None,
            "mean_tokens": float(np.mean([t.n_tokens for t in self.traces])) if self.traces else None,
            "mean_steps": len(self.step_rows) / max(1, len(self.traces)),
            "label_counts": self.label_counts(),
            "sites": {k: list(v.shape) for k, v in self.acts.items()},
            "generation_seconds": self.generation_seconds, "harvest_seconds": self.harvest_seconds,
            "n_from_cache": self.n_from_cache,
        }
        if with_traces:
            out["traces"] = [t.to_dict() for t in self.traces]
        return out


def build_prompt(problem: Problem, settings: HarvestSettings, model_id: str = "") -> tuple[Any, bool]:
    """(prompt, chat) for the engine (`auto` needs the model id, to find its family's prompt style)."""
    prompt = settings.prompt
    if prompt == "auto":
        prompt = family_for(model_id).prompt
    if prompt == "one-shot":
        return one_shot_messages(problem, system=settings.system), True
    if prompt == "cot" or prompt == "raw":
        return cot_prompt(problem), False
    if prompt == "question":
        return [{"role": "user", "content": problem.question}], True
    return [{"role": "user", "content": f"{problem.question}\nPlease reason step by step."}], True


def judge_for(labeller: str, model_id: str = "") -> Judge | None:
    """The step labeller as a RISE judge: None for the keyword list, the organism's own labeller for
    `toy-reasoner` (`auto`: the model family's)."""
    if labeller == "auto":
        labeller = family_for(model_id).labeller
    if labeller == "toy-reasoner":
        return rise_label
    return None


def resolve_delimiter(delimiter: str, model_id: str = "") -> str:
    """`auto` -> the model family's delimiter (analyses.families); `sentence`/`paragraph`; else a regex."""
    if delimiter == "auto":
        return family_for(model_id).step_delimiter
    compile_delimiter(delimiter)
    return NAMED.get(delimiter, delimiter)


def harvest(backend: Backend, problems: Sequence[Problem], settings: HarvestSettings | None = None,
            store: Any = None, judge: Judge | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> Harvest:
    """Generate, cut, label and read step vectors for `problems`; reuse and fill `store` (resumable).

    Each batch is stored as soon as it is done, so a rerun after an interruption only computes
    what is missing; changing the layers reuses the stored traces and reruns only the reading pass.
    `on_progress(done, total)` (problems done, of all) is called between any two model calls: after
    each decoding step of a batch's generation, after each reading pass and after each batch. `done`
    counts a batch's traces as they finish, short of the whole batch until its vectors are read. An
    exception raised by `on_progress` (a stopped job) ends the harvest before the next model call;
    what was stored before stays stored.
    """
    info = backend.info()
    settings = (settings or HarvestSettings()).resolved(info["model_id"])
    settings.validate(backend.arch().n_layers)
    judge = judge or judge_for(settings.labeller, info["model_id"])
    if not problems:
        raise BadInputError("no problems to harvest; ask for n >= 1")
    delimiter = resolve_delimiter(settings.delimiter, info["model_id"])
    keys = _StoreKeys(info["fingerprint"], settings, delimiter)
    traces: list[TraceRecord | None] = [None] * len(problems)
    vectors: list[dict[str, torch.Tensor] | None] = [None] * len(problems)
    gen_s = read_s = 0.0
    from_cache = 0
    for lo in range(0, len(problems), settings.batch_size):
        batch = list(range(lo, min(lo + settings.batch_size, len(problems))))
        todo_gen = []
        for i in batch:
            traces[i], vectors[i] = _load_cached(store, keys, problems[i], settings)
            from_cache += vectors[i] is not None
            if traces[i] is None:
                todo_gen.append(i)

        def tick(n_traced: int, lo: int = lo, batch: list[int] = batch, n_gen: int = len(todo_gen)) -> None:
            """Within a batch: its cached traces and `n_traced` of the new ones, short of the whole batch."""
            if on_progress:
                on_progress(lo + min(len(batch) - n_gen + n_traced, len(batch) - 1), len(problems))

        if todo_gen:
            started = time.perf_counter()
            made = generate_traces(backend, [problems[i] for i in todo_gen], settings, delimiter,
                                   seed=settings.seed * 100_003 + lo, on_step=tick)
            gen_s += time.perf_counter() - started
            for i, trace in zip(todo_gen, made):
                traces[i] = trace
                _store_trace(store, keys, trace)
        if settings.augment == "templated":
            for i in batch:
                if vectors[i] is None and not traces[i].augmented:
                    traces[i] = augment_trace(backend, traces[i], delimiter, seed=settings.seed * 100_003 + i)
        todo_read = [i for i in batch if vectors[i] is None]
        if todo_read:
            started = time.perf_counter()
            read = step_residuals(backend, [traces[i].prompt_ids + traces[i].gen_ids for i in todo_read],
                                  [[len(traces[i].prompt_ids) + s.token for s in traces[i].steps] for i in todo_read],
                                  settings.layers, batch_size=settings.batch_size,
                                  on_pass=lambda: tick(len(todo_gen)))
            read_s += time.perf_counter() - started
            for i, acts in zip(todo_read, read):
                vectors[i] = acts
                _store_vectors(store, keys, traces[i], acts)
        if on_progress:
            on_progress(batch[-1] + 1, len(problems))
    for trace in traces:
        for step in trace.steps:
            step.label = label_step(step.text, judge)
    acts = {site: torch.cat([v[site] for v in vectors]) for site in settings.sites}
    rows = [(t, s) for t, trace in enumerate(traces) for s in range(len(trace.steps))]
    return Harvest(info["model_id"], settings, delimiter, list(traces), acts, rows, gen_s, read_s, from_cache)


def generate_traces(backend: Backend, problems: Sequence[Problem], settings: HarvestSettings, delimiter: str,
                    interventions: Sequence[Any] = (), seed: int = 0,
                    on_step: Callable[[int], None] | None = None) -> list[TraceRecord]:
    """One batched generation (greedy, or sampled at `settings.temperature` with `seed`); each trace
    cut into steps located on its tokens.

    `on_step(n_finished)` runs once per decoding step, as its first record arrives (one model call
    made it; the next has not run), and once at the end, with the number of traces finished so far;
    an exception it raises ends the generation there (the stream is closed, the model freed) and
    propagates."""
    model_id = backend.info()["model_id"]
    prompts, chats = zip(*(build_prompt(p, settings, model_id) for p in problems))
    chat = chats[0]
    prompt_ids = [backend.encode(p, chat=chat) for p in prompts]
    eos = set(backend.eos_ids())
    ids: list[list[int]] = [[] for _ in problems]
    pieces: list[list[str]] = [[] for _ in problems]
    sampling = None
    if settings.temperature > 0:
        sampling = Sampling(temperature=settings.temperature)
    stream = backend.generate(prompts=list(prompts), max_new_tokens=settings.max_new_tokens, chat=chat,
                              interventions=interventions, sampling=sampling, seed=seed)
    n_finished, step = 0, None
    try:
        for rec in stream:
            if on_step and rec.step != step:
                on_step(n_finished)  # one model call made this step's records; the next has not run
            step = rec.step
            n_finished += bool(rec.finished)
            if rec.token_id in eos:
                continue
            ids[rec.batch_index].append(rec.token_id)
            pieces[rec.batch_index].append(rec.text)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()  # early exit (an exception from on_step): hand the model on now
    if on_step:
        on_step(n_finished)
    return [_make_trace(p, pids, gids, pcs, delimiter) for p, pids, gids, pcs in zip(problems, prompt_ids, ids, pieces)]


def _make_trace(problem: Problem, prompt_ids: list[int], gen_ids: list[int], pieces: list[str], delimiter: str,
                augmented: bool = False) -> TraceRecord:
    text = "".join(pieces)
    steps = locate_step_tokens(pieces, split_steps(text, delimiter))
    return TraceRecord(problem, text, list(prompt_ids), list(gen_ids), list(pieces), steps,
                       is_correct(text, problem), augmented)


# Generic sentences spliced into traces of models too small to reflect or backtrack [recon].
REFLECTION_TEMPLATES = (
    "Wait, let me check that again.", "Let me verify this step.", "Hold on, let me make sure that is right.",
    "Let me check: that seems right.", "Wait, I should think again about this.", "Let me make sure the numbers add up.",
)
BACKTRACKING_TEMPLATES = (
    "Alternatively, I can think differently about it.", "Another way to see this is to count on.",
    "Alternatively, let me try another approach.", "Let me use another method to solve it.",
    "Alternatively, there is another way to find the total.",
)


def augment_trace(backend: Backend, trace: TraceRecord, delimiter: str, seed: int = 0) -> TraceRecord:
    """Splice one templated reflection or backtracking sentence after a random step [recon].

    Only the embedded-model demo needs this: a 135M model never reflects on its own, so without
    it the labels have nothing to colour. The SAE still trains without labels.
    """
    if not trace.steps:
        return trace
    rng = random.Random(seed)
    template = rng.choice(REFLECTION_TEMPLATES if rng.random() < 0.5 else BACKTRACKING_TEMPLATES)
    # After a closed step (or at the start), so the template is a step of its own.
    cut = rng.choice([0] + [s.end for s in trace.steps if s.closed])
    joiner = "\n\n" if compile_delimiter(delimiter).fullmatch("\n\n") else " "
    head, rest = trace.text[:cut].rstrip(), trace.text[cut:].lstrip()
    text = (head + joiner if head else " ") + template + (joiner + rest if rest else "")
    gen_ids = backend.encode(text, add_special_tokens=False)
    return _make_trace(trace.problem, trace.prompt_ids, gen_ids, backend.token_texts(gen_ids), delimiter,
                       augmented=True)


def step_residuals(backend: Backend, sequences: Sequence[list[int]], positions: Sequence[list[int]],
                   layers: Sequence[int], batch_size: int = 16,
                   on_pass: Callable[[], None] | None = None) -> list[dict[str, torch.Tensor]]:
    """`resid_post.L` at `positions` of each token sequence: {site: [len(positions), d]} per sequence.

    One batched teacher-forced pass per `batch_size` sequences (`Backend.capture_batch`). The prefix
    all sequences share (the one-shot example, the system prompt) runs once and its state is reused;
    the pass stops after the deepest layer asked for, computes no logits, and only the rows at
    `positions` come back (a server ships a few kilobytes per trace, not every position).
    `on_pass()` runs after each model call (the shared prefix, each batch); it may raise to stop.
    """
    sites = [f"resid_post.{layer}" for layer in layers]
    shared = _shared_prefix(sequences, positions)
    # a backend without prefix states (an ndif: model) runs every sequence whole: the same values, more tokens
    reuse = shared >= 8 and backend.capabilities().get("fork", False)
    prefix = backend.prefill(list(sequences[0][:shared])) if reuse else None
    out: list[dict[str, torch.Tensor]] = []
    try:
        if prefix is not None and on_pass:
            on_pass()
        for lo in range(0, len(sequences), batch_size):
            chunk = list(range(lo, min(lo + batch_size, len(sequences))))
            captured = backend.capture_batch([sequences[i] for i in chunk], sites, prefix=prefix,
                                             positions=[list(positions[i]) for i in chunk])
            at = 0
            for i in chunk:
                k = len(positions[i])
                out.append({s: captured[s][at:at + k].float().cpu() for s in sites})
                at += k
            if on_pass:
                on_pass()
    finally:
        if prefix is not None:
            backend.free(prefix)
    return out


def _shared_prefix(sequences: Sequence[list[int]], positions: Sequence[list[int]]) -> int:
    """Length of the common token prefix, short of every position to be read."""
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for seq in sequences[1:]:
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    wanted = [p for pos in positions for p in pos]
    return min([n, *wanted]) if wanted else n


# ----- storage: one entry per trace (tokens, text) and one per (trace, layers) (step vectors)


@dataclass
class _StoreKeys:
    fingerprint: str
    settings: HarvestSettings
    delimiter: str

    def trace_settings(self) -> dict[str, Any]:
        s = self.settings
        sampling = "greedy" if s.temperature == 0 else {"temperature": s.temperature, "seed": s.seed,
                                                          "batch_size": s.batch_size}
        return {"kind": "rise-trace/v1", "max_new_tokens": s.max_new_tokens, "prompt": s.prompt,
                "system": s.system, "sampling": sampling}

    def vector_settings(self) -> dict[str, Any]:
        return {**self.trace_settings(), "kind": "rise-steps/v1", "delimiter": self.delimiter,
                "augment": self.settings.augment, "seed": self.settings.seed}

    @staticmethod
    def prompt(problem: Problem) -> str:
        return json.dumps(problem.to_dict(), sort_keys=True)


def _load_cached(store: Any, keys: _StoreKeys, problem: Problem, settings: HarvestSettings):
    if store is None:
        return None, None
    prompt = keys.prompt(problem)
    entry = store.get(keys.fingerprint, prompt, keys.vector_settings(), settings.sites)
    if entry is not None:
        return _trace_from_meta(problem, entry.meta, keys.delimiter), {s: entry.tensors[s] for s in settings.sites}
    entry = store.get(keys.fingerprint, prompt, keys.trace_settings(), [])
    if entry is None:
        return None, None
    return _trace_from_meta(problem, entry.meta, keys.delimiter), None


def _trace_from_meta(problem: Problem, meta: dict[str, Any], delimiter: str) -> TraceRecord:
    return _make_trace(problem, meta["prompt_ids"], meta["gen_ids"], meta["pieces"], delimiter,
                       augmented=meta.get("augmented", False))


def _trace_meta(trace: TraceRecord) -> dict[str, Any]:
    return {"prompt_ids": trace.prompt_ids, "gen_ids": trace.gen_ids, "pieces": trace.pieces,
            "text": trace.text, "augmented": trace.augmented}


def _store_trace(store: Any, keys: _StoreKeys, trace: TraceRecord) -> None:
    if store is not None:
        store.put(keys.fingerprint, keys.prompt(trace.problem), keys.trace_settings(), [], {}, _trace_meta(trace))


def _store_vectors(store: Any, keys: _StoreKeys, trace: TraceRecord, acts: dict[str, torch.Tensor]) -> None:
    if store is not None:
        store.put(keys.fingerprint, keys.prompt(trace.problem), keys.vector_settings(), keys.settings.sites,
                  {k: v.contiguous() for k, v in acts.items()}, _trace_meta(trace))
