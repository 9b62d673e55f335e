"""The fuzzy rule layer: K Gaussian rules over projected token representations whose consequents are concepts.

Our reconstruction [recon] of the ICML 2026 poster "Neuro-Fuzzy Concept Learning for Interpretable Large
Multimodal Models" (only the abstract is public; METHODS.md section 2), in the framing of CoX-LMM (Parekh et
al., NeurIPS 2024, arXiv 2406.08074). For a representation z (a hidden state of the target token):

    x = (z - mean) / scale                          standardised (one scalar scale keeps the geometry)
    s = P x                                         optional projection to m features (P initialised by PCA)
    log mu_r = -||s - c_r||^2 / (2 sigma_r^2)       Gaussian membership of rule r (`membership="gaussian"`)
             = -sum_j (s_j - c_rj)^2 / (2 sigma_rj^2)   per-dimension product in the log domain (`"product"`)
    w_r = mu_r,  wbar_r = w_r / sum_q w_q           firing and normalised firing (a softmax of log mu: no underflow)
    z_hat = sum_r wbar_r u_r                        weighted-average defuzzification; the consequents u_r are
                                                    the concepts, points in the model's hidden space

P, c, sigma and u are trained together by Adam on the reconstruction error (the fraction of variance left
unexplained) plus `sparsity` times the mean entropy of wbar, which pushes each sample towards few firing
rules. Centres start from k-means on the projected training samples and consequents from the cluster means,
so a seed fixes everything and the same data give the same rules.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> centres = torch.randn(3, 8, generator=g) * 4
    >>> Z = centres.repeat(50, 1) + 0.1 * torch.randn(150, 8, generator=g)
    >>> layer = FuzzyRuleLayer(n_rules=3, n_features=4, steps=200, seed=0).fit(Z)
    >>> wbar = layer.transform(Z)
    >>> bool(torch.allclose(wbar.sum(1), torch.ones(150)))
    True
    >>> float(layer.reconstruction_error(Z)) < 0.05
    True
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

MEMBERSHIPS = ("gaussian", "product")
WEIGHTS_FILE = "fuzzy_rules.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "thoughtscope-fuzzy-rules/v1"
# Words for where a rule's centre sits among the training samples' values of that feature (z-score bins).
TERMS = ((-1.5, "very low"), (-0.5, "low"), (0.5, "medium"), (1.5, "high"), (math.inf, "very high"))


def as_matrix(Z: Any, what: str = "the representations") -> torch.Tensor:
    """Z as a float32 [n, d] CPU tensor, with the checks every fit and transform needs (a project error)."""
    x = torch.as_tensor(np.asarray(Z) if not isinstance(Z, torch.Tensor) else Z).detach().to("cpu", torch.float32)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise BadInputError(f"{what} must be a matrix [samples, width]; got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).any(1).sum())
        raise BadInputError(f"{what} hold NaN or infinite values in {bad} of {x.shape[0]} rows; "
                            "harvest again (a broken model or dtype overflow) or drop those samples")
    return x


def standardiser(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(mean, scale) with scale = root mean squared distance to the mean: standardised rows have unit mean
    squared norm, so a squared reconstruction error is directly a fraction of variance."""
    mean = x.mean(0)
    scale = float((x - mean).pow(2).sum(1).mean().sqrt())
    return mean, scale if scale > 0 else 1.0


def check_rules_fit(n_rules: int, n_samples: int, x: torch.Tensor | None = None) -> None:
    """K larger than the number of samples (or of distinct samples in `x`) cannot be fitted: say so before
    any work."""
    checks.integer("the number of concepts K", n_rules, low=1)
    if n_rules > n_samples:
        raise BadInputError(f"K = {n_rules} concepts but only {n_samples} training samples: each concept needs at "
                            f"least one sample. Lower K to at most {n_samples} or harvest more samples.")
    if x is not None:
        distinct = int(torch.unique(x, dim=0).shape[0])
        if n_rules > distinct:
            raise BadInputError(f"K = {n_rules} concepts but the {n_samples} samples hold only {distinct} distinct "
                                "representations (the target word sits in identical contexts, e.g. at the same "
                                "position after the same words); lower K or use more varied texts.")


@dataclass
class Clause:
    """One antecedent clause of a rule: feature `feature` is near `centre` with width `width`."""

    feature: int
    centre: float
    width: float
    term: str  # "low", "high", ... relative to the training samples' values of this feature
    distinctiveness: float  # |centre - typical value| / width: how much this clause singles the rule out

    def text(self, names: Sequence[str] | None = None) -> str:
        name = names[self.feature] if names else f"f{self.feature + 1}"
        return f"{name} is {self.term} ({self.centre:.2f} \u00b1 {self.width:.2f})"


@dataclass
class Rule:
    """A rule as text: IF its most distinctive clauses THEN its concept (words filled in by grounding)."""

    index: int
    clauses: list[Clause]
    n_features: int
    words: list[str] = field(default_factory=list)
    feature_names: list[str] | None = None

    def text(self) -> str:
        shown = " AND ".join(c.text(self.feature_names) for c in self.clauses)
        rest = self.n_features - len(self.clauses)
        more = f" (and {rest} more feature{'s' if rest != 1 else ''} near their centres)" if rest > 0 else ""
        words = f": {', '.join(self.words[:6])}" if self.words else ""
        return f"Rule {self.index + 1}: IF {shown}{more} THEN concept {self.index + 1}{words}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text(), "clauses": [asdict(c) for c in self.clauses],
                "words": list(self.words)}


@dataclass
class Explanation:
    """Why a sample is represented as it is: every rule's membership and normalised firing, and the chain of
    rules that carry `coverage` of the firing, each with its clauses evaluated on the sample."""

    firing: list[float]  # wbar, sums to 1
    memberships: list[float]  # mu (unnormalised): all tiny means no rule really covers the sample
    features: list[float]  # the sample's projected features s
    chain: list[dict[str, Any]]
    reconstruction_cosine: float

    def text(self, names: Sequence[str] | None = None) -> str:
        lines = []
        for link in self.chain:
            parts = [f"{(names[c['feature']] if names else 'f' + str(c['feature'] + 1))} = {c['value']:.2f} "
                     f"(centre {c['centre']:.2f} \u00b1 {c['width']:.2f}, membership {c['membership']:.2f})"
                     for c in link["clauses"]]
            lines.append(f"rule {link['rule'] + 1} fires {link['firing']:.2f} because " + " AND ".join(parts))
        top = max(self.memberships)
        if top < 1e-3:
            lines.append(f"(no rule covers this sample well: the largest membership is {top:.1e})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FuzzyRuleLayer:
    """K fuzzy rules with Gaussian antecedents over m projected features and consequents in hidden space.

    Constructor arguments are stored as given (scikit-learn style); `fit` sets the learned state:
    `mean_`, `scale_` (standardisation), `projection_` [m, d], `centres_` [K, m], `widths_` ([K] for
    `gaussian`, [K, m] for `product`), `consequents_` [K, d] in standardised units, `concepts_` [K, d]
    (the consequents in the model's hidden space), `feature_mean_`/`feature_std_` (of the training
    features, for the readable terms), `loss_history_` and `n_iter_` (steps taken).

    `steps` bounds the full-batch Adam steps; training stops early once the loss improves by less than
    `tol` (relative) over 25 steps, and the parameters with the lowest loss seen are kept. `batch_size`
    switches to seeded minibatches (then the last parameters are kept).
    """

    def __init__(self, n_rules: int = 20, n_features: int | None = 16, membership: str = "gaussian",
                 sparsity: float = 0.03, lr: float = 0.01, steps: int = 400, batch_size: int | None = None,
                 tol: float = 1e-5, seed: int = 0):
        self.n_rules = n_rules
        self.n_features = n_features
        self.membership = membership
        self.sparsity = sparsity
        self.lr = lr
        self.steps = steps
        self.batch_size = batch_size
        self.tol = tol
        self.seed = seed

    # ----- parameters -----

    def get_params(self) -> dict[str, Any]:
        return {"n_rules": self.n_rules, "n_features": self.n_features, "membership": self.membership,
                "sparsity": self.sparsity, "lr": self.lr, "steps": self.steps, "batch_size": self.batch_size,
                "tol": self.tol, "seed": self.seed}

    def _check_params(self) -> None:
        checks.choice("membership", self.membership, MEMBERSHIPS)
        checks.integer("n_features (m)", self.n_features, low=1, none_ok=True)
        checks.number("sparsity", self.sparsity, low=0)
        checks.number("lr", self.lr, low=0, low_open=True)
        checks.integer("steps", self.steps, low=0)
        checks.number("tol", self.tol, low=0)
        checks.integer("batch_size", self.batch_size, low=1, none_ok=True, why="None: the full batch")

    # ----- fitting -----

    def fit(self, Z: Any, on_progress: Callable[[int, int], None] | None = None) -> "FuzzyRuleLayer":
        """Learn the rules from representations Z [n, d]; `on_progress(step, steps)` every few steps."""
        self._check_params()
        z = as_matrix(Z)
        check_rules_fit(self.n_rules, z.shape[0], z)
        n, d = z.shape
        m = d if self.n_features is None else min(int(self.n_features), d)
        torch.manual_seed(self.seed)  # nothing below draws from the global generator; belt and braces
        gen = torch.Generator().manual_seed(self.seed)
        self.mean_, self.scale_ = standardiser(z)
        x = (z - self.mean_) / self.scale_
        P, C, log_sigma, U = self._init(x, m)
        for p in (P, C, log_sigma, U):
            p.requires_grad_(True)
        # Adam moves every entry by about lr per step; the entries of P and U (rows of unit scale in d
        # dimensions) are ~1/sqrt(d), those of C and log sigma ~1, so P and U take a step scaled to match.
        opt = torch.optim.Adam([{"params": [C, log_sigma], "lr": float(self.lr)},
                                {"params": [P, U], "lr": float(self.lr) / math.sqrt(d)}])
        history: list[float] = []
        best = (math.inf, None)
        batch = n if self.batch_size is None else min(int(self.batch_size), n)
        every = max(1, self.steps // 50)
        row_sq = x.pow(2).sum(1)  # |x_i|^2, fixed: the expanded reconstruction error reads it every step
        for step in range(int(self.steps) + 1):
            if batch == n:
                rows, rows_sq = x, row_sq.mean()
            else:
                picked = torch.randperm(n, generator=gen)[:batch]
                rows, rows_sq = x[picked], row_sq[picked].mean()
            loss = _fit_loss(rows, rows_sq, P, C, log_sigma, U, self.sparsity)
            history.append(float(loss.detach()))
            if batch == n and history[-1] < best[0]:  # full batch: keep the best parameters seen
                best = (history[-1], [p.detach().clone() for p in (P, C, log_sigma, U)])
            if step == int(self.steps) or _converged(history, self.tol):
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            if on_progress and ((step + 1) % every == 0 or step + 1 == self.steps):
                on_progress(step + 1, int(self.steps))
        if on_progress:
            on_progress(int(self.steps), int(self.steps))
        if best[1] is not None:
            P, C, log_sigma, U = best[1]
        self.projection_, self.centres_ = P.detach(), C.detach()
        self.widths_ = log_sigma.detach().exp()
        self.consequents_ = U.detach()
        self.loss_history_, self.n_iter_ = history, len(history) - 1  # steps taken
        feats = x @ self.projection_.T
        self.feature_mean_, self.feature_std_ = feats.mean(0), feats.std(0).clamp_min(1e-8)
        return self

    def _init(self, x: torch.Tensor, m: int):
        """P from PCA, centres from k-means on the projected samples, widths from the cluster spread and
        consequents from the cluster means: gradient descent then refines a sensible start."""
        with importing("sklearn.cluster"):  # lazy: scikit-learn takes seconds to import
            from sklearn.cluster import KMeans

        # principal directions from the d x d covariance (cheaper than an SVD of the n x d matrix)
        _, vecs = torch.linalg.eigh((x.T @ x).double())
        P = vecs.flip(1)[:, :m].T.float().contiguous()
        s = (x @ P.T).numpy().astype(np.float64)
        km = KMeans(n_clusters=self.n_rules, n_init=3, random_state=self.seed).fit(s)
        labels = km.labels_
        C = torch.tensor(km.cluster_centers_, dtype=torch.float32)
        spread = []
        U = torch.zeros(self.n_rules, x.shape[1])
        for r in range(self.n_rules):
            members = labels == r
            diff = s[members] - km.cluster_centers_[r]
            if self.membership == "gaussian":
                spread.append(np.sqrt((diff ** 2).mean()) if members.sum() > 1 else np.nan)
            else:
                spread.append(np.sqrt((diff ** 2).mean(0)) if members.sum() > 1 else np.full(m, np.nan))
            U[r] = x[torch.from_numpy(members)].mean(0) if members.any() else x.mean(0)
        spread = np.array(spread, dtype=np.float64)
        fallback = float(np.nanmean(spread)) if np.isfinite(spread).any() else 1.0
        spread = np.where(np.isfinite(spread) & (spread > 1e-4), spread, max(fallback, 1e-2))
        log_sigma = torch.tensor(np.log(spread), dtype=torch.float32)
        return P, C, log_sigma, U

    # ----- inference -----

    def _standardise(self, Z: Any) -> torch.Tensor:
        self._check_fitted()
        z = as_matrix(Z)
        if z.shape[1] != self.mean_.shape[0]:
            raise BadInputError(f"these representations have width {z.shape[1]}; the rules were fitted on "
                                f"width {self.mean_.shape[0]} (another layer kind or model?)")
        return (z - self.mean_) / self.scale_

    def features(self, Z: Any) -> torch.Tensor:
        """The projected features s = P x [n, m] the rules read."""
        return self._standardise(Z) @ self.projection_.T

    def log_memberships(self, Z: Any) -> torch.Tensor:
        """log mu_r(z) [n, K]."""
        return _log_memberships(self.features(Z), self.centres_, self.widths_.log())

    def memberships(self, Z: Any) -> torch.Tensor:
        """Firing strengths w_r = mu_r(z) in (0, 1] [n, K]."""
        return self.log_memberships(Z).exp()

    def transform(self, Z: Any) -> torch.Tensor:
        """Normalised firing wbar [n, K]: each row sums to one (a softmax of log mu, so no underflow)."""
        return torch.softmax(self.log_memberships(Z), dim=-1)

    def fit_transform(self, Z: Any) -> torch.Tensor:
        return self.fit(Z).transform(Z)

    def inverse_transform(self, wbar: Any) -> torch.Tensor:
        """Defuzzification: sum_r wbar_r u_r in hidden space [n, d]."""
        self._check_fitted()
        w = torch.as_tensor(wbar, dtype=torch.float32)
        return w @ self.concepts_

    def reconstruct(self, Z: Any) -> torch.Tensor:
        return self.inverse_transform(self.transform(Z))

    def reconstruction_error(self, Z: Any) -> float:
        """Fraction of variance (around the training mean) the rules leave unexplained."""
        x = self._standardise(Z)
        x_hat = self.transform(Z) @ self.consequents_
        return float((x_hat - x).pow(2).sum(1).mean() / x.pow(2).sum(1).mean().clamp_min(1e-12))

    @property
    def concepts_(self) -> torch.Tensor:
        """The consequents u_r in the model's hidden space [K, d] (the concepts)."""
        self._check_fitted()
        return self.mean_ + self.scale_ * self.consequents_

    @property
    def directions_(self) -> torch.Tensor:
        """Each concept minus the training mean [K, d]: what the concept adds to the typical representation
        (the vector grounded in words and used for steering; the mean is shared by every concept)."""
        self._check_fitted()
        return self.scale_ * self.consequents_

    def _check_fitted(self) -> None:
        if not hasattr(self, "consequents_"):
            raise BadInputError("this FuzzyRuleLayer is not fitted yet: call fit(Z) first (or load a saved one)")

    # ----- readable logic -----

    def term(self, feature: int, value: float) -> str:
        """A word for `value` of feature `feature` relative to the training samples (z-score bins)."""
        zscore = (value - float(self.feature_mean_[feature])) / float(self.feature_std_[feature])
        return next(word for bound, word in TERMS if zscore < bound)

    def rules(self, max_clauses: int = 3, feature_names: Sequence[str] | None = None) -> list[Rule]:
        """Every rule as IF-THEN text over its `max_clauses` most distinctive features (all m features
        enter the membership; the others sit near their typical values)."""
        self._check_fitted()
        m = self.centres_.shape[1]
        widths = self.widths_ if self.widths_.ndim == 2 else self.widths_[:, None].expand(-1, m)
        out = []
        for r in range(self.centres_.shape[0]):
            distinct = (self.centres_[r] - self.feature_mean_).abs() / widths[r]
            order = torch.argsort(distinct, descending=True)[:max(1, min(max_clauses, m))]
            clauses = [Clause(int(j), float(self.centres_[r, j]), float(widths[r, j]),
                              self.term(int(j), float(self.centres_[r, j])), float(distinct[j])) for j in order]
            out.append(Rule(r, clauses, m, feature_names=list(feature_names) if feature_names else None))
        return out

    def explain(self, z: Any, coverage: float = 0.9, max_clauses: int = 3) -> Explanation:
        """Firing strengths of one sample and the rule chain that carries `coverage` of its firing."""
        z = as_matrix(torch.as_tensor(z).reshape(1, -1) if torch.as_tensor(z).ndim == 1 else z, "the sample")
        if z.shape[0] != 1:
            raise BadInputError("explain takes one sample")
        s = self.features(z)[0]
        wbar = self.transform(z)[0]
        mu = self.memberships(z)[0]
        rules = self.rules(max_clauses)
        widths = self.widths_ if self.widths_.ndim == 2 else self.widths_[:, None].expand_as(self.centres_)
        chain, total = [], 0.0
        for r in torch.argsort(wbar, descending=True).tolist():
            clauses = [{"feature": c.feature, "value": float(s[c.feature]), "centre": c.centre, "width": c.width,
                        "membership": float(torch.exp(-(s[c.feature] - c.centre) ** 2 / (2 * widths[r, c.feature] ** 2)))}
                       for c in rules[r].clauses]
            chain.append({"rule": r, "firing": float(wbar[r]), "membership": float(mu[r]), "clauses": clauses})
            total += float(wbar[r])
            if total >= coverage:
                break
        z_hat = self.reconstruct(z)[0] - self.mean_
        centred = z[0] - self.mean_
        cos = float(torch.nn.functional.cosine_similarity(z_hat, centred, dim=0))
        return Explanation(wbar.tolist(), mu.tolist(), s.tolist(), chain, cos)

    # ----- saving -----

    def save(self, folder: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """The learned tensors as safetensors plus a JSON config (parameters, format, `metadata`)."""
        self._check_fitted()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"mean": self.mean_, "projection": self.projection_, "centres": self.centres_,
                   "widths": self.widths_, "consequents": self.consequents_, "feature_mean": self.feature_mean_,
                   "feature_std": self.feature_std_}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))
        config = {"format": FORMAT, "params": self.get_params(), "scale": self.scale_, "n_iter": self.n_iter_,
                  "final_loss": self.loss_history_[-1] if self.loss_history_ else None, "metadata": metadata or {}}
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "FuzzyRuleLayer":
        """A layer saved by `save` (safetensors only; nothing is unpickled)."""
        folder = Path(folder)
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
            tensors = load_file(str(folder / WEIGHTS_FILE))
        except (OSError, ValueError) as err:
            raise BadInputError(f"{folder} does not hold saved fuzzy rules ({CONFIG_FILE} + {WEIGHTS_FILE}): {err}")
        if config.get("format") != FORMAT:
            raise BadInputError(f"{folder}/{CONFIG_FILE} is not a {FORMAT} config")
        layer = cls(**config["params"])
        layer.mean_, layer.scale_ = tensors["mean"], float(config["scale"])
        layer.projection_, layer.centres_ = tensors["projection"], tensors["centres"]
        layer.widths_, layer.consequents_ = tensors["widths"], tensors["consequents"]
        layer.feature_mean_, layer.feature_std_ = tensors["feature_mean"], tensors["feature_std"]
        layer.n_iter_, layer.loss_history_ = config.get("n_iter", 0), []
        layer.metadata_ = config.get("metadata", {})  # type: ignore[attr-defined]  # only a loaded layer has one
        return layer


def _fit_loss(rows: torch.Tensor, rows_sq_mean: torch.Tensor, P: torch.Tensor, C: torch.Tensor,
              log_sigma: torch.Tensor, U: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The training loss: mean |wbar U - x|^2 over the rows plus `sparsity` times the mean firing entropy.

    The squared error is expanded, |wbar U - x|^2 = wbar (U U^T) wbar^T - 2 wbar (U x) + |x|^2, so a step
    never builds an [n, d] tensor: one matrix product of the rows with [P; U] gives both the features
    s = P x and the products U x, and the rest is [n, K] work (K x K for U U^T). Forward and backward then
    read the n x d rows twice per step instead of five products and several n x d elementwise passes.
    """
    m = P.shape[0]
    projected = rows @ torch.cat([P, U]).T  # [n, m + K]
    s, xu = projected[:, :m], projected[:, m:]
    wbar = torch.softmax(_log_memberships(s, C, log_sigma), dim=-1)
    recon = (wbar * (wbar @ (U @ U.T) - 2 * xu)).sum(1).mean() + rows_sq_mean
    return recon + sparsity * _entropy(wbar).mean()


def _log_memberships(s: torch.Tensor, C: torch.Tensor, log_sigma: torch.Tensor) -> torch.Tensor:
    """log mu [n, K] of features s [n, m] for centres C [K, m] and log widths [K] or [K, m].

    Squared distances are expanded (|s|^2 - 2 s.c + |c|^2, each term weighted by 1/sigma^2) so no
    [n, K, m] tensor is built: 10k samples without a projection would need gigabytes.
    """
    inv = torch.exp(-2 * log_sigma)  # 1 / sigma^2
    if log_sigma.ndim == 1:  # isotropic: one width per rule
        sq = s.pow(2).sum(1, keepdim=True) - 2 * s @ C.T + C.pow(2).sum(1)[None, :]
        return -0.5 * sq.clamp_min(0) * inv[None, :]
    sq = s.pow(2) @ inv.T - 2 * s @ (C * inv).T + (C.pow(2) * inv).sum(1)[None, :]
    return -0.5 * sq.clamp_min(0)


def _converged(history: list[float], tol: float, window: int = 25) -> bool:
    """True when the loss fell by less than `tol` (relative) over the last `window` steps."""
    if tol <= 0 or len(history) <= window:
        return False
    return history[-window - 1] - history[-1] <= tol * max(abs(history[-1]), 1e-12)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(1e-12))).sum(-1)
