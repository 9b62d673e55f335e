"""Shipped toy models (issue 20, item 3): the zoo loads `docs/shipped/models/<id>/` only when its
manifest matches the recipe the code would train and every sha256 checks; a damaged or stale copy is
reported (a `ShippedModelWarning`) and the toy is retrained; `thoughtscope models ship ID` rebuilds a
shipped folder byte for byte (training is deterministic: one thread, deterministic algorithms, seeded).

The unit tests build fake shipped folders (no training); the `model` tests load, retrain and rebuild
`toy-moe:small` (about 10 s of one core) and compare with the shipped files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from probes.toys import moe, reasoner, shipped, verify, vlm  # noqa: E402
from probes.toys.common import recipe_hash  # noqa: E402
from probes.zoo import config_without_versions, list_models, toy_model_ids  # noqa: E402
from thoughtscope import numerics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED_SMALL = "toy-moe:small"
MODULES = {"toy-reasoner": reasoner, "toy-moe": moe, "toy-vlm": vlm}


@pytest.fixture
def private(tmp_path, monkeypatch):
    """A private shipped root and user cache, and a fresh record of reported problems."""
    monkeypatch.setenv(shipped.ENV, str(tmp_path / "shipped"))
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(verify, "_reported", set())  # the warn-once memory lives with the verification
    return tmp_path


def _fake(model_id: str, recipe: dict, files: dict[str, bytes]) -> Path:
    folder = shipped.shipped_path(model_id)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = {"model_id": model_id, "recipe_hash": recipe_hash(recipe),
                "files": {name: shipped.sha256_file(folder / name) for name in files}}
    (folder / shipped.MANIFEST).write_text(json.dumps(manifest))
    return folder


FAKE_FILES = {"model.safetensors": b"weights", "config.json": b"{}", "trained.json": b"{}"}


def test_every_toy_and_its_small_variant_is_listed():
    assert toy_model_ids() == ["toy-reasoner", "toy-reasoner:small", "toy-moe", "toy-moe:small",
                               "toy-vlm", "toy-vlm:small"]
    rows = {r["id"]: r["what"] for r in list_models()}
    for model_id in toy_model_ids():
        assert model_id in rows and rows[model_id].startswith("toy model (")
    assert shipped.shipped_name("toy-vlm:small") == "toy-vlm_small"


def test_a_verified_shipped_copy_is_the_folder_the_toy_reads(private):
    recipe = moe.recipe("small")
    folder = _fake(SHIPPED_SMALL, recipe, FAKE_FILES)
    assert shipped.verified(SHIPPED_SMALL, recipe_hash(recipe)) == folder
    assert moe.folder_for("small") == folder
    # another size is not affected; its folder is the user cache's
    assert moe.folder_for("full").parent == private / "cache" / "models"


@pytest.mark.parametrize("damage, problem", [
    ("flip", "model.safetensors does not match its sha256"),
    ("delete", "config.json does not match its sha256"),
    ("recipe", "was trained from recipe 000000000000"),
    ("manifest", "its manifest is unreadable"),
    ("other-id", "it holds 'toy-moe', not 'toy-moe:small'"),
])
def test_a_damaged_or_stale_shipped_copy_is_reported_and_not_used(private, damage, problem):
    recipe = moe.recipe("small")
    folder = _fake(SHIPPED_SMALL, recipe, FAKE_FILES)
    manifest_path = folder / shipped.MANIFEST
    if damage == "flip":
        (folder / "model.safetensors").write_bytes(b"weightz")
    elif damage == "delete":
        (folder / "config.json").unlink()
    elif damage == "recipe":
        manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "recipe_hash": "0" * 12}))
    elif damage == "manifest":
        manifest_path.write_text("{not json")
    else:
        manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "model_id": "toy-moe"}))
    with pytest.warns(shipped.ShippedModelWarning, match=problem):
        assert shipped.verified(SHIPPED_SMALL, recipe_hash(recipe)) is None
    # the toy reads its user-cache folder instead (where it is trained on first use)
    assert moe.folder_for("small").parent == private / "cache" / "models"


def test_a_manifest_without_weights_is_not_trusted(private):
    recipe = moe.recipe("small")
    _fake(SHIPPED_SMALL, recipe, {"config.json": b"{}", "trained.json": b"{}"})
    with pytest.warns(shipped.ShippedModelWarning, match="lists no model.safetensors"):
        assert shipped.verified(SHIPPED_SMALL, recipe_hash(recipe)) is None


def test_ship_refuses_what_is_not_a_toy(private):
    from thoughtscope.errors import UnknownModelError

    for bad in ("smollm2-135m", "toy-moe:huge", "", None):
        with pytest.raises(UnknownModelError, match="not a toy model"):
            shipped.ship(bad)


def test_the_models_command_refuses_an_unknown_action():
    from typer.testing import CliRunner

    from thoughtscope import cli as cli_module

    result = CliRunner().invoke(cli_module.build(), ["models", "unship", "toy-moe:small"])
    assert result.exit_code != 0 and "unknown models action 'unship'" in str(result.exception)


# ----------------------------------------------------------------- the shipped files in the repository


def _repo_shipped() -> list[Path]:
    root = REPO / "docs" / "shipped" / "models"
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "ship-"))) \
        if root.is_dir() else []


def test_the_repository_ships_each_small_toy_verified_against_its_recipe(monkeypatch):
    monkeypatch.delenv(shipped.ENV, raising=False)
    names = {p.name for p in _repo_shipped()}
    assert {"toy-reasoner_small", "toy-moe_small", "toy-vlm_small"} <= names
    for folder in _repo_shipped():
        manifest = json.loads((folder / shipped.MANIFEST).read_text())
        model_id = manifest["model_id"]
        name, _, size = model_id.partition(":")
        assert shipped.shipped_name(model_id) == folder.name
        assert manifest["recipe_hash"] == recipe_hash(MODULES[name].recipe(size or "full"))
        assert manifest["command"] == f"thoughtscope models ship {model_id}"
        assert shipped.problem_of(folder, model_id, manifest["recipe_hash"]) is None
        # safetensors and JSON only, each listed with its sha256
        on_disk = {p.name for p in folder.iterdir()} - {shipped.MANIFEST}
        assert on_disk == set(manifest["files"]) and all(n.endswith((".json", ".safetensors")) for n in on_disk)
        report = json.loads((folder / "trained.json").read_text())
        assert report.get("steps") == report.get("config", report.get("model_config", {})).get("steps")


# ----------------------------------------------------------------- model tier: load, retrain, rebuild


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """The parameters of the Qwen3-MoE whose safetensors file is `path`, as transformers lays them out
    in memory (the checkpoint stores each expert apart; the loaded model fuses them)."""
    from transformers import Qwen3MoeForCausalLM

    return dict(Qwen3MoeForCausalLM.from_pretrained(path.parent).named_parameters())


@pytest.mark.model
def test_a_shipped_toy_loads_without_training(private, monkeypatch):
    from probes.zoo import load_model

    monkeypatch.delenv(shipped.ENV)
    calls = []
    handle = load_model(SHIPPED_SMALL, device="cpu", on_progress=lambda *a: calls.append(a))
    assert calls == [] and not (private / "cache" / "models").exists()  # nothing trained, nothing cached
    weights = _weights(REPO / "docs" / "shipped" / "models" / "toy-moe_small" / "model.safetensors")
    params = dict(handle.model.named_parameters())
    assert set(weights) == set(params)
    for name, value in weights.items():
        assert torch.equal(params[name], value), name
    assert handle.tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2 = ?"}], tokenize=False,
                                                add_generation_prompt=True) == "Q : 1 + 2 = ? A :"


GOOD_SMALL = REPO / "docs" / "shipped" / "models" / "toy-moe_small"


def _ship_in_a_fresh_process(out: Path) -> Path:
    """`thoughtscope models ship toy-moe:small`, run as the shipped manifest says, in a fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "THOUGHTSCOPE_CACHE_DIR": str(out / "c")}
    command = json.loads((GOOD_SMALL / shipped.MANIFEST).read_text())["command"].split()
    assert command[:3] == ["thoughtscope", "models", "ship"]
    run = subprocess.run([sys.executable, "-m", "thoughtscope.cli", *command[1:], "--out", str(out / "out")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rebuilt = out / "out" / "toy-moe_small"
    assert run.stdout.strip().splitlines()[-1] == str(rebuilt)
    return rebuilt


@pytest.fixture(scope="module")
def rebuilt_small(tmp_path_factory):
    return _ship_in_a_fresh_process(tmp_path_factory.mktemp("ship"))


@pytest.fixture(scope="module")
def reference_small(rebuilt_small, tmp_path_factory):
    """What a rebuild on this machine must equal byte for byte: the shipped folder when it was built on
    this machine's float arithmetic (`thoughtscope.numerics`), else a second rebuild here. On another
    kind of CPU the kernels differ in their last bits and 300 training steps carry that into other weights
    (measured: max weight difference 0.28 between an AVX2 and the shipped build), so exactness across
    kinds is not a property training has; determinism on one machine is."""
    if numerics.same_numerics(json.loads((GOOD_SMALL / shipped.MANIFEST).read_text())):
        return GOOD_SMALL
    return _ship_in_a_fresh_process(tmp_path_factory.mktemp("ship-again"))


@pytest.mark.model
def test_a_damaged_shipped_toy_is_retrained_with_progress_and_equals_the_shipped_weights(private, reference_small):
    from probes.zoo import load_model

    copy = shipped.shipped_path(SHIPPED_SMALL)
    shutil.copytree(GOOD_SMALL, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    calls = []
    with pytest.warns(shipped.ShippedModelWarning, match="model.safetensors does not match its sha256"):
        handle = load_model(SHIPPED_SMALL, device="cpu", on_progress=lambda *a: calls.append(a))
    steps = moe.SIZES["small"][0].steps
    assert calls[0] == (1, steps, "training toy-moe:small")
    assert [c[0] for c in calls[:steps]] == list(range(1, steps + 1))
    assert calls[-1] == (steps, steps, "evaluating toy-moe:small on held-out problems")
    assert moe.folder_for("small").parent == private / "cache" / "models"  # the cache, not the damaged copy
    # deterministic training: the weights retrained in this process are the shipped ones (or, on other
    # numerics, those of the ship command run in a fresh process here), bit for bit
    weights = _weights(reference_small / "model.safetensors")
    params = dict(handle.model.named_parameters())
    assert set(weights) == set(params)
    for name, value in weights.items():
        assert torch.equal(params[name], value), name


@pytest.mark.model
def test_the_ship_command_rebuilds_a_shipped_toy_byte_for_byte(rebuilt_small, reference_small):
    """`thoughtscope models ship toy-moe:small`, run as the manifest says, in a fresh process: every
    shipped file but the manifest is the same bytes as the shipped folder's (on the numerics it was built
    on; elsewhere as a second rebuild's), and the training report differs only in timings."""
    cmp = shipped.same_training(reference_small, rebuilt_small)
    assert "model.safetensors" in cmp["files"] and "tokenizer_config.json" in cmp["files"]
    assert cmp["differ"] == [] and cmp["report_equal"], cmp
    manifest = json.loads((rebuilt_small / shipped.MANIFEST).read_text())
    assert manifest["files"] == json.loads((reference_small / shipped.MANIFEST).read_text())["files"] | {
        "trained.json": shipped.sha256_file(rebuilt_small / "trained.json")}
    assert manifest["numerics"] == numerics.fingerprint()  # the rebuild says which arithmetic made it
    # the config, tokenizer and recipe never depend on the arithmetic: the same bytes as shipped, anywhere;
    # the configs carry the writing transformers' version (5.24.0 in the shipped files), and under another
    # admitted release they equal the shipped ones in every other key
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (rebuilt_small / name).read_bytes() == (GOOD_SMALL / name).read_bytes(), name
    for name in ("config.json", "generation_config.json"):
        rebuilt, good = (json.loads((folder / name).read_text()) for folder in (rebuilt_small, GOOD_SMALL))
        if rebuilt["transformers_version"] == good["transformers_version"]:
            assert (rebuilt_small / name).read_bytes() == (GOOD_SMALL / name).read_bytes(), name
        assert config_without_versions(rebuilt) == config_without_versions(good), name
    assert manifest["recipe_hash"] == json.loads((GOOD_SMALL / shipped.MANIFEST).read_text())["recipe_hash"]
