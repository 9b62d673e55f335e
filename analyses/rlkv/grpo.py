"""The RL objective of RLKV's gate probe: GRPO without a KL term, plus an adaptive L1 penalty on the gates.

Du et al. 2025 (RLKV, arXiv 2510.08525), Section 3: for each prompt, G completions are sampled
with the current gates and scored with a verifiable 0/1 reward; each completion's advantage is its
reward normalised within its group, A_i = (r_i - mean(r)) / (std(r) + eps); the policy term is
-(1/N) sum_i A_i * mean_t log pi(o_it) over the N completions of a step (one update per batch of
rollouts, so GRPO's clipped ratio equals 1 and its gradient is this one), and the gates pay
beta' * mean(alpha) with beta' = 1[mean reward > tau] * beta * (exp(mean reward) - 1): no sparsity
pressure until the gated model solves more than tau of its problems, more the better it does.

[recon] The std is the sample standard deviation (ddof = 1) with eps = 1e-6, as in verl's GRPO, which
the official code builds on; a group whose rewards are all equal has zero advantage.

Example:
    >>> import torch
    >>> [round(a, 3) for a in group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))[0].tolist()]
    [0.866, -0.866, -0.866, 0.866]
    >>> round(adaptive_l1_weight(0.75, beta=1e-3, tau=0.5), 6), adaptive_l1_weight(0.5, beta=1e-3, tau=0.5)
    (0.001117, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from thoughtscope.errors import BadInputError

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """[prompts, G] rewards -> advantages (r - group mean) / (group sample std + eps)."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.ndim != 2 or r.shape[1] < 2:
        raise BadInputError(f"group advantages need rewards [prompts, G] with G >= 2, got shape {tuple(r.shape)}")
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


def adaptive_l1_weight(mean_reward: float, beta: float, tau: float) -> float:
    """beta' = 1[mean reward > tau] * beta * (exp(mean reward) - 1)."""
    return beta * (math.exp(mean_reward) - 1.0) if mean_reward > tau else 0.0


def policy_loss(token_logprobs: Sequence[torch.Tensor], advantages: Sequence[float] | torch.Tensor,
                n_total: int) -> torch.Tensor:
    """-(1/n_total) * sum_i A_i * mean_t logp_it over the given completions (a micro-batch of the step's
    n_total): micro-batch losses add up to the step's, so each can be backpropagated on its own."""
    if len(token_logprobs) != len(advantages):
        raise BadInputError(f"{len(token_logprobs)} completions but {len(advantages)} advantages")
    terms = [float(a) * lp.mean() for lp, a in zip(token_logprobs, advantages)]
    return -torch.stack(terms).sum() / n_total


def grpo_loss(token_logprobs: Sequence[torch.Tensor], advantages: Sequence[float] | torch.Tensor,
              gates: torch.Tensor, l1_weight: float) -> torch.Tensor:
    """The whole step's loss: the policy term over every completion plus l1_weight * mean(gates).

    >>> lp = [torch.tensor([-1.0, -3.0]), torch.tensor([-0.5])]
    >>> round(float(grpo_loss(lp, [1.0, -1.0], torch.tensor([1.0, 0.5]), 0.1)), 6)  # -(1*(-2) - 1*(-0.5))/2 + 0.1*0.75
    0.825
    """
    return policy_loss(token_logprobs, advantages, len(token_logprobs)) + l1_weight * gates.mean()
