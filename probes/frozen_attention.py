"""Frozen attention: steering that reaches later positions only through the residual stream.

Definition (docs/steering.md): in a call with `FrozenAttention()`, every forward of the model first
runs a shadow forward of the same model on the same inputs (token ids, positions, padding mask) with
no steering edit (`probes.edits`), keeping its own KV cache across the call; at every layer the
steered forward then uses, for the frozen rows, the attention probabilities that the shadow computed
(softmax(q k^T / sqrt(d) + mask) of the UNSTEERED model on the same tokens) and multiplies them with
its own (steered) values. So an edit changes what a position writes and what later positions read
from it, but never where they look. With no steering edit the shadow and the steered forward are the
same computation, and the frozen text equals the plain one.

The attention is eager (the probabilities are materialised), registered with transformers'
`AttentionInterface` under `ATTENTION_NAME` for the duration of the call, with transformers' eager
mask function under the same name. Other interventions (AddVector, head ablations, masks) act in both
the shadow and the steered forward: only the steering edits of `probes.edits` are what the shadow
leaves out. Supported: decoders whose attention modules call the attention interface with
`module.layer_idx` and `num_key_value_groups` (Llama/SmolLM2, Qwen2/3, Mistral, OLMoE, Mixtral);
soft-capped or sink attention is refused.

Example:
    >>> import torch
    >>> from probes import Engine
    >>> from probes.edits import Additive
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> plain = "".join(r.text for r in engine.generate("one two three", max_new_tokens=4))
    >>> frozen = "".join(r.text for r in engine.generate("one two three", max_new_tokens=4,
    ...                                                  interventions=[FrozenAttention()]))
    >>> plain == frozen
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probes.registered import Part, Registered
from thoughtscope import checks
from thoughtscope.errors import BadInputError

ATTENTION_NAME = "thoughtscope_frozen"
_OWNER = "_thoughtscope_frozen_run"  # attribute each attention module carries while a frozen run is open


@dataclass
class FrozenAttention(Registered):
    """Freeze the attention probabilities of the batch `rows` (None: every row) to those of the unsteered
    model on the same tokens (see the module docstring). A capability (`frozen_attention`) of the
    in-process engine and of the server; it travels as `{"kind": "frozen_attention", "rows": ...}`."""

    kind: ClassVar[str] = "frozen_attention"
    modes: ClassVar[tuple[str, ...]] = ("generate", "trace", "capture")
    elsewhere: ClassVar[str] = "frozen attention applies in generate, trace and capture"
    replaces_attention: ClassVar[bool] = True
    rows: list[int] | None = None

    def _check(self, arch: Any) -> None:
        if self.rows is not None:
            self.rows = checks.int_list("rows", self.rows, low=0)
            if not self.rows:
                raise BadInputError("frozen attention rows must name at least one batch row (or be None for all)")

    def bind(self, call: Any) -> "FrozenAttention":
        bound = self.validate(call.arch)
        if getattr(call.handle, "remote", False):
            raise BadInputError("frozen attention needs the weights in this process; ndif: models cannot run it")
        if call.arch.is_moe:
            raise BadInputError("frozen attention runs a shadow forward, which would advance a MoE router's "
                                "per-call state twice; it supports dense decoders only")
        rows = call.batch_rows
        if bound.rows is not None and rows is not None and max(bound.rows) >= rows:
            raise BadInputError(f"frozen attention names rows {bound.rows} but the batch has {rows} rows")
        run = call.part(FrozenRun.KEY, lambda: FrozenRun(call))
        if run.spec is not None:
            raise BadInputError("pass FrozenAttention at most once per call (name several rows in one)")
        run.spec = bound
        return bound

    def install(self, call: Any) -> Any:
        return call.parts[FrozenRun.KEY]

    def describe(self) -> str:
        return "frozen attention" + ("" if self.rows is None else f" in rows {self.rows}")


def side_by_side(terms: list[Any]) -> list[Any]:
    """The interventions of one batch of three rows of the same prompt (`prompts=[p] * 3`): row 0 unsteered,
    row 1 steered by `terms` (steering edits, one strength each), row 2 steered with frozen attention.

    >>> import torch
    >>> from probes.edits import Additive
    >>> [iv.describe() for iv in side_by_side([Additive("resid_post.0", torch.ones(64), term="t")])]
    ['t: additive 1 at resid_post.0 on rows [1, 2]', 'frozen attention in rows [2]']
    """
    from dataclasses import replace

    for t in terms:
        if isinstance(getattr(t, "strength", None), list) or getattr(t, "rows", None) is not None:
            raise BadInputError(f"{t.name()} has rows or per-row strengths of its own; side by side sets the rows")
    return [replace(t, rows=[1, 2]) for t in terms] + [FrozenAttention(rows=[2])]


class FrozenRun(Part):
    """The per-call state: the shadow's KV cache and its attention probabilities per layer."""

    KEY = "frozen_attention"

    def __init__(self, call: Any):
        super().__init__()
        self.call, self.model = call, call.handle.model
        self.spec: FrozenAttention | None = None
        self.probs: dict[int, torch.Tensor] = {}
        self.in_shadow = False
        self._cache: Any = None
        self._hook: Any = None
        self._saved: str | None = None

    def checked(self, call: Any) -> None:
        if call.cache_factory is not None:
            raise BadInputError("frozen attention cannot be combined with a KV-cache policy (both replace attention)")
        rows = call.batch_rows if call.batch_rows is not None else call.rows  # a teacher-forced pass: its mask rows
        if self.spec is not None and self.spec.rows is not None and max(self.spec.rows) >= rows:
            raise BadInputError(f"frozen attention names rows {self.spec.rows} but the call runs {rows} rows")

    def open(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(ATTENTION_NAME, _frozen_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
        self._saved = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTENTION_NAME)
        self._layers = [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
        if not self._layers:
            raise BadInputError(f"frozen attention found no attention modules with layer_idx in {type(self.model).__name__}")
        for m in self._layers:
            setattr(m, _OWNER, self)
        self._hook = self.model.register_forward_pre_hook(self._shadow_forward, with_kwargs=True)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for m in getattr(self, "_layers", []):
            if getattr(m, _OWNER, None) is self:
                delattr(m, _OWNER)
        if self._saved is not None:
            self.model.set_attn_implementation(self._saved)
            self._saved = None
        self.probs, self._cache = {}, None

    def _shadow_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.in_shadow:
            return
        from probes.token_masks import SteerRun

        shadow = dict(kwargs)
        for name in ("cache", "past_key_values"):
            if shadow.get(name) is not None:
                if self._cache is None:
                    from transformers import DynamicCache

                    self._cache = DynamicCache(config=self.model.config)
                shadow[name] = self._cache
        shadow.pop("logits_to_keep", None)
        shadow.pop("labels", None)
        # the decoder alone (`base_model`): the shadow needs every layer's attention, never the logits
        decoder = getattr(module, "base_model", module)
        steer = self.call.parts.get(SteerRun.KEY)
        self.in_shadow = True
        if steer is not None:
            steer.shadow = True
        try:
            decoder(*args, **shadow)
        finally:
            self.in_shadow = False
            if steer is not None:
                steer.shadow = False

    def frozen_rows(self, batch: int) -> list[int]:
        rows = self.spec.rows if self.spec is not None and self.spec.rows is not None else range(batch)
        return [r for r in rows if r < batch]


def _frozen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """Eager attention; in the steered forward the frozen rows take the shadow's probabilities."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise BadInputError("frozen attention does not support soft-capped or sink attention")
    from transformers.models.llama.modeling_llama import repeat_kv

    run = getattr(module, _OWNER, None)
    groups = getattr(module, "num_key_value_groups", 1)
    keys, values = repeat_kv(key, groups), repeat_kv(value, groups)
    batch = query.shape[0]
    frozen = run.frozen_rows(batch) if run is not None and not run.in_shadow else []
    if len(frozen) == batch:  # every row frozen: its own probabilities would be discarded, so never computed
        probs = run.probs[module.layer_idx]
    else:
        scaling = module.scaling if scaling is None else scaling
        scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask[..., :keys.shape[-2]]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if run is not None and run.in_shadow:
            run.probs[module.layer_idx] = probs
        elif frozen:
            probs = probs.clone()
            probs[frozen] = run.probs[module.layer_idx][frozen]
    out = torch.matmul(probs, values).transpose(1, 2).contiguous()
    return out, probs
