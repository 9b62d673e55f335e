"""Counting model work in tests: a test that says "refused before any model work" counts forward calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ForwardCounter:
    """Counts calls of a model's top-level forward: any model work goes through it. `on(n, fn)` runs `fn` during
    the n-th call (a user pressing Stop while it runs); `pace_s` makes each call take that much longer."""

    def __init__(self, model: torch.nn.Module):
        self.calls, self.pace_s = 0, 0.0
        self._at: dict[int, Any] = {}
        self._hook = model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1
        if self.calls in self._at:
            self._at[self.calls]()
        if self.pace_s:
            time.sleep(self.pace_s)

    def on(self, n: int, fn: Any) -> None:
        self._at[n] = fn

    def remove(self) -> None:
        self._hook.remove()


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
