"""Reasoning tasks with checkable answers: problem sets, prompts, answer extraction and scoring.

Four sources of problems:

- seeded arithmetic word problems (one or two steps), easy enough that the embedded
  SmolLM2-135M gets about half of the one-step ones right, so its traces contain both
  successes and failures to analyse;
- the GSM8K test set (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems",
  MIT licence, shipped in ``analyses/data``), real but hard for small models;
- the `toy-reasoner` organism's generator (``toy-reasoner``, ``toy-reasoner:small``, see
  ``analyses.organism``), whose calibration / dev / eval splits are disjoint by construction and
  whose problems carry their planted ground truth;
- a problem file of the user's (``PATH.jsonl``): one JSON object a line with a ``question`` and a numeric
  ``answer`` (GSM8K's ``"... #### 18"`` solutions are read as the number after ``####``). The command line
  names it by its content too (``canonical_task``: ``PATH.jsonl#sha256=<12 hex>``), so a result keyed by the
  task is never reused for a file that has changed since.

``load_splits`` gives the calibration / development / evaluation parts of a task the evaluation
protocol asks for (``analyses.evaluation``): the organism's own splits, or a seeded three-way cut of
a pool for the other tasks.

Scoring is exact match on a normalised number (``extract_answer`` / ``is_correct``), and
sampling-based accuracy uses the unbiased pass@k estimator of Chen et al. 2021
("Evaluating Large Language Models Trained on Code").

>>> problems = load_task("arith", n=3, seed=0)
>>> [p.id for p in problems]
['arith1-s0-0000', 'arith1-s0-0001', 'arith1-s0-0002']
>>> is_correct(f"... so the total is {problems[0].answer}. The answer is {problems[0].answer}.", problems[0])
True
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from importlib.resources import files
from pathlib import Path
from typing import Any

from analyses.evaluation import Splits, mean_pass_at_k, pass_at_k, split_three
from analyses.organism import organism_problems, size_of
from analyses.problem import Problem
from thoughtscope import checks
from thoughtscope.errors import BadInputError

TASK_NAMES = ("arith", "arith2", "arith-mixed", "gsm8k", "toy-reasoner", "toy-reasoner:small")
ORGANISM_TASKS = ("toy-reasoner", "toy-reasoner:small")

GSM8K_FILE = "gsm8k_test.jsonl"
TASK_FILE_SUFFIX = ".jsonl"  # a task name ending so (optionally with DIGEST_MARK + hex) is the user's problem file
DIGEST_MARK = "#sha256="
MAX_TASK_FILE_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------- arithmetic

_NAMES = (
    ("Tom", "he"), ("Sara", "she"), ("Ben", "he"), ("Lily", "she"), ("Omar", "he"),
    ("Mia", "she"), ("Jack", "he"), ("Emma", "she"), ("Ravi", "he"), ("Zoe", "she"),
    ("Leo", "he"), ("Anna", "she"), ("Sam", "he"), ("Nina", "she"), ("Carlos", "he"),
    ("Grace", "she"),
)
_OBJECTS = (
    "apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "shells",
    "cards", "balloons", "stamps", "toy cars", "flowers", "eggs", "beads", "crayons",
)
# Verb phrases without a subject, so the same phrase opens a sentence ("She buys ...") or
# follows "Then she ...". Every loss phrase names the object so the sentence reads alone.
_GAIN_PHRASES = (
    "buys {n} more",
    "finds {n} more",
    "picks up {n} more",
    "gets {n} more from a friend",
    "wins {n} more",
    "is given {n} more",
)
_LOSS_PHRASES = (
    "gives {n} {obj} to a friend",
    "loses {n} {obj}",
    "sells {n} {obj}",
    "gives away {n} {obj}",
    "trades away {n} {obj}",
    "uses {n} {obj}",
)
_ARITH_OPS = ("+", "-")
_MIN_OPERAND, _MAX_OPERAND = 2, 50


def arithmetic_problems(
    n: int, steps: int = 1, seed: int = 0, ops: Sequence[str] = _ARITH_OPS
) -> list[Problem]:
    """`n` distinct templated word problems of `steps` (1 or 2) additions/subtractions.

    Operands are 2-50 and every running total stays at least 1, so no subtraction goes
    negative. The same `(n, steps, seed, ops)` always gives the same problems, and the first
    `m` problems of a longer list equal the list of length `m`.

    >>> p = arithmetic_problems(1, steps=1, seed=0)[0]
    >>> p.id, p.source, p.steps
    ('arith1-s0-0000', 'arith1', 1)
    >>> arithmetic_problems(2, seed=3) == arithmetic_problems(2, seed=3)
    True
    """
    _check_count(n)
    if steps not in (1, 2):
        raise BadInputError(f"steps must be 1 or 2, got {steps!r}.")
    ops = _check_ops(ops)
    rng = random.Random(f"arith{steps}-{seed}")
    return _distinct_problems(n, rng, lambda i: f"arith{steps}-s{seed}-{i:04d}", lambda: steps, ops)


def mixed_arithmetic(n: int, seed: int = 0, ops: Sequence[str] = _ARITH_OPS) -> list[Problem]:
    """`n` arithmetic problems, each one- or two-step with equal chance (seeded).

    >>> sorted({p.steps for p in mixed_arithmetic(40, seed=0)})
    [1, 2]
    """
    _check_count(n)
    ops = _check_ops(ops)
    rng = random.Random(f"arith-mixed-{seed}")
    return _distinct_problems(
        n, rng, lambda i: f"arithmix-s{seed}-{i:04d}", lambda: rng.choice((1, 2)), ops
    )


def _distinct_problems(n, rng, make_id, pick_steps, ops) -> list[Problem]:
    # Duplicates would leak between calibration and evaluation splits, so redraw them.
    problems: list[Problem] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(problems) == n:
            return problems
        problem = _arithmetic_problem(rng, make_id(len(problems)), pick_steps(), ops)
        if problem.question not in seen:
            seen.add(problem.question)
            problems.append(problem)
    if len(problems) == n:
        return problems
    raise BadInputError(f"Could not make {n} distinct arithmetic problems; ask for fewer.")


def _arithmetic_problem(rng: random.Random, problem_id: str, steps: int, ops) -> Problem:
    chosen_ops, operands = _draw_chain(rng, steps, ops)
    name, pronoun = rng.choice(_NAMES)
    obj = rng.choice(_OBJECTS)
    sentences = [f"{name} has {operands[0]} {obj}."]
    for step, (op, number) in enumerate(zip(chosen_ops, operands[1:])):
        phrase = rng.choice(_GAIN_PHRASES if op == "+" else _LOSS_PHRASES).format(n=number, obj=obj)
        subject = pronoun.capitalize() if step == 0 else f"Then {pronoun}"
        sentences.append(f"{subject} {phrase}.")
    sentences.append(f"How many {obj} does {name} have now?")
    return Problem(
        id=problem_id,
        question=" ".join(sentences),
        answer=str(_apply_chain(operands, chosen_ops)),
        source=f"arith{steps}",
        steps=steps,
        meta={"operands": list(operands), "ops": list(chosen_ops)},
    )


def _draw_chain(rng: random.Random, steps: int, ops) -> tuple[list[str], list[int]]:
    # Rejection sampling keeps every operand uniform on 2-50 among the chains whose running
    # total never drops below 1; even with ops=("-",) about one draw in six is kept.
    while True:
        chosen_ops = [rng.choice(ops) for _ in range(steps)]
        operands = [rng.randint(_MIN_OPERAND, _MAX_OPERAND) for _ in range(steps + 1)]
        totals = [_apply_chain(operands[: i + 2], chosen_ops[: i + 1]) for i in range(steps)]
        if min(totals) >= 1:
            return chosen_ops, operands


def _apply_chain(operands: Sequence[int], ops: Sequence[str]) -> int:
    total = operands[0]
    for op, number in zip(ops, operands[1:]):
        total = total + number if op == "+" else total - number
    return total


def known_answer(question: str) -> str | None:
    """The answer of a question this module's generators write (an arithmetic word problem read back
    with the generator's own phrase tables, or a GSM8K test question), else None.

    >>> known_answer("Anna has 17 shells. She wins 3 more. How many shells does Anna have now?")
    '20'
    >>> p = arithmetic_problems(3, steps=2, seed=5)[2]
    >>> known_answer(p.question) == p.answer
    True
    >>> known_answer("What is the capital of France?") is None
    True
    """
    text = " ".join(str(question).split())
    names = "|".join(re.escape(n) for n, _ in _NAMES)
    objects = "|".join(re.escape(o) for o in _OBJECTS)
    head = re.match(rf"^({names}) has (\d+) ({objects})\. (.*) How many \3 does \1 have now\?$", text)
    if head:
        total = int(head.group(2))
        obj = head.group(3)
        pronoun = dict(_NAMES)[head.group(1)]
        phrases = [(re.escape(p).replace(re.escape("{n}"), r"(\d+)").replace(re.escape("{obj}"), re.escape(obj)), op)
                   for op, table in (("+", _GAIN_PHRASES), ("-", _LOSS_PHRASES)) for p in table]
        sentences = [s for s in head.group(4).split(". ") if s]
        for step, sentence in enumerate(sentences):
            subject = pronoun.capitalize() if step == 0 else f"Then {pronoun}"
            body = sentence.rstrip(".")
            if not body.startswith(subject + " "):
                return None
            body = body[len(subject) + 1:]
            match = next(((m, op) for pattern, op in phrases if (m := re.fullmatch(pattern, body))), None)
            if match is None:
                return None
            number = int(match[0].group(1))
            total = total + number if match[1] == "+" else total - number
        return str(total) if sentences else None
    for problem in load_gsm8k():
        if " ".join(problem.question.split()) == text:
            return problem.answer
    return None


def _check_ops(ops: Sequence[str]) -> tuple[str, ...]:
    ops = tuple(ops)
    if not ops or any(op not in _ARITH_OPS for op in ops):
        raise BadInputError(f"ops must be a non-empty choice from {_ARITH_OPS}, got {ops!r}.")
    return ops


def _check_count(n: Any) -> None:
    checks.integer("the number of problems", n, low=1)


# --------------------------------------------------------------------------- GSM8K


def load_gsm8k(n: int | None = None, seed: int | None = None) -> list[Problem]:
    """The GSM8K test set (1,319 problems) from the copy shipped in ``analyses.data``.

    Ids follow the file order (``gsm8k-0000`` is the first line) whatever the shuffle, so a
    problem keeps its id. With a `seed` the problems are shuffled first; `n` keeps the first
    `n`. `steps` is the number of lines in the reference solution.

    >>> load_gsm8k(1)[0].answer
    '18'
    """
    problems = [_gsm8k_problem(i, line) for i, line in enumerate(_gsm8k_lines())]
    if seed is not None:
        random.Random(seed).shuffle(problems)
    if n is None:
        return problems
    _check_count(n)
    if n > len(problems):
        raise BadInputError(
            f"GSM8K has {len(problems)} test problems; ask for at most that many (or n=None)."
        )
    return problems[:n]


def _gsm8k_lines() -> list[str]:
    text = files("analyses.data").joinpath(GSM8K_FILE).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _gsm8k_problem(index: int, line: str) -> Problem:
    row = json.loads(line)
    solution, _, final = row["answer"].rpartition("####")
    return Problem(
        id=f"gsm8k-{index:04d}",
        question=row["question"],
        answer=normalize_answer(final) or final.strip(),
        source="gsm8k",
        steps=len(solution.strip().splitlines()),
        meta={"solution": solution.strip()},
    )


# --------------------------------------------------------------------------- the user's problem file


def is_task_file(name: Any) -> bool:
    """Whether a task name is a problem file (``PATH.jsonl``, with or without its digest)."""
    return isinstance(name, str) and name.partition(DIGEST_MARK)[0].endswith(TASK_FILE_SUFFIX)


def task_label(name: Any) -> str:
    """A task's name as a figure's title shows it: a problem file by its file name (with its digest when the name
    does not hold it), since the full path would fill the title; provenance keeps the full name.

    >>> task_label("/home/me/.cache/problems/six-e2953bbe3166.jsonl#sha256=e2953bbe3166"), task_label("gsm8k")
    ('six-e2953bbe3166.jsonl', 'gsm8k')
    >>> task_label("runs/mine.jsonl#sha256=e2953bbe3166")
    'mine.jsonl (sha256 e2953bbe3166)'
    """
    if not is_task_file(name):
        return str(name)
    path, _, digest = name.partition(DIGEST_MARK)
    file = Path(path).name
    return file if not digest or digest in file else f"{file} (sha256 {digest})"


def _task_file_bytes(path: str) -> bytes:
    file = checks.user_path("problem file", path)
    if not file.is_file():
        raise BadInputError(f"no problem file {path!r}: a task is one of {', '.join(TASK_NAMES)} or a .jsonl file")
    if file.stat().st_size > MAX_TASK_FILE_BYTES:
        raise BadInputError(f"{path} has {file.stat().st_size:,} bytes; a problem file may have at most "
                            f"{MAX_TASK_FILE_BYTES:,}")
    try:
        return file.read_bytes()
    except OSError as err:
        raise BadInputError(f"cannot read {path}: {err}") from err


def canonical_task(name: str) -> str:
    """A task name as results are keyed by it: a problem file with its content's digest
    (``PATH.jsonl#sha256=<first 12 hex>``; the file is read and checked here), any other name unchanged.
    The command line's ``--task`` options pass through it."""
    if not is_task_file(name):
        return name
    path = name.partition(DIGEST_MARK)[0]
    data = _task_file_bytes(path)
    _file_problems(path, data)  # a malformed file is refused before any model work
    return f"{path}{DIGEST_MARK}{hashlib.sha256(data).hexdigest()[:12]}"


def store_problem_file(data: bytes, name: str = "problems.jsonl", folder: Path | None = None) -> str:
    """An uploaded problem file (its bytes), checked line by line and kept in `folder` (default: the user
    cache's `problems/`) under its digest, as the task name a run uses (`canonical_task`)."""
    from probes.paths import user_cache_dir

    if len(data) > MAX_TASK_FILE_BYTES:
        raise BadInputError(f"the file has {len(data):,} bytes; a problem file may have at most {MAX_TASK_FILE_BYTES:,}")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(name)).name).removesuffix(TASK_FILE_SUFFIX)[:60] or "problems"
    digest = hashlib.sha256(data).hexdigest()[:12]
    target = (folder or user_cache_dir() / "problems") / f"{stem}-{digest}{TASK_FILE_SUFFIX}"
    if not target.is_file():  # kept only once checked; a page's reruns find it and check nothing again
        _file_problems(f"{stem}{TASK_FILE_SUFFIX}", bytes(data))  # refused, naming the line, before it is kept
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(target)  # whole or absent: a page run never reads half a file
    return f"{target}{DIGEST_MARK}{digest}"


def task_size(name: str) -> int | None:
    """How many problems a task holds: a problem file's count, GSM8K's 1,319; None for the generated tasks. A
    name with its digest is counted once per process (the pages ask on every rerun; the digest fixes the
    content)."""
    if is_task_file(name):
        if DIGEST_MARK in name:
            return _digest_named_size(name)
        path = name.partition(DIGEST_MARK)[0]
        return len(_file_problems(path, _task_file_bytes(path)))
    return len(_gsm8k_lines()) if name == "gsm8k" else None


@functools.lru_cache(maxsize=32)
def _digest_named_size(name: str) -> int:
    return len(_checked_problems(name))


def load_task_file(name: str, n: int, seed: int | None = 0) -> list[Problem]:
    """`n` problems of a problem file (shuffled by `seed` first, as GSM8K's; ids follow the file's order). A
    name with a digest is checked against the file's content: a file changed since is refused."""
    _check_count(n)
    problems = _checked_problems(name)
    path = name.partition(DIGEST_MARK)[0]
    if seed is not None:
        random.Random(seed).shuffle(problems)
    if n > len(problems):
        raise BadInputError(f"{path} holds {len(problems)} problems; ask for at most that many")
    return problems[:n]


def _checked_problems(name: str) -> list[Problem]:
    """Every problem of a problem file, in file order; a name with a digest is checked against the content."""
    path, _, digest = name.partition(DIGEST_MARK)
    data = _task_file_bytes(path)
    now = hashlib.sha256(data).hexdigest()
    if digest and not now.startswith(digest):
        raise BadInputError(f"{path} has changed since this run was set up (sha256 {digest}..., now {now[:12]}...): "
                            "start it again to use the new problems")
    return _file_problems(path, data)


def _file_problems(path: str, data: bytes) -> list[Problem]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInputError(f"{path} is not UTF-8 text ({err})") from err
    stem = Path(path).name.removesuffix(TASK_FILE_SUFFIX)
    problems: list[Problem] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: arrays nested past Python's stack
            why = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
            raise BadInputError(f"{where} is not JSON ({why}): a problem file holds one JSON object a line") from err
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise BadInputError(f'{where}: each line is an object with a "question" (text) and an "answer" (a number)')
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise BadInputError(f'{where}: "answer" is a number or text ending in one (GSM8K\'s "... #### 18"), '
                                f"not {type(answer).__name__}")
        solution, _, final = str(answer).rpartition("####")
        value = normalize_answer(final.strip())
        if value is None:
            raise BadInputError(f"{where}: the answer {final.strip()!r} is not a number (answers are scored by exact "
                                "match on a number)")
        problems.append(Problem(id=f"{stem}-{len(problems):04d}", question=row["question"], answer=value,
                                source=stem, steps=max(1, len(solution.strip().splitlines())),
                                meta={"solution": solution.strip()} if solution.strip() else {}))
    if not problems:
        raise BadInputError(f"{path} holds no problem")
    return problems


# --------------------------------------------------------------------------- task registry


def load_task(name: str, n: int, seed: int = 0, split: str = "eval") -> list[Problem]:
    """`n` problems of the task `name` (one of ``TASK_NAMES``, or a problem file), chosen by `seed`.

    `split` only matters for the organism's tasks, which draw from the generator's own split
    (calibration, dev or eval; never the problems the organism was trained on).

    >>> len(load_task("arith-mixed", 5))
    5
    >>> load_task("gsm8k", 1, seed=None)[0].id
    'gsm8k-0000'
    >>> load_task("toy-reasoner:small", 1, split="dev")[0].id
    'toy-reasoner-dev-s0-0000'
    """
    _check_count(n)
    if name in ORGANISM_TASKS:
        return organism_problems(n, split=split, seed=seed, size=size_of(name))
    if name == "arith":
        return arithmetic_problems(n, steps=1, seed=seed)
    if name == "arith2":
        return arithmetic_problems(n, steps=2, seed=seed)
    if name == "arith-mixed":
        return mixed_arithmetic(n, seed=seed)
    if name == "gsm8k":
        return load_gsm8k(n, seed=seed)
    if is_task_file(name):
        return load_task_file(name, n, seed=seed)
    raise BadInputError(f"Unknown task {name!r}; choose one of: {', '.join(TASK_NAMES)}, or a .jsonl problem file.")


def load_splits(name: str, n_calibration: int, n_development: int, n_evaluation: int, seed: int = 0):
    """Disjoint calibration / development / evaluation problems of a task (`analyses.evaluation.Splits`).

    The organism's tasks draw each part from the generator's own split; the other tasks load one
    pool of `n_calibration + n_development + n_evaluation` problems and cut it three ways (seeded).

    >>> load_splits("arith", 2, 3, 5, seed=0).sizes()
    {'calibration': 2, 'development': 3, 'evaluation': 5}
    """
    if name in ORGANISM_TASKS:
        parts = [load_task(name, k, seed=seed, split=split) if k else []
                 for k, split in ((n_calibration, "calibration"), (n_development, "dev"), (n_evaluation, "eval"))]
        return Splits(*parts, seed=seed)
    total = n_calibration + n_development + n_evaluation
    return split_three(load_task(name, total, seed=seed), n_calibration, n_development, n_evaluation, seed=seed)


def split_problems(
    problems: Sequence[Problem], n_calibration: int | float = 0.5, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Split into disjoint (calibration, evaluation) lists, each keeping the input order.

    `n_calibration` is a count, or a fraction in (0, 1) of the problems. Methods that fit a
    threshold or a probe fit it on the calibration part and report on the evaluation part,
    so the two must never share a problem; duplicate ids are refused for that reason.

    >>> calibration, evaluation = split_problems(load_task("arith", 10), 0.3, seed=1)
    >>> len(calibration), len(evaluation)
    (3, 7)
    """
    problems = list(problems)
    if len({p.id for p in problems}) != len(problems):
        raise BadInputError("Problems to split have duplicate ids; remove the duplicates first.")
    size = _calibration_size(n_calibration, len(problems))
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    chosen = set(order[:size])
    calibration = [p for i, p in enumerate(problems) if i in chosen]
    evaluation = [p for i, p in enumerate(problems) if i not in chosen]
    return calibration, evaluation


def _calibration_size(n_calibration: int | float, total: int) -> int:
    if isinstance(n_calibration, float):
        size = round(checks.number("a calibration fraction", n_calibration, low=0, high=1, low_open=True,
                                   high_open=True) * total)
    else:
        size = checks.integer("n_calibration", n_calibration, why="a count, or a fraction in (0, 1) as a float")
    if not 0 < size < total:
        raise BadInputError(
            f"Both parts need at least one problem: {size} of {total} problems for calibration; "
            "give more problems or change n_calibration."
        )
    return size


# --------------------------------------------------------------------------- prompts

SYSTEM_PROMPT = "Solve the problem step by step. End with 'The answer is N.'"

# One worked example per difficulty: the embedded model copies the example's shape, so a
# two-step example shows it how to chain two operations. Both end in 17 so the final line
# looks the same.
_ONE_STEP_EXAMPLE = (
    "Sara has 9 pencils. She buys 8 more. How many pencils does Sara have now?",
    "Sara starts with 9 pencils. She buys 8 more, so 9 + 8 = 17. The answer is 17.",
)
_TWO_STEP_EXAMPLE = (
    "Ben has 20 marbles. He gives 6 marbles to a friend. Then he finds 3 more. "
    "How many marbles does Ben have now?",
    "Ben starts with 20 marbles. He gives away 6, so 20 - 6 = 14. "
    "Then he finds 3 more, so 14 + 3 = 17. The answer is 17.",
)


def one_shot_messages(problem: Problem | str, system: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages: instructions, one worked example, then the problem.

    This prompt shape gave the embedded SmolLM2-135M about 50% greedy accuracy on one-step
    problems (a bare "think step by step" prompt about 26%).

    >>> [m["role"] for m in one_shot_messages(load_task("arith", 1)[0])]
    ['system', 'user', 'assistant', 'user']
    """
    question, steps = _question_and_steps(problem)
    example_question, example_answer = _ONE_STEP_EXAMPLE if steps <= 1 else _TWO_STEP_EXAMPLE
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": example_question},
        {"role": "assistant", "content": example_answer},
        {"role": "user", "content": question},
    ]


def cot_prompt(problem: Problem | str) -> str:
    """A bare zero-shot chain-of-thought prompt (Kojima et al. 2022), as plain text.

    >>> cot_prompt("What is 2 + 3?")
    "Question: What is 2 + 3?\\nAnswer: Let's think step by step."
    """
    question, _ = _question_and_steps(problem)
    return f"Question: {question}\nAnswer: Let's think step by step."


def _question_and_steps(problem: Problem | str) -> tuple[str, int]:
    if isinstance(problem, Problem):
        return problem.question, problem.steps
    if isinstance(problem, str) and problem.strip():
        return problem.strip(), 1
    raise BadInputError("A prompt needs a Problem or a non-empty question string.")


# --------------------------------------------------------------------------- answers

# A number: optional sign and dollar sign, digits with thousands commas, optional decimals.
# The look-behind keeps "5-3" from reading as "-3" and "v2" from reading as "2".
_NUMBER = r"(?<![\w.])-?(?:\$\s?)?-?\d[\d,]*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# Explicit answer markers, most trusted first. Each takes its first occurrence: small models
# often go on to invent a new question after answering, and the first answer is theirs.
_ANSWER_MARKERS = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"answer is\s*:?\s*\**\s*(" + _NUMBER + ")",
        r"\\boxed\{\s*(?:\\\$)?(" + _NUMBER + r")\s*\}",
        r"####\s*(" + _NUMBER + ")",
        r"answer\s*:\s*\**\s*(" + _NUMBER + ")",
    )
)


def extract_answer(text: str) -> str | None:
    """The normalised numeric answer in free text, or None when it holds no number.

    An explicit marker ("The answer is X", "\\boxed{X}", "#### X", "Answer: X") wins;
    otherwise the last number in the text is taken. Pass only the model's continuation, not
    the prompt: a one-shot example's "The answer is 17." would otherwise be read first.

    >>> extract_answer("9 + 8 = 17. The answer is 17.")
    '17'
    >>> extract_answer("So she has $1,234.00 left")
    '1234'
    >>> extract_answer("no idea") is None
    True
    """
    if not isinstance(text, str):
        text = str(text)
    for marker in _ANSWER_MARKERS:
        match = marker.search(text)
        if match:
            return normalize_answer(match.group(1))
    numbers = _NUMBER_RE.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def normalize_answer(value: str | int | float) -> str | None:
    """A canonical string for a number: no commas, dollar signs or trailing zeros.

    >>> [normalize_answer(v) for v in ("1,234", "$5", "18.0", "3.50", "-3", "7.", 4, "2.5e-3", "-1E3")]
    ['1234', '5', '18', '3.5', '-3', '7', '4', '0.0025', '-1000']
    """
    number = _parse_number(value)
    if number is None:
        return None
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


MAX_ANSWER_DIGITS = 100  # an answer past this many digits is not a number a task compares (nor prints: 4,300)


def _parse_number(value: str | int | float) -> Decimal | None:
    """The number in an answer ("$1,234", "-$5", "2.5e-3"), or None. Minus signs before the digits count
    (an odd number of them is negative); an exponent keeps its own sign (2.5e-3 is 0.0025, not -2500)."""
    text = str(value).strip().replace(",", "").replace(" ", "").rstrip(".")
    if len(text) > 4 * MAX_ANSWER_DIGITS:
        return None
    mantissa, e, exponent = text.replace("E", "e").partition("e")
    negative = mantissa.count("-") % 2 == 1
    mantissa = mantissa.replace("$", "").replace("-", "")
    try:
        number = Decimal(mantissa + e + exponent)
    except InvalidOperation:
        return None
    if not number.is_finite() or (number and abs(number.adjusted()) > MAX_ANSWER_DIGITS):
        return None
    return -number if negative else number


def is_correct(prediction: str | int | float | None, target: Problem | str | int | float) -> bool:
    """Whether a model's text (or a bare answer) matches the problem's answer.

    Numbers compare by value ("18.0" equals "18"); a non-numeric target compares as
    stripped, case-folded text.

    >>> is_correct("He has 18 left. The answer is 18.", "18.0")
    True
    >>> is_correct(None, "18")
    False
    """
    if prediction is None:
        return False
    expected = target.answer if isinstance(target, Problem) else str(target)
    expected_number = _parse_number(expected)
    if expected_number is None:
        return str(prediction).strip().casefold() == expected.strip().casefold()
    predicted = extract_answer(str(prediction))
    return predicted is not None and _parse_number(predicted) == expected_number
