"""`thoughtscope features ...` refuses bad input with a message, before the model loads: sites the feature browser
cannot read, counts of zero or less, options that conflict or go unused, SAEs and files that are not there, and
SAEs whose weights are NaN."""

from __future__ import annotations

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from analyses.feature_browser import cli as fb_cli
from analyses.feature_browser import search_cli
from thoughtscope.errors import BadInputError

MODEL = "tiny-random:llama"
SITE = "resid_post.1"
USABLE = "resid_pre.<layer>, resid_post.<layer>, attn_out.<layer>, mlp_out.<layer>"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An SAE of width 64 (the tiny model's d_model), the same SAE with NaN weights, a corpus and a vector file."""
    from saes.io import load_sae, save_sae
    from saes.train import SAETrainSettings, train_sae

    root = tmp_path_factory.mktemp("features_cli")
    sae, _ = train_sae(torch.randn(256, 64), SAETrainSettings(d_sae=16, batch_size=64, steps=5, progress=False))
    save_sae(sae, root / "sae_ok")
    broken = load_sae(root / "sae_ok")
    with torch.no_grad():
        broken.W_enc.fill_(float("nan"))
    save_sae(broken, root / "sae_nan")
    (root / "corp.txt").write_text("Anna has 17 shells.\n\nShe wins 3 more today.\n\nHow many now?")
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(root / "vtwo.safetensors"))
    return root


@pytest.fixture
def features(monkeypatch, tmp_path):
    """Run `thoughtscope features ARGS`; a check that waits for the model fails the test (no model loads here)."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(fb_cli, "backend", no_model)
    monkeypatch.setattr(search_cli, "backend", no_model)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    cli = typer.Typer()
    fb_cli.register(cli)

    def run(*args: str):
        return CliRunner().invoke(cli, ["features", *args, "--model", MODEL])

    return run


def refused(result, *says: str) -> str:
    """The message of a project error the command stopped with (printed as `error: ...` by the entry point)."""
    assert isinstance(result.exception, BadInputError), result.output or repr(result.exception)
    message = " ".join(str(result.exception).split())
    for part in says:
        assert part in message, message
    return message


def typer_refused(result, option: str, says: str) -> None:
    """A value out of an option's range, refused by the command-line parser (exit 2, usage error)."""
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.replace("│", " ").split())
    assert f"Invalid value for '{option}'" in out and says in out, out


# ----------------------------------------------------------------- 1. sites that are not one vector per token

@pytest.mark.parametrize("site,holds", [("q.1", "[heads, head_dim]"), ("z.1", "[heads, head_dim]"),
                                        ("attn_pattern.1", "[heads, kv_len]"), ("logits", "[vocab]")])
def test_tokens_refuses_a_site_that_is_not_one_residual_vector_per_token(features, files, site, holds):
    result = features("tokens", "hi", "--site", site, "--sae", str(files / "sae_ok"))
    refused(result, f"site '{site}' holds {holds} per token", f"the feature browser reads {USABLE}")


@pytest.mark.parametrize("command", ["top", "index"])
def test_top_and_index_refuse_a_per_head_or_pattern_site(features, files, command):
    direction = ["--neuron", "0"] if command == "top" else []
    for site in ("q.1", "attn_pattern.1"):
        result = features(command, "--corpus", str(files / "corp.txt"), "--site", site, *direction)
        refused(result, f"site '{site}' holds", USABLE)


def test_the_library_refuses_those_sites_too(llama):
    from analyses.feature_browser import build_index, load_corpus
    from analyses.feature_browser.token_latents import trace_latents
    from saes.train import SAETrainSettings, make_training_sae

    sae = make_training_sae(64, SAETrainSettings(d_sae=8))
    with pytest.raises(BadInputError, match=r"site 'q.1' holds \[heads, head_dim\] per token"):
        trace_latents(llama, llama.encode("Wait, let me check."), sae, "q.1")
    with pytest.raises(BadInputError, match=r"site 'attn_pattern.1' holds \[heads, kv_len\]"):
        build_index(llama, load_corpus("gsm8k-questions", n=2), "attn_pattern.1", store=None)


# ----------------------------------------------------------------- 2. counts of zero or less

@pytest.mark.parametrize("command,count,value", [("labels", "--k", "0"), ("labels", "--k", "-2"),
                                                 ("tokens", "--k", "0"), ("tokens", "--k", "-1"),
                                                 ("search", "--k", "0"), ("index", "--n", "-1"),
                                                 ("top", "--n", "0"), ("labels", "--n", "0")])
def test_a_count_below_one_is_refused_when_the_command_line_is_read(features, files, command, count, value):
    args = {"labels": ["--sae", str(files / "sae_ok")], "search": ["much", "--sae", str(files / "sae_ok")],
            "tokens": ["hi", "--sae", str(files / "sae_ok")], "index": [], "top": ["--neuron", "0"]}[command]
    result = features(command, *args, "--site", SITE, count, value)
    typer_refused(result, count, "greater than or equal to 1")


# ----------------------------------------------------------------- 3. an SAE of NaN weights

def test_an_sae_with_nan_weights_is_refused_naming_its_file(features, files):
    result = features("tokens", "hi", "--site", SITE, "--sae", str(files / "sae_nan"))
    refused(result, f"{files / 'sae_nan' / 'sae_weights.safetensors'} holds an SAE whose W_enc has 1,024 NaN")


# ----------------------------------------------------------------- 4. options that would be ignored

def test_top_refuses_tensor_without_vector_and_latent_without_sae(features, files):
    base = ["top", "--corpus", str(files / "corp.txt"), "--site", SITE, "--neuron", "3"]
    refused(features(*base, "--tensor", "a"), "--tensor names a tensor in --vector", "drop --tensor")
    refused(features(*base, "--latent", "5"), "--latent picks a latent of --sae", "drop --latent")


# ----------------------------------------------------------------- 5. checked before the model loads

def test_index_checks_unit_max_tokens_and_corpus_before_the_model_loads(features, files):
    base = ["index", "--site", SITE]
    corpus = ["--corpus", str(files / "corp.txt")]
    refused(features(*base, *corpus, "--unit", "bogus"), "--unit 'bogus' is not an option",
            "'paragraph', 'line'")
    typer_refused(features(*base, *corpus, "--max-tokens", "0"), "--max-tokens", "greater than or equal to 2")
    refused(features(*base, "--corpus", str(files / "nosuch.txt")), "is neither a corpus (gsm8k-questions",
            "nor a text file")


def test_top_wants_exactly_one_direction_before_the_model_loads(features, files):
    base = ["top", "--corpus", str(files / "corp.txt"), "--site", SITE]
    refused(features(*base), "give exactly one direction")
    refused(features(*base, "--neuron", "1", "--vector", str(files / "vtwo.safetensors")),
            "give exactly one direction")


def test_a_missing_sae_folder_names_the_flag(features, files):
    message = refused(features("tokens", "hi", "--site", SITE, "--sae", str(files / "nosuch")),
                      "--sae", "no such folder; give a SAELens SAE folder")
    assert "sae_id" not in message
    refused(features("top", "--site", SITE, "--sae", str(files / "corp.txt")), "is not a SAELens SAE folder")


# ----------------------------------------------------------------- 6. a vector file of several tensors

def test_a_vector_file_of_two_tensors_asks_for_tensor(features, files):
    message = refused(features("top", "--corpus", str(files / "corp.txt"), "--site", SITE,
                               "--vector", str(files / "vtwo.safetensors")),
                      "vtwo.safetensors holds ['a', 'b']; say which one with --tensor NAME")
    assert "key=" not in message
