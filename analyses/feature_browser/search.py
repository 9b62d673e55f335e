"""Search an SAE's latents by text: TF-IDF over their labels and top contexts (Neuronpedia's search by
explanation, over our model-free labels [recon]).

Each latent's document is its label (`LatentLabel.document`: the tokens it fires on, weighted by
how often, the words its decoder writes, its top contexts); scikit-learn's `TfidfVectorizer`
indexes them once and a query is ranked by cosine similarity (the rows are l2-normalised, so one
sparse product). Tokens are words and single punctuation marks, so a query for ";" or "Wait" finds
the latents that fire on them. Dead latents are left out of the index.

Example:
    >>> from analyses.feature_browser.labels import LatentLabel, LatentLabels
    >>> labels = LatentLabels({}, [LatentLabel(0, 9, 1.0, [[" cat", 9]], ["the «cat» sat"], [" dog"], "ok"),
    ...                            LatentLabel(1, 7, 1.0, [[" Wait", 7]], ["«Wait», let me"], [" check"], "ok")])
    >>> [hit.latent for hit in LabelSearch(labels).search("wait")]
    [1]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from analyses.feature_browser.labels import LatentLabels
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

MAX_QUERY_CHARS = 500
TOKEN_PATTERN = r"(?u)\b\w+\b|[^\w\s]"  # words (of one letter too) and single punctuation marks


@dataclass
class SearchHit:
    """One latent a query found: its rank, cosine score and label."""

    rank: int
    latent: int
    score: float
    summary: str
    quality: str
    n_active: int
    contexts: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_query(query: Any) -> str:
    if not isinstance(query, str) or not query.strip():
        raise BadInputError("type a few words to search for (a token, a word the latent writes, a context)")
    if len(query) > MAX_QUERY_CHARS:
        raise BadInputError(f"the query has {len(query):,} characters; search takes at most {MAX_QUERY_CHARS} "
                            "(a few words)")
    return query.strip()


class LabelSearch:
    """A TF-IDF index over the labels of one SAE; `search(query, k)` ranks latents by cosine similarity."""

    def __init__(self, labels: LatentLabels):
        with importing("sklearn.feature_extraction.text"):  # lazy: scikit-learn takes seconds to import
            from sklearn.feature_extraction.text import TfidfVectorizer

        self.labels = labels
        self.latents_ = np.array([lab.latent for lab in labels.labels if lab.quality != "dead"], dtype=np.int64)
        if self.latents_.size == 0:
            raise BadInputError("every latent of this SAE is dead on the indexed corpus: there is nothing to search")
        by_latent = {lab.latent: lab for lab in labels.labels}
        self._by_latent = by_latent
        self.vectorizer_ = TfidfVectorizer(token_pattern=TOKEN_PATTERN, lowercase=True, sublinear_tf=True)
        self.matrix_ = self.vectorizer_.fit_transform([by_latent[int(j)].document() for j in self.latents_]).tocsc()

    def search(self, query: str, k: int = 20) -> list[SearchHit]:
        """The `k` latents whose labels match `query` best (score > 0), ties to the lower latent."""
        query = check_query(query)
        if not isinstance(k, int) or k < 1:
            raise BadInputError(f"k must be a positive number of results, got {k!r}")
        q = self.vectorizer_.transform([query])
        if q.nnz == 0:
            return []
        scores = np.asarray((self.matrix_ @ q.T).todense()).ravel()
        hits = np.flatnonzero(scores > 0)
        order = hits[np.lexsort((self.latents_[hits], -scores[hits]))][:k]
        out = []
        for rank, i in enumerate(order):
            lab = self._by_latent[int(self.latents_[i])]
            out.append(SearchHit(rank, lab.latent, float(scores[i]), lab.summary, lab.quality, lab.n_active,
                                 lab.contexts))
        return out
