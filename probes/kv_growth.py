"""A KV cache layer that grows in place: keys and values are written into a buffer with room to spare, grown
by half (rounded to `CHUNK` positions) when full, instead of transformers' one concatenation per step.

Why (issue 28, the batch-rows growth curve on SmolLM2-135M): transformers' `DynamicLayer` makes a new tensor
of every layer's keys and values at every decode step (`torch.cat`), a little larger each time, and frees the
old one. On CPU that leaves the process' heap full of freed blocks just too small for the next request, so
the peak resident memory of a batch grew faster than its data: 64 rows x 64 tokens held a 189 MB KV cache
and peaked at 448 MB in the curve's process (122 MB at 32 rows; top / linear 1.83). With this layer each
layer allocates once for such a batch (the prompt's positions rounded up to 64 hold the 32 new tokens too):
measured in one process running the curve's sizes in order, 64 rows peaked at 314 against 408 MB (top /
linear 1.018 against 1.299), the same tokens, the same speed (1,024-token stream with all sites captured
67.6 / 69.9 against 67.4 / 71.4 s; 64 rows x 32 tokens 16.9 / 16.8 against 16.8 / 16.9 s, alternated).
A long stream reallocates each layer about log1.5(n) times instead of n (and copies its cache as often).

Only a buffer the layer made itself is written in place: a layer whose keys were replaced (a fork's view of a
prefix state, crop, a batch reordered, a copy of the layer) starts a new buffer of exactly what it holds plus
the new positions, rounded to `CHUNK`, so a state's cache that forks share is never written by them. The maker
is known by a weak reference to it, not by `id()`: a copy made after its original was freed often gets the
original's address (CPython reuses it at once), and with an `id()` check such a copy wrote into the shared
buffer over positions a later copy of the original still showed (200 of 200 trials in
`tests/test_kv_growth.py`). The engine's paths keep the maker alive (a state taken from a live stream holds
the stream's cache itself; a fork's copies write into buffers of their own), so none of them reached it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

CHUNK = 64  # positions a buffer is rounded up to
GROWTH = 1.5  # a full buffer grows to this many times what it holds


def next_capacity(held: int, adding: int, capacity: int | None) -> int:
    """The buffer size after adding `adding` positions to `held` ones in a buffer of `capacity` (None: the
    layer holds no buffer of its own yet): unchanged when they fit."""
    need = held + adding
    if capacity is not None and need <= capacity:
        return capacity
    want = need if capacity is None else max(need, int(held * GROWTH))
    return -(-want // CHUNK) * CHUNK


def capacity_after(first: int, total: int) -> int:
    """The buffer size of a layer that took `first` positions in one update, then one per step to `total`
    (a stream: the prompt, then its new tokens): what the memory budget counts."""
    capacity = next_capacity(0, first, None)
    held = first
    while held < total:
        grown = next_capacity(held, 1, capacity)
        if grown == capacity:  # no growth until the buffer is full: jump there
            held = min(total, capacity)
            continue
        capacity, held = grown, held + 1
    return capacity


class GrowingLayer(DynamicLayer):
    """transformers' dynamic cache layer, written in place into a buffer that grows by half (module docstring)."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _view: torch.Tensor | None = None  # the keys this layer last handed out: still its own while `keys` is it
    _owner: weakref.ref | None = None  # the layer that made the buffers (a copy of the layer is not it)
    allocations = 0  # buffers made by this layer (tests count the work)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        adding = key_states.shape[-2]
        own = (self._buffers is not None and self._owner is not None and self._owner() is self
               and self.keys is self._view)
        capacity = self._buffers[0].shape[-2] if own else None
        size = next_capacity(held, adding, capacity)
        if size != capacity:
            b, h, _, d = key_states.shape
            keys = key_states.new_empty(b, h, size, d)
            values = value_states.new_empty(b, value_states.shape[1], size, value_states.shape[-1])
            if held:
                keys[..., :held, :] = self.keys
                values[..., :held, :] = self.values
            self._buffers, self._owner = (keys, values), weakref.ref(self)
            self.allocations += 1
        assert self._buffers is not None
        keys, values = self._buffers
        keys[..., held:held + adding, :] = key_states
        values[..., held:held + adding, :] = value_states
        self.keys, self.values = keys[..., :held + adding, :], values[..., :held + adding, :]
        self._view = self.keys
        return self.keys, self.values

    def __getstate__(self) -> dict[str, Any]:
        """A pickled layer (a weak reference does not pickle) leaves its maker behind: it is a copy."""
        state = dict(self.__dict__)
        state.pop("_owner", None)
        return state


def growing(cache: Any) -> Any:
    """`cache` (a transformers DynamicCache) with its plain dynamic layers growing in place; sliding-window and
    other layers stay as they are."""
    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache
