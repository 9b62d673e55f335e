"""thoughtscope.numerics and shipped.rebuild_differences: which float arithmetic made a shipped file, and how a
rebuild is compared with it (the same bytes on the same arithmetic, float tolerance on another CPU kind)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from thoughtscope import numerics, shipped


def test_the_fingerprint_names_the_kernels_this_process_uses():
    assert numerics.fingerprint() == numerics.fingerprint() and len(numerics.fingerprint()) == 16
    info = numerics.describe()
    assert info["numerics"] == numerics.fingerprint()
    assert info["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    code = "from thoughtscope import numerics; print(numerics.fingerprint())"
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert same.stdout.strip() == numerics.fingerprint()  # another process, the same arithmetic
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        # PyTorch's generic kernels instead of this CPU's vector ones: other last bits, another fingerprint
        generic = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "ATEN_CPU_CAPABILITY": "default"})
        assert generic.stdout.strip() != numerics.fingerprint()


def test_mismatches_compares_floats_within_tolerance_and_the_rest_exactly():
    assert numerics.mismatches({"x": 1.0, "k": [1, 2]}, {"x": 1.0 + 1e-9, "k": [1, 2]}) == []
    assert numerics.mismatches({"x": 1.0}, {"x": 1.001}) == ["x: 1.0 != 1.001"]
    assert numerics.mismatches({"x": 1.0}, {"x": 1.001}, atol=0.01) == []
    assert numerics.mismatches({"k": [1, 2]}, {"k": [1, 2, 3]}) == ["k: length 2 != 3"]
    assert numerics.mismatches({"a": 1}, {"b": 1}) == ["value: keys ['a', 'b'] in one only"]
    assert numerics.mismatches({"s": "A"}, {"s": "B"}) == ["s: 'A' != 'B'"]
    assert numerics.mismatches(float("nan"), 1.0) == ["value: nan != 1.0"]
    assert numerics.same_numerics({"numerics": numerics.fingerprint()})
    assert not numerics.same_numerics({}) and not numerics.same_numerics({"numerics": "0" * 16})


def _result(root, vector, study, numerics_tag):
    folder = shipped.write("demo", "toy:x", "fp", {"v.safetensors": save_and_read(root, vector),
                                                     "study.json": study}, command="thoughtscope ship demo",
                           root=root)
    manifest = json.loads((folder / shipped.MANIFEST).read_text())
    manifest["numerics"] = numerics_tag
    (folder / shipped.MANIFEST).write_text(json.dumps(manifest))
    return shipped.find("demo", "toy:x", "fp", root=root)


def save_and_read(root, vector):
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"v{len(list(root.iterdir()))}.safetensors.src"
    save_file({"vector": vector, "ids": torch.arange(3)}, str(path), metadata={"site": "resid"})
    return path.read_bytes()


def test_a_rebuild_is_compared_byte_for_byte_on_the_same_arithmetic_and_within_tolerance_elsewhere(tmp_path):
    v = torch.tensor([0.5, -0.25, 0.125])
    here = numerics.fingerprint()
    old = _result(tmp_path / "old", v, {"r": 0.3861, "n": 148, "costs": 1.0}, here)
    nudged = _result(tmp_path / "new", v + 1e-7, {"r": 0.3861 + 1e-9, "n": 148, "costs": 2.0}, here)
    assert nudged.manifest["numerics"] == here and old.manifest["numerics"] == here
    # the same arithmetic: any changed bit is a difference; timings named in `ignore` are left out
    assert shipped.rebuild_differences(nudged, old, ignore={"study.json": {"costs"}}) == [
        "study.json: differs", "v.safetensors: not the same tensors and metadata"]
    same = _result(tmp_path / "same", v, {"r": 0.3861, "n": 148, "costs": 2.0}, here)
    assert shipped.rebuild_differences(same, old, ignore={"study.json": {"costs"}}) == []
    # made on other arithmetic: floats within tolerance pass, integers and names must still be equal
    elsewhere = {**old.manifest, "numerics": "0" * 16}
    old_elsewhere = shipped.Shipped(old.folder, elsewhere)
    assert shipped.rebuild_differences(nudged, old_elsewhere, ignore={"study.json": {"costs"}}) == []
    far = _result(tmp_path / "far", v + 1e-2, {"r": 0.3961, "n": 149, "costs": 2.0}, here)
    assert shipped.rebuild_differences(far, old_elsewhere, ignore={"study.json": {"costs"}}) == [
        "study.json: n: 149 != 148", "study.json: r: 0.3961 != 0.3861",
        "v.safetensors: tensors differ beyond float tolerance (or names, shapes, metadata)"]
    assert shipped.rebuild_differences(far, old_elsewhere, ignore={"study.json": {"costs", "n"}},
                                       atol={"study.json": 0.02})[:1] == [
        "v.safetensors: tensors differ beyond float tolerance (or names, shapes, metadata)"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files_made_elsewhere_may_differ_by_one_step(tmp_path, dtype):
    v = torch.tensor([165.0, 0.5, -3.0], dtype=dtype)
    one_step = torch.nextafter(v, torch.full_like(v, 1e4))
    old = _result(tmp_path / "old", v, {}, "0" * 16)
    assert shipped.rebuild_differences(_result(tmp_path / "a", one_step, {}, "1" * 16), old) == []
    assert shipped.rebuild_differences(_result(tmp_path / "b", v * 1.01, {}, "1" * 16), old) != []


class _Stop(Exception):
    """Raised where a shipped build would load its model."""


def test_every_shipped_build_runs_on_one_thread_and_gives_the_callers_threads_back(monkeypatch):
    """A build run in-process (a test, `thoughtscope ship`) must not leave the process on one torch thread: each
    `analyses/*/ship.py` build set one thread and never restored it. Each build is stopped where it loads its
    model; it has set one thread by then, and the caller's count is back after the error."""
    from probes.engine import Engine
    from thoughtscope.cli import shipped_results

    seen = {}

    def from_id(cls, model_id, **kwargs):
        seen[current] = torch.get_num_threads()
        raise _Stop(model_id)

    monkeypatch.setattr(Engine, "from_id", classmethod(from_id))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for current, (model_id, build) in sorted(shipped_results().items()):
            with pytest.raises(_Stop):
                build(model_id, "test")
            assert torch.get_num_threads() == 2, current
    finally:
        torch.set_num_threads(before)
    assert len(seen) >= 7 and set(seen.values()) == {1}, seen
