"""Train sparse autoencoders on activations held in memory (or read from `cache/`) with SAELens.

SAELens does the work: `StandardTrainingSAE` (ReLU, L1) or `TopKTrainingSAE`, driven by
`SAETrainer` with a data provider that is a plain iterator of activation batches (SAELens 6
accepts any `Iterator[Tensor]`, so no language model or SAELens `ActivationsStore` is needed and
nothing touches the network). The one thing we add is the unit-norm decoder constraint of RISE
(METHODS.md section 1): `UnitNormSAETrainer.step` renormalises the decoder rows after every
optimiser step, and the SAE is left with unit-norm rows after SAELens folds its input scaling.

Defaults are the RISE ones [summary] (dictionary 2048, batch 1024, Adam lr 1e-4 cosine, L1
2e-3), scaled for small models and small step sets by `SAETrainSettings.scaled` (see there).

Example:
    >>> import torch
    >>> acts = torch.randn(512, 16)
    >>> sae, stats = train_sae(acts, SAETrainSettings(d_sae=32, batch_size=128, steps=20, progress=False))
    >>> sae.W_dec.shape, round(float(sae.W_dec.norm(dim=1).mean()), 4)
    (torch.Size([32, 16]), 1.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import import_from, import_module  # sae_lens under the heavy-imports lock: jobs run in threads
from saes.stats import SAEStats, sae_stats

ARCHITECTURES = ("standard", "topk")
CENTRED = "centred"

# RISE's published defaults [summary]; `SAETrainSettings.scaled` adapts them to small data.
PAPER_D_MODEL = 1536  # DeepSeek-R1-Distill-Qwen-1.5B, the paper's model
PAPER_D_SAE = 2048
PAPER_BATCH = 1024
PAPER_LR = 1e-4
PAPER_L1 = 2e-3
# With inputs at norm sqrt(d) the reconstruction term grows like d and the L1 term like sqrt(d),
# so the coefficient for a given density grows like sqrt(d). 0.35 * sqrt(d) gave 13% density and
# a recovered planted dictionary (mean max cosine 0.95) at d = 32 [recon].
L1_PER_SQRT_D = 0.35


@dataclass
class SAETrainSettings:
    """Hyper-parameters of one SAE training run, stored as given (scikit-learn style).

    `l1_coefficient` is in SAELens' units: the squared error is summed over `d_in` and inputs are
    normalised to mean norm sqrt(d_in). The paper's 2e-3 comes without its loss normalisation, so
    it cannot be carried over; `scaled` picks the coefficient that gives the paper's stated ~15%
    latent density instead (see `L1_PER_SQRT_D`) [recon].
    """

    architecture: str = "standard"
    d_sae: int = PAPER_D_SAE
    l1_coefficient: float = L1_PER_SQRT_D * PAPER_D_MODEL**0.5
    k: int = 16  # active latents per input, TopK only
    lr: float = PAPER_LR
    batch_size: int = PAPER_BATCH
    steps: int = 2000
    lr_schedule: str = "cosineannealing"
    warmup_steps: int = 0
    l1_warmup_steps: int = 0
    # "centred" (ours): train on (x - mean) scaled to mean norm sqrt(d_in), then fold both into the
    # weights; or any SAELens mode ("expected_average_only_in", "none", ...), handled by SAELens.
    normalize_activations: str = "centred"
    seed: int = 0
    device: str = "cpu"
    progress: bool = True

    @classmethod
    def scaled(cls, d_in: int, n_samples: int, architecture: str = "standard", **overrides: Any) -> "SAETrainSettings":
        """RISE's defaults adapted to width `d_in` and `n_samples` training vectors [recon].

        - dictionary: the paper's ratio 2048/1536 = 4/3 of `d_in`, rounded up to a multiple of
          64, but at most a quarter of the samples (a latent needs examples to learn from);
        - batch: 1024, or a quarter of the samples when there are fewer than 4096;
        - steps: enough for ~300 passes over a small set, between 300 and 3000;
        - lr: 1e-4 is tuned for millions of vectors; with a few thousand steps it barely moves
          the weights, so small sets use 1e-3 (cosine decay to 0 as in the paper);
        - L1: `L1_PER_SQRT_D * sqrt(d_in)`, aiming at the paper's ~15% density (its 2e-3 is in
          units we cannot reconstruct).
        """
        if d_in < 1 or n_samples < 2:
            raise BadInputError(f"an SAE needs d_in >= 1 and at least 2 samples, got d_in={d_in}, n={n_samples}")
        d_sae = _round_up(math.ceil(d_in * PAPER_D_SAE / PAPER_D_MODEL), 64)
        d_sae = max(16, min(d_sae, _round_up(max(n_samples // 4, 16), 16)))
        batch = PAPER_BATCH if n_samples >= 4 * PAPER_BATCH else max(16, n_samples // 4)
        steps = int(min(3000, max(300, 300 * n_samples / batch)))
        lr = PAPER_LR if n_samples >= 100_000 else 1e-3
        base = cls(architecture=architecture, d_sae=d_sae, l1_coefficient=L1_PER_SQRT_D * d_in**0.5, k=max(1, min(32, d_sae // 16)),
                   lr=lr, batch_size=batch, steps=steps)
        return replace(base, **overrides)

    def validate(self, d_in: int, n_samples: int) -> None:
        checks.choice("the SAE architecture", self.architecture, ARCHITECTURES)
        for name in ("d_sae", "batch_size", "steps"):
            checks.integer(name, getattr(self, name), low=1)
        if self.architecture == "topk" and not 1 <= self.k <= self.d_sae:
            raise BadInputError(f"TopK needs 1 <= k <= d_sae ({self.d_sae}), got k={self.k}")
        checks.number("lr", self.lr, low=0, low_open=True)
        checks.number("l1_coefficient", self.l1_coefficient, low=0)
        if n_samples < 2:
            raise BadInputError(f"an SAE needs at least 2 activation vectors, got {n_samples}")
        if d_in < 1:
            raise BadInputError("activations have width 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def make_training_sae(d_in: int, settings: SAETrainSettings, metadata: dict[str, Any] | None = None):
    """A fresh SAELens training SAE (seeded) for inputs of width `d_in`."""
    sae_lens = import_module("sae_lens")
    StandardTrainingSAE, StandardTrainingSAEConfig = sae_lens.StandardTrainingSAE, sae_lens.StandardTrainingSAEConfig
    TopKTrainingSAE, TopKTrainingSAEConfig = sae_lens.TopKTrainingSAE, sae_lens.TopKTrainingSAEConfig
    SAEMetadata = import_from("sae_lens.saes.sae", "SAEMetadata")

    sae_lens_norm = "none" if settings.normalize_activations == CENTRED else settings.normalize_activations
    common = dict(d_in=d_in, d_sae=settings.d_sae, dtype="float32", device=settings.device,
                  normalize_activations=sae_lens_norm,
                  metadata=SAEMetadata(**(metadata or {})))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        if settings.architecture == "topk":
            sae = TopKTrainingSAE(TopKTrainingSAEConfig(k=settings.k, **common))
        else:
            sae = StandardTrainingSAE(StandardTrainingSAEConfig(
                l1_coefficient=settings.l1_coefficient, l1_warm_up_steps=settings.l1_warmup_steps, **common))
    _renormalise_decoder(sae)
    return sae


@torch.no_grad()
def _renormalise_decoder(sae: Any) -> None:
    sae.W_dec.data /= sae.W_dec.data.norm(dim=1, keepdim=True).clamp(min=1e-8)


def _centring(acts: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean and the factor that brings centred vectors to mean norm sqrt(d_in).

    Residual streams share a large mean; SAELens' own scaling (by the uncentred norm) leaves the
    part that differs between steps tiny next to it, and the L1 penalty then kills every latent.
    """
    centre = acts.mean(0)
    spread = (acts - centre).norm(dim=1).mean().clamp(min=1e-8)
    return centre, float(acts.shape[1] ** 0.5 / spread)


@torch.no_grad()
def _fold_centring(sae: Any, centre: torch.Tensor, scale: float) -> None:
    """Make the SAE trained on (x - centre) * scale read and write raw x: same latents' pattern,
    latent values divided by `scale` (undone by `fold_W_dec_norm` afterwards)."""
    sae.fold_activation_norm_scaling_factor(scale)
    sae.b_dec.data += centre.to(sae.b_dec.dtype).to(sae.b_dec.device)


@torch.no_grad()
def _init_b_dec_to_mean(sae: Any, acts: torch.Tensor) -> None:
    """Without our centring, start the decoder bias at the data mean (in the units the SAE sees
    after SAELens scales its input) rather than spend the short CPU runs learning it."""
    mean = acts.mean(0)
    if sae.cfg.normalize_activations == "expected_average_only_in":
        mean = mean * acts.shape[1] ** 0.5 / acts.norm(dim=1).mean().clamp(min=1e-8)
    sae.b_dec.data.copy_(mean.to(sae.b_dec.dtype).to(sae.b_dec.device))


def shuffled_batches(acts: torch.Tensor, batch_size: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless data provider for `SAETrainer`: seeded reshuffles of `acts`, full batches only."""
    n = acts.shape[0]
    batch_size = min(batch_size, n)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, batch_size):
            yield acts[order[start:start + batch_size]]


def _trainer_class():
    SAETrainer = import_from("sae_lens", "SAETrainer")

    class UnitNormSAETrainer(SAETrainer):
        """SAELens' trainer with RISE's constraint: decoder rows back to unit norm after each step.

        `step` is the trainer's public per-batch seam (`fit` calls it), so the constraint holds
        at every step without re-implementing the loop.
        """

        def step(self, batch: torch.Tensor):
            out = super().step(batch)
            _renormalise_decoder(self.sae)
            return out

    return UnitNormSAETrainer


def train_sae(
    acts: torch.Tensor,
    settings: SAETrainSettings | None = None,
    metadata: dict[str, Any] | None = None,
    eval_acts: torch.Tensor | None = None,
) -> tuple[Any, SAEStats]:
    """Train an SAE on `acts` [n, d_in] and return (SAELens SAE with unit-norm decoder rows, stats).

    `settings` defaults to `SAETrainSettings.scaled(d_in, n)`. `metadata` (e.g. model_name,
    hook_name) is saved in `cfg.json`. Stats are measured on `eval_acts` (default: `acts`).
    """
    config = import_module("sae_lens.config")
    LoggingConfig, SAETrainerConfig = config.LoggingConfig, config.SAETrainerConfig

    acts = _as_matrix(acts)
    n, d_in = acts.shape
    settings = settings or SAETrainSettings.scaled(d_in, n)
    settings.validate(d_in, n)
    batch = min(settings.batch_size, n)
    sae = make_training_sae(d_in, settings, metadata)
    centre, scale = _centring(acts) if settings.normalize_activations == CENTRED else (None, None)
    train_acts = (acts - centre) * scale if centre is not None else acts
    if centre is None:
        _init_b_dec_to_mean(sae, acts)
    cfg = SAETrainerConfig(
        total_training_samples=settings.steps * batch,
        train_batch_size_samples=batch,
        lr=settings.lr,
        lr_end=0.0,
        lr_scheduler_name=settings.lr_schedule,
        lr_warm_up_steps=settings.warmup_steps,
        device=settings.device,
        # Dead-latent bookkeeping in SAELens units (steps); our own stats count on the data.
        dead_feature_window=max(50, settings.steps // 4),
        feature_sampling_window=max(100, settings.steps // 2),
        logger=LoggingConfig(log_to_wandb=False),
        n_batches_for_norm_estimate=max(1, min(100, n // batch)),
    )
    provider = shuffled_batches(train_acts.to(settings.device), batch, seed=settings.seed)
    trainer = _trainer_class()(cfg, sae, provider)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _quiet_progress(not settings.progress):
        torch.manual_seed(settings.seed)
        trainer.fit()
    seconds = time.perf_counter() - started
    if centre is not None:
        _fold_centring(sae, centre, scale)
    # Folding an input scale divides W_dec by it (SAELens does the same for its own scaling);
    # folding the decoder norms into the encoder restores unit rows with the same function.
    sae.fold_W_dec_norm()
    sae.eval()
    stats = sae_stats(sae, acts if eval_acts is None else _as_matrix(eval_acts))
    stats.train_seconds = seconds
    stats.activations_per_second = settings.steps * batch / max(seconds, 1e-9)
    stats.settings = settings.to_dict()
    return sae, stats


def _as_matrix(acts: Any) -> torch.Tensor:
    acts = torch.as_tensor(acts)
    if acts.ndim != 2 or acts.shape[0] == 0 or acts.shape[1] == 0:
        raise BadInputError(f"activations must be a non-empty [n, d] matrix, got shape {tuple(acts.shape)}")
    acts = acts.float()
    if not torch.isfinite(acts).all():
        raise BadInputError("activations contain NaN or infinite values")
    return acts


class _quiet_progress:
    """Silence SAELens' tqdm bars (training, norm estimate) when progress=False (tests, benchmarks)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self):
        if self.quiet:
            from functools import partial

            scaler_module = import_module("sae_lens.training.activation_scaler")
            trainer_module = import_module("sae_lens.training.sae_trainer")

            for module in (trainer_module, scaler_module):
                self._saved.append((module, module.tqdm))
                module.tqdm = partial(module.tqdm, disable=True)
        return self

    def __exit__(self, *exc):
        for module, original in self._saved:
            module.tqdm = original
        self._saved.clear()


def sae_throughput(d_in: int = 576, n: int = 8192, steps: int = 100, architecture: str = "standard",
                   device: str = "cpu") -> dict[str, Any]:
    """Training throughput (activations/s) of the SAELens loop on random data of width `d_in`."""
    acts = torch.randn(n, d_in, generator=torch.Generator().manual_seed(0))
    settings = SAETrainSettings.scaled(d_in, n, architecture=architecture, steps=steps, progress=False, device=device)
    _, stats = train_sae(acts, settings)
    return {"d_in": d_in, "d_sae": settings.d_sae, "batch": settings.batch_size, "steps": steps,
            "device": device, "architecture": architecture, "seconds": stats.train_seconds,
            "activations_per_s": stats.activations_per_second}
