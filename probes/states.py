"""The model server's prefix states: KV caches held under opaque ids, bounded in number and bytes, with a TTL.

A client of `thoughtscope serve` calls `prefill` and gets an id; `fork`, `capture_batch` and
`prefill(base=...)` name that id; `free` releases it. The server never lets states grow without
bound: beyond `max_states` or `max_bytes` the least recently used states are evicted, and a state
unused for `ttl_s` seconds expires. An evicted, expired or unknown id is a 404 that says so.

Example:
    >>> store = PrefixStore(max_states=2, max_bytes=10**9, ttl_s=60)
    >>> class S:  # anything with id and n_bytes
    ...     def __init__(self, i): self.id, self.n_bytes = i, 10
    >>> for i in "abc": store.put(S(i))
    >>> sorted(store.ids())  # "a" was the least recently used
    ['b', 'c']
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from thoughtscope.errors import RequestTooLargeError, UnknownStateError

DEFAULT_MAX_STATES = 64
DEFAULT_MAX_STATE_BYTES = 2 * 1024**3
DEFAULT_STATE_TTL_S = 900.0


class PrefixStore:
    """Prefix states by id: LRU-evicted beyond `max_states`/`max_bytes`, expired after `ttl_s` unused."""

    def __init__(self, max_states: int = DEFAULT_MAX_STATES, max_bytes: int = DEFAULT_MAX_STATE_BYTES,
                 ttl_s: float = DEFAULT_STATE_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.max_states, self.max_bytes, self.ttl_s = max_states, max_bytes, ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[Any, int, float]] = OrderedDict()  # id -> (state, bytes, last used)
        self._lock = threading.Lock()
        self.evicted = 0
        self.expired = 0

    def put(self, state: Any) -> None:
        size = int(state.n_bytes)
        if size > self.max_bytes:
            raise RequestTooLargeError(f"this prefix state holds {size} bytes, over the server's state budget of "
                                       f"{self.max_bytes}; use a shorter prefix or restart with a larger budget")
        with self._lock:
            self._expire()
            self._items[state.id] = (state, size, self._clock())
            while len(self._items) > self.max_states or self._bytes() > self.max_bytes:
                self._items.popitem(last=False)
                self.evicted += 1

    def get(self, state_id: str) -> Any:
        with self._lock:
            self._expire()
            if state_id not in self._items:
                raise UnknownStateError(
                    f"no prefix state {state_id!r} on this server: it was never made here, was freed, expired after "
                    f"{self.ttl_s:g} s unused, or was evicted to stay within {self.max_states} states / "
                    f"{self.max_bytes} bytes. Call prefill again.")
            state, size, _ = self._items.pop(state_id)
            self._items[state_id] = (state, size, self._clock())
            return state

    def free(self, state_id: str) -> bool:
        with self._lock:
            return self._items.pop(state_id, None) is not None

    def ids(self) -> list[str]:
        with self._lock:
            self._expire()
            return list(self._items)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire()
            return {"states": len(self._items), "bytes": self._bytes(), "max_states": self.max_states,
                    "max_bytes": self.max_bytes, "ttl_s": self.ttl_s, "evicted": self.evicted, "expired": self.expired}

    def _bytes(self) -> int:
        return sum(size for _, size, _ in self._items.values())

    def _expire(self) -> None:
        now = self._clock()
        for state_id in [k for k, (_, _, used) in self._items.items() if now - used > self.ttl_s]:
            del self._items[state_id]
            self.expired += 1
