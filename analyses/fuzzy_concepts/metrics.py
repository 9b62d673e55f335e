"""The metrics every concept model goes through, the fuzzy rules and the baselines alike (METHODS.md section 2).

- `reconstruction_error`: fraction of variance unexplained on held-out rows, around the training mean.
- `active_concepts`: per sample, exp(entropy) of the code shares |v_k| / sum |v|: 1 when one concept
  carries the sample, K when all share it equally; averaged over samples.
- `word_overlap`: CoX-LMM's overlap of grounded words between concepts (lower = more disentangled):
  mean over ordered pairs k != l of |T_k & T_l| / |T_k| [recon of the exact normalisation].
- `matched_similarity`: stability across seeds: concepts of two fits matched one-to-one (Hungarian
  assignment on cosine similarity), mean cosine of the matched pairs.
- `adjusted_mutual_information`: agreement between each sample's strongest concept and known labels.
- `seed_interval`: mean and 95% t-interval over seeds (paired tests over samples and bootstrap intervals
  come from the shared protocol, `analyses.evaluation`).

Example:
    >>> m, o = word_overlap([["dog", "cat"], ["dog", "fish"], ["tree"]])
    >>> round(o, 3)  # pairs (0,1) and (1,0) share one of two words; the other four pairs share nothing
    0.167
    >>> seed_interval([1.0, 1.0, 1.0])
    (1.0, 1.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from thoughtscope.imports import importing


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.float64) if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def per_sample_errors(model: Any, Z: Any) -> np.ndarray:
    """Squared reconstruction error of each row [n], in units of the training data's mean squared
    distance to its mean (so their mean over the training rows is the fraction of variance unexplained)."""
    z = _np(Z)
    z_hat = _np(model.reconstruct(Z))
    return ((z - z_hat) ** 2).sum(1) / (model.scale_ ** 2)


def reconstruction_error(model: Any, Z: Any) -> float:
    """Fraction of variance unexplained on the rows Z: sum |z - z_hat|^2 / sum |z - training mean|^2."""
    z = _np(Z)
    residual = ((z - _np(model.reconstruct(Z))) ** 2).sum()
    total = ((z - _np(model.mean_)) ** 2).sum()
    return float(residual / max(total, 1e-12))


def code_shares(codes: Any) -> np.ndarray:
    """|v_k| / sum_k |v_k| per row (uniform for an all-zero row)."""
    a = np.abs(_np(codes))
    sums = a.sum(1, keepdims=True)
    return np.where(sums > 0, a / np.where(sums > 0, sums, 1.0), 1.0 / a.shape[1])


def active_concepts(codes: Any) -> float:
    """Mean effective number of concepts per sample: exp of the entropy of the code shares."""
    p = code_shares(codes)
    entropy = -(p * np.log(np.clip(p, 1e-12, None))).sum(1)
    return float(np.exp(entropy).mean())


def assignments(codes: Any) -> np.ndarray:
    """Each sample's strongest concept (largest |code|)."""
    return np.abs(_np(codes)).argmax(1)


def word_overlap(words: Sequence[Sequence[str]]) -> tuple[np.ndarray, float]:
    """(K x K matrix of |T_k & T_l| / |T_k| with zero diagonal, mean over k != l). Empty sets overlap nothing."""
    sets = [set(w) for w in words]
    k = len(sets)
    matrix = np.zeros((k, k))
    for a in range(k):
        for b in range(k):
            if a != b and sets[a]:
                matrix[a, b] = len(sets[a] & sets[b]) / len(sets[a])
    mean = float(matrix.sum() / (k * (k - 1))) if k > 1 else 0.0
    return matrix, mean


def matched_similarity(a: Any, b: Any) -> float:
    """Mean cosine similarity of two concept sets [K, d] after a one-to-one (Hungarian) matching."""
    with importing("scipy.optimize"):  # lazy: scipy takes seconds to import
        from scipy.optimize import linear_sum_assignment

    x, y = _np(a), _np(b)
    x = x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
    y = y / np.clip(np.linalg.norm(y, axis=1, keepdims=True), 1e-12, None)
    sim = x @ y.T
    rows, cols = linear_sum_assignment(-sim)
    return float(sim[rows, cols].mean())


def adjusted_mutual_information(codes: Any, labels: Sequence[Any]) -> float:
    """AMI between the strongest concept of each sample and its label."""
    with importing("sklearn.metrics"):  # lazy: scikit-learn takes seconds to import
        from sklearn.metrics import adjusted_mutual_info_score

    return float(adjusted_mutual_info_score([str(x) for x in labels], assignments(codes)))


def seed_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a t-interval over seeds (n < 2 or no spread: the interval is the mean itself)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return (float("nan"),) * 3
    mean = float(v.mean())
    if v.size < 2 or float(v.std(ddof=1)) == 0.0:
        return mean, mean, mean
    with importing("scipy"):  # lazy: scipy takes seconds to import
        from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return mean, mean - half, mean + half
