"""Counting model work in tests: a test that says "refused before any model work" counts forward calls."""

from __future__ import annotations

import torch


class ForwardCounter:
    """Counts calls of a model's top-level forward: any model work goes through it."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1
