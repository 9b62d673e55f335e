"""Architecture facts (`ArchInfo`): the typed model facts every analysis reads through `Backend.arch()`.

A leaf module (dataclasses only), so the Backend protocol and the HTTP client can name the type
without importing the model zoo; `probes.zoo` re-exports both names.

Example:
    >>> from transformers import LlamaConfig
    >>> arch_from_config(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)).head_dim
    16
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ArchInfo:
    """Architecture facts every analysis needs, read once from the HF config."""

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    d_mlp: int
    vocab_size: int
    context_length: int
    n_experts: int = 0
    experts_top_k: int = 0
    moe_layers: tuple[int, ...] = ()  # layers with a router (some families keep dense MLPs in a few)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (tuples as lists), so the dict is the same after a trip through the server."""
        # the fields are scalars and one flat tuple: read directly (asdict deep-copies each value)
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ArchInfo":
        """The inverse of `to_dict` (what a client rebuilds from a server's /info)."""
        return cls(**{**d, "moe_layers": tuple(d.get("moe_layers", ()))})


def arch_from_config(config: Any) -> ArchInfo:
    cfg = getattr(config, "text_config", None) or config
    # a VLM is named by its own type (llava, smolvlm): its language model's modules sit elsewhere
    model_type = config.model_type if getattr(config, "vision_config", None) is not None else cfg.model_type
    n_heads = cfg.num_attention_heads
    d_model = cfg.hidden_size
    n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    return ArchInfo(
        model_type=model_type,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        # multi-head latent attention (DeepSeek) sets head_dim to its rope part; its per-head output is v_head_dim
        head_dim=getattr(cfg, "v_head_dim", None) or getattr(cfg, "head_dim", None) or d_model // n_heads,
        d_model=d_model,
        d_mlp=getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", 0) or 0,
        vocab_size=cfg.vocab_size,
        context_length=getattr(cfg, "max_position_embeddings", None) or 2048,
        n_experts=int(n_experts),
        experts_top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if n_experts else 0,
        moe_layers=_moe_layers(cfg, cfg.num_hidden_layers) if n_experts else (),
    )


def _moe_layers(cfg: Any, n_layers: int) -> tuple[int, ...]:
    """Layers whose MLP is a routed MoE block: Qwen2/3-MoE skip `mlp_only_layers` and keep one in
    `decoder_sparse_step`; DeepSeek-V2/V3 keep the first `first_k_dense_replace` layers dense."""
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    first = getattr(cfg, "first_k_dense_replace", None) or 0
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0 and i >= first)
