"""Corpora to run a direction over: shipped (GSM8K), generated (task problems), or the user's own text.

A corpus is a named list of texts (contexts) with where it came from and its split, so a result's
provenance can say exactly what was read. Long texts are cut into token windows when the corpus is
indexed (`analyses.feature_browser.index`), not here.

Example:
    >>> corpus = load_corpus("gsm8k-questions", n=3)
    >>> corpus.name, corpus.split, len(corpus.texts)
    ('gsm8k-questions', 'test', 3)
    >>> text_corpus("one\\n\\ntwo", name="notes.txt").texts
    ('one', 'two')
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from analyses.tasks import load_gsm8k, load_task
from thoughtscope import checks
from thoughtscope.errors import BadInputError

CORPORA = ("gsm8k-questions", "gsm8k-solutions", "gsm8k-sentences", "arith-problems")
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, not text a model reads
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclass(frozen=True)
class Corpus:
    """Texts to index, with their name, data set split and source (for the provenance record)."""

    name: str
    texts: tuple[str, ...]
    split: str | None = None
    source: str = ""

    @property
    def key(self) -> str:
        """A digest of the name and every text: two corpora with the same key are the same corpus."""
        h = hashlib.sha256(self.name.encode())
        for text in self.texts:
            h.update(b"\0" + text.encode("utf-8", "surrogatepass"))
        return h.hexdigest()[:24]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "split": self.split, "source": self.source, "n_texts": len(self.texts),
                "key": self.key}


def _kept(texts: list[str], what: str) -> tuple[str, ...]:
    kept = tuple(t.strip() for t in texts if t and t.strip())
    if not kept:
        raise BadInputError(f"{what} holds no text; give a file with at least one non-empty line")
    return kept


def _sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if len(s) > 1]


def load_corpus(name: str, n: int | None = None, seed: int = 0) -> Corpus:
    """A shipped or generated corpus by name (see `CORPORA`); `n` keeps the first n texts."""
    if name not in CORPORA:
        raise BadInputError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)} or give a text file")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise BadInputError(f"n must be a positive number of texts, got {n!r}")
    if name == "arith-problems":
        problems = load_task("arith", n or 10_000, seed=seed)
        return Corpus(name, _kept([p.question for p in problems], name), "generated",
                      f"analyses.tasks arithmetic problems, seed {seed}")
    problems = load_gsm8k()
    if name == "gsm8k-questions":
        texts = [p.question for p in problems]
    elif name == "gsm8k-solutions":
        texts = [_CALCULATOR.sub("", p.meta["solution"]) for p in problems]
    else:
        texts = [s for p in problems for s in (*_sentences(p.question), *_sentences(_CALCULATOR.sub("", p.meta["solution"])))]
    texts = texts[:n] if n is not None else texts
    return Corpus(name, _kept(texts, name), "test", "GSM8K test set shipped in analyses/data (MIT licence)")


def text_corpus(text: str, name: str = "text", unit: str = "paragraph") -> Corpus:
    """The user's own text as a corpus: one context per paragraph (blank-line separated) or per line."""
    if unit not in ("paragraph", "line"):
        raise BadInputError(f"unit={unit!r}; split a text by 'paragraph' or 'line'")
    parts = re.split(r"\n\s*\n", text) if unit == "paragraph" else text.splitlines()
    return Corpus(name, _kept(parts, name), None, f"user text, one context per {unit}")


def file_corpus(path: str | Path, unit: str = "paragraph") -> Corpus:
    """A UTF-8 text file on disk as a corpus (see `text_corpus`)."""
    path = checks.user_path("text file", path)
    if not path.is_file():
        raise BadInputError(f"no text file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BadInputError(f"{path} is not a readable UTF-8 text file ({err})") from err
    corpus = text_corpus(text, path.name, unit)
    return Corpus(corpus.name, corpus.texts, None, f"file {path}, one context per {unit}")
