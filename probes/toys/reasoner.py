"""toy-reasoner: a reasoning model organism whose behaviours have known positions (issue 11).

A small `LlamaForCausalLM` trained here, on first use, on synthetic chains of thought for multi-step
arithmetic. The generator plants four kinds of step, and records where each one is:

- `compute`: one operation, "17 + 8 = 25 ;" (a planted *wrong* compute step gets `wrong=True`);
- `reflection`: "Wait , let me check : 17 + 8 = 25 ;" re-verifies the step before it, at rate
  `REFLECTION_RATE_HARD` after a hard step (carry or borrow) and `REFLECTION_RATE_EASY` after an easy one;
- `backtrack`: after a planted wrong step (rate `BACKTRACK_RATE_HARD` / `BACKTRACK_RATE_EASY`),
  "No , that is wrong . 17 + 8 = 25 ;" rejects it and corrects it;
- `redundant`: 0-2 steps after the last computation that restate or verify a fixed answer
  ("The result is 13 ;", "Indeed 13 + 12 = 25 ;").

The *settling step* is the step that produces the final value for good (the last computation, or the
correction of a wrong last computation): before it the final answer is unknown, after it nothing can
change it. Because the rates depend on what the model computes (hardness, its own error), a direction
in the residual stream can move them, which is what RISE steering and CoT-entropy detection are
checked against.

A trace is the prompt "Q : 17 + 8 - 12 = ? A :" followed by the steps, each closed by the one-token
delimiter `STEP_DELIMITER` (";"), then `ANSWER_SUFFIX` (" So the answer is"), the answer and " .".
Training cuts `CUT_RATE` of the traces at a random step end and appends the answer marker and the
final answer, with no loss on the marker: the model learns what it would answer if forced at any step
end (high entropy before the settling step, low after, as the DESIGN.md feasibility run found) without
learning to stop early.

This is our construction (no paper): the format and rates follow the feasibility run in DESIGN.md,
except that a wrong step is off by exactly ten (with slips of one or two allowed, the model never
learned to tell its wrong steps from right ones, and its arithmetic was worse).

Measured (seed 0, one torch thread, on 2 CPU cores shared with other jobs at load average 12-20):
- `full` (4 layers, width 128, 2,000 AdamW steps of 64 traces, operands 1-30, 2-3 operations): 830
  CPU-seconds of training (46 min of wall time on the loaded machine). Greedy accuracy 0.987 on 300
  held-out eval problems. Sampled at T=1 on 200 other eval problems (2 samples each), counted by
  `label_steps`: reflection after hard steps 0.54 and after easy ones 0.10 (the generator's traces of
  the same problems: 0.60 / 0.11); a backtrack after 0.33 of its own wrong steps and 0.07 of its right
  ones. Forced-answer entropy (40 eval traces, every step end): 1.93 nats before the settling step,
  0.07 after.
- `small` (2 layers, width 64, 800 steps of 32, operands 1-9): 38 CPU-seconds; greedy accuracy 0.965.

Usage (the analyses import the format from here):
    engine = Engine.from_id("toy-reasoner:small")            # trained once, then cached
    ex = examples(1, seed=0, split="eval", config=task_config("small"))[0]
    text = "".join(r.text for r in engine.generate(ex.prompt, max_new_tokens=100))
    label_steps(text), extract_answer(text) == str(ex.answer)
    # the forced answer's entropy after the first k steps
    engine.trace(ex.prompt + ex.trace[:ex.steps[k - 1].end] + ANSWER_SUFFIX).entropies[-1]

Example:
    >>> ex = examples(1, seed=0, split="eval")[0]
    >>> label_steps(ex.trace) == [(s.text, s.kind) for s in ex.steps]
    True
    >>> extract_answer(ex.trace) == str(ex.answer)
    True
    >>> ex.trace[ex.steps[0].start:ex.steps[0].end] == ex.steps[0].text
    True
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import random
import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from probes.toys.common import ChainProblem, apply_op, read_folder, ready_folder, training, word_tokenizer
from thoughtscope.errors import BadInputError, UnknownModelError

log = logging.getLogger(__name__)

NAME = "toy-reasoner"
# Bump when the generator, the trace format or the training recipe changes: it is part of the
# cache key, so a changed organism is retrained instead of loaded stale.
GENERATOR_VERSION = 2

# ----------------------------------------------------------------------------- the trace format

STEP_DELIMITER = ";"  # one token; closes every step (in decoded text it reads " ;")
ANSWER_SUFFIX = " So the answer is"  # ends every trace before the answer; appended to force one
ANSWER_END = " ."  # follows the answer
PROMPT_START = "Q :"
PROMPT_END = "A :"
REFLECTION_PREFIX = "Wait , let me check :"
BACKTRACK_PREFIX = "No , that is wrong ."
RESTATE_PREFIX = "The result is"
VERIFY_PREFIX = "Indeed"
KINDS = ("compute", "reflection", "backtrack", "redundant")
OTHER = "other"  # what the labeller calls a step that fits no planted kind

# ----------------------------------------------------------------------------- planted rates

REFLECTION_RATE_HARD = 0.6  # P(reflection | the step before was hard: a carry or a borrow)
REFLECTION_RATE_EASY = 0.1
BACKTRACK_RATE_HARD = 0.2  # P(a wrong step, then a backtrack | the operation is hard)
BACKTRACK_RATE_EASY = 0.1
REDUNDANT_COUNTS = (0, 1, 2)  # drawn uniformly after the last computation
CUT_RATE = 0.3  # share of training traces cut at a random step end and answered at once
# A wrong result is off by ten (a dropped or doubled carry). Measured on the small config: with
# slips of 1 or 2 allowed too, the model could not tell its wrong steps from right ones
# (P("No") 0.20 vs 0.10 after them); with tens only it learned to (0.78 vs 0.03).
WRONG_OFFSETS = (-10, 10)

# Problems are assigned to splits by a hash of the problem, so the splits never share a problem
# whatever the seed: percent buckets [lo, hi).
SPLITS = {"train": (0, 80), "calibration": (80, 87), "dev": (87, 94), "eval": (94, 100)}
MAX_MISSES = 20_000  # draws without a new problem of the split: the split is used up


@dataclass(frozen=True)
class TaskConfig:
    """Which problems the generator draws: operands in [min_operand, max_operand], min_ops..max_ops
    operations (+ or -), every intermediate value in [0, max_value]."""

    min_operand: int = 1
    max_operand: int = 30
    min_ops: int = 2
    max_ops: int = 3
    max_value: int = 99


# ----------------------------------------------------------------------------- ground truth


def is_hard(a: int, op: str, b: int) -> bool:
    """A carry (units digits sum past 9) or a borrow (units digit of `a` below that of `b`)."""
    return (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)


@dataclass(frozen=True)
class Problem(ChainProblem):
    """A chained problem with toy-reasoner's key, prompt and trace."""

    @property
    def key(self) -> str:
        return self.question

    @property
    def split(self) -> str:
        bucket = int(hashlib.sha256(self.key.encode()).hexdigest()[:8], 16) % 100
        return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


@dataclass
class TraceStep:
    """One planted step: its text (delimiter included), its kind, its character span in the trace,
    whether its operation is hard, whether it is a planted wrong computation, and the running value
    it leaves."""

    index: int
    kind: str
    text: str
    start: int
    end: int
    hard: bool = False
    wrong: bool = False
    value: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Example:
    """A problem with one generated trace and its ground truth.

    `trace` is the continuation after `prompt` exactly as the model writes it (it starts with a
    space); step spans index into it. After `settle_step` the answer is fixed.
    """

    problem: Problem
    prompt: str
    trace: str
    steps: list[TraceStep]
    settle_step: int
    answer: int
    split: str

    @property
    def text(self) -> str:
        return self.prompt + self.trace

    @property
    def hard_steps(self) -> list[int]:
        """Indices of the compute and backtrack steps whose operation is hard (carry or borrow)."""
        return [s.index for s in self.steps if s.hard and s.kind in ("compute", "backtrack")]

    def counts(self) -> dict[str, int]:
        c = Counter(s.kind for s in self.steps)
        return {k: c.get(k, 0) for k in KINDS}

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.problem.question, "prompt": self.prompt, "trace": self.trace,
                "steps": [s.to_dict() for s in self.steps], "settle_step": self.settle_step,
                "answer": self.answer, "split": self.split, "hard_steps": self.hard_steps}


def prompt_text(problem: Problem) -> str:
    """The organism's prompt for a problem: "Q : 17 + 8 - 12 = ? A :"."""
    return f"{PROMPT_START} {problem.question} {PROMPT_END}"


# The chat template renders user turns in the organism's prompt format, so `chat=True` prompts (the
# problem's `question` as the user turn) give exactly the ids of `prompt_text`. System turns are
# dropped: the organism never saw one.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ 'Q : ' + m['content'] + ' ' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'A : ' + m['content'] + ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A :' }}{%- endif -%}"
)


def sample_problem(rng: random.Random, config: TaskConfig = TaskConfig()) -> Problem:
    """Draw a problem whose every intermediate value stays in [0, max_value] (rejection sampling)."""
    while True:
        n_ops = rng.randint(config.min_ops, config.max_ops)
        start = rng.randint(config.min_operand, config.max_operand)
        ops = tuple((rng.choice("+-"), rng.randint(config.min_operand, config.max_operand)) for _ in range(n_ops))
        problem = Problem(start, ops)
        if all(0 <= v <= config.max_value for v in problem.values):
            return problem


PlantedStep = tuple[str, str, bool, bool, int]  # kind, text, hard, wrong, value


def sample_trace(problem: Problem, rng: random.Random, max_value: int = 99) -> tuple[list[PlantedStep], int]:
    """Planted steps (kind, text, hard, wrong, value) for a problem, and the settling step index."""
    steps: list[PlantedStep] = []
    a = problem.start
    settle = 0
    for op, b in problem.ops:
        c = apply_op(a, op, b)
        hard = is_hard(a, op, b)
        if rng.random() < (BACKTRACK_RATE_HARD if hard else BACKTRACK_RATE_EASY):
            wrong = rng.choice([c + d for d in WRONG_OFFSETS if 0 <= c + d <= max_value])
            steps.append(("compute", f"{a} {op} {b} = {wrong} {STEP_DELIMITER}", hard, True, wrong))
            steps.append(("backtrack", f"{BACKTRACK_PREFIX} {a} {op} {b} = {c} {STEP_DELIMITER}", hard, False, c))
        else:
            steps.append(("compute", f"{a} {op} {b} = {c} {STEP_DELIMITER}", hard, False, c))
        settle = len(steps) - 1
        if rng.random() < (REFLECTION_RATE_HARD if hard else REFLECTION_RATE_EASY):
            steps.append(("reflection", f"{REFLECTION_PREFIX} {a} {op} {b} = {c} {STEP_DELIMITER}", hard, False, c))
        a_prev, a = a, c
    # Restate the answer, or check the last operation backwards; either way nothing new is computed.
    inverse = "-" if problem.ops[-1][0] == "+" else "+"
    forms = [f"{RESTATE_PREFIX} {a} {STEP_DELIMITER}",
             f"{VERIFY_PREFIX} {a} {inverse} {problem.ops[-1][1]} = {a_prev} {STEP_DELIMITER}"]
    rng.shuffle(forms)
    for text in forms[:rng.choice(REDUNDANT_COUNTS)]:
        steps.append(("redundant", text, False, False, a))
    return steps, settle


def make_example(problem: Problem, rng: random.Random, max_value: int = 99) -> Example:
    planted, settle = sample_trace(problem, rng, max_value)
    pieces, steps, at = [], [], 0
    for i, (kind, text, hard, wrong, value) in enumerate(planted):
        at += 1  # the space before the step
        steps.append(TraceStep(i, kind, text, at, at + len(text), hard, wrong, value))
        pieces.append(" " + text)
        at += len(text)
    trace = "".join(pieces) + f"{ANSWER_SUFFIX} {problem.answer}{ANSWER_END}"
    return Example(problem, prompt_text(problem), trace, steps, settle, problem.answer, problem.split)


def iter_examples(seed: int = 0, split: str = "train", config: TaskConfig = TaskConfig()) -> Iterator[Example]:
    """Endless examples of one split. Held-out splits never repeat a problem (train may), so once
    a split's few two-operation problems are used up its later examples have three operations."""
    if split not in SPLITS:
        raise BadInputError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    rng = random.Random(f"{NAME}/{split}/{seed}")
    seen: set[str] = set()
    misses = 0
    while True:
        problem = sample_problem(rng, config)
        if problem.split != split or (split != "train" and problem.key in seen):
            misses += 1
            if misses > MAX_MISSES:
                raise BadInputError(f"the {split} split of {config} holds only {len(seen)} problems; "
                                    "ask for fewer examples or widen the task config")
            continue
        misses = 0
        if split != "train":
            seen.add(problem.key)
        yield make_example(problem, rng, config.max_value)


def examples(n: int, seed: int = 0, split: str = "train", config: TaskConfig = TaskConfig()) -> list[Example]:
    """The first `n` examples of a split for a seed (so `examples(k)` is a prefix of `examples(n)`, k < n)."""
    if not isinstance(n, int) or n < 0:
        raise BadInputError(f"n must be a non-negative integer, got {n!r}")
    return list(islice(iter_examples(seed, split, config), n))


# ----------------------------------------------------------------------------- reading traces

_NUM = r"(-?\d+)"
_EQUATION = re.compile(rf"{_NUM} ([+-]) {_NUM} = {_NUM}")
_COMPUTE = re.compile(rf"^{_NUM} [+-] {_NUM} = {_NUM} {re.escape(STEP_DELIMITER)}$")
_ANSWER = re.compile(rf"{re.escape(ANSWER_SUFFIX.strip())} {_NUM}")


def step_kind(step_text: str) -> str:
    """The planted kind a step's text shows (`other` when it shows none); by its opening words."""
    text = " ".join(step_text.split())
    if text.startswith(REFLECTION_PREFIX):
        return "reflection"
    if text.startswith(BACKTRACK_PREFIX):
        return "backtrack"
    if text.startswith(RESTATE_PREFIX) or text.startswith(VERIFY_PREFIX):
        return "redundant"
    if _COMPUTE.match(text):
        return "compute"
    return OTHER


def label_steps(text: str) -> list[tuple[str, str]]:
    """Steps of a trace with their kinds: [(step text, kind)], each text ending with the delimiter.

    Reads a generated continuation (or a whole prompt + trace: everything up to the prompt's "A :"
    is skipped). The answer statement and anything after it, and an unfinished last piece without a
    delimiter, are not steps.

    >>> label_steps(" 9 + 8 = 17 ; Wait , let me check : 9 + 8 = 17 ; So the answer is 17 .")
    [('9 + 8 = 17 ;', 'compute'), ('Wait , let me check : 9 + 8 = 17 ;', 'reflection')]
    """
    _, sep, rest = text.partition(PROMPT_END)
    body = rest if sep else text
    body = body.split(ANSWER_SUFFIX.strip(), 1)[0]
    pieces = body.split(STEP_DELIMITER)[:-1]  # the last piece has no delimiter: not a step
    out = []
    for piece in pieces:
        step = " ".join(piece.split())
        if step:
            step = f"{step} {STEP_DELIMITER}"
            out.append((step, step_kind(step)))
    return out


def step_is_correct(step_text: str) -> bool | None:
    """Whether the equation in a step holds (None when the step holds no equation)."""
    match = _EQUATION.search(step_text)
    if not match:
        return None
    a, op, b, c = match.groups()
    return apply_op(int(a), op, int(b)) == int(c)


def extract_answer(text: str) -> str | None:
    """The number after the first "So the answer is" in a generation, or None.

    >>> extract_answer(" 3 + 4 = 7 ; So the answer is 7 .")
    '7'
    """
    match = _ANSWER.search(text)
    return match.group(1) if match else None


def behaviour_counts(texts: Sequence[str]) -> dict[str, float]:
    """Mean number of steps of each kind per trace (and `other`), counted by `label_steps`."""
    totals: Counter[str] = Counter()
    for text in texts:
        totals.update(kind for _, kind in label_steps(text))
    n = max(len(texts), 1)
    return {k: totals.get(k, 0) / n for k in (*KINDS, OTHER)}


def behaviour_rates(texts: Sequence[str]) -> dict[str, float]:
    """What the planted rates become in a set of traces (the model's, or the generator's own).

    `per_trace_<kind>`: steps of that kind per trace. `reflection_after_hard` / `_easy`: among steps
    that compute correctly (a compute step whose equation holds, or a backtrack's correction), the
    share followed by a reflection, split by whether the operation is hard; on generator traces they
    estimate `REFLECTION_RATE_HARD` / `_EASY`. `backtrack_after_wrong` / `_right`: among compute
    steps, the share followed by a backtrack, split by whether the equation is wrong (1 and 0 when
    planted; for the model, how often it catches its own errors and how often it rejects a right step).
    """
    counts = behaviour_counts(texts)
    tally: Counter[str] = Counter()
    for text in texts:
        steps = label_steps(text)
        for (step, kind), (_, next_kind) in zip(steps, steps[1:] + [("", "end")]):
            ok, eq = step_is_correct(step), _EQUATION.search(step)
            if kind == "compute" and ok is not None:
                key = "right" if ok else "wrong"
                tally[f"n_{key}"] += 1
                tally[f"backtrack_{key}"] += next_kind == "backtrack"
            if kind in ("compute", "backtrack") and ok:
                a, op, b, _ = eq.groups()
                key = "hard" if is_hard(int(a), op, int(b)) else "easy"
                tally[f"n_{key}"] += 1
                tally[f"reflection_{key}"] += next_kind == "reflection"
    out = {f"per_trace_{k}": v for k, v in counts.items()}
    for behaviour, given in (("reflection", "hard"), ("reflection", "easy"), ("backtrack", "wrong"),
                             ("backtrack", "right")):
        n = tally[f"n_{given}"]
        out[f"{behaviour}_after_{given}"] = tally[f"{behaviour}_{given}"] / n if n else float("nan")
        out[f"n_{given}"] = n
    return out


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelConfig:
    """The `LlamaForCausalLM` and how it is trained."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    mlp: int = 512
    context: int = 256
    steps: int = 2000
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    eval_problems: int = 300  # greedy accuracy on the eval split, written to the training report
    rate_problems: int = 150  # sampled (T=1) behaviour rates on the eval split, in the report
    # One thread: matmuls this small gain little from a second one, a busy machine made two spinning
    # OpenMP threads run a step ten times slower than one (measured), and a fixed thread count keeps
    # the weights the same on every machine. 0 keeps torch's setting.
    threads: int = 1


SIZES: dict[str, tuple[ModelConfig, TaskConfig]] = {
    "full": (ModelConfig(), TaskConfig()),
    # For the tests, under a minute (38 CPU-seconds measured): smaller numbers keep the addition
    # table small enough to learn in 800 small steps; the trace format and rates are the same.
    "small": (ModelConfig(layers=2, width=64, heads=4, mlp=256, steps=800, batch=32, lr=3e-3, warmup=30,
                          eval_problems=200, rate_problems=100),
              TaskConfig(min_operand=1, max_operand=9, min_ops=2, max_ops=3, max_value=30)),
}


def vocabulary(config: TaskConfig) -> list[str]:
    """Every word a trace of `config` can hold; each number is one token."""
    words = " ".join([PROMPT_START, PROMPT_END, "= ? + -", STEP_DELIMITER, ANSWER_SUFFIX, ANSWER_END,
                      REFLECTION_PREFIX, BACKTRACK_PREFIX, RESTATE_PREFIX, VERIFY_PREFIX]).split()
    numbers = [str(i) for i in range(config.max_value + max(WRONG_OFFSETS) + 1)]
    return list(dict.fromkeys([*words, *numbers]))


def build_tokenizer(config: TaskConfig):
    """The organism's word-level tokenizer (numbers are single tokens) with its chat template."""
    return word_tokenizer(vocabulary(config), chat_template=CHAT_TEMPLATE)


def build_model(mc: ModelConfig, vocab_size: int, tok: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=mc.width, intermediate_size=mc.mlp, num_hidden_layers=mc.layers,
        num_attention_heads=mc.heads, num_key_value_heads=mc.heads, max_position_embeddings=mc.context,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(mc.seed)
        return LlamaForCausalLM(config)


def training_sequence(example: Example, vocab: dict[str, int], eos_id: int,
                      cut_at: int | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + trace + eos, and where the loss applies (the trace, never the prompt).

    With `cut_at = k`, the trace stops after its first k steps and goes straight to the answer
    marker and the final answer; the marker carries no loss, so forcing an answer is learned but
    stopping early is not.
    """
    prompt = example.prompt.split()
    if cut_at is None:
        body, body_loss = example.trace.split(), None
    else:
        steps = " ".join(s.text for s in example.steps[:cut_at]).split()
        marker = ANSWER_SUFFIX.split()
        tail = f"{example.answer}{ANSWER_END}".split()
        body = steps + marker + tail
        body_loss = [True] * len(steps) + [False] * len(marker) + [True] * len(tail)
    ids = [vocab[w] for w in prompt + body] + [eos_id]
    loss = [False] * len(prompt) + (body_loss or [True] * len(body)) + [True]
    return ids, loss


def _batch(seqs: list[tuple[list[int], list[bool]]], pad_id: int):
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, (ids, loss) in enumerate(seqs):
        t = torch.tensor(ids)
        input_ids[b, :len(ids)] = t
        mask[b, :len(ids)] = 1
        labels[b, :len(ids)] = torch.where(torch.tensor(loss), t, torch.tensor(-100))
    return input_ids, mask, labels


def training_batches(mc: "ModelConfig", tc: TaskConfig, vocab: dict[str, int], eos_id: int,
                     pool: int = 16) -> Iterator[list[tuple[list[int], list[bool]]]]:
    """Endless training batches (seeded). `pool` batches' worth of traces are sorted by length and cut
    into batches, whose order is then shuffled: padding shrinks to a few tokens, which halves the
    cost of a step on a CPU, while each batch still mixes problems."""
    data = iter_examples(mc.seed, "train", tc)
    rng = random.Random(f"{NAME}/batches/{mc.seed}")
    while True:
        seqs = []
        for ex in islice(data, mc.batch * pool):
            cut = rng.randrange(len(ex.steps)) if rng.random() < CUT_RATE else None
            seqs.append(training_sequence(ex, vocab, eos_id, cut))
        seqs.sort(key=lambda s: len(s[0]))
        chunks = [seqs[i:i + mc.batch] for i in range(0, len(seqs), mc.batch)]
        rng.shuffle(chunks)
        yield from chunks


def train(folder: Path, mc: ModelConfig = ModelConfig(), tc: TaskConfig = TaskConfig(), progress: bool = True,
          label: str = "full", on_progress: Any = None) -> dict[str, Any]:
    """Train an organism into `folder` (safetensors + tokenizer) and return its training report:
    steps, seconds, held-out greedy accuracy and sampled behaviour rates on the eval split.

    `on_progress(done, total, message)` is called after every step, then once before the evaluation."""
    with training(mc.threads):  # fixed threads, deterministic algorithms: the same weights each run
        return _fit(folder, mc, tc, progress, label, on_progress)


def _fit(folder: Path, mc: ModelConfig, tc: TaskConfig, progress: bool, label: str,
         on_progress: Any = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    tok = build_tokenizer(tc)
    vocab = tok.get_vocab()
    model = build_model(mc, len(vocab), tok)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=mc.lr, weight_decay=mc.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        # linear warmup, then cosine decay to a tenth
        if step < mc.warmup:
            return (step + 1) / mc.warmup
        frac = (step - mc.warmup) / max(1, mc.steps - mc.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    batches = training_batches(mc, tc, vocab, tok.eos_token_id)
    t0, cpu0 = time.perf_counter(), time.process_time()
    losses: list[float] = []
    steps_done = 0
    bar = tqdm(range(mc.steps), desc=f"training {NAME}:{label}", disable=not progress, unit="step")
    for step in bar:
        seqs = next(batches)
        input_ids, mask, labels = _batch(seqs, tok.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        steps_done = step + 1
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if on_progress is not None:
            on_progress(steps_done, mc.steps, f"training {NAME}:{label}")
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    bar.close()
    model.eval()
    report: dict[str, Any] = {
        "model": NAME, "size": label, "generator_version": GENERATOR_VERSION,
        "model_config": asdict(mc), "task_config": asdict(tc),
        "steps": steps_done, "batch": mc.batch, "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "steps_per_second": round(steps_done / seconds, 2), "torch_threads": torch.get_num_threads(),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
    }
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    if on_progress is not None:
        on_progress(mc.steps, mc.steps, f"evaluating {NAME}:{label} on held-out problems")
    report.update(evaluate(model, tok, tc, mc.eval_problems, mc.rate_problems))
    return report


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def continue_batch(model: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int = 96,
                   temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Continuations of `prompts` (greedy at temperature 0, else plain sampling), decoded as the
    engine decodes them (a leading space before each word). A plain KV-cached loop, left-padded: the
    training report is written before the model exists in the zoo, so `probes.Engine` cannot run it."""
    from transformers import DynamicCache

    vocab = tok.get_vocab()
    ids = [[vocab.get(w, tok.unk_token_id) for w in p.split()] for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = [[] for _ in ids]
    done = torch.zeros(len(ids), dtype=torch.bool)
    feed = input_ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{cache_kw: cache}).logits[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen).view(-1)
        for b in range(len(ids)):
            if not done[b]:
                out[b].append(int(nxt[b]))
        done |= nxt == tok.eos_token_id
        if bool(done.all()):
            break
        feed = nxt.view(-1, 1)
        mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
    texts = []
    for row in out:
        words = [tok.convert_ids_to_tokens(i) for i in row if i != tok.eos_token_id]
        texts.append("".join(" " + w for w in words))
    return texts


def evaluate(model: Any, tok: Any, tc: TaskConfig, n_greedy: int, n_sampled: int, seed: int = 0) -> dict[str, Any]:
    """Held-out greedy accuracy and sampled (T=1) behaviour rates on the eval split, beside the
    rates planted in the generator's traces of the same problems."""
    exs = examples(max(n_greedy, n_sampled), seed=seed, split="eval", config=tc)
    greedy, sampled = [], []
    for lo in range(0, n_greedy, 100):
        greedy += continue_batch(model, tok, [ex.prompt for ex in exs[lo:min(lo + 100, n_greedy)]])
    for lo in range(0, n_sampled, 100):
        sampled += continue_batch(model, tok, [ex.prompt for ex in exs[lo:min(lo + 100, n_sampled)]],
                                  temperature=1.0, seed=seed + lo)
    correct = [extract_answer(text) == str(ex.answer) for text, ex in zip(greedy, exs)]
    sampled_correct = [extract_answer(text) == str(ex.answer) for text, ex in zip(sampled, exs)]
    return {
        "eval_split": "eval", "eval_seed": seed,
        "greedy_accuracy": round(sum(correct) / max(len(correct), 1), 4), "greedy_n": len(correct),
        "sampled_accuracy": round(sum(sampled_correct) / max(len(sampled_correct), 1), 4),
        "sampled_n": len(sampled),
        "sampled_rates": {k: round(v, 3) for k, v in behaviour_rates(sampled).items()},
        "planted_rates": {k: round(v, 3) for k, v in behaviour_rates([ex.trace for ex in exs[:n_sampled]]).items()},
    }


# ----------------------------------------------------------------------------- the zoo's entry point


def recipe(size: str) -> dict[str, Any]:
    """Everything that decides the weights: the cache folder is named by its hash."""
    mc, tc = SIZES[size]
    return {"name": NAME, "generator_version": GENERATOR_VERSION, "model": asdict(mc), "task": asdict(tc),
            "rates": [REFLECTION_RATE_HARD, REFLECTION_RATE_EASY, BACKTRACK_RATE_HARD, BACKTRACK_RATE_EASY,
                      list(REDUNDANT_COUNTS), CUT_RATE, list(WRONG_OFFSETS)], "splits": SPLITS}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise UnknownModelError(f"{NAME} comes in sizes {', '.join(SIZES)}, not {size!r}")


def folder_for(size: str = "full") -> Path:
    """Where a size's weights and training report are read from: the shipped copy
    (`docs/shipped/models`) when it verifies against this recipe, else the user-cache folder."""
    _check_size(size)
    return read_folder(NAME, size, recipe(size))


def task_config(size: str = "full") -> TaskConfig:
    """The problems a size was trained on (draw held-out examples with the same config)."""
    _check_size(size)
    return SIZES[size][1]


def train_into(size: str, folder: Path, on_progress: Any = None, progress: bool = True) -> dict[str, Any]:
    """Train a size from scratch into `folder` and return its training report (the zoo's and
    `thoughtscope models ship`'s one way to train it)."""
    _check_size(size)
    return train(folder, *SIZES[size], progress=progress, label=size, on_progress=on_progress)


def load(size: str = "full", dtype: torch.dtype = torch.float32, on_progress: Any = None):
    """The trained organism (shipped, or trained and cached on first use) and its tokenizer."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    _check_size(size)

    def _train(tmp: Path) -> dict[str, Any]:
        log.warning("thoughtscope: training %s:%s once (%s); cached afterwards", NAME, size,
                    "about 14 minutes of one CPU core" if size == "full" else "under a minute")
        return train_into(size, tmp, on_progress=on_progress)

    folder = ready_folder(NAME, size, recipe(size), _train)
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok
