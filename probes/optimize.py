"""Gradient fits through a frozen model: coefficients over a basis of directions that lower entropy.

RISE's confidence vectors (Zhang et al., arXiv 2512.23988; METHODS.md section 1, item 10) learn
coefficients S over all SAE decoder columns W such that adding `S @ W` to the residual stream at
one site minimises the model's next-token entropy; the model stays frozen and only S learns.
This is the one place that needs gradients through the whole model for a method, so it is an
engine operation (and a model-server endpoint): an analysis hands over token sequences and a
basis and gets coefficients back, never touching the model's modules.

Example:
    >>> import torch
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> seqs = [engine.encode("2 + 2 = 4 and 3 + 3 = 6")]
    >>> fit = engine.minimize_entropy(seqs, [3], "resid_post.0", torch.randn(8, 64), iterations=3)
    >>> fit.coefficients.shape, len(fit.history)
    (torch.Size([8]), 3)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probes.sites import get_module, parse_site
from thoughtscope import checks
from thoughtscope.errors import BadInputError

MAX_BASIS = 65_536


@dataclass
class EntropyFit:
    """Coefficients [n_basis] and the mean next-token entropy after each iteration."""

    coefficients: torch.Tensor
    history: list[float]
    settings: dict[str, Any]


def check_entropy_fit(arch: Any, sequences: Sequence[Sequence[int]], starts: Sequence[int], site: str,
                      basis: torch.Tensor, iterations: int, lr: float, batch_size: int) -> torch.Tensor:
    """Every argument checked before any model work; returns the basis as float [n, d_model]."""
    s = parse_site(site)
    if s.kind not in ("resid_pre", "resid_post", "attn_out", "mlp_out") or s.layer is None:
        raise BadInputError(f"entropy fits add the basis at a residual site (resid_post.L, ...), not {site!r}")
    if not 0 <= s.layer < arch.n_layers:
        raise BadInputError(f"site {site!r}: this model has layers 0..{arch.n_layers - 1}")
    basis = torch.as_tensor(basis).float()
    if basis.ndim != 2 or basis.shape[1] != arch.d_model or not 1 <= basis.shape[0] <= MAX_BASIS:
        raise BadInputError(f"the basis must be [n, {arch.d_model}] with 1 <= n <= {MAX_BASIS}; got {tuple(basis.shape)}")
    if not torch.isfinite(basis).all():
        raise BadInputError("the basis contains NaN or infinite values")
    if not sequences or len(sequences) != len(starts):
        raise BadInputError("give one start (index of the first generated token) per token sequence")
    for seq, start in zip(sequences, starts):
        if not 1 <= int(start) < len(seq):
            raise BadInputError(f"start {start} must be inside its sequence of {len(seq)} tokens (after the prompt)")
    checks.integer("iterations", iterations, low=1, high=100_000)
    checks.number("the learning rate", lr, low=0, low_open=True)
    checks.integer("batch_size", batch_size, low=1, high=1024)
    return basis


def minimize_entropy(handle: Any, sequences: Sequence[Sequence[int]], starts: Sequence[int], site: str,
                     basis: torch.Tensor, *, iterations: int = 30, lr: float = 0.01, batch_size: int = 8,
                     seed: int = 0, pad_id: int = 0,
                     on_step: Callable[[int, float], None] | None = None) -> EntropyFit:
    """Adam (cosine schedule) on S [n_basis]: minimise the mean next-token entropy at the positions
    that predict generated tokens (from `starts[i] - 1` on) when `S @ basis` is added at `site`
    at those positions — where a `where="generated"` intervention acts during generation."""
    basis = check_entropy_fit(handle.arch, sequences, starts, site, basis, iterations, lr, batch_size)
    dev = handle.device
    w = basis.to(dev)
    coeffs = torch.zeros(w.shape[0], device=dev, requires_grad=True)
    opt = torch.optim.Adam([coeffs], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, iterations))
    module = get_module(handle.model, parse_site(site).module_path(handle.family))
    rng = random.Random(seed)
    state: dict[str, torch.Tensor] = {}

    def add_at_predicting(_m: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + state["predict"].unsqueeze(-1) * (coeffs @ w).to(hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    history: list[float] = []
    hook = module.register_forward_hook(add_at_predicting)
    try:
        with torch.enable_grad():
            for i in range(iterations):
                chosen = [rng.randrange(len(sequences)) for _ in range(batch_size)]
                ids, mask, predict = _padded([sequences[c] for c in chosen], [starts[c] for c in chosen], pad_id, dev)
                state["predict"] = predict.float()
                hidden = handle.model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
                logits = handle.model.get_output_embeddings()(hidden[predict.bool()]).float()
                logp = torch.log_softmax(logits, -1)
                entropy = -(logp.exp() * logp).sum(-1).mean()
                opt.zero_grad()
                entropy.backward()
                opt.step()
                sched.step()
                history.append(entropy.item())
                if on_step:
                    on_step(i + 1, history[-1])
    finally:
        hook.remove()
    settings = {"iterations": iterations, "lr": lr, "batch_size": batch_size, "seed": seed, "schedule": "cosine",
                "site": site, "n_basis": int(w.shape[0])}
    return EntropyFit(coeffs.detach().cpu(), history, settings)


def _padded(seqs: Sequence[Sequence[int]], starts: Sequence[int], pad_id: int, dev: Any):
    """Right-padded ids, attention mask, and the positions whose output predicts a generated token."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=dev)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
    predict = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
    for b, (seq, start) in enumerate(zip(seqs, starts)):
        ids[b, :len(seq)] = torch.tensor(list(seq), device=dev)
        mask[b, :len(seq)] = 1
        predict[b, int(start) - 1:len(seq) - 1] = 1
    return ids, mask, predict
