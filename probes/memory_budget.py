"""Memory bounds: the estimated size of an engine call, refused before any model work when over a budget.

A capture of every layer's attention pattern over a 4,096-token chain of thought is
`layers x heads x 4096^2` floats (for SmolLM2: 30 x 9 x 4096^2 x 4 bytes = 18 GiB); a stream that keeps
every site for 2,048 new tokens, or a trace's per-position log-probabilities over a 49k vocabulary,
grow the same way. Rather than let such a call run until the machine swaps or the GPU runs out,
the engine estimates what the call will hold (`estimate`) and refuses it (`MemoryBudgetError`,
HTTP 413 through the server) with the estimate and its parts in the message.

What is counted (bytes of the model's dtype unless said otherwise; B rows, T tokens per row, N new tokens):
- captured activations: B x T x width per site (width: d_model, heads x head_dim, kv_heads x head_dim,
  experts); a stream keeps one position per step: B x N x width;
- attention patterns: B x heads x T x T per captured `attn_pattern` site (a stream: B x heads x N x (T + N/2));
- the attention working set: with eager attention (attention patterns need it) one layer's scores and
  softmax, 2 x B x heads x T x T, alive while the layer runs;
- logits: a trace keeps B x T x vocab in the model's dtype plus three float32 copies (log-softmax,
  its exponent, their product for the entropies); a capture or a stream keeps the last position only;
- the KV cache of a generation, a prefill or a fork: 2 x layers x kv_heads x head_dim x B x the positions its
  buffers hold after T + N (`probes.kv_growth.capacity_after`: rounded to 64, grown by half when full);
- a stream's token records: B x N x 2 KiB of Python objects (top-k texts, lists, dicts: measured with
  tracemalloc on 400-token streams, 1.96-2.15 KB per record with top-5);
- a stream's captured values as objects: each record holds one tensor per captured site, a view into the
  site's block (`probes.hooks.StepBlocks`), B x N x sites x 640 bytes (the tensor object and its dict entry:
  566-806 bytes per value measured as resident memory over 4,000 records of 1, 3 and 30 sites, torch 2.13;
  tracemalloc does not see them), and the slots of each site's last block not yet written
  (`StepBlocks.slots_for`: blocks of 16, 32, ... up to 256 slots or 1 MiB);
- a gradient's saved activations: layers x B x T x (6 d_model + 3 d_mlp) float32 (and the eager
  attention of every layer, when patterns are read).

The budget: `THOUGHTSCOPE_MEMORY_BUDGET` (bytes, or with a unit: `8GiB`, `500MB`; `off` turns the
check off), else half the device's memory (RAM for the CPU, the GPU's total memory for CUDA). It is
an estimate, not a measurement: the model's weights and the allocator's slack are not in it.

Example:
    >>> from probes.arch import ArchInfo
    >>> arch = ArchInfo("llama", 2, 4, 2, 16, 64, 128, 1000, 4096)
    >>> estimate(arch, 4, mode="capture", lengths=[4096], sites=["attn_pattern.0"], eager=True).parts["attention patterns"]
    268435456
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.hooks import StepBlocks
from probes.kv_growth import capacity_after
from thoughtscope.errors import BadInputError, MemoryBudgetError

ENV_VAR = "THOUGHTSCOPE_MEMORY_BUDGET"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TEACHER_FORCED = ("trace", "capture", "capture_batch", "gradient")
_KEEPS_KV = ("generate", "fork", "prefill")
RECORD_BYTES = 2048  # Python objects of one TokenRecord with top-5 (measured, module docstring)
VALUE_OBJECT_BYTES = 640  # one captured value held by a record: its tensor object and dict entry (measured)


@dataclass(frozen=True)
class MemoryEstimate:
    """What one call would hold, by part (bytes)."""

    mode: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = [f"{name} {format_bytes(n)}" for name, n in sorted(self.parts.items(), key=lambda kv: -kv[1]) if n]
        return f"about {format_bytes(self.total)} ({', '.join(shown) or 'nothing'})"


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int | None:
    """'8GiB' -> 8589934592, '500 MB' -> 500000000, '1e9' -> 1000000000; 'off' -> None (no budget)."""
    value = str(text).strip().lower().replace("_", "")
    if value in ("off", "none", "unlimited"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)", value)
    if match is None or match.group(2) not in _UNITS:
        raise BadInputError(f"{ENV_VAR}={text!r} is not a size; write bytes or a size with a unit "
                            "(8GiB, 500MB) or 'off'")
    n = int(float(match.group(1)) * _UNITS[match.group(2)])
    if n < 1:
        raise BadInputError(f"{ENV_VAR}={text!r}: the budget must be at least one byte (or 'off')")
    return n


def device_memory_bytes(device: Any = "cpu") -> int:
    """The device's total memory: the GPU's for a CUDA device, else this machine's RAM."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def budget_bytes(device: Any = "cpu") -> int | None:
    """The budget in force: the environment variable, else half the device's memory (None: no budget)."""
    configured = os.environ.get(ENV_VAR, "").strip()
    if configured:
        return parse_bytes(configured)
    return device_memory_bytes(device) // 2


def _site_width(kind: str, arch: Any) -> tuple[int, int]:
    """(values per position, bytes per value or 0 for the model's dtype) of a non-pattern site."""
    if kind in ("q", "z"):
        return arch.n_heads * arch.head_dim, 0
    if kind in ("k", "v"):
        return arch.n_kv_heads * arch.head_dim, 0
    if kind == "router":
        return max(arch.n_experts, 1), 0
    if kind == "experts":
        return max(arch.experts_top_k, 1), 8  # int64 indices
    if kind == "expert_gates":
        return max(arch.experts_top_k, 1), 0
    if kind == "logits":
        return arch.vocab_size, 0
    return arch.d_model, 0


def estimate(arch: Any, dtype_bytes: int, *, mode: str, lengths: Sequence[int], rows: int = 1,
             sites: Sequence[Any] = (), max_new_tokens: int = 0, eager: bool = False) -> MemoryEstimate:
    """The bytes a call of `mode` over sequences of `lengths` would hold (module docstring: what is counted).

    `rows` is the batch rows each sequence runs as in a teacher-forced pass (row masks); `sites` are
    site names or `Site`s; `eager` says whether attention runs eagerly (its scores materialised)."""
    names = [s if isinstance(s, str) else s.name for s in sites]
    kinds = [name.rpartition(".")[0] or name for name in names]
    batch = max(len(lengths), 1) * (rows if mode in _TEACHER_FORCED else 1)
    seq = max(lengths, default=0)
    new = max_new_tokens if mode in ("generate", "fork") else 0
    streamed = mode in ("generate", "fork")  # one position captured per step
    eager = eager or "attn_pattern" in kinds
    s = dtype_bytes
    captured = patterns = unwritten = 0
    for kind in kinds:
        if kind == "attn_pattern":
            if streamed:
                patterns += batch * arch.n_heads * new * (seq + (new + 1) // 2) * s
            else:
                patterns += batch * arch.n_heads * seq * seq * s
            continue
        width, size = _site_width(kind, arch)
        captured += batch * (new if streamed else seq) * width * (size or s)
        if streamed and new:  # a step's value [B, 1, width] is one slot of the site's blocks
            slot = batch * width * (size or s)
            unwritten += (StepBlocks.slots_for(new, slot) - new) * slot
    parts = {"captured activations": captured, "attention patterns": patterns}
    if streamed:
        parts["unwritten capture slots"] = unwritten
        parts["captured value objects"] = batch * new * len(kinds) * VALUE_OBJECT_BYTES
    if mode == "trace":
        parts["logits"] = batch * seq * arch.vocab_size * (s + 3 * 4)
    elif mode == "gradient":
        parts["logits"] = batch * seq * arch.vocab_size * 3 * 4
    elif "logits" not in kinds:
        parts["logits"] = batch * arch.vocab_size * (s + 3 * 4)
    if streamed:
        parts["token records"] = batch * new * RECORD_BYTES
    if mode in _KEEPS_KV:
        parts["kv cache"] = (2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * batch
                             * capacity_after(seq, seq + new) * s)
    if mode == "gradient":
        parts["saved for backward"] = arch.n_layers * batch * seq * (6 * arch.d_model + 3 * arch.d_mlp) * 4 + (
            arch.n_layers * 2 * batch * arch.n_heads * seq * seq * 4 if eager else 0)
    parts["attention working set"] = 2 * batch * arch.n_heads * seq * seq * s if eager else 0
    parts["layer working set"] = batch * seq * (2 * max(arch.d_mlp, arch.d_model) + 2 * arch.d_model) * s
    return MemoryEstimate(mode, parts)


_REMEDY = {
    "generate": "fewer sequences, fewer new tokens or fewer captured sites",
    "fork": "a shorter suffix, fewer new tokens or fewer captured sites",
    "prefill": "a shorter prompt",
}


def check(estimate_: MemoryEstimate, budget: int | None, what: str = "") -> MemoryEstimate:
    """Raise `MemoryBudgetError` when the estimate is over `budget` (None: no budget); else return it."""
    if budget is None or estimate_.total <= budget:
        return estimate_
    remedy = _REMEDY.get(estimate_.mode, "a shorter text, fewer rows or fewer captured sites (attention "
                                          "patterns grow with the square of the length)")
    raise MemoryBudgetError(
        f"{what or estimate_.mode} would hold {estimate_.describe()}, over the memory budget of "
        f"{format_bytes(budget)}; refused before any model work. Use {remedy}, or raise the budget "
        f"({ENV_VAR}=16GiB, or 'off')")


def dtype_size(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4


def check_handle(handle: Any, *, mode: str, lengths: Sequence[int], rows: int = 1, sites: Sequence[Any] = (),
                 max_new_tokens: int = 0, eager: bool = False, budget: int | None | str = "default",
                 what: str = "") -> MemoryEstimate:
    """Estimate a call on a loaded model (`ModelHandle`) and check it against the budget in force
    (`budget="default"`: `budget_bytes(handle.device)`)."""
    model = getattr(handle, "model", None)
    config = getattr(model, "config", None)
    eager = eager or getattr(config, "_attn_implementation", None) == "eager"
    found = estimate(handle.arch, dtype_size(getattr(handle, "dtype", None)), mode=mode, lengths=lengths,
                     rows=rows, sites=sites, max_new_tokens=max_new_tokens, eager=eager)
    limit = budget_bytes(getattr(handle, "device", "cpu")) if budget == "default" else budget
    return check(found, limit, what)  # type: ignore[arg-type]


def check_call(handle: Any, call: Any) -> MemoryEstimate | None:
    """The engine's check of a bound `probes.calls.Call` (before `with call:` runs any model work)."""
    if getattr(handle, "remote", False):  # an ndif: model's memory is the remote side's business
        return None
    return check_handle(handle, mode=call.mode, lengths=call.lengths, rows=call.rows,
                        sites=list(call.runner._by_site), max_new_tokens=call.max_new_tokens,
                        eager=call.runner.needs_eager, what=f"{call.mode}()")
