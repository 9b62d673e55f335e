"""SAEs on disk in SAELens' own format (`cfg.json` + `sae_weights.safetensors`), so SAEs move both ways.

- `save_sae(sae, folder)`: a training SAE is saved as its inference SAE (what SAELens'
  `save_inference_model` writes), so `sae_lens.SAE.load_from_disk(folder)` loads it anywhere.
- `load_sae(ref)`: a folder written by SAELens (here or elsewhere), or a SAELens pretrained
  release (`load_sae("gpt2-small-res-jb", sae_id="blocks.8.hook_resid_pre")`) read from the local
  Hugging Face cache with the hub forced offline: nothing is ever downloaded.
- `check_fits(sae, width, site)`: an SAE whose width does not match the site is a user error.
- An SAE whose weights hold NaN or infinity is refused when it loads: its latents would be NaN everywhere.

Example:
    >>> import tempfile, torch
    >>> from saes.train import SAETrainSettings, train_sae
    >>> sae, _ = train_sae(torch.randn(256, 8), SAETrainSettings(d_sae=16, batch_size=64, steps=5, progress=False))
    >>> folder = tempfile.mkdtemp()
    >>> _ = save_sae(sae, folder)
    >>> torch.equal(load_sae(folder).W_dec, sae.W_dec)
    True
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.imports import import_from, import_module  # sae_lens under the heavy-imports lock: jobs run in threads

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"


def save_sae(sae: Any, folder: str | Path) -> Path:
    """Write `cfg.json` + `sae_weights.safetensors` into `folder` (created); return the folder."""
    TrainingSAE = import_from("sae_lens", "TrainingSAE")

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(sae, TrainingSAE):
            sae.save_inference_model(folder)
        else:
            sae.save_model(folder)
    except OSError as err:
        raise BadInputError(f"cannot write the SAE to {folder}: {err}") from err
    return folder


def is_sae_folder(path: str | Path) -> bool:
    try:
        path = checks.user_path("SAE folder", path)
    except BadInputError:  # empty, NUL or over-long: no folder at all
        return False
    return (path / CFG_FILENAME).is_file() and (path / WEIGHTS_FILENAME).is_file()


def load_sae(ref: str | Path, sae_id: str | None = None, device: str = "cpu") -> Any:
    """An inference SAE from a SAELens folder, or from a pretrained release in the local HF cache."""
    SAE = import_from("sae_lens", "SAE")

    path = checks.user_path("SAE folder or release", ref)
    if path.is_dir():
        if not is_sae_folder(path):
            raise BadInputError(
                f"{path} is not a SAELens SAE folder: it needs {CFG_FILENAME} and {WEIGHTS_FILENAME} "
                "(save one with saes.io.save_sae or SAELens' save_model)")
        from safetensors import SafetensorError

        try:
            sae = SAE.load_from_disk(str(path), device=device)
        # a malformed folder: cfg.json not an object or missing a field (KeyError, TypeError, AttributeError, bad
        # JSON), weights not safetensors or cut short (SafetensorError), or shaped unlike cfg.json says (RuntimeError)
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, SafetensorError, OSError) as err:
            why = " ".join(str(err).split())[:300]  # torch's shape message spans lines
            raise BadInputError(f"{path} holds an SAE this SAELens cannot read ({type(err).__name__}: {why})") from err
        return check_finite(sae, str(path / WEIGHTS_FILENAME))
    if sae_id is None:
        raise BadInputError(f"{ref!r} is not a folder; for a SAELens pretrained release pass sae_id= too")
    return check_finite(_load_pretrained_offline(str(ref), sae_id, device), f"{ref}/{sae_id}")


def check_finite(sae: Any, source: str) -> Any:
    """`sae` when every weight is finite; NaN or infinity (a training run that diverged) would make every
    latent NaN, and a score of NaN is neither a ranking nor valid JSON."""
    import torch

    for name, weight in sae.state_dict().items():
        if torch.is_floating_point(weight) and not bool(torch.isfinite(weight).all()):
            bad = int((~torch.isfinite(weight)).sum())
            raise BadInputError(f"{source} holds an SAE whose {name} has {bad:,} NaN or infinite values of "
                                f"{weight.numel():,}; retrain it (a lower learning rate) or pick another SAE")
    return sae


@contextlib.contextmanager
def _hub_offline():
    """Force huggingface_hub offline for the duration (it reads this flag at call time)."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def _load_pretrained_offline(release: str, sae_id: str, device: str) -> Any:
    SAE = import_from("sae_lens", "SAE")
    directories = import_module("sae_lens.loading.pretrained_saes_directory")
    get_pretrained_saes_directory = directories.get_pretrained_saes_directory
    get_repo_id_and_folder_name = directories.get_repo_id_and_folder_name

    directory = get_pretrained_saes_directory()
    if release not in directory and "/" not in release:
        raise BadInputError(f"{release!r} is neither a folder nor a SAELens pretrained release "
                            "(see sae_lens' pretrained_saes.yaml)")
    try:
        repo_id, folder = get_repo_id_and_folder_name(release, sae_id)
    except ValueError as err:
        known = sorted(directory[release].saes_map)[:8] if release in directory else []
        raise BadInputError(f"{err}; some ids of this release: {known}") from err
    hint = (f"the SAE {release}/{sae_id} is not in the local Hugging Face cache; on a machine with network run "
            f"`huggingface-cli download {repo_id} --include '{folder}/*'` and copy the cache here")
    with _hub_offline():
        try:
            return SAE.from_pretrained(release, sae_id, device=device)
        except Exception as err:  # offline misses surface as several hub/OS error types
            cached = _cached_folder(repo_id, folder)
            if cached is None:
                raise BadInputError(hint) from err
            # Config and weights are cached but an optional file (the sparsity log) is not:
            # read the folder directly, as SAELens' own disk loader does.
            return _load_cached_folder(cached, release, sae_id, device)


def _cached_folder(repo_id: str, folder: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    cfg = try_to_load_from_cache(repo_id, f"{folder}/{CFG_FILENAME}")
    weights = try_to_load_from_cache(repo_id, f"{folder}/{WEIGHTS_FILENAME}")
    if isinstance(cfg, str) and isinstance(weights, str):
        return Path(cfg).parent
    return None


def _load_cached_folder(path: Path, release: str, sae_id: str, device: str) -> Any:
    SAE = import_from("sae_lens", "SAE")
    get_norm_scaling_factor = import_from("sae_lens.loading.pretrained_saes_directory", "get_norm_scaling_factor")

    sae = SAE.load_from_disk(str(path), device=device)
    if sae.cfg.normalize_activations == "expected_average_only_in":
        factor = get_norm_scaling_factor(release, sae_id)
        if factor is not None:
            sae.fold_activation_norm_scaling_factor(factor)
    return sae


def check_fits(sae: Any, width: int, site: str = "") -> None:
    """Raise a user error when the SAE's input width is not `width`, the values per token at the site
    (`probes.sites.site_width`: d_model on the residual stream, heads * head_dim at `z.L`)."""
    d_in = int(sae.cfg.d_in)
    if d_in != int(width):
        where = f" at {site}" if site else ""
        raise BadInputError(f"this SAE reads vectors of width {d_in} but the model's activations{where} have width "
                            f"{width}; pick an SAE trained on this model and site")
