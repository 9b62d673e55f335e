"""SAEs with SAELens: training recovers a planted dictionary, SAELens' format round-trips, and
SAELens pretrained releases load from the local Hugging Face cache without the network."""

from __future__ import annotations

import json

import pytest
import torch

from thoughtscope.errors import BadInputError
from saes.io import check_fits, is_sae_folder, load_sae, save_sae
from saes.stats import sae_stats
from saes.train import SAETrainSettings, train_sae


def planted_data(n=8192, d=32, atoms=48, active=3, seed=0):
    """Sparse sums of `active` unit atoms out of `atoms` (magnitudes 1-3): the dictionary to find."""
    gen = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(atoms, d, generator=gen)
    dictionary /= dictionary.norm(dim=1, keepdim=True)
    which = torch.stack([torch.randperm(atoms, generator=gen)[:active] for _ in range(n)])
    codes = torch.zeros(n, atoms).scatter_(1, which, 1 + 2 * torch.rand(n, active, generator=gen))
    return codes @ dictionary, dictionary


def mean_max_cosine(dictionary: torch.Tensor, sae) -> float:
    """For each planted atom, the best cosine with a learned decoder row; averaged."""
    learned = sae.W_dec.detach()
    learned = learned / learned.norm(dim=1, keepdim=True)
    return float((dictionary @ learned.T).max(1).values.mean())


@pytest.mark.parametrize("architecture,offset", [("standard", 0.0), ("topk", 0.0), ("standard", 40.0)])
def test_training_recovers_planted_dictionary(architecture, offset):
    acts, dictionary = planted_data()
    # Residual streams share a large mean; the SAE must find the features on top of it.
    shared = torch.randn(32, generator=torch.Generator().manual_seed(5))
    acts = acts + offset * shared / shared.norm()
    settings = SAETrainSettings.scaled(32, len(acts), architecture=architecture, d_sae=96, k=3,
                                       batch_size=256, steps=600, progress=False)
    sae, stats = train_sae(acts, settings)
    assert mean_max_cosine(dictionary, sae) >= 0.9
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(96), atol=1e-5)  # unit-norm decoder rows
    assert stats.explained_variance > 0.7
    assert 0 < stats.l0 < 20 and stats.dead_latents < 48
    assert stats.to_dict()["settings"]["architecture"] == architecture


def test_scaled_defaults_follow_the_paper_for_large_sets_and_shrink_for_small_ones():
    big = SAETrainSettings.scaled(1536, 1_000_000)
    assert (big.d_sae, big.batch_size, big.lr) == (2048, 1024, 1e-4)
    small = SAETrainSettings.scaled(576, 400)
    assert small.d_sae == 112 and small.batch_size == 100 and small.lr == 1e-3


def test_saelens_round_trip(tmp_path):
    acts, _ = planted_data(n=1024, d=16, atoms=24)
    sae, _ = train_sae(acts, SAETrainSettings(d_sae=32, batch_size=128, steps=30, l1_coefficient=1.0, progress=False),
                       metadata={"model_name": "tiny", "hook_name": "resid_post.1"})
    folder = save_sae(sae, tmp_path / "sae")
    assert is_sae_folder(folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["architecture"] == "standard" and cfg["d_in"] == 16 and cfg["metadata"]["hook_name"] == "resid_post.1"

    loaded = load_sae(folder)
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
        assert torch.equal(getattr(loaded, name), getattr(sae, name)), name
    assert torch.allclose(loaded.encode(acts[:64]), sae.encode(acts[:64]))

    from sae_lens import SAE  # what another tool does with our folder

    assert torch.equal(SAE.load_from_disk(str(folder)).W_dec, sae.W_dec)


def test_topk_round_trip(tmp_path):
    acts, _ = planted_data(n=512, d=16, atoms=24)
    sae, _ = train_sae(acts, SAETrainSettings(architecture="topk", d_sae=32, k=4, batch_size=128, steps=20, progress=False))
    loaded = load_sae(save_sae(sae, tmp_path / "topk"))
    assert torch.allclose(loaded.encode(acts[:32]), sae.encode(acts[:32]), atol=1e-6)
    assert int((loaded.encode(acts[:32]) > 0).sum(1).max()) <= 4


def _fake_hub_cache(root, repo_id: str, folder: str, sae) -> None:
    """Lay out a Hugging Face hub cache holding one SAELens SAE, as `huggingface-cli download` would."""
    snapshot = root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / ("0" * 40)
    save_sae(sae, snapshot / folder)
    refs = root / f"models--{repo_id.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0" * 40)


def test_pretrained_release_loads_from_local_hub_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    acts, _ = planted_data(n=256, d=768, atoms=8, active=1)
    sae, _ = train_sae(acts, SAETrainSettings(d_sae=16, batch_size=64, steps=3, normalize_activations="none",
                                              progress=False))
    # gpt2-small-res-jb is a real SAELens release stored in SAELens' own format.
    _fake_hub_cache(tmp_path, "jbloom/GPT2-Small-SAEs-Reformatted", "blocks.0.hook_resid_pre", sae)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # load_sae must force offline by itself
    loaded = load_sae("gpt2-small-res-jb", sae_id="blocks.0.hook_resid_pre")
    assert torch.equal(loaded.W_dec, sae.W_dec)
    assert constants.HF_HUB_OFFLINE is False  # restored

    with pytest.raises(BadInputError, match="not in the local Hugging Face cache"):
        load_sae("gpt2-small-res-jb", sae_id="blocks.1.hook_resid_pre")


def test_user_errors_say_what_to_do(tmp_path):
    with pytest.raises(BadInputError, match="not a SAELens SAE folder"):
        load_sae(tmp_path)
    with pytest.raises(BadInputError, match="sae_id"):
        load_sae("no-such-release")
    acts = torch.randn(64, 8)
    sae, _ = train_sae(acts, SAETrainSettings(d_sae=8, batch_size=32, steps=2, progress=False))
    with pytest.raises(BadInputError, match="width 8 .* width 576"):
        check_fits(sae, 576, "resid_post.3")
    with pytest.raises(BadInputError, match="non-empty"):
        train_sae(torch.zeros(0, 8))
    with pytest.raises(BadInputError, match="architecture"):
        train_sae(acts, SAETrainSettings(architecture="gated", progress=False))


def test_an_sae_whose_weights_are_nan_is_refused_when_it_loads(tmp_path):
    sae, _ = train_sae(torch.randn(64, 8), SAETrainSettings(d_sae=8, batch_size=32, steps=2, progress=False))
    with torch.no_grad():
        sae.b_dec[2] = float("inf")  # a run that diverged: every latent would read NaN
    save_sae(sae, tmp_path / "diverged")
    with pytest.raises(BadInputError) as err:
        load_sae(tmp_path / "diverged")
    assert str(err.value).startswith(f"{tmp_path / 'diverged' / 'sae_weights.safetensors'} holds an SAE whose "
                                     "b_dec has 1 NaN or infinite values of 8")


def test_stats_count_dead_latents_and_l0():
    acts = torch.randn(128, 8)
    sae, _ = train_sae(acts, SAETrainSettings(d_sae=16, batch_size=32, steps=2, progress=False))
    with torch.no_grad():
        sae.W_enc[:, 3] = 0
        sae.b_enc[3] = -1.0  # latent 3 can never fire
    stats = sae_stats(sae, acts)
    assert stats.dead_latents >= 1 and stats.density == pytest.approx(stats.l0 / 16)


@pytest.mark.parametrize("damage, why", [
    ("cut", "SafetensorError"),        # the weights file cut short
    ("garbage", "SafetensorError"),    # not a safetensors file at all
    ("d_sae", "size mismatch for W_dec"),  # cfg.json says another width than the weights have
    ("cfg_list", "TypeError"),          # cfg.json is JSON, but not an object
])
def test_a_damaged_sae_folder_is_a_clear_error_and_stays_on_disk(tmp_path, damage, why):
    from saes.train import make_training_sae

    folder = save_sae(make_training_sae(16, SAETrainSettings(d_sae=32)), tmp_path / "sae")
    weights, cfg = folder / "sae_weights.safetensors", folder / "cfg.json"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "garbage":
        weights.write_bytes(b"not an SAE " * 8)
    elif damage == "d_sae":
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "d_sae": 64}))
    else:
        cfg.write_text("[1, 2]")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(BadInputError, match=f"{folder} holds an SAE this SAELens cannot read .*{why}"):
        load_sae(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_loading_an_sae_in_a_thread_imports_sae_lens_under_the_heavy_imports_lock(tmp_path):
    """A job thread that loads an SAE imports sae_lens (and with it transformer_lens) under
    `thoughtscope.imports.HEAVY_IMPORTS`, so it never enters that package graph beside the correctness badge's
    bridge import (two threads entering transformer_lens at once broke one of them; thoughtscope/imports.py).
    In a fresh interpreter the main thread holds the lock: the loading thread must be seen waiting inside
    `import_module`, with sae_lens not imported, until the lock is released; then it loads the SAE."""
    from saes.train import make_training_sae
    from tests.lock_helpers import run_while_heavy_imports_held

    sae = make_training_sae(8, SAETrainSettings(d_sae=16))
    folder = save_sae(sae, tmp_path / "sae")
    torch.save(sae.W_dec.detach().clone(), tmp_path / "w_dec.pt")
    printed = run_while_heavy_imports_held(
        "import torch\nfrom saes.io import load_sae", f"load_sae({str(folder)!r})", "sae_lens", "import_module",
        f"'equal', torch.equal(out['value'].W_dec, torch.load({str(tmp_path / 'w_dec.pt')!r}, weights_only=True))")
    assert printed == ["waiting", "True", "imported", "False", "equal", "True"]
