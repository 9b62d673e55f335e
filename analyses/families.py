"""One table of model-family facts the methods share: how a family's traces divide into steps, how to
force an answer out of it, and how task prompts are written for it.

RISE cuts traces at the family's step delimiter; CoT entropy probes at the same step ends with the
family's answer-forcing suffix. Adding a model family is one row here [recon: the papers give the
paragraph delimiter and a `</think>` answer suffix for reasoning models; the rest is ours].

Example:
    >>> family_for("smollm2-135m").step_delimiter
    '[.!?](?=\\\\s)'
    >>> family_for("hf:deepseek-ai/DeepSeek-R1-Distill-Qwen-7B").answer_suffix
    '</think>\\nThe answer is '
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from analyses.steps import PARAGRAPH, SENTENCE, compile_delimiter
from analyses.tasks import cot_prompt, one_shot_messages


@dataclass(frozen=True)
class ModelFamily:
    """How to cut a family's traces into steps, force an answer, and prompt it.

    `prompt`: `one-shot` (a worked example in chat form, `analyses.tasks.one_shot_messages`),
    `chat` (the question and "Please reason step by step." as one user turn), `question` (the bare
    question as one user turn: the organism's chat template writes its own prompt format) or `raw`
    (plain text continuation). `labeller`: how RISE labels steps (`keywords`, or `toy-reasoner`:
    the organism's own labeller). `task`: the task whose problems the family was made for, if any.
    """

    name: str
    step_delimiter: str  # regex; a step ends where a match ends
    answer_suffix: str  # appended at a step end to force the intermediate answer
    answer_stop: tuple[str, ...] = (".", "\n")
    answer_max_tokens: int = 8
    probe_every: int = 64  # Dynasor-CoT's probe interval k
    probe_agree: int = 3  # Dynasor-CoT's m consecutive agreeing answers
    prompt: str = "chat"
    labeller: str = "keywords"
    task: str | None = None

    def with_delimiter(self, delimiter: str | None) -> "ModelFamily":
        if not delimiter:
            return self
        compile_delimiter(delimiter)
        return replace(self, step_delimiter=delimiter)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


FAMILIES: dict[str, ModelFamily] = {
    # ~35-token traces without blank lines: sentence ends; probes every 8 tokens, 2 must agree.
    "smollm2": ModelFamily("smollm2", SENTENCE, " The answer is ", probe_every=8, probe_agree=2, prompt="one-shot"),
    "instruct": ModelFamily("instruct", PARAGRAPH, "The answer is ", probe_every=32, probe_agree=3),
    "thinking": ModelFamily("thinking", PARAGRAPH, "</think>\nThe answer is ", probe_every=64, probe_agree=3),
    # Random-weight test models write words, not sentences: every word end is a step, short probes.
    "tiny": ModelFamily("tiny", r"\S(?=\s)", " The answer is ", answer_max_tokens=3, probe_every=4, probe_agree=2,
                        prompt="one-shot"),
    # The organism (probes.toys.reasoner): every step ends with the one-token delimiter ";", every trace
    # with " So the answer is N ."; steps are 6-12 tokens, traces 20-60.
    "toy-reasoner": ModelFamily("toy-reasoner", ";", " So the answer is", answer_stop=(".",), answer_max_tokens=3,
                                probe_every=8, probe_agree=2, prompt="question", labeller="toy-reasoner",
                                task="toy-reasoner"),
}
_THINKING_IDS = re.compile(r"r1|qwq|thinking|reason|qwen3(?!.*instruct)", re.IGNORECASE)


def task_prompt(problem: Any, family: ModelFamily) -> tuple[Any, bool]:
    """(prompt, chat) for a task problem in the family's prompt style."""
    if family.prompt == "one-shot":
        return one_shot_messages(problem), True
    if family.prompt == "chat":
        return [{"role": "user", "content": f"{problem.question}\nPlease reason step by step."}], True
    if family.prompt == "question":
        return [{"role": "user", "content": problem.question}], True
    return cot_prompt(problem), False


def default_task(model: Any, fallback: str = "arith") -> str:
    """The task a model is evaluated on by default: its family's (with the toy's size), else `fallback`.

    >>> default_task("toy-reasoner:small"), default_task("smollm2-135m")
    ('toy-reasoner:small', 'arith')
    """
    model_id = model if isinstance(model, str) else model.info()["model_id"]
    family = family_for(model_id)
    if family.task is None:
        return fallback
    _, sep, size = model_id.partition(":")
    return family.task + (f":{size}" if sep and size and size != "full" else "")


def family_for(model: Any) -> ModelFamily:
    """The family of a model id, or of a backend (its `info()["model_id"]`)."""
    model_id = model if isinstance(model, str) else model.info()["model_id"]
    lowered = model_id.lower()
    for name, family in FAMILIES.items():  # toy models register rows named after their id
        if lowered == name or lowered.startswith(name + ":"):
            return family
    if lowered.startswith("tiny-random:"):
        return FAMILIES["tiny"]
    if "smollm" in lowered:
        return FAMILIES["smollm2"]
    if _THINKING_IDS.search(lowered):
        return FAMILIES["thinking"]
    return FAMILIES["instruct"]
