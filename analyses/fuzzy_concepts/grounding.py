"""Grounding concepts: words from the unembedding, samples by firing strength (METHODS.md section 2, step 5).

Text grounding follows CoX-LMM (Parekh et al., arXiv 2406.08074): each concept vector is read through the
model's unembedding without the final norm (`backend.readout(v, norm=False, top_k=50)`), and of its 50
top tokens the ones that are not words (punctuation, numbers, pieces shorter than two letters, for
tokenizers that mark word starts with a space as byte-level BPE does pieces that continue a word, and
word-start pieces that are not English words, such as " auton" or " incorpor") and the stopwords are
dropped; 15 are kept. English words are those of Webster's 2nd and GCIDE (the `english-words` package:
a word list, not a model; no hand-written list would cover them), with plain inflections (-s, -es,
-ed, -ing, -ly, -er, -est) reduced to a listed stem. The vector read is the concept relative to the
training mean (`directions_`), since the mean is common to every concept and would dominate every
readout [recon].
Visual (here: sample) grounding is the samples with the largest firing strength for the concept.

Example:
    >>> is_grounding_word(" Dog"), is_grounding_word(" the"), is_grounding_word(" 42"), is_grounding_word("ing")
    (True, False, False, False)
    >>> filter_words([" the", " dog", "ing", " Dog", " auton", " parks", "!"])
    ['dog', 'parks']
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from english_words import get_english_words_set

from probes.backend import Backend
from thoughtscope.imports import importing

TOP_K = 50
KEEP = 15
_WORD = re.compile(r"^[A-Za-z]{2,}$")
# scikit-learn's English stopwords plus chat and contraction fragments a readout often returns.
_EXTRA_STOPWORDS = {"im", "ll", "ve", "re", "don", "didn", "doesn", "isn", "wasn", "won", "ain", "th", "nd", "st",
                    "rd", "s", "t", "d", "m", "user", "assistant", "system"}


def stopwords() -> frozenset[str]:
    with importing("sklearn.feature_extraction.text"):  # lazy: scikit-learn takes seconds to import
        from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS) | _EXTRA_STOPWORDS


@functools.lru_cache(maxsize=1)
def lexicon() -> frozenset[str]:
    """Lower-case English words: Webster's 2nd and GCIDE, about 263k (read once, about 0.1 s)."""
    return frozenset(get_english_words_set(["web2", "gcide"], lower=True, alpha=True))


_INFLECTIONS = ("ies", "ied", "ing", "est", "es", "ed", "er", "ly", "s")


def is_english_word(word: str) -> bool:
    """`word` (letters) is in the lexicon, or is a plain inflection of a word in it.

    Example:
        >>> is_english_word("obstructions"), is_english_word("compared"), is_english_word("incorpor")
        (True, True, False)
    """
    w, words = word.lower(), lexicon()
    if w in words:
        return True
    for suffix in _INFLECTIONS:
        stem = w[: -len(suffix)]
        if not w.endswith(suffix) or len(stem) < 2 or (suffix == "s" and stem.endswith("s")):
            continue
        stems = {stem, stem + "e"}
        if suffix in ("ies", "ied"):
            stems.add(stem + "y")
        if len(stem) >= 3 and stem[-1] == stem[-2]:
            stems.add(stem[:-1])  # stopped -> stop
        if not stems.isdisjoint(words):
            return True
    return False


def is_grounding_word(token_text: str, stop: frozenset[str] | None = None, word_start: bool = True) -> bool:
    """A token is a grounding word if, stripped, it is two or more letters, not a stopword, an English word
    (`is_english_word`) and (with `word_start`, for tokenizers that mark word starts by a leading space) it
    begins a word."""
    word = token_text.strip()
    if word_start and not token_text[:1].isspace():
        return False
    return (bool(_WORD.match(word)) and word.lower() not in (stop if stop is not None else stopwords())
            and is_english_word(word))


def filter_words(token_texts: Sequence[str], keep: int = KEEP) -> list[str]:
    """The first `keep` distinct (case-insensitive) grounding words of a ranked token list, lower-cased.

    Word pieces are told from words by a leading space when the tokenizer marks word starts that way
    (some of the tokens begin with a space); otherwise (tokens decoded without their word-start mark)
    every alphabetic piece counts."""
    stop = stopwords()
    word_start = any(t[:1].isspace() for t in token_texts)
    out: list[str] = []
    for text in token_texts:
        word = text.strip().lower()
        if is_grounding_word(text, stop, word_start) and word not in out:
            out.append(word)
            if len(out) == keep:
                break
    return out


def ground_words(backend: Backend, directions: Any, top_k: int = TOP_K, keep: int = KEEP) -> list[list[str]]:
    """Per concept vector [K, d]: up to `keep` words among the `top_k` tokens of its unembedding readout."""
    vectors = torch.as_tensor(directions, dtype=torch.float32)
    top_k = min(top_k, backend.arch().vocab_size)  # a toy's word-level vocabulary can be smaller
    readout = backend.readout(vectors, norm=False, top_k=top_k)
    return [filter_words([backend.decode([int(i)]) for i in row], keep) for row in readout.top_ids.tolist()]


def top_samples(codes: Any, k: int = 5) -> list[list[int]]:
    """Per concept, the indices of the `k` samples with the largest code (firing strength), strongest first."""
    c = codes.detach().cpu().numpy() if isinstance(codes, torch.Tensor) else np.asarray(codes)
    order = np.argsort(-c, axis=0, kind="stable")[:k]
    return [order[:, j].tolist() for j in range(c.shape[1])]
