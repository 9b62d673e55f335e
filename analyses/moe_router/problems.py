"""The problems Expert-Sample is evaluated on: development and evaluation splits, prompts and verifiers.

Two sources, one shape (`Item`: an id, the prompt as the backend takes it, the answer, the verifier):

- `toy-moe` / `toy-moe:small`: the organism's own arithmetic (probes.toys.moe), whose dev and eval
  splits are disjoint from each other and from training by a hash of the problem; the prompt is the
  question as one chat turn (the toy's template writes its own format), the verifier reads "answer N";
- the shared tasks of `analyses.tasks` (`arith`, `gsm8k`, ...), for `hf:` MoE models: one pool of
  1,000 problems cut in two seeded halves (development, evaluation), prompts in the model family's style.

`task="auto"` takes the model's own task (toy-moe for toy-moe, with its size), else `arith`.

Example:
    >>> dev = load_items("toy-moe:small", "development", 2)
    >>> dev[0].prompt[0]["role"], dev[0].verify(f" 1 + 1 = 2 . answer {dev[0].answer}")
    ('user', True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from analyses.evaluation import split_three
from analyses.families import family_for, task_prompt
from analyses.tasks import TASK_NAMES, extract_answer, is_correct, is_task_file, load_task, task_size
from probes.backend import Backend
from probes.toys import moe
from thoughtscope import checks
from thoughtscope.errors import BadInputError

TOY_TASKS = ("toy-moe", "toy-moe:small")
SPLITS = ("development", "evaluation")
SHARED_POOL = 1000  # problems of a shared task cut in two halves: development and evaluation


@dataclass(frozen=True)
class Item:
    """One problem: `prompt` and `chat` go to `backend.generate`; `verify(text)` scores a generation and
    `parse(text)` reads its final answer (None when it gives none; majority votes count these)."""

    id: str
    question: str
    answer: str
    prompt: Any
    chat: bool
    checker: Callable[[str], bool]
    parser: Callable[[str], Any]

    def verify(self, text: str) -> bool:
        return bool(self.checker(text))

    def parse(self, text: str) -> str | None:
        value = self.parser(text)
        return None if value is None else str(value)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "answer": self.answer}


def resolve_task(task: str, backend: Backend | None = None) -> str:
    """`auto` -> the model's own task (toy-moe[:small] for the toy), else `arith`; other names are checked."""
    if task == "auto":
        model_id = backend.info()["model_id"] if backend is not None else ""
        name, _, size = model_id.partition(":")
        if name == "toy-moe":
            return "toy-moe:small" if size == "small" else "toy-moe"
        return "arith"
    if task not in (*TOY_TASKS, *TASK_NAMES) and not is_task_file(task):
        raise BadInputError(f"unknown task {task!r}; use auto, {', '.join(TOY_TASKS)}, one of {', '.join(TASK_NAMES)} "
                            "or a .jsonl problem file")
    return task


def load_items(task: str, split: str, n: int, seed: int = 0, backend: Backend | None = None) -> list[Item]:
    """`n` problems of one split (`development` or `evaluation`) of `task` (resolved with `resolve_task`)."""
    checks.choice("split", split, SPLITS)
    checks.integer("the number of problems", n, low=1)
    task = resolve_task(task, backend)
    if task in TOY_TASKS:
        return _toy_items(task, split, n, seed)
    return _shared_items(task, split, n, seed, backend)


def _toy_items(task: str, split: str, n: int, seed: int) -> list[Item]:
    size = "small" if task.endswith(":small") else "full"
    problems = moe.problems("dev" if split == "development" else "eval", n, seed=seed, config=moe.task_config(size))
    return [Item(id=f"{task}-{split[:3]}-s{seed}-{i:04d}", question=p.question, answer=str(p.answer),
                 prompt=[{"role": "user", "content": p.question}], chat=True,
                 checker=lambda text, p=p: moe.is_correct(text, p), parser=moe.parse_answer)
            for i, p in enumerate(problems)]


def file_split_size(task: str, split: str) -> int:
    """How many problems of a problem file one split holds (the pool's seeded halves, `_shared_items`)."""
    checks.choice("split", split, SPLITS)
    pool = min(SHARED_POOL, task_size(task) or SHARED_POOL)
    return pool // 2 if split == "development" else pool - pool // 2


def _shared_items(task: str, split: str, n: int, seed: int, backend: Backend) -> list[Item]:
    # one pool and one seeded cut whichever split is asked for, so development and evaluation never overlap
    pool = load_task(task, min(SHARED_POOL, task_size(task) or SHARED_POOL), seed=seed)
    halves = split_three(pool, 0, len(pool) // 2, seed=seed, key=lambda p: p.id)
    problems = (halves.development if split == "development" else halves.evaluation)[:n]
    if len(problems) < n:
        raise BadInputError(f"{task} has {len(problems)} {split} problems here; ask for at most that many")
    family = family_for(backend) if backend is not None else family_for("instruct")
    items = []
    for p in problems:
        prompt, chat = task_prompt(p, family)
        items.append(Item(id=p.id, question=p.question, answer=str(p.answer), prompt=prompt, chat=chat,
                          checker=lambda text, p=p: is_correct(text, p), parser=extract_answer))
    return items
