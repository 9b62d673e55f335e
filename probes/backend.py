"""The Backend protocol: what a page or an analysis may ask of a model, wherever it lives.

Two implementations: `probes.engine.Engine` (in-process) and `probes.client.RemoteBackend`
(HTTP to `thoughtscope serve`). Pages and analyses take a `Backend` and never check which one
they have; a page states what it needs with `require(backend, ...)` against `capabilities()`
(an `ndif:` engine, for instance, traces but cannot fork or steer).

Prefix states (`prefill`/`fork`/`free`) are opaque handles with `.id`, `.ids` (the tokens) and
`.fingerprint` (the model): in-process they hold the KV cache, through the server they name a
state the server holds (bounded in number and bytes, with a time-to-live). A fork never changes
its state.

Example:
    >>> from probes import Engine
    >>> backend: Backend = Engine.from_id("tiny-random:llama")
    >>> require(backend, "fork")
    >>> state = backend.prefill("2 + 2 =")
    >>> [r.token_id for r in backend.fork(state, " The answer is", max_new_tokens=2)] == \\
    ...     [r.token_id for r in backend.fork(state, " The answer is", max_new_tokens=2)]
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from probes.arch import ArchInfo
from probes.records import Readout, TokenRecord, Trace
from thoughtscope.errors import BadInputError


class PrefixHandle(Protocol):
    """What a method may read of a prefix state (`probes.engine.PrefixState`, `probes.client.RemotePrefix`)."""

    @property
    def id(self) -> str: ...

    @property
    def ids(self) -> list[int]: ...

    @property
    def fingerprint(self) -> str: ...


class TokenStream(Protocol):
    """What `generate` returns: the records as they are made (`probes.engine.GenerationStream`,
    `probes.client.RemoteStream`); `records` holds those seen so far, `close()` stops the generation."""

    records: list[TokenRecord]

    def __iter__(self) -> Iterator[TokenRecord]: ...

    def __next__(self) -> TokenRecord: ...

    def close(self) -> None: ...

    def text(self, batch_index: int = 0) -> str: ...


@runtime_checkable
class Backend(Protocol):
    # ----- the model -----

    def info(self) -> dict[str, Any]:
        """Model id, fingerprint, device, dtype, family, `arch` facts as a dict (see `ModelHandle.info`);
        read model facts through `arch()`, which types them."""

    def arch(self) -> ArchInfo:
        """The model's architecture facts (layers, heads, widths, vocabulary, experts), typed."""

    def sites(self) -> list[dict[str, Any]]:
        """Every hook site of the model: rows of site, shape, tl_hook, doc."""

    def capabilities(self) -> dict[str, bool]:
        """What this backend can do: generate, trace, interventions, fork, capture_batch, readout,
        grad, attention, kv_policy, router, vision, head_gates (see `probes.engine.CAPABILITIES`)."""

    # ----- tokens -----

    def encode(self, prompt: Any, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Text, chat messages or token ids -> token ids, with every prompt check (see `probes.tokens`)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Per-token texts that concatenate to the decoded text."""

    def eos_ids(self) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...

    # ----- running the model -----

    def generate(self, prompt: Any = None, *, prompts: Sequence[Any] | None = None, n_samples: int = 1,
                 max_new_tokens: int = 64, sampling: Any = None, seed: int = 0, capture: Sequence[str] = (),
                 interventions: Sequence[Any] = (), top_k: int = 5, stop: Sequence[str] = (),
                 chat: bool = False, images: Any = None) -> TokenStream:
        """Stream one record per new token (see `Engine.generate`); a VLM takes `images` (one per prompt)."""

    def trace(self, text: Any, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False, images: Sequence[Any] | None = None) -> Trace:
        """One teacher-forced pass (see `Engine.trace`)."""

    def capture(self, text: Any, capture: Sequence[str], interventions: Sequence[Any] = (),
                chat: bool = False, images: Sequence[Any] | None = None) -> dict[str, torch.Tensor]:
        """One forward, the named sites out: {site: [seq, ...]}."""

    def capture_batch(self, sequences: Sequence[list[int]], capture: Sequence[str], prefix: Any = None,
                      stop_after_last_site: bool = True, positions: Sequence[Sequence[int]] | None = None,
                      interventions: Sequence[Any] = (), images: Any = None) -> dict[str, torch.Tensor]:
        """Batched teacher-forced capture, optionally reusing a prefix state, keeping only `positions`,
        under `interventions`; a VLM takes `images`, one entry per sequence (None: a row without one)."""

    def head_means(self, texts: Sequence[str], layer: int) -> torch.Tensor:
        """Mean per-head attention output at `z.layer` [n_heads, head_dim] (for mean ablation)."""

    def readout(self, vectors: torch.Tensor, *, norm: bool = True, top_k: int = 10, bottom_k: int = 0,
                token_ids: Sequence[int] | None = None) -> Readout:
        """Vectors decoded through the unembedding (the logit lens with `norm`, feature words without)."""

    def minimize_entropy(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], site: str,
                         basis: torch.Tensor, *, iterations: int = 30, lr: float = 0.01, batch_size: int = 8,
                         seed: int = 0, on_step: Any = None) -> Any:
        """Coefficients over `basis` that lower next-token entropy (see `probes.optimize`)."""

    def input_x_gradient(self, text: Any, *, target: str = "logprob", positions: Sequence[int] | None = None,
                         token: int | None = None, foil: int | None = None, sites: Sequence[str] = (),
                         interventions: Sequence[Any] = (), chat: bool = False,
                         images: Sequence[Any] | None = None) -> Any:
        """Input x gradient of one output (`probes.gradients.GradientAttribution`)."""

    # ----- prefix states -----

    def prefill(self, prompt: Any, chat: bool = False, base: Any = None, images: Any = None) -> PrefixHandle:
        """Run a prefix once (extending `base` when given) and keep its state for forks; a VLM takes the
        prompt's `images` (then forks start after the image tokens)."""

    def fork(self, state: Any, suffix: str | list[int], max_new_tokens: int = 16, capture: Sequence[str] = (),
             top_k: int = 5, stop: Sequence[str] = (), at: int | None = None,
             interventions: Sequence[Any] = ()) -> list[TokenRecord]:
        """Greedy continuation of `state` (or of its first `at` tokens) plus `suffix`, under `interventions`."""

    def free(self, state: Any) -> None:
        """Release a prefix state."""

    # ----- RLKV head gates (capability "head_gates": in-process only) -----

    def head_gates(self, sink: int = 128, recent: int = 256, init: float = 1.0, gates: Any = None) -> Any:
        """A `probes.gates.GateSession` (see `Engine.head_gates`); `require(backend, "head_gates")` first."""


def require(backend: Backend, *needed: str) -> None:
    """Raise a `BadInputError` naming what is missing when `backend` lacks a capability."""
    have = backend.capabilities()
    missing = [name for name in needed if not have.get(name, False)]
    if missing:
        info = backend.info()
        model = info.get("model_id", "this model")
        why = ""
        if info.get("remote"):  # an ndif: model says why it refuses each (probes.ndif.VERDICTS)
            from probes.ndif import verdict

            why = "; ".join(f"{name}: {verdict(name)[1]}" for name in missing) + "; "
        raise BadInputError(f"{model} cannot do {', '.join(missing)} on this backend "
                            f"({why}it can: {', '.join(k for k, v in have.items() if v)})")


def open_backend(model: str | None = None, server: str | None = None, token: str | None = None,
                 timeout: float = 600.0, **load_kwargs: Any) -> Backend:
    """The backend a CLI or script asked for: a model server at `server`, else `model` in this process."""
    if server is not None:  # an empty --server is a mistake, not "in this process"
        from probes.client import RemoteBackend
        from thoughtscope import checks

        backend = RemoteBackend(checks.server_url(server), token=token, timeout=timeout)
        backend.info()  # fail now, with the server's message, if it is not there or not ready
        return backend
    from probes.engine import Engine

    return Engine.from_id(model or "smollm2-135m", **load_kwargs)
