"""The base of everything that travels in `interventions=`: a wire name, a spec, and how it installs itself.

Every kind the engine applies (site edits, attention masks, router rules, KV-cache policies)
inherits `Registered`. The pattern is kvpress's `BasePress.__call__` (a context manager that
registers its own hooks): `kind.install(call)` enters whatever that kind needs for one engine
call (a hook on the call's runner, a router forward, an attention masker, a compressed cache), so
the engine knows no kind by name. What a kind can or cannot join is said declaratively, in class
attributes the engine's `probes.calls.Call` reads generically:

- `modes`: the engine calls it may join (`MODES`), `elsewhere` the refusal anywhere else;
- `exclusive`: a name shared by kinds of which one call takes at most one (`exclusive_hint` says why);
- `replaces_attention`: it switches the model's attention function (a session that owns the
  attention, such as `probes.gates.GateSession`, refuses it).

Parameters stay as given (scikit-learn style): `validate(arch)` checks them and returns a per-call
copy holding the derived values (trailing underscore: a unit direction `direction_`, a tensor
`vector_`), never overwriting the object it checks; nothing is validated in `__init__`.

This module imports nothing of the project but the error types, so `probes.attention_masks`,
`probes.interventions`, `probes.routing` and the KV modules can all build on it without a circle.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, ClassVar, TypeVar

from thoughtscope.errors import BadInputError

# The engine calls an intervention can join; `Call.mode` is one of these.
MODES = ("generate", "trace", "capture", "capture_batch", "gradient", "fork")
TEACHER_FORCED = ("trace", "capture", "capture_batch", "gradient")

# Every kind the engine applies, by its wire name. A class registers itself by defining `kind`.
KINDS: dict[str, type["Registered"]] = {}

R = TypeVar("R", bound="Registered")


class Registered:
    """Base of everything that travels in `interventions=`: it has a wire name (`kind`), its spec is
    its constructor's arguments (read back from attributes of the same names), and `tensor_fields`
    name the arguments that are tensors (sent as safetensors bytes, never pickle).

    Subclasses check their parameters in `_check(arch)` (setting derived values with a trailing
    underscore on the per-call copy it runs on), and override `install(call)` to enter what they need."""

    kind: ClassVar[str] = ""
    tensor_fields: ClassVar[tuple[str, ...]] = ()
    modes: ClassVar[tuple[str, ...]] = MODES
    elsewhere: ClassVar[str] = ""
    exclusive: ClassVar[str] = ""
    exclusive_hint: ClassVar[str] = ""
    replaces_attention: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("kind")
        if name:
            if name in KINDS and KINDS[name].__qualname__ != cls.__qualname__:
                raise TypeError(f"two classes claim the intervention kind {name!r}: {KINDS[name]} and {cls}")
            KINDS[name] = cls

    # ----- the spec (what travels over the wire) -----

    @classmethod
    def parameters(cls) -> list[str]:
        """The constructor's argument names: what a spec holds besides `kind`."""
        return [n for n in inspect.signature(cls.__init__).parameters if n != "self"]

    def spec(self) -> dict[str, Any]:
        """{'kind': ..., <constructor argument>: value, ...}; tensors stay tensors (the wire encodes them)."""
        return {"kind": self.kind, **{name: getattr(self, name) for name in self.parameters()}}

    @classmethod
    def from_spec(cls, fields: dict[str, Any]) -> "Registered":
        unknown = sorted(set(fields) - set(cls.parameters()))
        if unknown:
            raise BadInputError(f"{cls.kind!r} takes {cls.parameters()}; unknown field(s) {unknown}")
        try:
            return cls(**fields)
        except TypeError as err:  # a missing required argument
            raise BadInputError(f"{cls.kind!r}: {err}") from err

    # ----- checks and installation (what one engine call does with it) -----

    def validate(self: R, arch: Any) -> R:
        """Check the parameters against the model (before any model work); return the per-call copy that
        holds the derived values. The object itself is never changed."""
        bound = copy.copy(self)
        bound._check(arch)
        return bound

    def _check(self, arch: Any) -> None:
        """Subclasses check their own parameters here (on the per-call copy: derived values end in `_`)."""

    def bind(self: R, call: Any) -> R:
        """The checks of one engine call (`probes.calls.Call`): `validate` plus what depends on the call
        (its batch, its mode). The engine calls it once per call and installs what it returns."""
        return self.validate(call.arch)

    def install(self, call: Any) -> contextlib.AbstractContextManager:
        """Enter what this kind needs for the call in flight; everything is undone on exit."""
        return contextlib.nullcontext()

    def batch_rows(self) -> int:
        """Batch rows a teacher-forced pass runs for this intervention (1: it brings no rows of its own)."""
        return 1

    def describe(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.parameters() if n not in self.tensor_fields)
        return f"{type(self).__name__}({args})"


def kind_of(name: str) -> type[Registered]:
    """The registered class of a wire name; an unknown name lists the known ones."""
    if name not in KINDS:
        raise BadInputError(f"unknown intervention kind {name!r}; known kinds: {', '.join(sorted(KINDS))}")
    return KINDS[name]


class Part:
    """A helper several interventions of one call share (the attention masker, a router's replaced forward),
    made once per call by `Call.part` and entered by every member's `install`: the first enter opens it,
    the last exit closes it. Subclasses override `open`, `close` and, for joint checks over all members
    once every intervention of the call is bound, `checked(call)`."""

    def __init__(self) -> None:
        self._depth = 0

    def checked(self, call: Any) -> None:
        """Joint checks (and the call's settings) once every intervention of the call is bound."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Part":
        if self._depth == 0:
            self.open()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.close()
