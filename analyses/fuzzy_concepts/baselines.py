"""Baseline concept dictionaries, run beside the fuzzy rules through the same metric code (METHODS.md section 2).

- `SemiNMFConcepts`: CoX-LMM's dictionary (Parekh et al., NeurIPS 2024, arXiv 2406.08074): Z ~ V U with
  codes V >= 0 and a free-signed dictionary U, via scikit-learn's `DictionaryLearning(positive_code=True)`
  (coordinate descent; its `alpha` is the L1 weight on the codes).
- `KMeansConcepts`: K centroids; a sample is its nearest centroid.
- `PCAConcepts`: the top K principal directions; each oriented so its largest-magnitude training code is
  positive (a principal direction has no sign of its own, and a readout through the unembedding needs one).

Every model has the fuzzy layer's surface: `fit(Z)`, `transform(Z)` (codes [n, K]), `reconstruct(Z)`
([n, d] in hidden space), `directions_` [K, d] (each concept as a vector relative to the training mean:
what is grounded in words and used for steering) and `concepts_`. All fit on the same standardised
rows as the fuzzy layer (centred, one scalar scale) [recon: CoX-LMM decomposes Z without centring].

Example:
    >>> import torch
    >>> Z = torch.randn(60, 8)
    >>> pca = PCAConcepts(n_concepts=3).fit(Z)
    >>> pca.reconstruct(Z).shape, pca.directions_.shape
    (torch.Size([60, 8]), torch.Size([3, 8]))
"""

from __future__ import annotations

import warnings
from typing import Any, Self

import numpy as np
import torch

from analyses.fuzzy_concepts.rules import as_matrix, check_rules_fit, standardiser
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing


class _Standardised:
    """Plumbing shared by the baselines: standardise, fit `_fit_x` on x, map codes back to hidden space."""

    name = "baseline"

    def __init__(self, n_concepts: int = 20, seed: int = 0):
        self.n_concepts = n_concepts
        self.seed = seed

    def get_params(self) -> dict[str, Any]:
        return {"n_concepts": self.n_concepts, "seed": self.seed}

    def fit(self, Z: Any) -> Self:
        z = as_matrix(Z)
        check_rules_fit(self.n_concepts, z.shape[0], z)
        self.mean_, self.scale_ = standardiser(z)
        x = ((z - self.mean_) / self.scale_).numpy().astype(np.float64)
        self.atoms_ = torch.tensor(self._fit_x(x), dtype=torch.float32)  # [K, d] in standardised units
        return self

    def _x(self, Z: Any) -> np.ndarray:
        if not hasattr(self, "atoms_"):
            raise BadInputError(f"this {type(self).__name__} is not fitted yet: call fit(Z) first")
        z = as_matrix(Z)
        if z.shape[1] != self.mean_.shape[0]:
            raise BadInputError(f"width {z.shape[1]} does not match the fitted width {self.mean_.shape[0]}")
        return ((z - self.mean_) / self.scale_).numpy().astype(np.float64)

    def transform(self, Z: Any) -> torch.Tensor:
        return torch.tensor(self._codes(self._x(Z)), dtype=torch.float32)

    def reconstruct(self, Z: Any) -> torch.Tensor:
        return self.mean_ + self.scale_ * (self.transform(Z) @ self.atoms_)

    @property
    def directions_(self) -> torch.Tensor:
        return self.scale_ * self.atoms_

    @property
    def concepts_(self) -> torch.Tensor:
        return self.mean_ + self.directions_

    def _fit_x(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _codes(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class SemiNMFConcepts(_Standardised):
    """CoX-LMM's semi-NMF dictionary: non-negative sparse codes over a free-signed dictionary."""

    name = "semi-NMF"

    def __init__(self, n_concepts: int = 20, alpha: float = 0.05, max_iter: int = 200, seed: int = 0):
        super().__init__(n_concepts, seed)
        self.alpha = alpha
        self.max_iter = max_iter

    def get_params(self) -> dict[str, Any]:
        return {**super().get_params(), "alpha": self.alpha, "max_iter": self.max_iter}

    def _fit_x(self, x: np.ndarray) -> np.ndarray:
        with importing("sklearn.decomposition", "sklearn.exceptions"):  # lazy: scikit-learn takes seconds to import
            from sklearn.decomposition import DictionaryLearning
            from sklearn.exceptions import ConvergenceWarning

        self.model_ = DictionaryLearning(n_components=self.n_concepts, alpha=self.alpha, max_iter=self.max_iter,
                                         fit_algorithm="cd", transform_algorithm="lasso_cd",
                                         transform_alpha=self.alpha, positive_code=True,
                                         random_state=self.seed, tol=1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # max_iter bounds the time; the metrics judge it
            self.model_.fit(x)
        return self.model_.components_

    def _codes(self, x: np.ndarray) -> np.ndarray:
        with importing("sklearn.exceptions"):  # lazy: scikit-learn takes seconds to import
            from sklearn.exceptions import ConvergenceWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return self.model_.transform(x)


class KMeansConcepts(_Standardised):
    """K-means centroids: a sample's code is one-hot on its nearest centroid."""

    name = "k-means"

    def _fit_x(self, x: np.ndarray) -> np.ndarray:
        with importing("sklearn.cluster"):  # lazy: scikit-learn takes seconds to import
            from sklearn.cluster import KMeans

        self.model_ = KMeans(n_clusters=self.n_concepts, n_init=3, random_state=self.seed).fit(x)
        return self.model_.cluster_centers_

    def _codes(self, x: np.ndarray) -> np.ndarray:
        codes = np.zeros((x.shape[0], self.n_concepts))
        codes[np.arange(x.shape[0]), self.model_.predict(x)] = 1.0
        return codes


class PCAConcepts(_Standardised):
    """The top K principal directions (codes are signed projections)."""

    name = "PCA"

    def _fit_x(self, x: np.ndarray) -> np.ndarray:
        with importing("sklearn.decomposition"):  # lazy: scikit-learn takes seconds to import
            from sklearn.decomposition import PCA

        k = min(self.n_concepts, *x.shape)
        self.model_ = PCA(n_components=k, svd_solver="full").fit(x)
        comps = self.model_.components_.copy()
        codes = (x - self.model_.mean_) @ comps.T
        signs = np.sign(codes[np.abs(codes).argmax(0), np.arange(k)])
        comps *= np.where(signs == 0, 1.0, signs)[:, None]
        self.signs_ = signs
        if k < self.n_concepts:  # fewer directions than asked exist; pad with zero directions (never fire)
            comps = np.vstack([comps, np.zeros((self.n_concepts - k, x.shape[1]))])
        self._k = k
        return comps

    def _codes(self, x: np.ndarray) -> np.ndarray:
        return (x - self.model_.mean_) @ self.atoms_.numpy().astype(np.float64).T

    def reconstruct(self, Z: Any) -> torch.Tensor:
        # PCA's own centre is the training mean in standardised units (~0); keep it for exactness.
        x_hat = self.transform(Z) @ self.atoms_ + torch.tensor(self.model_.mean_, dtype=torch.float32)
        return self.mean_ + self.scale_ * x_hat


BASELINES = {"semi-NMF": SemiNMFConcepts, "k-means": KMeansConcepts, "PCA": PCAConcepts}
