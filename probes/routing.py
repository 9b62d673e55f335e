"""Router selection rules for mixture-of-experts models: which experts each token uses, with which gates.

A rule sits at `router.L` sites (one layer, or every MoE layer with `site="router.*"`) and replaces the
model's own top-k choice: from the router logits it produces the expert indices and their gates
together, the gates computed the way that family's router computes them (`ROUTER_STYLES`), and hands
them to the MoE block in place of the router's own output. Three rules:

- `TopK(k)`: the family's own top-k with any k (k = the model's top-k is the identity; fewer experts
  measure "accuracy as active experts shrink").
- `ExpertSample(k_h, m, t_e)`: Expert-Sample (Chen et al., "Certain Head, Uncertain Tail: Expert-Sample
  for Test-Time Scaling in Fine-Grained MoE", arXiv 2602.02443). Only the abstract is public; the rule
  is our reconstruction (METHODS.md section 6): keep the k_h most confident experts, sample the other
  k - k_h from the next m by Gumbel-top-k at temperature t_e, and renormalise the gates over the chosen
  set as the base router does (`tail_gates` says how the sampled experts are weighted instead).
- `ForceExperts(experts)`: route every token to a fixed set (a causal test of what experts do).

How each family's router turns logits into (experts, gates), read from transformers 5.24's modeling code:

| model_type | scores | choice | gates |
|---|---|---|---|
| qwen3_moe, qwen2_moe, olmoe | softmax over all experts (float32) | top-k of the probabilities | the k probabilities, divided by their sum when the router's `norm_topk_prob`, cast to the logits' dtype |
| mixtral | softmax over all experts (float32) | top-k | always renormalised over the k (float32) |
| deepseek_v2 | softmax (float32) | top-k, or with `topk_method="group_limited_greedy"` top-k inside the `topk_group` groups whose best expert scores highest | the k probabilities, never renormalised, times `routed_scaling_factor` |
| deepseek_v3 | sigmoid per expert | top-k of sigmoid + `e_score_correction_bias`, inside the `topk_group` groups with the highest top-2 sums | the k sigmoids (no bias), divided by their sum when `norm_topk_prob`, times `routed_scaling_factor` |
| gpt_oss | raw logits | top-k of the logits | softmax over the k chosen logits (top-k, then softmax) |

Every family keeps `top_k` on each layer's router module (`module.top_k`): editing
`config.num_experts_per_tok` after loading changes nothing, so `k=None` means that module's value.

Sampling noise is a pure function of (seed, layer, token column, batch row, pool slot): one seeded
random stream per (seed, layer, column), read row by row (`uniform_noise`). The N samples of a batch
differ, a step differs from the last, the same seed reproduces on any device and batch size, and a
teacher-forced `trace` over a generated text sees the same noise as its generation did. Decode steps read
their noise from `NoiseChunks`: each layer draws the seeded streams of 16 columns at once and transforms
them in one pass, so a step's noise is a ready view (at toy scale a rule's cost is its number of tensor
operations, so the rule does only what it must).

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:qwen3_moe")
    >>> rule = ExpertSample("router.*", k_h=1, m=4, t_e=1.0, seed=3)
    >>> rule.describe()
    "expert-sample: head 1 of the model's k, the rest sampled from the next 4 at T_e=1 (gates: router, seed 3) at router.*"
    >>> recs = list(engine.generate("hello", n_samples=2, max_new_tokens=4, interventions=[rule]))
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch

from thoughtscope import checks
from thoughtscope.errors import BadInputError, UnknownSiteError
from probes.interventions import WHERE, Intervention, _finite
from probes.registered import Part, Registered
from probes.sites import Site, get_module, validate_site

EVERY_LAYER = "router.*"
TAIL_GATES = ("router", "displaced", "uniform")


@dataclass(frozen=True)
class RouterStyle:
    """How one family's router turns logits into (expert indices, gates). See the module table.

    `score`: `softmax` (probabilities over all experts), `sigmoid` (independent per expert) or
    `logits` (top-k of the raw logits, then a softmax over the chosen). `renorm`: `always`, `never`,
    `norm_topk_prob` (the router module's flag) or `softmax_chosen`. `groups`: `best` (DeepSeek-V2
    `group_limited_greedy`: a group scores its best expert) or `top2` (DeepSeek-V3: the sum of its
    two best). `gate_dtype`: `logits` casts the gates to the logits' dtype, `float32` keeps them.
    """

    score: str
    renorm: str
    groups: str | None = None
    scaled: bool = False
    bias: bool = False
    sorted_topk: bool = True
    gate_dtype: str = "float32"
    float32_logits: bool = False  # DeepSeek routers compute their logits in float32 whatever the model's dtype


_QWEN_STYLE = RouterStyle("softmax", "norm_topk_prob", gate_dtype="logits")
ROUTER_STYLES: dict[str, RouterStyle] = {
    "qwen3_moe": _QWEN_STYLE,
    "qwen2_moe": _QWEN_STYLE,
    "olmoe": _QWEN_STYLE,
    "mixtral": RouterStyle("softmax", "always"),
    "deepseek_v2": RouterStyle("softmax", "never", groups="best", scaled=True, sorted_topk=False,
                               float32_logits=True),
    "deepseek_v3": RouterStyle("sigmoid", "norm_topk_prob", groups="top2", scaled=True, bias=True,
                               sorted_topk=False, float32_logits=True),
    "gpt_oss": RouterStyle("logits", "softmax_chosen"),
}


@dataclass
class RouterSpec:
    """One layer's router as its module holds it: style, top_k, experts, flags, group limits."""

    style: RouterStyle
    top_k: int
    n_experts: int
    normalize: bool
    scaling: float = 1.0
    n_group: int = 0
    topk_group: int = 0
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, module: Any, model_type: str) -> "RouterSpec":
        style = style_of(model_type)
        grouped = style.groups == "top2" or getattr(module, "topk_method", None) == "group_limited_greedy"
        return cls(
            style=style,
            top_k=int(module.top_k),
            n_experts=int(module.num_experts),
            normalize={"always": True, "never": False, "softmax_chosen": False}.get(
                style.renorm, bool(getattr(module, "norm_topk_prob", False))),
            scaling=float(getattr(module, "routed_scaling_factor", 1.0)) if style.scaled else 1.0,
            n_group=int(getattr(module, "num_group", 0) or 0) if grouped else 0,
            topk_group=int(getattr(module, "topk_group", 0) or 0) if grouped else 0,
            bias=getattr(module, "e_score_correction_bias", None) if style.bias else None,
        )

    # --- the family's arithmetic, exactly as its router module does it ---

    def logits(self, module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router's logits [tokens, n_experts], computed as the family's router computes them (a linear
        map, in float32 for DeepSeek, with gpt-oss's bias): what a rule needs, without the router's own
        softmax and top-k, which a rule would throw away."""
        weight = module.weight
        h = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, weight.shape[1])
        if self.style.float32_logits:
            return torch.nn.functional.linear(h.float(), weight.float())
        return torch.nn.functional.linear(h, weight, getattr(module, "bias", None))

    def choice_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what the family's top-k ranks, which experts its group limit allows or None), computed with
        the family's own fill value for excluded experts (0 in DeepSeek-V2, -inf in V3), because
        `topk(sorted=False)` may order its result by the values it passes over."""
        if self.style.score == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        elif self.style.score == "sigmoid":
            scores = logits.sigmoid()
            if self.bias is not None:
                scores = scores + self.bias
        else:
            scores = logits
        if not self.n_group:
            return scores, None
        grouped = scores.view(-1, self.n_group, self.n_experts // self.n_group)
        if self.style.groups == "top2":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        allowed = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.n_experts).bool()
        fill = -math.inf if self.style.groups == "top2" else 0.0
        return scores.masked_fill(~allowed, fill), allowed

    def family_topk(self, choice: torch.Tensor, k: int) -> torch.Tensor:
        return torch.topk(choice, k, dim=-1, sorted=self.style.sorted_topk)[1]

    def sample_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Log of each expert's unnormalised gate: Gumbel-top-k at T_e samples in proportion to gate^(1/T_e)."""
        if self.style.score == "sigmoid":
            return torch.nn.functional.logsigmoid(logits.float())
        return logits.float()

    def gates(self, logits: torch.Tensor, idx: torch.Tensor, choice: torch.Tensor | None = None) -> torch.Tensor:
        """The gates the family gives the chosen experts `idx` [tokens, k]; `choice` (this router's
        `choice_scores`) saves recomputing a softmax family's probabilities."""
        if self.style.score == "logits":
            chosen = logits.gather(1, idx)
            return torch.softmax(chosen, dim=1, dtype=chosen.dtype)
        if self.style.score == "softmax":
            probs = choice if choice is not None else torch.softmax(logits, dim=-1, dtype=torch.float32)
            g = probs.gather(1, idx)
            if self.normalize:
                g = g / g.sum(dim=-1, keepdim=True)
        else:
            g = logits.sigmoid().gather(1, idx)
            if self.normalize:
                g = g / (g.sum(dim=-1, keepdim=True) + 1e-20)
        if self.style.scaled:
            g = g * self.scaling
        return g.to(logits.dtype) if self.style.gate_dtype == "logits" else g


def style_of(model_type: str) -> RouterStyle:
    if model_type not in ROUTER_STYLES:
        raise BadInputError(f"router rules know the families {', '.join(sorted(ROUTER_STYLES))}, not {model_type!r}; "
                            "add its router's arithmetic to probes.routing.ROUTER_STYLES")
    return ROUTER_STYLES[model_type]


# ----- seeded noise: a pure function of (seed, layer, column, row, slot) -----

_M32 = 0xFFFFFFFF


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2^32 for 0 <= x < 2^32 (Python ints here; the same formula works on int64 tensors)."""
    if c < (1 << 31):
        return (x * c) & _M32
    return (x * (c - (1 << 31)) + ((x & 1) << 31)) & _M32


def _mix32(x: Any) -> Any:
    """The `lowbias32` integer hash (C. Wellons): every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=65536)
def _fold(h: int, key: int) -> int:
    """Fold an integer of any size into a 32-bit hash state (in Python: free)."""
    return _mix32(_mix32(h ^ (key & _M32)) ^ ((key >> 32) & _M32) ^ 0x9E3779B9)


def stream_key(seed: int, layer: int, column: int) -> int:
    """The seed of the random stream of one (seed, layer, column): a 32-bit hash (what torch's CPU
    Mersenne Twister takes)."""
    return _fold(_fold(_fold(0x2545F491, int(seed)), int(layer)), int(column))


class Positions:
    """Where router tokens sit: batch row and column (tokens this layer saw before, in one engine call)
    of each token, [tokens] each. `grid` = (batch, seq, start) when the tokens are every row of the
    columns start..start+seq-1 in row-major order (a forward's own layout: noise is drawn per column).
    A grid's rows and columns are built only when asked for: the noise of a grid needs only the grid,
    and a decode step should not pay for index tensors nobody reads."""

    def __init__(self, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None,
                 grid: tuple[int, int, int] | None = None, device: Any = None):
        if rows is None and grid is None:
            raise ValueError("Positions needs rows and columns, or a grid")
        self._rows, self._cols, self.grid = rows, cols, grid
        self.device = rows.device if rows is not None else torch.device(device or "cpu")

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            batch, seq, _ = self.grid
            self._rows = torch.arange(batch, device=self.device).repeat_interleave(seq)
        return self._rows

    @property
    def cols(self) -> torch.Tensor:
        if self._cols is None:
            batch, seq, start = self.grid
            self._cols = start + torch.arange(seq, device=self.device).repeat(batch)
        return self._cols

    @classmethod
    def of(cls, n_tokens: int, row: int = 0, start: int = 0, device: Any = None) -> "Positions":
        """`n_tokens` consecutive columns of one batch row (what a teacher-forced trace sees)."""
        return cls(torch.full((n_tokens,), row, dtype=torch.long, device=device),
                   start + torch.arange(n_tokens, device=device), (1, n_tokens, start) if row == 0 else None)

    @classmethod
    def of_forward(cls, batch: int, seq: int, start: int, device: Any = None) -> "Positions":
        """Every row of a forward over `seq` new columns from `start`, row-major (the router's token order)."""
        return cls(grid=(batch, seq, start), device=device)

    def __getitem__(self, mask: torch.Tensor) -> "Positions":
        return Positions(self.rows[mask], self.cols[mask])


_GENERATORS = threading.local()  # one CPU generator per thread, reseeded per stream (creating one costs more)


def _stream(seed: int, layer: int, column: int, n_rows: int, width: int) -> torch.Tensor:
    """Uniform [0, 1) draws [n_rows, width] of one (seed, layer, column) stream. The CPU generator fills a
    tensor in order, so row r reads the same values whatever the number of rows (checked in the tests)."""
    gen = getattr(_GENERATORS, "gen", None)
    if gen is None:
        gen = _GENERATORS.gen = torch.Generator(device="cpu")
    gen.manual_seed(stream_key(seed, layer, column))
    return torch.rand(n_rows, width, generator=gen)


def uniform_noise(seed: int, layer: int, at: Positions, width: int) -> torch.Tensor:
    """Uniform draws [tokens, width] in [0, 1) for the tokens `at`: a pure function of (seed, layer, column,
    row, slot), drawn on the CPU (the same on every device and for every batch size: a sample's noise
    depends on its row, not on how many rows share the batch). One torch call per column: a decode step
    costs one, a teacher-forced trace one per token."""
    if at.grid is not None:
        batch, seq, start = at.grid
        if seq == 1:
            u = _stream(seed, layer, start, batch, width)
        else:
            u = torch.stack([_stream(seed, layer, start + j, batch, width) for j in range(seq)], 1).view(-1, width)
    else:
        rows, cols = at.rows.tolist(), at.cols.tolist()
        n_rows = max(rows, default=0) + 1
        streams = {c: _stream(seed, layer, c, n_rows, width) for c in sorted(set(cols))}
        u = torch.stack([streams[c][r] for r, c in zip(rows, cols)]) if rows else torch.zeros(0, width)
    return u.to(at.device)


def gumbel_noise(seed: int, layer: int, at: Positions, width: int) -> torch.Tensor:
    """Standard Gumbel noise [tokens, width] (float32) for the tokens `at`; `ExpertSample` adds exactly these
    to its tail pool (slot j = the pool's j-th most likely expert). A draw of u = 0 (probability 2^-24)
    gives -inf: that slot is not picked."""
    return uniform_noise(seed, layer, at, width).log_().neg_().log_().neg_()  # a fresh tensor: in place is safe


NOISE_CHUNK = 16  # decode columns whose noise one layer draws at once


class NoiseChunks:
    """Gumbel noise of decode steps drawn `NOISE_CHUNK` columns ahead, per layer: the same values as
    `gumbel_noise` of each column (one seeded stream per column, read row by row), but the Gumbel
    transform and the move to the device run once per chunk instead of once per layer and step, and a
    step reads its noise as a ready view. `head` leading slots hold +inf (Expert-Sample's head experts:
    they win any Gumbel-top-k over the whole pool), then the `width` Gumbel slots. A chunk of more rows
    serves a step of fewer (row r's draws do not depend on how many rows a stream fills). Pure in (seed,
    layer, column, row, slot): an entry is valid whoever made it, so a shared one is never wrong."""

    def __init__(self, seed: int, width: int, head: int = 0, chunk: int = NOISE_CHUNK):
        self.seed, self.width, self.head, self.chunk = int(seed), int(width), int(head), int(chunk)
        self._layers: dict[int, tuple[int, int, Any, list[torch.Tensor]]] = {}

    def decode(self, layer: int, column: int, n_rows: int, device: Any) -> torch.Tensor:
        """Noise [n_rows, head + width] (float32) of rows 0..n_rows-1 at one column: +inf, then
        `gumbel_noise` of a one-column grid, exactly."""
        entry = self._layers.get(layer)
        if entry is None or not 0 <= column - entry[0] < self.chunk or entry[1] < n_rows or entry[2] != device:
            u = torch.stack([_stream(self.seed, layer, c, n_rows, self.width)
                             for c in range(column, column + self.chunk)])
            noise = u.log_().neg_().log_().neg_()
            if self.head:
                noise = torch.cat([noise.new_full((self.chunk, n_rows, self.head), math.inf), noise], dim=-1)
            entry = (column, n_rows, device, list(noise.to(device).unbind(0)))
            self._layers[layer] = entry
        noise = entry[3][column - entry[0]]
        return noise if entry[1] == n_rows else noise[:n_rows]


def gumbel_top_k(logits: torch.Tensor, k: int, t_e: float, noise: torch.Tensor) -> torch.Tensor:
    """Positions of k draws without replacement, probabilities proportional to exp(logits / t_e)
    (Gumbel-top-k: the k largest of logits / t_e + Gumbel noise; Kool et al. 2019)."""
    scores = logits.float() if t_e == 1.0 else logits.float() / t_e
    return torch.topk(scores + noise, k, dim=-1)[1]


# ----- rules -----


@dataclass
class RouterRule(Intervention):
    """Base of router selection rules: `site` is `router.L` or `router.*` (every MoE layer); a subclass
    overrides `choose` (indices, and gates or None for the family's own gates)."""

    kinds: ClassVar[tuple[str, ...]] = ("router",)

    def sites(self, arch: Any) -> list[Site]:
        """The router sites this rule applies at, checked against the model (before any model work)."""
        if not arch.is_moe:
            raise UnknownSiteError(f"{type(self).__name__} needs an MoE model; {arch.model_type} is dense "
                                   "(it has no router sites)")
        if self.site == EVERY_LAYER:
            layers = getattr(arch, "moe_layers", None) or range(arch.n_layers)
            return [Site("router", layer) for layer in layers]
        site = validate_site(self.site, arch)
        if site.kind != "router":
            raise BadInputError(f"{type(self).__name__} applies at router.L or {EVERY_LAYER!r}, not {self.site!r}")
        return [site]

    def validate(self, arch: Any) -> "RouterRule":
        sites = self.sites(arch)
        style_of(arch.model_type)
        if self.where not in WHERE:
            raise BadInputError(f"where={self.where!r}; use one of {WHERE}")
        bound = Registered.validate(self, arch)
        bound.sites_ = sites
        return bound

    @contextlib.contextmanager
    def install(self, call: Any) -> Iterator[None]:
        """Replace the forward of every router this rule covers for the call (`RoutedForward`, one per router,
        shared by the rules at that site in the order given)."""
        with contextlib.ExitStack() as stack:
            for site in self.sites_:
                part = call.part(("router", site.name), lambda site=site: RoutedForward(call, site))
                part.rules.append(self)
                stack.enter_context(part)
            yield

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        raise BadInputError(f"{type(self).__name__} replaces a router's whole output; the hook runner calls route()")

    def choose(self, spec: RouterSpec, logits: torch.Tensor, layer: int,
               at: Positions) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def select(self, spec: RouterSpec, logits: torch.Tensor, layer: int,
               at: Positions, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(gates, indices) [tokens, k] for router logits [tokens, n_experts] of the tokens `at`.

        `check` looks for NaN gates (the hook runner skips it in decode steps, where the engine's own
        check of the next-token scores catches a NaN within the same step)."""
        idx, gates = self.choose(spec, logits, layer, at)
        if idx.shape[-1] < 1:
            raise BadInputError(f"{self.describe()} selected no expert; a token needs at least one")
        if gates is None:
            gates = spec.gates(logits, idx)
        if check and not torch.isfinite(gates).all():
            raise BadInputError(f"{self.describe()} produced NaN or infinite gates at layer {layer} "
                                "(are the router logits finite?)")
        return gates, idx

    def route(self, output: tuple, spec: RouterSpec, layer: int, batch: int, start: int, phase: str,
              positions: "PositionsMemo") -> tuple:
        """The router module's output with its (gates, indices) replaced by this rule's.

        `batch` rows of `output[0].shape[0] // batch` tokens each; `start` is the column of the first
        of them (tokens this layer has seen in this engine call); `phase` is the hook runner's.
        """
        logits, own_gates, own_idx = output[0], output[1], output[2]
        if self.where == "generated" and phase == "context":
            return output
        seq = logits.shape[0] // batch
        at = positions.of(batch, seq, start, logits.device)
        if self.where == "generated" and phase == "prefill" and seq > 1:
            keep = at.cols == start + seq - 1  # a prefill's last position is all that predicts a generated token
            gates, idx = self.select(spec, logits[keep], layer, at[keep])
            width = max(gates.shape[-1], own_idx.shape[-1])
            new_gates, new_idx = _pad(own_gates, own_idx, width)
            sel_gates, sel_idx = _pad(gates.to(new_gates.dtype), idx, width)
            new_gates, new_idx = new_gates.clone(), new_idx.clone()
            new_gates[keep], new_idx[keep] = sel_gates, sel_idx
        else:
            new_gates, new_idx = self.select(spec, logits, layer, at, check=phase != "decode")
        return (logits, new_gates, new_idx, *output[3:])

    def routed_forward(self, module: Any, hidden_states: torch.Tensor, spec: RouterSpec, layer: int, batch: int,
                       start: int, phase: str, positions: "PositionsMemo") -> tuple | None:
        """The router's output computed by this rule alone (logits, then this rule's gates and indices), or
        None where the rule needs the router's own choice too (`where="generated"` outside decode steps)."""
        if self.where == "generated" and phase != "decode":
            return None
        logits = spec.logits(module, hidden_states)
        at = positions.of(batch, logits.shape[0] // batch, start, logits.device)
        gates, idx = self.select(spec, logits, layer, at, check=phase != "decode")
        return logits, gates, idx


class PositionsMemo:
    """The positions of one forward, built once per call and forward, not once per layer (the call's state)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._positions: Positions | None = None

    def of(self, batch: int, seq: int, start: int, device: Any) -> Positions:
        key = (batch, seq, start, device)
        if self._key != key:
            self._key, self._positions = key, Positions.of_forward(batch, seq, start, device)
        return self._positions


class RoutedForward(Part):
    """One router's forward, replaced for one call by the rules at its site: the router computes its logits and
    the rules their (gates, indices), which the MoE block uses. Replacing the forward, rather than rewriting
    the router's output in a hook, spares the router's own softmax and top-k, which a rule would discard
    (about 10% of a toy MoE's decode step). Hooks on the router (captures) still run around it. The per-call
    state lives here: the router's spec (read once) and the token columns it has seen (the noise's column)."""

    def __init__(self, call: Any, site: Site):
        super().__init__()
        self.call, self.site = call, site
        self.rules: list[RouterRule] = []
        self.columns = 0
        self.module: Any = None
        self.instance_forward: Any = None

    def open(self) -> None:
        handle, ctx = self.call.handle, self.call.runner.ctx
        module = self.module = get_module(handle.model, self.site.module_path(handle.family))
        # a forward already in the instance's slot stays the one this call wraps and the one put back after it:
        # nnsight's controller lives there for good once the model is wrapped (handle.nnsight), and deleting it
        # left every later nnsight trace of this model without the router's handoffs (OutOfOrderError)
        self.instance_forward = module.__dict__.get("forward")
        own_forward, layer, rules = module.forward, self.site.layer, self.rules
        spec = RouterSpec.of(module, handle.arch.model_type)
        positions = self.call.part(PositionsMemo, PositionsMemo)

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
            batch = ctx.batch
            seq = hidden_states.numel() // hidden_states.shape[-1] // batch  # tokens per row, no reshape op
            start = self.columns
            self.columns = start + seq
            if len(rules) == 1:
                output = rules[0].routed_forward(module, hidden_states, spec, layer, batch, start, ctx.phase, positions)
                if output is not None:
                    return output
            output = own_forward(hidden_states, *args, **kwargs)
            for rule in rules:  # each rule replaces the choice before it (where it applies)
                output = rule.route(output, spec, layer, batch, start, ctx.phase, positions)
            return output

        module.forward = forward

    def close(self) -> None:
        if self.instance_forward is None:
            del self.module.forward  # the instance attribute goes; the class's forward is back
        else:
            self.module.forward = self.instance_forward


def _pad(gates: torch.Tensor, idx: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen to `width` columns with zero gates (on the row's first expert), which add exactly nothing."""
    extra = width - idx.shape[-1]
    if extra <= 0:
        return gates, idx
    return (torch.cat([gates, gates.new_zeros(gates.shape[0], extra)], dim=-1),
            torch.cat([idx, idx[:, :1].expand(-1, extra)], dim=-1))


@dataclass
class TopK(RouterRule):
    """The family's own top-k with `k` experts (None: each layer's own top_k, the identity), gates
    renormalised as the family does. Fewer experts than the model's k measure how much it needs them."""

    kind: ClassVar[str] = "router_topk"
    site: str = EVERY_LAYER
    k: int | None = None

    def _check(self, arch: Any) -> None:
        if self.k is not None:
            checks.integer("the number of experts k", self.k, low=1, why="a token needs at least one expert")
            if self.k > arch.n_experts:
                raise BadInputError(f"k={self.k} but this model has {arch.n_experts} experts per layer")

    def choose(self, spec, logits, layer, at):
        choice = spec.choice_scores(logits)[0]
        idx = spec.family_topk(choice, self.k or spec.top_k)
        return idx, spec.gates(logits, idx, choice)

    def describe(self) -> str:
        return f"router top-{self.k} at {self.site}" if self.k else f"router top-k (each layer's own k) at {self.site}"


@dataclass
class ExpertSample(RouterRule):
    """Expert-Sample (Chen et al. 2026, reconstruction): keep the top `k_h` experts, sample `k - k_h`
    of the next `m` by Gumbel-top-k at temperature `t_e` with seeded noise; `k` None is the model's.

    `tail_gates` weights the chosen set: `router` renormalises over it as the family does (with
    norm_topk_prob a sampled tail expert gets its small share), `displaced` gives the sampled experts
    the gates of the top-k experts they displaced (the head keeps its own; the total is the model's),
    `uniform` splits the router's total over the chosen set equally.
    """

    kind: ClassVar[str] = "expert_sample"
    site: str = EVERY_LAYER
    k_h: int = 2
    m: int = 8
    t_e: float = 1.0
    k: int | None = None
    tail_gates: str = "router"
    seed: int = 0

    def _check(self, arch: Any) -> None:
        k = self.k if self.k is not None else arch.experts_top_k
        checks.integer("the number of experts k", k, low=1, why="a token needs at least one expert")
        checks.integer("k_h", self.k_h, low=0, why="head experts")
        checks.integer("m", self.m, low=0, why="tail pool size")
        if self.k_h > k:
            raise BadInputError(f"k_h={self.k_h} is larger than k={k}: the head is part of the k experts "
                                f"(k_h = k keeps the model's own top-k; Expert-Sample needs k_h < k)")
        if self.m < k - self.k_h:
            raise BadInputError(f"the tail pool m={self.m} is smaller than the {k - self.k_h} experts to sample "
                                f"(k - k_h = {k} - {self.k_h}); use m >= {k - self.k_h}")
        if self.k_h + self.m > arch.n_experts:
            raise BadInputError(f"k_h + m = {self.k_h + self.m} but this model has {arch.n_experts} experts per layer")
        try:
            t_e = float(self.t_e)
        except (TypeError, ValueError) as err:
            raise BadInputError(f"expert temperature T_e must be a number, got {self.t_e!r}") from err
        if not (math.isfinite(t_e) and t_e > 0):
            raise BadInputError(f"expert temperature T_e must be a finite number > 0, got {self.t_e}")
        if self.tail_gates not in TAIL_GATES:
            raise BadInputError(f"tail_gates={self.tail_gates!r}; use one of {TAIL_GATES}")
        checks.integer("seed", self.seed, low=0)
        self.noise_, self.heads_ = NoiseChunks(self.seed, self.m, self.k_h), {}  # this call's own (a copy shares none)

    def choose(self, spec, logits, layer, at):
        k = self.k or spec.top_k
        if self.k_h == k:  # no tail to sample: the family's own top-k (with the model's k, its own routing)
            choice = spec.choice_scores(logits)[0]
            return self._weighted(spec, logits, spec.family_topk(choice, k), choice, k)
        # A softmax (or raw-logit) router without group limits ranks experts as their logits rank, so the rule
        # ranks the logits themselves and samples from the top-k values: no softmax over all experts per token
        # (a rule's cost at toy scale is its number of tensor operations).
        k_h = self.k_h
        by_logits = spec.style.score in ("softmax", "logits") and not spec.n_group
        if by_logits:
            values, ranked = torch.topk(logits, k_h + self.m, dim=-1)
            choice = allowed = None
        else:
            choice, allowed = spec.choice_scores(logits)
            ranked = torch.topk(choice, k_h + self.m, dim=-1)[1]
            pool_logits = spec.sample_logits(logits).gather(1, ranked[:, k_h:])
            if allowed is not None:
                pool_logits = pool_logits.masked_fill(~allowed.gather(1, ranked[:, k_h:]), -math.inf)
        noise = self._noise(layer, at)  # [tokens, k_h + m]: +inf on the head's slots, then the tail's Gumbel noise
        t_e = float(self.t_e)
        if by_logits:
            # Gumbel-top-k over the whole pool at once: the head's +inf slots come first (in some order, put
            # back as ranks 0..k_h-1), then the tail's k - k_h largest of logit / T_e + Gumbel, as
            # `gumbel_top_k` ranks them (the tail's scores are the same numbers)
            pool = values if values.dtype == torch.float32 else values.float()
            pos = torch.topk(pool + noise if t_e == 1.0 else pool / t_e + noise, k, dim=-1)[1]
            if k_h:
                pos[:, :k_h] = self._head(logits.shape[0], logits.device)
        else:
            picked = gumbel_top_k(pool_logits, k - k_h, t_e, noise[:, k_h:])
            if allowed is not None and torch.isinf(pool_logits.gather(1, picked)).any():
                raise BadInputError(f"{self.describe()}: the tail pool reaches experts this router's group limit "
                                    "excludes; use a smaller m")
            # the chosen experts' places in the ranking: the head's 0..k_h-1, then the drawn tail slots
            pos = torch.cat([self._head(logits.shape[0], logits.device), picked.add_(k_h)], dim=-1) if k_h else picked
        idx = ranked.gather(1, pos)
        if by_logits and self.tail_gates == "router" and spec.style.score == "softmax" and spec.normalize:
            # renormalised probabilities over the chosen set are the softmax of their logits
            gates = torch.softmax(values.gather(1, pos), dim=-1, dtype=torch.float32)
            if spec.style.scaled:
                gates = gates * spec.scaling
            if spec.style.gate_dtype == "logits" and logits.dtype != torch.float32:
                gates = gates.to(logits.dtype)
            return idx, gates
        return self._weighted(spec, logits, idx, choice, k)

    def _noise(self, layer: int, at: Positions) -> torch.Tensor:
        """[tokens, k_h + m]: +inf for the head, then the tail pool's Gumbel noise `gumbel_noise(seed, layer, at,
        m)`; a decode step's from this call's `NoiseChunks` (drawn a chunk of columns ahead, the same values)."""
        grid = at.grid
        if grid is None or grid[1] != 1:
            noise = gumbel_noise(self.seed, layer, at, self.m)
            return torch.cat([noise.new_full((noise.shape[0], self.k_h), math.inf), noise], dim=-1) if self.k_h else noise
        chunks = self.__dict__.get("noise_")
        if chunks is None or (chunks.seed, chunks.width, chunks.head) != (self.seed, self.m, self.k_h):
            chunks = self.__dict__["noise_"] = NoiseChunks(self.seed, self.m, self.k_h)
        return chunks.decode(layer, grid[2], grid[0], at.device)

    def _head(self, n_tokens: int, device: Any) -> torch.Tensor:
        """Ranks 0..k_h-1 for `n_tokens` tokens [n_tokens, k_h] (built once per shape and call)."""
        heads = self.__dict__.setdefault("heads_", {})
        key = (n_tokens, self.k_h, device)
        head = heads.get(key)
        if head is None:
            head = heads[key] = torch.arange(self.k_h, device=device).expand(n_tokens, self.k_h)
        return head

    def _weighted(self, spec: RouterSpec, logits: torch.Tensor, idx: torch.Tensor, choice: torch.Tensor | None,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, gates) of the chosen experts `idx` under this rule's `tail_gates`."""
        if self.tail_gates == "router":
            return idx, spec.gates(logits, idx, choice)
        if self.tail_gates == "uniform":
            gates = spec.gates(logits, idx, choice)
            return idx, gates.mean(dim=-1, keepdim=True).expand_as(gates).contiguous()
        # displaced: the model's own top-k gates by rank; rank k_h + j's gate goes to the j-th sampled expert
        if choice is None:
            choice = spec.choice_scores(logits)[0]
        ranked = torch.topk(choice, k, dim=-1)[1]
        return torch.cat([ranked[:, :self.k_h], idx[:, self.k_h:]], dim=-1), spec.gates(logits, ranked, choice)

    def describe(self) -> str:
        k = "the model's k" if self.k is None else f"k={self.k}"
        return (f"expert-sample: head {self.k_h} of {k}, the rest sampled from the next {self.m} at "
                f"T_e={float(self.t_e):g} (gates: {self.tail_gates}, seed {self.seed}) at {self.site}")


@dataclass
class ForceExperts(RouterRule):
    """Route every token to the fixed `experts`, with the family's gates over them, or `gates` as given."""

    kind: ClassVar[str] = "force_experts"
    experts: list[int]
    gates: list[float] | None = None

    def _check(self, arch: Any) -> None:
        if not isinstance(self.experts, (list, tuple)) or not self.experts:
            raise BadInputError("ForceExperts needs at least one expert: a token with no expert has no MoE output")
        experts = checks.int_list("experts", self.experts, low=0, high=arch.n_experts - 1)
        if len(set(experts)) != len(experts):
            raise BadInputError(f"experts {experts} repeat an expert; list each once")
        self.experts_, self.gates_ = experts, None
        if self.gates is not None:
            if not isinstance(self.gates, (list, tuple)) or len(self.gates) != len(experts):
                raise BadInputError(f"gates must be a list of {len(experts)} numbers, one per expert")
            self.gates_ = [_finite(g, "a gate (NaN or infinite gates are not allowed)") for g in self.gates]

    def choose(self, spec, logits, layer, at):
        # the checked values on a per-call copy; as given when a caller selects with the rule itself
        experts, gates = self.__dict__.get("experts_", self.experts), self.__dict__.get("gates_", self.gates)
        idx = torch.tensor(list(experts), device=logits.device).expand(logits.shape[0], -1)
        if gates is None:
            return idx, None
        return idx, torch.tensor(list(gates), dtype=torch.float32, device=logits.device).expand(logits.shape[0], -1)

    def describe(self) -> str:
        gates = "" if self.gates is None else f" with gates {list(self.gates)}"
        return f"route to experts {list(self.experts)}{gates} at {self.site}"
