"""Model folders in the user cache: what a killed build leaves is removed on the next load, a
damaged cached model is rebuilt (SmolLM2 from its GGUF, a toy by training it again), and a folder
that is not a model says so.

Examples of use: `smollm2_files()` is the folder of the embedded model (made from the GGUF once);
`train_once(folder, train)` runs `train` unless `folder` already holds a whole trained model;
`safetensors_problem(path)` says why a weights file is not whole, or None.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from probes.toys.common import train_once
from probes.zoo import load_model, smollm2_files
from thoughtscope.errors import UnknownModelError


def dead_pid() -> int:
    """The pid of a process that has exited, as a killed conversion's would be."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


HOLD_LOCK = """
import sys, filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def real_folder() -> Path:
    """The SmolLM2 folder of this machine's cache (made from the GGUF if it never was)."""
    smollm2_files.cache_clear()
    try:
        return smollm2_files()
    finally:
        smollm2_files.cache_clear()


@pytest.fixture
def model_cache(real_folder, tmp_path, monkeypatch) -> Path:
    """A cache folder under tmp_path whose SmolLM2 folder links to the real files."""
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "models" / real_folder.name
    folder.mkdir(parents=True)
    for file in real_folder.iterdir():
        (folder / file.name).symlink_to(file)
    smollm2_files.cache_clear()
    yield folder
    smollm2_files.cache_clear()  # later tests get the real folder again
    shutil.rmtree(tmp_path / "cache")  # a rebuilt model is 540 MB


# ---- SmolLM2 from its GGUF --------------------------------------------------------------------


def test_a_killed_conversion_leaves_a_temporary_folder_the_next_load_removes(model_cache):
    stale = model_cache.with_name(f"{model_cache.name}.tmp{dead_pid()}")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)  # half written when it was killed

    assert smollm2_files() == model_cache
    assert not stale.exists()
    assert sorted(p.name for p in model_cache.parent.iterdir() if ".tmp" in p.name) == []


def test_the_temporary_folder_of_a_conversion_in_progress_is_kept(model_cache):
    # Another process holds the build lock: it is converting right now into its folder.
    lock = f"{model_cache}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, lock], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = model_cache.with_name(f"{model_cache.name}.tmp{holder.pid}")
        busy.mkdir()
        assert smollm2_files() == model_cache
        assert busy.is_dir()
    finally:
        holder.kill()
        holder.wait()
    # Its writer died without finishing: the next load removes it.
    smollm2_files.cache_clear()
    assert smollm2_files() == model_cache
    assert not busy.exists()


@pytest.mark.model
def test_a_cut_short_cached_model_is_rebuilt_from_the_gguf(model_cache, real_folder, caplog):
    weights = model_cache / "model.safetensors"
    weights.unlink()  # the link: the real cached file is left alone
    with open(real_folder / "model.safetensors", "rb") as f:
        weights.write_bytes(f.read(1 << 20))  # the first MiB of 538 MB, as a full disk leaves it
    stale = model_cache.with_name(f"{model_cache.name}.tmp{dead_pid()}")
    stale.mkdir()

    with caplog.at_level(logging.WARNING, logger="probes.zoo"):
        assert smollm2_files() == model_cache
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    assert not stale.exists()
    assert not weights.is_symlink()
    assert weights.stat().st_size == (real_folder / "model.safetensors").stat().st_size
    name = "model.embed_tokens.weight"
    with safetensors.safe_open(weights, "pt") as rebuilt, \
            safetensors.safe_open(real_folder / "model.safetensors", "pt") as cached:
        assert torch.equal(rebuilt.get_tensor(name), cached.get_tensor(name))
    assert load_model("smollm2-135m").arch.n_layers == 30


# ---- the damage check ---------------------------------------------------------------------------


def test_safetensors_problem_names_what_is_wrong(tmp_path):
    from probes.model_files import safetensors_problem

    whole = tmp_path / "whole.safetensors"
    safetensors.torch.save_file({"w": torch.ones(64, 64), "b": torch.zeros(64)}, whole)
    data = whole.read_bytes()
    assert safetensors_problem(whole) is None

    cases = {
        "cut.safetensors": data[:-100],
        "longer.safetensors": data + b"\0" * 10,
        "empty.safetensors": b"",
        "header_only.safetensors": data[:8],
        "garbage.safetensors": b"\x10\0\0\0\0\0\0\0not json at all!" + data[24:],
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        assert safetensors_problem(tmp_path / name) is not None, name
    assert "bytes" in safetensors_problem(tmp_path / "cut.safetensors")
    assert "missing" in safetensors_problem(tmp_path / "nothing.safetensors")
    (tmp_path / "folder.safetensors").mkdir()
    assert "not a file" in safetensors_problem(tmp_path / "folder.safetensors")


def test_folder_problem_checks_the_weights_and_the_json_files(tmp_path):
    from probes.model_files import folder_problem

    safetensors.torch.save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64}\n')
    assert folder_problem(tmp_path, json_files=("config.json",)) is None

    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidd')
    assert "config.json" in folder_problem(tmp_path, json_files=("config.json",))
    assert "tokenizer.json" in folder_problem(tmp_path, json_files=("tokenizer.json",))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "model.safetensors" in folder_problem(tmp_path)


# ---- toy models ---------------------------------------------------------------------------------


def train_tiny(runs: list[int]):
    def train(folder: Path) -> dict:
        runs.append(1)
        safetensors.torch.save_file({"w": torch.full((256,), float(len(runs)))}, folder / "model.safetensors")
        return {"steps": 1}

    return train


def test_a_cut_short_toy_model_is_trained_again(tmp_path, caplog):
    folder, runs = tmp_path / "models" / "toy-small-abc", []
    assert train_once(folder, train_tiny(runs)) == folder
    assert train_once(folder, train_tiny(runs)) == folder
    assert len(runs) == 1  # cached

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with caplog.at_level(logging.WARNING, logger="probes.toys.common"):
        train_once(folder, train_tiny(runs))
    assert len(runs) == 2 and "damaged" in caplog.text
    assert torch.equal(safetensors.torch.load_file(weights)["w"], torch.full((256,), 2.0))


def test_a_killed_toy_training_is_cleaned_up_even_when_another_run_finished(tmp_path):
    folder, runs = tmp_path / "models" / "toy-small-abc", []
    train_once(folder, train_tiny(runs))
    stale = folder.with_name(f"{folder.name}.tmp{dead_pid()}")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100)

    assert train_once(folder, train_tiny(runs)) == folder
    assert len(runs) == 1 and not stale.exists()


# ---- hf:<folder> ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/etc", "empty", "file"])
def test_hf_with_a_folder_that_is_not_a_model_says_so(tmp_path, where):
    ref = {"/etc": "/etc", "empty": str(tmp_path), "file": str(tmp_path / "weights.bin")}[where]
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnknownModelError, match="config.json") as err:
        load_model(f"hf:{ref}")
    assert "not a model folder" in str(err.value)
