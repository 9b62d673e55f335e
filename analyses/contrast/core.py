"""Contrast two sets of reasoning steps: which features separate them, by how much, and does it hold out.

Goodfire's contrastive search, over chains of thought [recon; no paper method]. Steps (one row
per step: the activations at the token that closes it, `analyses.contrast.steps`) are split into
set A and set B by a rule (`rules`), then into a development and a held-out part by trace, so
steps of one trace never sit on both sides (`analyses.evaluation`'s protocol: choose on
development, report once on held-out). At each chosen site every feature is scored on the
development steps:

- `sae:<site>`: every latent of an SAE (its activation);
- `heads:<layer>`: the output norm of every attention head (`z.<layer>`, before `o_proj`);
- `direction:<site>`: the difference-of-means direction mean(A) - mean(B), fit on one half of the
  development traces and scored on the other, so its development statistics are not inflated by
  fitting (scoring both ways and pooling would be: each fold's statistic is the same d1 . d2).

For each feature: the standardised mean difference (pooled standard deviation), the AUROC of A
against B (Mann-Whitney U / n_a n_b), a two-sided Mann-Whitney p-value and its Benjamini-Hochberg
q-value over every feature of the contrast (`scipy.stats.false_discovery_control`). The `top_k`
by |SMD| get 95% percentile-bootstrap intervals (steps resampled within each set) and their
held-out AUROC with its interval. The directions (fit on all development steps) can be exported
as steering vectors (`export_direction`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save

from analyses.evaluation import CONFIDENCE, Interval
from saes.io import check_fits
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import importing

KINDS = ("sae", "heads", "direction")
MIN_STEPS = 2  # per set and part: a contrast needs a spread on both sides


@dataclass
class ContrastSite:
    """What to score: `kind` (sae, heads, direction) at the captured `site` (an SAE for `sae`)."""

    kind: str
    site: str
    sae: Any = None
    sae_name: str = ""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.site}"

    def validate(self) -> None:
        checks.choice("site kind", self.kind, KINDS)
        if self.kind == "sae" and self.sae is None:
            raise BadInputError(f"{self.name} needs an SAE (a SAELens folder)")
        if self.kind == "heads" and not self.site.startswith("z."):
            raise BadInputError(f"head output norms are read at z.<layer>, not {self.site}")


@dataclass
class ContrastSettings:
    """Held-out share of traces, bootstrap resamples, how many top features get intervals, FDR level, seed."""

    heldout_fraction: float = 0.5
    n_resamples: int = 1000
    top_k: int = 20
    alpha: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        checks.number("heldout_fraction", self.heldout_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        checks.integer("n_resamples", self.n_resamples, low=10, high=100_000)
        checks.integer("top_k", self.top_k, low=1, high=1000)
        checks.number("alpha", self.alpha, low=0.0, high=1.0, low_open=True, high_open=True)
        checks.integer("seed", self.seed, low=0)


@dataclass
class ContrastResult:
    """Every feature's effect on development steps, the top ones with intervals and held-out AUROC."""

    rule: dict[str, Any]
    sites: list[str]
    n: dict[str, int]  # steps of A and B on development and held-out
    settings: dict[str, Any]
    features: dict[str, dict[str, list[float]]]  # site name -> smd, auroc, p, q (one per feature)
    top: list[dict[str, Any]]
    n_significant: int
    directions: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # site -> mean(A) - mean(B)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["directions"] = {k: {"norm": float(v.norm()), "width": int(v.numel())} for k, v in self.directions.items()}
        return out


# --------------------------------------------------------------------------- statistics


def smd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Standardised mean difference (A - B) / pooled sd per column; 0 where both sets are constant."""
    na, nb = a.shape[0], b.shape[0]
    pooled = ((na - 1) * a.var(0, ddof=1) + (nb - 1) * b.var(0, ddof=1)) / (na + nb - 2)
    diff = a.mean(0) - b.mean(0)
    sd = np.sqrt(pooled)
    return np.where(sd > 0, diff / np.where(sd > 0, sd, 1.0), 0.0)


def auroc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """P(a random A step scores above a random B step) per column (ties count half), via ranks."""
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import rankdata

    na, nb = a.shape[-2], b.shape[-2]
    ranks = rankdata(np.concatenate([a, b], axis=-2), axis=-2)
    return (ranks[..., :na, :].sum(-2) - na * (na + 1) / 2) / (na * nb)


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two-sided Mann-Whitney p-values per column; 1 for a column constant over both sets."""
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import mannwhitneyu

    with np.errstate(invalid="ignore", divide="ignore"):
        p = mannwhitneyu(a, b, axis=0, alternative="two-sided").pvalue
    return np.where(np.isfinite(p), p, 1.0)


def _interval(estimate: float, draws: np.ndarray, n: int, settings: ContrastSettings) -> dict[str, Any]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Interval(float(estimate), float(low), float(high), n, CONFIDENCE, settings.n_resamples, settings.seed,
                    "percentile bootstrap over steps, within each set").to_dict()


def _bootstrap(a: np.ndarray, b: np.ndarray, settings: ContrastSettings, seed_offset: int = 0):
    """(SMD draws, AUROC draws) [R, k] for the columns of a and b, steps resampled within each set."""
    rng = np.random.default_rng(settings.seed + seed_offset)
    ia = rng.integers(0, a.shape[0], size=(settings.n_resamples, a.shape[0]))
    ib = rng.integers(0, b.shape[0], size=(settings.n_resamples, b.shape[0]))
    ra, rb = a[ia], b[ib]  # [R, n, k]
    na, nb = a.shape[0], b.shape[0]
    pooled = ((na - 1) * ra.var(1, ddof=1) + (nb - 1) * rb.var(1, ddof=1)) / (na + nb - 2)
    sd = np.sqrt(pooled)
    smds = np.where(sd > 0, (ra.mean(1) - rb.mean(1)) / np.where(sd > 0, sd, 1.0), 0.0)
    # AUROC of each resample without re-ranking it: with pair scores M[i, j] = [a_i > b_j] + [a_i = b_j] / 2
    # and the resample's counts wa, wb of every original step, AUROC* = wa M wb / (na nb) (the same number)
    wa = _counts(ia, na)
    wb = _counts(ib, nb)
    aurocs = np.empty((settings.n_resamples, a.shape[1]))
    for k in range(a.shape[1]):
        pairs = (a[:, k, None] > b[None, :, k]) + 0.5 * (a[:, k, None] == b[None, :, k])
        aurocs[:, k] = ((wa @ pairs) * wb).sum(1) / (na * nb)
    return smds, aurocs


def _counts(indices: np.ndarray, n: int) -> np.ndarray:
    """[R, n]: how often each of the n originals is drawn in each of the R resamples."""
    r = indices.shape[0]
    return np.bincount((indices + n * np.arange(r)[:, None]).ravel(), minlength=r * n).reshape(r, n).astype(float)


# --------------------------------------------------------------------------- features


@torch.no_grad()
def _sae_features(sae: Any, acts: torch.Tensor) -> np.ndarray:
    z = sae.encode(acts.float().to(sae.W_enc.dtype))
    return (z.to_dense() if z.is_sparse else z).float().cpu().numpy()


def _direction(acts: torch.Tensor, in_a: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    x = acts[torch.as_tensor(rows)].float()
    mask = torch.as_tensor(in_a[rows])
    return x[mask].mean(0) - x[~mask].mean(0)


def _unit(v: torch.Tensor) -> torch.Tensor:
    n = float(v.norm())
    return v / n if n > 0 else v


def features_at(site: ContrastSite, acts: torch.Tensor, in_a: np.ndarray, dev: np.ndarray, heldout: np.ndarray,
                traces: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor | None]:
    """(the development rows scored, their features [n, k], held-out features [n_heldout, k], the direction
    or None). A direction is fit on half of the development traces and scored on the other half (a
    fold scored both ways would count the same noise twice: d1 . d2 is both folds' statistic)."""
    if site.kind == "sae":
        check_fits(site.sae, int(acts.shape[-1]), site.site)
        return dev, _sae_features(site.sae, acts[dev]), _sae_features(site.sae, acts[heldout]), None
    if site.kind == "heads":
        if acts.dim() != 3:
            raise BadInputError(f"{site.site} has no head axis; head norms are read at z.<layer>")
        norms = acts.float().norm(dim=-1).numpy()
        return dev, norms[dev], norms[heldout], None
    folds = np.random.default_rng(seed).permutation(np.unique(traces[dev]))
    fit = np.isin(traces[dev], folds[: len(folds) // 2])
    fit_rows, scored = dev[fit], dev[~fit]
    for part, rows in (("fitting", fit_rows), ("scoring", scored)):
        if in_a[rows].sum() < MIN_STEPS or (~in_a[rows]).sum() < MIN_STEPS:
            raise BadInputError(f"the {part} half of the development traces has too few steps of set A or B for "
                                "the difference of means: add traces")
    v = _unit(_direction(acts, in_a, fit_rows))
    direction = _direction(acts, in_a, dev)  # all of development: what is exported and held out
    held = acts[torch.as_tensor(heldout)].float().numpy() @ _unit(direction).numpy()
    return scored, (acts[torch.as_tensor(scored)].float().numpy() @ v.numpy())[:, None], held[:, None], direction


def _column_stats(da: np.ndarray, db: np.ndarray) -> dict[str, list[float]]:
    return {"smd": smd(da, db).tolist(), "auroc": auroc(da, db).tolist(), "p": mann_whitney_p(da, db).tolist()}


def _top_row(rank: int, site: ContrastSite, j: int, stats: dict[str, float], cols: tuple, settings: ContrastSettings,
             contexts: list[str] | None) -> dict[str, Any]:
    """One top feature with its development intervals and held-out AUROC (steps resampled within each set)."""
    dev_rows, f_dev, a_dev, f_held, a_held = cols
    x, h = f_dev[:, j:j + 1], f_held[:, j:j + 1]
    smd_draws, auroc_draws = _bootstrap(x[a_dev], x[~a_dev], settings, seed_offset=rank)
    _, held_draws = _bootstrap(h[a_held], h[~a_held], settings, seed_offset=10_000 + rank)
    row = {"rank": rank, "site": site.name, "kind": site.kind, "feature": j, **stats,
           "significant": bool(stats["q"] <= settings.alpha),
           "smd_interval": _interval(stats["smd"], smd_draws[:, 0], len(x), settings),
           "auroc_interval": _interval(stats["auroc"], auroc_draws[:, 0], len(x), settings),
           "heldout_auroc": _interval(float(auroc(h[a_held], h[~a_held])[0]), held_draws[:, 0], len(h), settings)}
    if contexts is not None and site.kind == "sae":
        best = np.argsort(-x[:, 0], kind="stable")[:3]
        row["contexts"] = [{"text": contexts[dev_rows[r]], "activation": float(x[r, 0]),
                            "set": "A" if a_dev[r] else "B"} for r in best if x[r, 0] > 0]
    return row


# --------------------------------------------------------------------------- the contrast


def split_traces(traces: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(development rows, held-out rows): whole traces go to one part (seeded)."""
    unique = np.random.default_rng(seed).permutation(np.unique(traces))
    n_held = int(round(len(unique) * fraction))
    if n_held < 1 or n_held >= len(unique):
        raise BadInputError(f"{len(unique)} trace(s) cannot be split into development and held-out parts: "
                            "use at least 4 traces")
    held = np.isin(traces, unique[:n_held])
    return np.flatnonzero(~held), np.flatnonzero(held)


def contrast(acts: dict[str, torch.Tensor], traces: np.ndarray, in_a: np.ndarray, in_b: np.ndarray,
             sites: list[ContrastSite], settings: ContrastSettings | None = None, rule: dict[str, Any] | None = None,
             contexts: list[str] | None = None) -> ContrastResult:
    """Contrast the steps `in_a` against `in_b` (boolean masks over the rows of `acts`, grouped by `traces`)."""
    settings = settings or ContrastSettings()
    settings.validate()
    if not sites:
        raise BadInputError("choose at least one site to contrast (an SAE, head norms or the direction)")
    in_a, in_b, traces = np.asarray(in_a, bool), np.asarray(in_b, bool), np.asarray(traces)
    if (in_a & in_b).any():
        raise BadInputError("a step is in both sets: the rule must split the steps into two disjoint sets")
    for name, mask in (("A", in_a), ("B", in_b)):
        if mask.sum() == 0:
            raise BadInputError(f"set {name} is empty: no stored step matches its rule")
        if len(np.unique(traces[mask])) < 2:
            raise BadInputError(f"set {name} holds steps of a single trace: a contrast needs several traces per set")
    for site in sites:
        site.validate()
        if site.site not in acts:
            raise BadInputError(f"the stored steps have no activations at {site.site} (they hold "
                                f"{', '.join(sorted(acts))}); harvest them at that site")
    keep = np.flatnonzero(in_a | in_b)
    sub_traces = traces[keep]
    dev, held = split_traces(sub_traces, settings.heldout_fraction, settings.seed)
    a_rows = in_a[keep]
    for part, rows in (("development", dev), ("held-out", held)):
        for name, side in (("A", a_rows[rows]), ("B", ~a_rows[rows])):
            if side.sum() < MIN_STEPS:
                raise BadInputError(f"the {part} part has {int(side.sum())} step(s) of set {name}; a contrast needs "
                                    f"at least {MIN_STEPS} on each side of each part: add traces")
    features, cols, labels, directions = {}, {}, [], {}
    for site in sites:
        x = acts[site.site][torch.as_tensor(keep)]
        rows, f_dev, f_held, direction = features_at(site, x, a_rows, dev, held, sub_traces, settings.seed)
        if direction is not None:
            directions[site.site] = direction
        features[site.name] = _column_stats(f_dev[a_rows[rows]], f_dev[~a_rows[rows]])
        cols[site.name] = (keep[rows], f_dev, a_rows[rows], f_held, a_rows[held])
        labels += [(site, j) for j in range(f_dev.shape[1])]
    with importing("scipy.stats"):  # lazy: scipy takes seconds to import
        from scipy.stats import false_discovery_control

    p_all = np.concatenate([features[s.name]["p"] for s in sites])
    q_all = false_discovery_control(p_all, method="bh")
    at = 0
    for s in sites:
        k = len(features[s.name]["p"])
        features[s.name]["q"] = q_all[at:at + k].tolist()
        at += k
    smd_all = np.concatenate([features[s.name]["smd"] for s in sites])
    auroc_all = np.concatenate([features[s.name]["auroc"] for s in sites])
    order = np.lexsort((np.arange(len(smd_all)), -np.abs(smd_all)))[:settings.top_k]
    top = [_top_row(rank, labels[i][0], labels[i][1],
                    {"smd": float(smd_all[i]), "auroc": float(auroc_all[i]), "p": float(p_all[i]),
                     "q": float(q_all[i])}, cols[labels[i][0].name], settings, contexts)
           for rank, i in enumerate(order)]
    n = {"dev_a": int(a_rows[dev].sum()), "dev_b": int((~a_rows[dev]).sum()), "heldout_a": int(a_rows[held].sum()),
         "heldout_b": int((~a_rows[held]).sum()), "dev_traces": len(np.unique(sub_traces[dev])),
         "heldout_traces": len(np.unique(sub_traces[held]))}
    return ContrastResult(rule or {}, [s.name for s in sites], n, asdict(settings), features, top,
                          int((q_all <= settings.alpha).sum()), directions)


def export_direction(result: ContrastResult, row: dict[str, Any], sites: list[ContrastSite]) -> tuple[torch.Tensor, str]:
    """(vector, site) of a top row as a steering vector: the difference of means, or the SAE latent's decoder row."""
    kind, site_name = row["kind"], row["site"].split(":", 1)[1]
    if kind == "direction":
        return result.directions[site_name].clone(), site_name
    if kind == "sae":
        sae = next(s.sae for s in sites if s.name == row["site"])
        return sae.W_dec[int(row["feature"])].detach().float().cpu().clone(), site_name
    raise BadInputError("a head's output norm is not a direction in the residual stream; export a latent or the "
                        "difference of means")


def save_direction(vector: torch.Tensor, site: str, path: Any, meta: dict[str, Any] | None = None) -> bytes:
    """The vector as .safetensors bytes (tensor `vector`, the site in its metadata), written to `path` if given."""
    data = save({"vector": vector.contiguous()}, metadata={"site": site, "source": json.dumps(meta or {})})
    if path is not None:  # its folder may be new (the CLI checked it can be made): the result is never lost to it
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return data
