"""The float arithmetic of this machine, as one short fingerprint, and comparisons for rebuilds made elsewhere.

A shipped file (a trained toy, a stored result) is rebuilt byte for byte by its command on the kind of CPU
it was built on: one thread, deterministic algorithms, a fixed seed. On another kind of CPU the same
code takes other kernels (PyTorch's CPU dispatch picks AVX-512 or AVX2 code, MKL's sgemm blocks its sums
differently), so floats differ in their last bits, and a training run (whose routing and updates amplify
those bits) ends on other weights. `fingerprint()` runs a small fixed workload on the kernels our builds
use (matrix products of several shapes, softmax, exp, RMS and layer norm, SiLU, attention, a backward
pass, AdamW steps) on one thread and hashes the output bits: two machines with the same fingerprint
compute those kernels identically. Every ship records it in its manifest (`numerics`), so a rebuild test
knows whether to expect the same bytes (same fingerprint) or only the same result within float tolerance
(`close`).

Example:
    >>> fingerprint() == fingerprint()
    True
    >>> mismatches({"a": [1.0, 2.0], "n": 3}, {"a": [1.0, 2.0 + 1e-7], "n": 3})
    []
    >>> mismatches({"a": [1.0], "n": 3}, {"a": [1.5], "n": 4})
    ['a[0]: 1.0 != 1.5', 'n: 3 != 4']
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Iterator
from typing import Any

RTOL = 1e-4  # float fields of a rebuilt result made on other numerics (last bits of float32 sums, carried on)
ATOL = 1e-6


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread inside (a fixed reduction order: what a byte-for-byte rebuild needs), the caller's
    thread count restored after, also on an error; a decorator too (every shipped build uses it, so a test
    or a page that builds in-process keeps its threads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """16 hex digits naming this machine's float arithmetic for the kernels our builds use (one thread)."""
    import torch

    with one_thread():
        g = torch.Generator().manual_seed(0)
        outs = []
        for m, k, n in ((1, 64, 64), (37, 96, 160), (128, 576, 576), (64, 1536, 576), (7, 45, 49152)):
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) / math.sqrt(k)
            outs.append(a @ b)
        x = torch.randn(4, 33, 64, generator=g)
        outs += [torch.softmax(x, -1), x.exp(), torch.nn.functional.silu(x), torch.tanh(x), x.float().sum(-1),
                 x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
                 torch.nn.functional.layer_norm(x, (64,)), x.cumsum(1), torch.log_softmax(x, -1)]
        q, kk, v = (torch.randn(2, 4, 33, 16, generator=g) for _ in range(3))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))
        w1 = torch.nn.Parameter(torch.randn(64, 96, generator=g) * 0.1)
        w2 = torch.nn.Parameter(torch.randn(96, 45, generator=g) * 0.1)
        opt = torch.optim.AdamW([w1, w2], lr=3e-3, weight_decay=0.01)
        target = torch.randint(0, 45, (4 * 33,), generator=g)
        for _ in range(3):
            logits = torch.nn.functional.silu(x.reshape(-1, 64) @ w1) @ w2
            loss = torch.nn.functional.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        outs += [w1.detach(), w2.detach()]
        digest = hashlib.sha256()
        for t in outs:
            digest.update(t.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


def same_numerics(manifest: dict[str, Any]) -> bool:
    """Whether a shipped manifest was built on this machine's float arithmetic (absent: not known, so no)."""
    return manifest.get("numerics") == fingerprint()


def describe() -> dict[str, Any]:
    """The fingerprint with what a reader needs to see which CPU it stands for."""
    import platform

    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    return {"numerics": fingerprint(), "cpu": {"model": model or platform.processor(),
                                               "capability": torch.backends.cpu.get_cpu_capability(),
                                               "machine": platform.machine()}}


def mismatches(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL, path: str = "") -> list[str]:
    """Where two JSON-like values differ beyond float tolerance: floats within `rtol`/`atol`, everything
    else (ints, strings, keys, lengths) exactly. Empty when they agree."""
    where = path or "value"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))} in one only"]
        return [m for k in sorted(a) for m in mismatches(a[k], b[k], rtol, atol, f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in mismatches(x, y, rtol, atol, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and (a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b))):
            return []
        return [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
