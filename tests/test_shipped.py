"""Shipped results (thoughtscope/shipped.py): shown only for their own model, never when damaged, within budget."""

from __future__ import annotations

import json

from thoughtscope import shipped


def test_a_shipped_result_round_trips_with_its_command(tmp_path):
    folder = shipped.write("calibration", "smollm2-135m", "fp1", {"detector.json": {"h": 2.0}},
                           command="thoughtscope cot calibrate --n 12", provenance={"seed": 0}, root=tmp_path)
    found = shipped.find("calibration", "smollm2-135m", "fp1", root=tmp_path)
    assert found and found.folder == folder
    assert found.json("detector.json") == {"h": 2.0}
    # the record names the command that rebuilds the result (the manifest's, where the record has none)
    assert found.command == "thoughtscope cot calibrate --n 12"
    assert found.provenance == {"seed": 0, "command": "thoughtscope cot calibrate --n 12"}


def test_another_models_result_is_never_shown_as_this_ones(tmp_path):
    shipped.write("calibration", "smollm2-135m", "fp1", {"d.json": [1]}, command="c", root=tmp_path)
    other = shipped.find("calibration", "smollm2-135m", "fp2", root=tmp_path)
    assert not other and "other weights" in other.reason and not other.damaged
    assert not shipped.find("calibration", "toy-moe", "fp1", root=tmp_path)


def test_a_damaged_file_is_reported_not_trusted(tmp_path):
    folder = shipped.write("fit", "m", "fp", {"a.json": {"x": 1}, "b.json": {"y": 2}}, command="c", root=tmp_path)
    (folder / "b.json").write_text(json.dumps({"y": 3}))
    found = shipped.find("fit", "m", "fp", root=tmp_path)
    assert not found and found.damaged and found.files == ("b.json",)
    (folder / "manifest.json").write_text("{not json")
    found = shipped.find("fit", "m", "fp", root=tmp_path)
    assert not found and found.damaged and "damaged manifest" in found.reason


def test_only_safetensors_and_json_ship(tmp_path):
    import pytest

    from thoughtscope.errors import BadInputError

    with pytest.raises(BadInputError, match="safetensors or JSON"):
        shipped.write("x", "m", "fp", {"weights.pt": b"\0"}, command="c", root=tmp_path)


def test_everything_shipped_stays_within_the_budget_and_verifies():
    root = shipped.shipped_root()
    assert shipped.total_bytes(root) <= shipped.BUDGET_BYTES
    results = [m for m in root.rglob(shipped.MANIFEST) if m.parent.parent.name != "models"]  # figure-previews: no MANIFEST
    assert results, "no shipped results: every method page should open on one"
    for manifest in results:  # the toy models under models/ are verified by probes.toys.shipped's tests
        data = json.loads(manifest.read_text())
        assert all(name.endswith(shipped.ALLOWED_SUFFIXES) for name in data["files"]), manifest
        found = shipped.find(data["name"], data["model_id"], data["fingerprint"], root=root)
        assert found, getattr(found, "reason", "")
