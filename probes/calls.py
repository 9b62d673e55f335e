"""One engine call (generate, trace, capture, capture_batch, input_x_gradient, fork): what interventions install into.

The engine builds a `Call` per call, binds every intervention once (`Registered.bind`: its checks,
the derived values on a per-call copy, before any model work), and runs the model inside
`with call:`, which enters the hook runner and then each bound intervention's `install(call)`, in
the order given. The engine reads what the bound kinds asked for through a few generic settings,
never through a kind's name:

- `rows`: batch rows a teacher-forced pass runs (row masks ask for more than one);
- `hidden_columns`, `feed_last_alone`: prompt columns no generated token may read (the 2D mask of a
  generation) and whether the last prompt token is fed as a decode step of its own (so it sees them);
- `cache_factory`: the KV cache a generation uses (a KV policy's compressed cache; None: a plain one).

Per-call state (a router's memo, the masker, the compressed cache) lives here, in `parts`, never on
the intervention objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from probes.hooks import HookRunner
from probes.registered import MODES, TEACHER_FORCED, Part, Registered
from probes.sites import Site
from thoughtscope.errors import BadInputError


class Call:
    """The per-call context: the handle, the call's `mode` and batch, the hook `runner`, the bound interventions."""

    def __init__(self, handle: Any, mode: str, *, lengths: Sequence[int] = (), batch_rows: int | None = None,
                 capture: Sequence[Site] = (), max_new_tokens: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown call mode {mode!r}")
        self.handle, self.arch, self.mode = handle, handle.arch, mode
        self.lengths = list(lengths)  # tokens of each sequence (a trace: its one text)
        self.batch_rows = batch_rows  # rows of the batch when the call knows them (per-row values are checked)
        self.max_new_tokens = max_new_tokens
        self.runner = HookRunner(handle, list(capture))
        self.bound: list[Registered] = []
        self.parts: dict[Any, Part] = {}
        # settings the bound kinds set, read by the engine
        self.rows = 1
        self.hidden_columns: list[int] = []
        self.feed_last_alone = False
        self.first_query: int | None = None
        self.cache_factory: Callable[[], Any] | None = None
        self.cache: Any = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def teacher_forced(self) -> bool:
        return self.mode in TEACHER_FORCED

    def bind(self, interventions: Sequence[Any]) -> "Call":
        """Check every intervention once, in order (before any model work), then the joint checks of the parts."""
        for iv in interventions:
            if not isinstance(iv, Registered):
                raise BadInputError(f"{iv!r} is not an intervention (see probes.interventions)")
            cls = type(iv)
            if self.mode not in cls.modes:
                raise BadInputError(cls.elsewhere or f"{cls.__name__} does not apply in {self.mode}()")
            if cls.exclusive and any(type(b).exclusive == cls.exclusive for b in self.bound):
                raise BadInputError(cls.exclusive_hint or f"pass at most one {cls.exclusive} per call")
            if getattr(self.handle, "remote", False):  # an ndif: model serves site edits only (probes.ndif)
                from probes.ndif import check_intervention

                check_intervention(self.handle, iv)
            self.bound.append(iv.bind(self))
        if self.teacher_forced:
            self.rows = max((b.batch_rows() for b in self.bound), default=1)
        for part in list(self.parts.values()):
            part.checked(self)
        return self

    def described(self) -> list[str]:
        return [b.describe() for b in self.bound]

    def part(self, key: Any, factory: Callable[[], Part]) -> Any:
        """The call's shared helper under `key`, made by `factory` on first use."""
        if key not in self.parts:
            self.parts[key] = factory()
        return self.parts[key]

    def new_cache(self, plain: Callable[[], Any]) -> Any:
        """The generation's KV cache: what a bound kind asked for (`cache_factory`), else `plain()`."""
        self.cache = self.cache_factory() if self.cache_factory is not None else plain()
        return self.cache

    def __enter__(self) -> "Call":
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.runner)
            for bound in self.bound:
                stack.enter_context(bound.install(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
