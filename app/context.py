"""What every page receives: the `PageContext` the shared sidebar builds (backend, model, prompt, settings).

A page reads the model only through `ctx.backend` (in-process engine or HTTP client alike) and
keys its caches with `ctx.cache_key()`, so two pages asked the same thing share one result.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from probes.engine import Sampling
from thoughtscope.errors import BadInputError, ThoughtscopeError

ChatMessages = list[dict[str, str]]


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings from the sidebar; `top_alternatives` is how many rivals a record keeps."""

    max_new_tokens: int = 48
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    top_alternatives: int = 5

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PageContext:
    """The sidebar's choices. `prompt` is what the user typed; `model_input()` is what the model gets."""

    backend: Any
    model_id: str
    prompt: str
    chat: bool = True
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    seed: int = 0
    server_url: str | None = None
    one_shot: bool = True  # chat mode: prepend the worked example that helps the embedded model

    def model_input(self) -> str | ChatMessages:
        """Raw text, or chat messages (with the one-shot worked example when asked for)."""
        if not self.prompt.strip():
            raise BadInputError("the prompt is empty; type a question in the sidebar (or reload for the example)")
        if not self.chat:
            return self.prompt
        if self.one_shot:
            from analyses.tasks import one_shot_messages

            return one_shot_messages(self.prompt)
        return [{"role": "user", "content": self.prompt}]

    def result_key(self, kind: str, **parts: Any) -> str:
        """A string naming a page's result by its kind, the model behind it and `parts` (not the prompt)."""
        return json.dumps({"kind": kind, "server": self.server_url, "model": self.model_id, **parts},
                          sort_keys=True, default=str)

    def cache_key(self, **extra: Any) -> str:
        """A string naming everything a generation depends on (plus `extra`), for st.cache_data keys."""
        return json.dumps({
            "server": self.server_url, "model": self.model_id, "input": self.model_input(),
            "settings": self.settings.to_dict(), "seed": self.seed, **extra,
        }, sort_keys=True)

    def provenance(self, *, interventions: Sequence[Any] = (), settings: dict[str, Any] | None = None,
                   data: str | None = None, split: str | None = None, prompt: Any = "sidebar",
                   **extra: Any) -> dict[str, Any]:
        """The provenance record of a result made on this page (`thoughtscope.provenance`): model and
        fingerprint, the model input (or `prompt`), seed, generation settings plus `settings`,
        interventions, data set and split."""
        from thoughtscope.provenance import provenance

        if prompt == "sidebar":
            try:
                prompt = self.model_input()
            except BadInputError:
                prompt = self.prompt
        return provenance(
            self.backend.info(), prompt=prompt, data=data, split=split, seed=self.seed,
            settings={"generation": self.settings.to_dict(), "chat": self.chat, "one_shot": self.one_shot,
                      **(settings or {})},
            interventions=interventions, command="thoughtscope app",
            backend=f"server {self.server_url}" if self.server_url else "in-process", **extra)

    def generate(self, **kwargs: Any):
        """Stream token records for the current prompt and settings (see `Engine.generate`)."""
        s = self.settings
        return self.backend.generate(self.model_input(), max_new_tokens=s.max_new_tokens, sampling=s.sampling(),
                                     seed=self.seed, top_k=s.top_alternatives, **kwargs)


class FinishedGenerations:
    """Finished streamed generations, shared by every session of this process (newest 32 kept).

    A streamed generation draws while it runs, which `st.cache_data` cannot replay, so the records
    are kept here once complete: reopening a page with the same prompt and settings shows them at once.
    """

    def __init__(self, max_entries: int = 32):
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def get(self, key: str) -> list[dict[str, Any]] | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: str, records: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[key] = records
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)


@dataclass
class ErrorSpot:
    """What `shows_errors` caught (None when the block ran through)."""

    error: ThoughtscopeError | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@contextlib.contextmanager
def shows_errors(where: Any = None) -> Iterator[ErrorSpot]:
    """Show a user's mistake (a `ThoughtscopeError`) raised in the block right here, as an st.error in
    `where` (default: the current container), instead of in place of the whole page: the controls
    drawn before stay, and the page goes on below.

        with shows_errors() as spot:
            records = generate(ctx)
        if spot.failed:
            return
    """
    import streamlit as st

    spot = ErrorSpot()
    try:
        yield spot
    except ThoughtscopeError as err:
        spot.error = err
        (where if where is not None else st).error(str(err), icon=":material/error:")
