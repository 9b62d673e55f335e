"""Hook sites: one naming scheme across architectures, mapped to module paths in one table.

A site name is `<kind>.<layer>` (`resid_post.12`, `attn_pattern.3`, `router.5`) or `logits`.
`SITE_KINDS` says, per kind, which module of a decoder layer carries it, whether it is read from
the module's input or output, its shape, and its TransformerLens hook name. `FAMILIES` maps
each HF architecture family to the module paths those kinds refer to. Nothing else in the
project spells a module path.

Example:
    >>> parse_site("resid_post.3")
    Site(kind='resid_post', layer=3)
    >>> SITE_KINDS["resid_post"].tl_hook.format(layer=3)
    'blocks.3.hook_resid_post'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thoughtscope.errors import UnknownSiteError


@dataclass(frozen=True)
class SiteKind:
    """How one kind of site is read. `part` names a module in `FAMILIES`; `read` is
    `input` (forward pre-hook, first positional argument) or `output` (forward hook);
    `index` picks an element of a tuple output; `shape` documents the per-position shape."""

    part: str
    read: str
    index: int | None
    shape: str
    tl_hook: str | None
    doc: str
    needs_eager_attention: bool = False
    moe_only: bool = False


SITE_KINDS: dict[str, SiteKind] = {
    "resid_pre": SiteKind("layer", "input", None, "[d_model]", "blocks.{layer}.hook_resid_pre",
                          "residual stream entering the layer"),
    "resid_post": SiteKind("layer", "output", 0, "[d_model]", "blocks.{layer}.hook_resid_post",
                           "residual stream leaving the layer"),
    "attn_out": SiteKind("attn", "output", 0, "[d_model]", "blocks.{layer}.hook_attn_out",
                         "attention block output (after o_proj, before any post-norm)"),
    "mlp_out": SiteKind("mlp", "output", 0, "[d_model]", "blocks.{layer}.hook_mlp_out",
                        "MLP or MoE block output"),
    "attn_pattern": SiteKind("attn", "output", 1, "[heads, kv_len]", "blocks.{layer}.attn.hook_pattern",
                             "attention weights after softmax (eager attention is switched on)",
                             needs_eager_attention=True),
    "q": SiteKind("q_proj", "output", 0, "[heads, head_dim]", "blocks.{layer}.attn.hook_q",
                  "query projection per head, before RoPE"),
    "k": SiteKind("k_proj", "output", 0, "[kv_heads, head_dim]", "blocks.{layer}.attn.hook_k",
                  "key projection per KV head, before RoPE"),
    "v": SiteKind("v_proj", "output", 0, "[kv_heads, head_dim]", "blocks.{layer}.attn.hook_v",
                  "value projection per KV head"),
    "z": SiteKind("o_proj", "input", None, "[heads, head_dim]", "blocks.{layer}.attn.hook_z",
                  "per-head attention output before o_proj (where heads are ablated)"),
    "router": SiteKind("router", "output", 0, "[n_experts]", None,
                       "MoE router logits (before softmax)", moe_only=True),
    # what the MoE block uses: read after any router rule (probes.routing) replaced the router's choice
    "experts": SiteKind("router", "output", 2, "[top_k]", None,
                        "indices of the experts the token is routed to (after any router rule)", moe_only=True),
    "expert_gates": SiteKind("router", "output", 1, "[top_k]", None,
                             "gates of those experts, as the MoE block weights them (after any router rule)",
                             moe_only=True),
}
GLOBAL_SITES: dict[str, SiteKind] = {
    "logits": SiteKind("lm_head", "output", 0, "[vocab]", None, "next-token logits"),
}

# Module paths per family. A layer-relative path is joined to `layers.<L>`.
_DECODER = {
    "layers": "model.layers",
    "layer": "",
    "attn": "self_attn",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "mlp": "mlp",
    "router": "mlp.gate",
    "lm_head": "lm_head",
    "final_norm": "model.norm",
    "embed": "model.embed_tokens",
}
FAMILIES: dict[str, dict[str, str]] = {
    "decoder": _DECODER,
    # gpt-oss names its router `router`, not `gate`
    "gpt_oss": {**_DECODER, "router": "mlp.router"},
    # multi-head latent attention (DeepSeek-V2/V3) has no per-head key/value projections: k/v sites
    # do not exist; `q_proj` exists when q_lora_rank is None (V2-Lite), else the query is `q_b_proj`'s output
    "mla": {part: path for part, path in _DECODER.items() if part not in ("k_proj", "v_proj")},
    # vision-language models: the sites are those of the language model inside (probes.vision)
    "llava": {**_DECODER, "layers": "model.language_model.layers", "final_norm": "model.language_model.norm",
              "embed": "model.language_model.embed_tokens"},
    "idefics3": {**_DECODER, "layers": "model.text_model.layers", "final_norm": "model.text_model.norm",
                 "embed": "model.text_model.embed_tokens"},
    "qwen2_vl": {**_DECODER, "layers": "model.language_model.layers", "final_norm": "model.language_model.norm",
                 "embed": "model.language_model.embed_tokens"},
}
MODEL_TYPE_FAMILY: dict[str, str] = {
    **{t: "decoder"
       for t in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "olmoe", "olmo2",
                 "mixtral", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3", "granite", "smollm3")},
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "llava": "llava",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",  # the same module layout (model.language_model.layers)
    "qwen3_vl": "qwen2_vl",
}


def family_of(model_type: str) -> str:
    # Unknown HF decoders almost always follow the llama layout; paths are checked when resolved.
    return MODEL_TYPE_FAMILY.get(model_type, "decoder")


@dataclass(frozen=True)
class Site:
    kind: str
    layer: int | None

    @property
    def name(self) -> str:
        return self.kind if self.layer is None else f"{self.kind}.{self.layer}"

    @property
    def spec(self) -> SiteKind:
        return GLOBAL_SITES.get(self.kind) or SITE_KINDS[self.kind]

    def tl_hook(self) -> str | None:
        return self.spec.tl_hook.format(layer=self.layer) if self.spec.tl_hook else None

    def module_path(self, family: str = "decoder") -> str:
        paths = FAMILIES[family]
        if self.spec.part not in paths:
            raise UnknownSiteError(f"site {self.name!r} does not exist in {family} models "
                                   f"(they have no {self.spec.part} module); see `thoughtscope sites`")
        part = paths[self.spec.part]
        if self.layer is None:
            return part
        base = f"{paths['layers']}.{self.layer}"
        return f"{base}.{part}" if part else base


def parse_site(name: str) -> Site:
    """`'resid_post.12'` -> `Site('resid_post', 12)`. Unknown kinds raise with the list of kinds."""
    if not isinstance(name, str):
        raise UnknownSiteError(f"a site name is text, got {type(name).__name__} {str(name)[:40]!r}; sites look like "
                               "'resid_post.3' (see `thoughtscope sites`)")
    if not name.strip():
        raise UnknownSiteError("empty site name; sites look like 'resid_post.3' (see `thoughtscope sites`)")
    name = name.strip()
    if name in GLOBAL_SITES:
        return Site(name, None)
    kind, _, layer = name.rpartition(".")
    if kind not in SITE_KINDS or not (layer.isascii() and layer.isdigit()) or len(layer) > 6:  # "²".isdigit()
        kinds = ", ".join([f"{k}.L" for k in SITE_KINDS] + list(GLOBAL_SITES))
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UnknownSiteError(f"unknown site {shown!r}; sites are {kinds} (L = layer index)")
    return Site(kind, int(layer))


def validate_site(name: str, arch: Any) -> Site:
    """Parse and check against a model's `ArchInfo` (layer range, MoE-only kinds)."""
    site = parse_site(name)
    if site.layer is not None and not 0 <= site.layer < arch.n_layers:
        raise UnknownSiteError(
            f"site {name!r}: layer {site.layer} is out of range; this model has layers 0..{arch.n_layers - 1}"
        )
    if site.spec.moe_only and not arch.is_moe:
        raise UnknownSiteError(f"site {name!r}: this model has no MoE router ({arch.model_type} is dense)")
    moe_layers = getattr(arch, "moe_layers", None)
    if site.spec.moe_only and moe_layers and site.layer not in moe_layers:
        raise UnknownSiteError(f"site {name!r}: layer {site.layer} of this model is a dense MLP layer; "
                               f"its MoE layers are {list(moe_layers)}")
    if site.spec.part not in FAMILIES[family_of(arch.model_type)]:
        raise UnknownSiteError(f"site {name!r} does not exist in {arch.model_type} models "
                               f"(they have no {site.spec.part} module); see `thoughtscope sites`")
    return site


# what each word of a SiteKind's `shape` reads off an ArchInfo; kv_len grows with the sequence (no fixed width)
_SHAPE_DIMS = {"d_model": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_dim",
               "n_experts": "n_experts", "top_k": "experts_top_k", "vocab": "vocab_size"}


def site_width(name: str, arch: Any) -> int | None:
    """Values per position at a site, flattened (`resid_post.3` -> d_model, `q.3` -> heads * head_dim), read
    off its shape in `SITE_KINDS`; None where the width grows with the sequence (`attn_pattern`). Checks the
    site first (`validate_site`), so a caller can refuse a wrong width before any model work.

    Example:
        >>> from types import SimpleNamespace as A
        >>> arch = A(model_type="llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_model=32,
        ...          n_experts=0, experts_top_k=0, vocab_size=100, is_moe=False)
        >>> site_width("resid_post.1", arch), site_width("k.0", arch), site_width("attn_pattern.0", arch)
        (32, 16, None)
    """
    site = validate_site(name, arch)
    width = 1
    for word in site.spec.shape.strip("[]").split(","):
        field = _SHAPE_DIMS.get(word.strip())
        if field is None:
            return None
        width *= int(getattr(arch, field))
    return width


def list_sites(arch: Any) -> list[dict[str, Any]]:
    """Every site of a model, one row each: name, shape, TransformerLens hook, description."""
    rows = []
    paths = FAMILIES[family_of(arch.model_type)]
    moe_layers = getattr(arch, "moe_layers", None)
    for layer in range(arch.n_layers):
        for kind, spec in SITE_KINDS.items():
            if spec.moe_only and (not arch.is_moe or (moe_layers and layer not in moe_layers)):
                continue
            if spec.part not in paths:
                continue
            site = Site(kind, layer)
            rows.append({"site": site.name, "shape": spec.shape, "tl_hook": site.tl_hook(), "doc": spec.doc})
    for kind, spec in GLOBAL_SITES.items():
        rows.append({"site": kind, "shape": spec.shape, "tl_hook": None, "doc": spec.doc})
    return rows


def get_module(model: Any, path: str) -> Any:
    """Resolve a dotted module path; a missing part means the family table does not fit the model."""
    module = model
    for part in path.split("."):
        if not part:
            continue
        child = getattr(module, part, None)
        if child is None and part.isdigit():
            child = module[int(part)]
        if child is None:
            raise UnknownSiteError(
                f"module path {path!r} does not exist in {type(model).__name__}; "
                "this architecture needs an entry in probes.sites.FAMILIES"
            )
        module = child
    return module
