"""Reasoning steps: one segmenter for every method that cuts a chain of thought into steps.

A step ends where a match of the model family's delimiter (a regular expression, see
`analyses.families`) ends: the paragraph break `\\n\\n` for reasoning models [summary of both
papers], sentence ends for the embedded SmolLM2 whose ~35-token traces rarely hold blank lines
[recon]. Two views of the same cut:

- `split_steps(text)` -> `Step`s with character spans (RISE labels and reads them);
- `StepSegmenter.push(piece)` online, token by token -> `StepEnd`s with token boundaries (CoT
  entropy probes at them while the model writes); `step_ends(token_texts)` is the same offline.

A delimiter with look-ahead (`[.!?](?=\\s)`) is only seen one token late: `StepEnd.detected_at`
says when, `StepEnd.boundary` where the step ended.

Example:
    >>> [(s.text, s.end) for s in split_steps("We add. So 2.5 + 1 = 3.5! Done", SENTENCE)]
    [('We add.', 7), ('So 2.5 + 1 = 3.5!', 25), ('Done', 30)]
    >>> step_ends(["We", " add", ".", " So", " 3", ".", " Done"], SENTENCE)
    [StepEnd(boundary=3, detected_at=4), StepEnd(boundary=6, detected_at=7)]
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from thoughtscope.errors import BadInputError

SENTENCE = r"[.!?](?=\s)"  # a sentence end followed by white space (so "2.5" is not cut)
PARAGRAPH = r"\n\n"
NAMED = {"sentence": SENTENCE, "paragraph": PARAGRAPH}


def compile_delimiter(delimiter: str) -> re.Pattern:
    """A step delimiter (a regex, or `sentence` / `paragraph`) compiled; one that matches nothing
    but the empty string is refused, because it would cut everywhere."""
    if not isinstance(delimiter, str) or not delimiter:
        raise BadInputError("the step delimiter is empty; use 'sentence', 'paragraph' or a regular expression")
    delimiter = NAMED.get(delimiter, delimiter)
    try:
        pattern = re.compile(delimiter)
    except re.error as err:
        raise BadInputError(f"the step delimiter {delimiter!r} is not a valid regular expression: {err}") from err
    if pattern.fullmatch(""):
        raise BadInputError(f"the step delimiter {delimiter!r} matches the empty string; give one that eats text")
    return pattern


# ----------------------------------------------------------------------------- character spans


@dataclass
class Step:
    """One reasoning step: its text, its character span in the trace (delimiter included), and the
    index (into the trace's generated tokens) of the token that closes it."""

    index: int
    text: str
    start: int
    end: int
    token: int = -1
    closed: bool = True  # False for a trailing fragment without a delimiter
    label: str = "other"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_steps(text: str, delimiter: str = PARAGRAPH, include_tail: bool = True) -> list[Step]:
    """Cut `text` into steps, each ending where a delimiter match ends.

    White-space-only pieces are not steps. A trailing piece without a delimiter is a step with
    `closed=False` when `include_tail`.
    """
    pattern = compile_delimiter(delimiter)
    steps: list[Step] = []
    start = 0
    for match in pattern.finditer(text):
        end = match.end()
        piece = text[start:end]
        if piece.strip() and piece.strip() != match.group(0).strip():
            steps.append(Step(len(steps), piece.strip(), start, end))
        start = end
    if include_tail and text[start:].strip():
        steps.append(Step(len(steps), text[start:].strip(), start, len(text), closed=False))
    return steps


def locate_step_tokens(pieces: Sequence[str], steps: list[Step]) -> list[Step]:
    """Set each step's `token`: the token holding its last character (for a closed step, the
    delimiter's last character; for a tail, its last non-space character). `pieces` are the
    generated tokens' texts, which concatenate to the trace text."""
    ends = np.cumsum([len(p) for p in pieces]) if pieces else np.zeros(0, dtype=int)
    text = "".join(pieces)
    for step in steps:
        last = step.end - 1
        if not step.closed:
            while last > step.start and text[last].isspace():
                last -= 1
        step.token = int(np.searchsorted(ends, last, side="right"))  # the first token ending past `last`
        if step.token >= len(pieces):
            raise BadInputError(f"step {step.index} ends at character {step.end}, beyond the {len(text)}-character trace")
    return steps


# ----------------------------------------------------------------------------- token boundaries, online


@dataclass(frozen=True)
class StepEnd:
    """A step ends after `boundary` generated tokens; the delimiter was seen after `detected_at`."""

    boundary: int
    detected_at: int


class StepSegmenter:
    """Finds step ends online: `push` one token's text, get the step boundaries it reveals."""

    def __init__(self, delimiter: str):
        self.pattern = compile_delimiter(delimiter)
        self.text = ""
        self._token_ends: list[int] = []
        self._search_from = 0
        self.ends: list[StepEnd] = []

    def push(self, piece: str) -> list[int]:
        self.text += piece
        self._token_ends.append(len(self.text))
        new: list[int] = []
        for match in self.pattern.finditer(self.text, self._search_from):
            self._search_from = match.end()
            boundary = bisect_left(self._token_ends, match.end()) + 1  # tokens covering the delimiter
            if (self.ends and boundary <= self.ends[-1].boundary) or boundary in new:
                continue
            new.append(boundary)
            self.ends.append(StepEnd(boundary, len(self._token_ends)))
        return new


def step_ends(token_texts: Sequence[str], delimiter: str) -> list[StepEnd]:
    """Step ends of a finished trace, exactly as `StepSegmenter` finds them while generating."""
    segmenter = StepSegmenter(delimiter)
    for piece in token_texts:
        segmenter.push(piece)
    return segmenter.ends
