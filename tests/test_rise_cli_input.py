"""Bad input to `thoughtscope rise ...` and `thoughtscope eval rise-organism`: a clear `error: ...` and exit 2,
refused before the work it would spoil (the model's load, the harvest, the SAEs' training), and stored SAEs reused
only when they are the ones the run would train."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from thoughtscope import cli as cli_module  # noqa: E402

# the tiny random model's family cuts at every word; sentences keep one templated step per trace
TINY = ["--n", "6", "--max-new-tokens", "8", "--augment", "templated", "--delimiter", "sentence", "--quiet", "--json"]


def run_cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr with rich's line wrapping undone) of `thoughtscope ARGV`."""
    monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
    code = 0
    try:
        cli_module.main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())


# `no-such-model` is not in the zoo: a setting refused with its own message was checked before the model loaded
@pytest.mark.parametrize("argv, says", [
    (["rise", "train", "--arch", "bogus"], "error: the SAE architecture 'bogus' is not an option; use one of 'standard', 'topk'"),
    (["rise", "train", "--d-sae", "0"], "error: d_sae must be an integer >= 1 (SAE latents), got 0"),
    (["rise", "train", "--l1", "nan"], "error: l1 must be a finite number"),
    (["rise", "train", "--lr", "-1"], "error: lr must be a finite number > 0"),
    (["rise", "train", "--steps", "0"], "error: SAE training steps must be an integer >= 1, got 0"),
    (["rise", "analyse", "--projection", "bogus"], "error: projection 'bogus' is not an option; use one of 'umap', 'pca'"),
    (["rise", "harvest", "--prompt", "bogus"], "error: prompt 'bogus' is not an option"),
    (["rise", "harvest", "--augment", "bogus"], "error: augment 'bogus' is not an option; use one of 'none', 'templated'"),
    (["rise", "harvest", "--delimiter", "(["], "error: the step delimiter '([' is not a valid regular expression"),
    (["rise", "harvest", "--batch-size", "0"], "error: batch_size must be an integer >= 1, got 0"),
    (["rise", "harvest", "--layers", "-1"], "error: layers must be a list of integers >= 0, got -1 among them"),
    (["rise", "steer", "--layer", "-1"], "error: --layer must be an integer >= 0, got -1"),
    (["eval", "rise-organism", "--d-sae", "0"], "error: d_sae must be an integer >= 1 (SAE latents), got 0"),
    (["eval", "rise-organism", "--l1", "nan"], "error: l1 must be a finite number"),
    (["eval", "rise-organism", "--n-steer", "0"], "error: --n-steer must be an integer >= 1, got 0"),
])
def test_a_bad_setting_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path, argv, says):
    code, out, err = run_cli(monkeypatch, capsys, *argv, "--model", "no-such-model", "--store", str(tmp_path / "st"),
                             "--quiet")
    assert code == 2 and out == "" and "Traceback" not in err
    assert says in err


def test_a_steering_layer_the_run_does_not_read_is_refused_before_the_harvest(monkeypatch, capsys, tmp_path):
    """`--layer 99` on a two-layer model once ran the harvest, the SAEs' training and the analysis first."""
    store = tmp_path / "store"
    code, out, err = run_cli(monkeypatch, capsys, "rise", "steer", "--model", "tiny-random:llama", "--layer", "99",
                             "--n-harvest", "6", "--max-new-tokens", "8", "--store", str(store),
                             "--saes", str(tmp_path / "saes"), "--quiet", "--json")
    assert code == 2 and out == ""
    assert "error: cannot steer at layer 99: this run reads layers 1 (the model has layers 0..1)" in err
    assert not store.exists() or not any(store.rglob("*.safetensors"))  # nothing harvested
    assert not (tmp_path / "saes").exists() or not any((tmp_path / "saes").rglob("cfg.json"))  # nothing trained


def test_stored_saes_of_another_model_or_other_settings_are_refused_not_reused(monkeypatch, capsys, tmp_path):
    """SAEs in a --saes folder were reused whatever trained them: another model's, or a d_sae the run did not ask
    for, while the report named this run's settings. Only the SAEs the run would train are reused."""
    saes = str(tmp_path / "saes")
    common = ["--layers", "1", "--store", str(tmp_path / "store"), "--saes", saes, *TINY]
    code, out, err = run_cli(monkeypatch, capsys, "rise", "train", "--model", "tiny-random:llama", "--steps", "20",
                             *common)
    assert code == 0, err
    assert json.loads((tmp_path / "saes" / "resid_post.1" / "rise.json").read_text())["model_id"] == "tiny-random:llama"

    # the same settings: the stored SAE is reused (a steps setting analyse does not take is the stored one's)
    code, out, err = run_cli(monkeypatch, capsys, "rise", "analyse", "--model", "tiny-random:llama",
                             "--projection", "pca", *common)
    assert code == 0, err
    assert json.loads(out)["analysis"]["layers"][0]["site"] == "resid_post.1"

    code, out, err = run_cli(monkeypatch, capsys, "rise", "analyse", "--model", "tiny-random:qwen2",
                             "--projection", "pca", *common)
    assert code == 2 and out == ""
    assert (f"error: the SAE stored in {saes}/resid_post.1 does not fit this run (trained on 'tiny-random:llama', "
            "this run uses 'tiny-random:qwen2'). Use a fresh --saes folder") in err

    code, out, err = run_cli(monkeypatch, capsys, "rise", "analyse", "--model", "tiny-random:llama",
                             "--projection", "pca", "--arch", "topk", *common)
    assert code == 2 and "architecture: stored 'standard', this run 'topk'" in err


def test_a_training_setting_the_run_sets_must_be_the_stored_saes(tmp_path):
    """`eval rise-organism --d-sae 7` after a run with the default d_sae reported d_sae 7 and used the d_sae 16
    SAEs; the pipeline (which the eval runs) now says what differs."""
    from analyses.rise.pipeline import RiseOptions, RisePipeline
    from probes.engine import Engine
    from thoughtscope.errors import BadInputError

    tiny = Engine.from_id("tiny-random:llama")
    base = dict(n=6, layers=(1,), max_new_tokens=8, augment="templated", delimiter="sentence", sae_steps=20,
                saes=str(tmp_path / "saes"), store=str(tmp_path / "store"))
    first = RisePipeline(tiny, RiseOptions(**base))
    h = first.harvest()
    saes, _ = first.train(h)
    d_sae = saes["resid_post.1"].cfg.d_sae
    assert d_sae != 7
    again, _ = RisePipeline(tiny, RiseOptions(**base, d_sae=d_sae)).train(h)  # the stored size, asked for: reused
    assert again["resid_post.1"].cfg.d_sae == d_sae
    with pytest.raises(BadInputError, match=f"d_sae: stored {d_sae}, this run 7") as refused:
        RisePipeline(tiny, RiseOptions(**base, d_sae=7)).train(h)
    assert "retrain the SAEs there with `thoughtscope rise train`" in str(refused.value)
    with pytest.raises(BadInputError, match="n: stored 6, this run 5"):
        RisePipeline(tiny, RiseOptions(**{**base, "n": 5})).train(h)
