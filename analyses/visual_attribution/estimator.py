"""The amortized attribution estimator: a linear map from attention features to causal effects.

vSTREAM (Kang et al. 2026, arXiv 2604.16587) trains a linear model on (span, region) pairs whose
features are the span's attention to the region per layer and head and whose targets are the
exhaustive effects, with a 1 - Pearson loss: what matters is the ranking and shape of the effects
over a span's regions, not their scale. Our reconstruction: the loss is averaged over groups (one
group = one span's regions), features are standardised on the training pairs, and after the fit a
least-squares scale and offset (`calibration_`) put predictions back in nats. `features="log"` fits on
log(attention + 1e-4) instead of the attention itself (attention is heavy-tailed: a few heads put
most of their mass on one token); which one, and the epochs and penalty, are chosen on development
scenes by the study (analyses.visual_attribution.evaluate.choose_settings).

scikit-learn style: constructor arguments are stored as given, learned state ends in `_`; saved as
safetensors (the weights) + JSON (settings and feature names), never pickle.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(400, 6)); w = np.array([1.0, -2.0, 0.0, 0.5, 0.0, 3.0])
    >>> est = AmortizedAttribution(epochs=300).fit(X, X @ w, groups=np.repeat(np.arange(50), 8))
    >>> bool(np.corrcoef(est.predict(X), X @ w)[0, 1] > 0.99)
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from thoughtscope import checks
from thoughtscope.errors import BadInputError

VERSION = 1


def pearson_loss(pred: torch.Tensor, target: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
    """1 - Pearson correlation, averaged over groups (rows sharing a group id, numbered 0..G-1); groups
    whose target is constant carry no ranking and are left out."""
    if groups is None:
        groups = torch.zeros(len(pred), dtype=torch.long)
    n_groups = int(groups.max()) + 1
    count = torch.zeros(n_groups, dtype=pred.dtype).index_add_(0, groups, torch.ones_like(pred))

    def centred(x: torch.Tensor) -> torch.Tensor:
        mean = torch.zeros(n_groups, dtype=x.dtype).index_add_(0, groups, x) / count.clamp(min=1)
        return x - mean[groups]

    p, t = centred(pred), centred(target)

    def per_group(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=x.dtype).index_add_(0, groups, x)

    tt = per_group(t * t)
    keep = (count >= 2) & (tt > 1e-24)
    if not bool(keep.any()):
        raise BadInputError("no group has a varying target: the effects are all equal within every span")
    r = per_group(p * t)[keep] / ((per_group(p * p)[keep] * tt[keep]).sqrt() + 1e-12)
    return (1 - r).mean()


class AmortizedAttribution:
    """Linear estimator of exhaustive effects from attention features (fit / predict / save / load)."""

    FEATURES = ("raw", "log")
    LOG_FLOOR = 1e-4  # attention weights are >= 0; the floor keeps log finite where a head ignores a region

    def __init__(self, epochs: int = 200, lr: float = 0.05, l2: float = 1e-4, seed: int = 0, features: str = "raw"):
        self.epochs = epochs
        self.lr = lr
        self.l2 = l2
        self.seed = seed
        self.features = features

    def _check_x(self, X: Any, fitting: bool = False) -> np.ndarray:
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < 1:
            raise BadInputError(f"features must be a 2-d array [pairs, features]; got shape {x.shape}")
        if not np.isfinite(x).all():
            raise BadInputError("features contain NaN or infinite values")
        if not fitting and x.shape[1] != self.n_features_in_:
            raise BadInputError(f"this estimator was fitted on {self.n_features_in_} features; got {x.shape[1]}")
        if self.features == "log":
            if (x < 0).any():
                raise BadInputError("features='log' takes attention weights (>= 0); got negative features")
            return np.log(x + self.LOG_FLOOR)
        return x

    def fit(self, X: Any, y: Any, groups: Any = None, feature_names: list[str] | None = None,
            on_progress: Any = None) -> "AmortizedAttribution":
        """Fit on pairs: X [n, F] features, y [n] effects, groups [n] (span ids; default: one group)."""
        checks.integer("epochs", self.epochs, low=1)
        checks.number("lr", self.lr, low=0, low_open=True)
        checks.number("l2", self.l2, low=0)
        checks.choice("features", self.features, self.FEATURES)
        x = self._check_x(X, fitting=True)
        t = np.asarray(y, dtype=np.float64).reshape(-1)
        if len(t) != len(x):
            raise BadInputError(f"{len(x)} feature rows but {len(t)} targets")
        g = None if groups is None else torch.as_tensor(np.unique(np.asarray(groups), return_inverse=True)[1])
        self.n_features_in_ = x.shape[1]
        self.feature_names_ = list(feature_names) if feature_names is not None else [f"f{i}" for i in range(x.shape[1])]
        self.mean_ = x.mean(0)
        self.scale_ = np.where(x.std(0) > 0, x.std(0), 1.0)
        xs = torch.as_tensor((x - self.mean_) / self.scale_, dtype=torch.float64)
        target = torch.as_tensor(t)
        gen = torch.Generator().manual_seed(int(self.seed))
        w = (torch.randn(x.shape[1], generator=gen, dtype=torch.float64) * 0.01).requires_grad_(True)
        opt = torch.optim.Adam([w], lr=self.lr)
        self.history_ = []
        for epoch in range(self.epochs):
            opt.zero_grad()
            loss = pearson_loss(xs @ w, target, g) + self.l2 * (w * w).sum()
            loss.backward()
            opt.step()
            self.history_.append(float(loss.detach()))
            if on_progress is not None:
                on_progress(epoch + 1, self.epochs)
        self.weights_ = w.detach().numpy().copy()
        score = xs.numpy() @ self.weights_
        a, c = np.polyfit(score, t, 1) if score.std() > 0 else (0.0, float(t.mean()))
        self.calibration_ = (float(a), float(c))
        return self

    def scores(self, X: Any) -> np.ndarray:
        """Uncalibrated scores (what the Pearson loss ranks)."""
        x = self._check_x(X)  # transformed as in the fit
        return ((x - self.mean_) / self.scale_) @ self.weights_

    def predict(self, X: Any) -> np.ndarray:
        """Predicted effects in nats (scores put on the training effects' scale)."""
        a, c = self.calibration_
        return a * self.scores(X) + c

    @property
    def coef_(self) -> np.ndarray:
        """Weights on the unstandardised features (log attention with features="log"), calibration included."""
        return self.calibration_[0] * self.weights_ / self.scale_

    def save(self, path: str | Path) -> Path:
        """Write `<path>.safetensors` (weights, mean, scale) and `<path>.json` (settings); returns the JSON path."""
        if not hasattr(self, "weights_"):
            raise BadInputError("fit the estimator before saving it")
        stem = checks.user_path("saved estimator", path).with_suffix("")
        stem.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: torch.as_tensor(getattr(self, f"{k}_")) for k in ("weights", "mean", "scale")},
                  str(stem.with_suffix(".safetensors")))
        meta = {"version": VERSION, "params": {"epochs": self.epochs, "lr": self.lr, "l2": self.l2, "seed": self.seed,
                                                 "features": self.features},
                "n_features_in": self.n_features_in_, "feature_names": self.feature_names_,
                "calibration": list(self.calibration_), "final_loss": self.history_[-1] if self.history_ else None}
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=2))
        return stem.with_suffix(".json")

    @classmethod
    def load(cls, path: str | Path) -> "AmortizedAttribution":
        from safetensors import SafetensorError

        stem = Path(path).with_suffix("")
        try:
            meta = json.loads(stem.with_suffix(".json").read_text())
            tensors = load_file(str(stem.with_suffix(".safetensors")))
        except (OSError, ValueError, RecursionError, SafetensorError) as err:
            raise BadInputError(f"no saved estimator at {stem} (.json + .safetensors): {err}") from err
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            got = meta.get("version") if isinstance(meta, dict) else "none (not a JSON object)"
            raise BadInputError(f"{stem}.json is estimator version {got}, this code reads {VERSION}")
        # a damaged or hand-edited pair of files: every field checked, so the page says so instead of a traceback
        try:
            est = cls(**meta["params"])
            est.n_features_in_ = int(meta["n_features_in"])
            est.feature_names_ = list(meta["feature_names"])
            a, c = (float(v) for v in meta["calibration"])
            est.calibration_ = (a, c)
            est.history_ = []
            for k in ("weights", "mean", "scale"):
                value = tensors[k].numpy().astype(np.float64)
                if value.shape != (est.n_features_in_,) or not np.isfinite(value).all():
                    raise ValueError(f"{k} has shape {list(value.shape)} (or values that are not finite); "
                                     f"n_features_in is {est.n_features_in_}")
                setattr(est, f"{k}_", value)
        except (KeyError, TypeError, ValueError) as err:
            raise BadInputError(f"{stem} (.json + .safetensors) is not an estimator this code can read "
                                f"({type(err).__name__}: {err})") from err
        return est
