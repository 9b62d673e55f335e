"""RISE behaviour labels: a keyword labeller (or any judge) for reflection and backtracking steps.

Labels colour and evaluate; they never train (Zhang et al., arXiv 2512.23988; keywords from
METHODS.md section 1, item 5 [summary]).

>>> label_step("Wait, let me check: 17 - 8 = 9."), label_step("Alternatively, count on."), label_step("So 9 + 8 = 17.")
('reflection', 'backtracking', 'other')
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

from analyses.steps import split_steps
from thoughtscope.errors import BadInputError

BEHAVIOURS = ("reflection", "backtracking")
OTHER = "other"
LABELS = (*BEHAVIOURS, OTHER)

# METHODS.md section 1, item 5 [summary].
REFLECTION_KEYWORDS = ("wait", "verify", "make sure", "hold on", "think again", "let me check",
                       "seems right", "'s correct", "'s incorrect")
BACKTRACKING_KEYWORDS = ("alternatively", "think differently", "another way", "another approach",
                         "another method", "another solution", "another strategy")

Judge = Callable[[str], "str | None"]


def _keyword_pattern(words: Sequence[str]) -> re.Pattern[str]:
    parts = [(r"\b" if w[0].isalnum() else "") + re.escape(w) + r"\b" for w in words]
    return re.compile("|".join(parts))


_REFLECTION_RE = _keyword_pattern(REFLECTION_KEYWORDS)
_BACKTRACKING_RE = _keyword_pattern(BACKTRACKING_KEYWORDS)


def label_step(text: str, judge: Judge | None = None) -> str:
    """`reflection`, `backtracking` or `other`: the judge's answer when it gives one, else keywords.

    With keywords of both kinds the one that comes first wins [recon].

    >>> label_step("Wait, let me check: 17 - 8 = 9."), label_step("Alternatively, count on."), label_step("So 9 + 8 = 17.")
    ('reflection', 'backtracking', 'other')
    """
    if judge is not None:
        verdict = judge(text)
        if verdict is not None:
            if verdict not in LABELS:
                raise BadInputError(f"the judge answered {verdict!r}; it must answer one of {LABELS} or None")
            return verdict
    low = text.lower().replace("\u2019", "'")
    hits = [(m.start(), label) for label, rx in (("reflection", _REFLECTION_RE), ("backtracking", _BACKTRACKING_RE))
            if (m := rx.search(low))]
    return min(hits)[1] if hits else OTHER


def count_behaviours(text: str, delimiter: str) -> dict[str, int]:
    """Steps of each label in a trace: the quantity steering moves."""
    counts = Counter(label_step(s.text) for s in split_steps(text, delimiter))
    return {label: counts.get(label, 0) for label in LABELS}
