"""The Backend protocol: what a page or an analysis may ask of a model, wherever it lives.

Two implementations: `probes.engine.Engine` (in-process) and `probes.client.RemoteBackend`
(HTTP to `thoughtscope serve`). Pages and analyses take a `Backend` and never check which.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from probes.records import TokenRecord, Trace


@runtime_checkable
class Backend(Protocol):
    def info(self) -> dict[str, Any]:
        """Model id, fingerprint, device, dtype, family, `arch` facts (see `ModelHandle.info`)."""

    def sites(self) -> list[dict[str, Any]]:
        """Every hook site of the model: rows of site, shape, tl_hook, doc."""

    def generate(self, prompt: Any = None, *, prompts: Sequence[Any] | None = None, n_samples: int = 1,
                 max_new_tokens: int = 64, sampling: Any = None, seed: int = 0, capture: Sequence[str] = (),
                 interventions: Sequence[Any] = (), top_k: int = 5, stop: Sequence[str] = (),
                 chat: bool = False) -> Iterator[TokenRecord]:
        """Stream one record per new token (see `Engine.generate`)."""

    def trace(self, text: Any, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False) -> Trace:
        """One teacher-forced pass (see `Engine.trace`)."""
