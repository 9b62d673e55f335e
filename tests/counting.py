"""Counting model work in tests: a test that says "refused before any model work" counts forward calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ForwardCounter:
    """Counts calls of a model's top-level forward: any model work goes through it."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


@contextmanager
def counted_tiny_server(limits: Any) -> Iterator[tuple[str, Any, ForwardCounter]]:
    """(url, engine, counter): tiny-random:llama served in this process under `limits`, its forwards counted."""
    from probes import Engine
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    engine = Engine.from_id("tiny-random:llama", device="cpu")
    counter = ForwardCounter(engine.model)
    with serving_in_thread(create_app(engine, max_queue=2, limits=limits)) as url:
        yield url, engine, counter
