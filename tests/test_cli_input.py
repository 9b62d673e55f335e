"""The command line against careless input, round two (a fuzzing pass of 2026-12-07): each test failed before.

Tracebacks became one-line errors (a device torch does not know, a log level uvicorn does not know, a model
folder whose config.json is not a configuration, an export whose data does not fit its figure); options that
a command line alone can check are refused before any model loads (a density, a tolerance, a vote's
threshold, bootstrap resamples, a contrast's top-k, a learning rate of 0, an unknown model for `serve` and
`app`, a server URL that is not one); an export never leaves a partial set of files nor writes over its own
source; an `--export` into a new folder keeps the result.
"""

from __future__ import annotations

import json

import pytest
import torch

from thoughtscope import cli as cli_module


def _run(monkeypatch, capsys, argv: list[str]) -> tuple[int, str]:
    monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    captured = capsys.readouterr()
    text = " ".join((captured.err + captured.out).replace("│", " ").split())
    assert "Traceback" not in text, text
    return exit_info.value.code, text


@pytest.fixture
def no_model(monkeypatch):
    """Every method command's backend, recorded instead of loaded: a check that runs first leaves it empty."""
    loaded: list[tuple] = []
    import probes.engine

    for module in ("analyses.cot_entropy.cli", "analyses.moe_router.cli", "analyses.contrast.cli",
                   "analyses.rlkv.cli", "analyses.fuzzy_concepts.cli", "analyses.visual_attribution.cli"):
        monkeypatch.setattr(f"{module}.backend", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(probes.engine.Engine, "from_id", lambda *a, **k: loaded.append(a))
    return loaded


@pytest.mark.parametrize("argv, says", [
    (["eval", "cot-exit", "--model", "tiny-random:llama", "--tolerance", "nan"],
     "error: --tolerance must be a finite number in [0, 1], got nan"),
    (["eval", "cot-exit", "--model", "tiny-random:llama", "--tolerance", "-1"],
     "error: --tolerance must be a finite number in [0, 1], got -1.0"),
    (["eval", "cot-exit", "--model", "tiny-random:llama", "--density", "bogus"],
     "error: --density 'bogus' is not an option; use one of 'kde', 'histogram'"),
    (["eval", "cot-exit", "--model", "tiny-random:llama", "--bins", "0"],
     "Invalid value for '--bins'"),
    (["eval", "cot-exit", "--model", "tiny-random:llama", "--bandwidth", "0"],
     "error: --bandwidth takes bandwidths above 0 (nats); got 0"),
    (["eval", "cot-settling", "--density", "bogus"], "error: --density 'bogus' is not an option"),
    (["eval", "cot-vote", "--model", "tiny-random:llama", "--h", "nan"], "error: --h must be a finite number > 0"),
    (["eval", "cot-vote", "--model", "tiny-random:llama", "--temperature", "0"],
     "error: --temperature must be a finite number > 0 (voting needs sampled trajectories), got 0.0"),
    (["eval", "expert-sample", "--model", "tiny-random:qwen3_moe", "--n-resamples", "0"],
     "Invalid value for '--n-resamples'"),
    (["eval", "active-experts", "--model", "tiny-random:qwen3_moe", "--n-resamples", "-5"],
     "Invalid value for '--n-resamples'"),
    (["eval", "expert-sample", "--model", "tiny-random:qwen3_moe", "--batch-rows", "0"],
     "Invalid value for '--batch-rows'"),
    (["contrast", "run", "--model", "toy-reasoner:small", "--top-k", "0"],
     "error: top_k must be an integer in 1..1000, got 0"),
    (["contrast", "run", "--model", "toy-reasoner:small", "--resamples", "-1"],
     "error: n_resamples must be an integer in 10..100000, got -1"),
    (["rlkv", "train", "--model", "tiny-random:llama", "--lr", "0"], "error: --lr must be a finite number in (0, 10]"),
    (["models", "--out", "/tmp/x"], "error: --out applies to `thoughtscope models ship ID...` only"),
    (["generate", "--model", "tiny-random:llama", "--prompt", "  "], "error: --prompt is empty"),
    (["generate", "--model", "tiny-random:llama", "--prompt", "hi", "--max-new-tokens", "0"],
     "error: --max-new-tokens must be an integer in 1..8192, got 0"),
    (["generate", "--model", "tiny-random:llama", "--prompt", "hi", "--temperature", "nan"],
     "error: temperature must be a finite number >= 0"),
    (["sites", "--model", "tiny-random:llama", "--layer", "-1"], "Invalid value for '--layer'"),
    (["router", "profile", "--model", "tiny-random:qwen3_moe", "--p", "nan"], "error: --p must be a finite number"),
    (["router", "profile", "--model", "tiny-random:qwen3_moe", "--k-h", "0"], "Invalid value for '--k-h'"),
    (["router", "profile", "--model", "tiny-random:qwen3_moe", "--n", "0"], "Invalid value for '--n'"),
    (["eval", "fuzzy-concepts", "--model", "tiny-random:llama", "--token", "water", "--where", "bogus"],
     "error: --where 'bogus' is not an option; use one of 'generated', 'any'"),
    (["eval", "fuzzy-concepts", "--model", "tiny-random:llama", "--token", "water", "--membership", "bogus"],
     "error: --membership 'bogus' is not an option"),
    (["eval", "vis-attr", "--model", "tiny-random:llava", "--n", "0"], "Invalid value for '--n'"),
    (["eval", "vis-attr", "--model", "tiny-random:llava", "--epochs", "0"], "Invalid value for '--epochs'"),
    (["rlkv", "train", "--model", "tiny-random:llama", "--sink", "-1"], "Invalid value for '--sink'"),
    (["rlkv", "train", "--model", "tiny-random:llama", "--recent", "0"], "Invalid value for '--recent'"),
    # checked after the model had loaded, until 2026-12-07 (the fuzzing pass's list, left then)
    (["contrast", "run", "--model", "toy-reasoner:small", "--split", "test"],
     "error: split 'test'; use one of calibration, dev, eval"),
    (["contrast", "run", "--model", "toy-reasoner:small", "--organism", "3"],
     "error: ask for at least 4 organism traces, got 3"),
    (["contrast", "run", "--model", "toy-reasoner:small", "--prompts-a", "pyproject.toml"],
     "error: give two prompt files (--prompts-a and --prompts-b) to contrast them"),
    (["contrast", "run", "--model", "toy-reasoner:small", "--harvest", "arith", "--prompts-a", "pyproject.toml",
      "--prompts-b", "pyproject.toml"], "error: steps come from a RISE harvest or from two prompt sets, not both"),
    (["router", "profile", "--model", "tiny-random:qwen3_moe", "--task", "nope"], "error: unknown task 'nope'"),
    (["eval", "expert-sample", "--model", "tiny-random:qwen3_moe", "--task", "nope"], "error: unknown task 'nope'"),
])
def test_an_option_the_command_line_can_check_is_refused_before_any_model_loads(monkeypatch, capsys, no_model,
                                                                                 argv, says):
    code, text = _run(monkeypatch, capsys, argv)
    assert code == 2 and says in text, text
    assert no_model == []


def test_an_empty_server_url_is_not_this_process(monkeypatch, capsys):
    """`rlkv map --server ""` loaded smollm2-135m in this process without a word."""
    import probes.engine

    monkeypatch.setattr(probes.engine.Engine, "from_id", lambda *a, **k: pytest.fail("a model was loaded"))
    code, text = _run(monkeypatch, capsys, ["rlkv", "map", "--model", "tiny-random:llama", "--server", ""])
    assert code == 2 and "error: --server is empty; give the model server's URL" in text


@pytest.mark.parametrize("argv, says", [
    (["--model", "nope"], "error: unknown model id 'nope'"),
    (["--model", "tiny-random:nope"], "error: unknown tiny-random architecture 'nope'"),
    (["--server", "notaurl"], "error: --server 'notaurl' is not an http(s) URL with a host"),
    (["--server", "http://127.0.0.1:99999"], "error: --server 'http://127.0.0.1:99999' is not a URL"),
    (["--model", "toy-moe", "--server", "http://127.0.0.1:8765"], "error: give --server (a model server) or --model"),
])
def test_the_workbench_refuses_a_model_or_server_it_could_never_open(monkeypatch, capsys, argv, says):
    """Each of these started Streamlit, which then failed on the page."""
    import app.cli

    monkeypatch.setattr(app.cli, "run_app", lambda *a, **k: pytest.fail("the workbench started"))
    code, text = _run(monkeypatch, capsys, ["app", "--headless", *argv])
    assert code == 2 and says in text, text


@pytest.mark.parametrize("argv, says", [
    (["--model", "nope"], "error: unknown model id 'nope'"),
    (["--model", "tiny-random:llama", "--log-level", "bogus"], "error: --log-level 'bogus' is not an option"),
    (["--model", "tiny-random:llama", "--device", "tpu"], "error: unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
    (["--model", "tiny-random:llama", "--dtype", "float8"], "error: unknown dtype 'float8'"),
])
def test_serve_refuses_what_would_fail_before_it_says_it_is_running(monkeypatch, capsys, argv, says):
    """`serve --model nope` printed "Uvicorn running", then the load error twice; `--log-level bogus` was a KeyError
    traceback from uvicorn's logging set-up."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the server started"))
    code, text = _run(monkeypatch, capsys, ["serve", "--port", "18931", *argv])
    assert code == 2 and says in text, text


def test_an_unknown_device_is_an_error_not_torchs_traceback(monkeypatch, capsys):
    code, text = _run(monkeypatch, capsys, ["validate", "--model", "tiny-random:llama", "--device", "tpu"])
    assert code == 2 and "error: unknown device 'tpu'" in text


@pytest.mark.parametrize("config, says", [
    ("[]", "config.json is not a model configuration"),  # was a TypeError traceback
    ("{", "config.json is not readable JSON"),  # was "not in the local Hugging Face cache nor a folder here"
])
def test_a_model_folder_with_a_broken_config_says_so(monkeypatch, capsys, tmp_path, config, says):
    (tmp_path / "config.json").write_text(config)
    code, text = _run(monkeypatch, capsys, ["sites", "--model", f"hf:{tmp_path}"])
    assert code == 2 and says in text, text


_MISMATCHED = {"tokens": ["a", "b", "c"], "entropies": [0.1], "logprobs": [-0.1, -0.2],
               "top_tokens": [["a", "x"], ["b", "y"]], "top_probs": [[0.9, 0.1], [0.8, 0.2]]}


def test_an_export_whose_data_does_not_fit_writes_nothing(monkeypatch, capsys, tmp_path):
    """The SVG was written, then the CSV table raised an IndexError traceback: a partial export stayed behind."""
    source, out = tmp_path / "mis.json", tmp_path / "out"
    source.write_text(json.dumps(_MISMATCHED))
    code, text = _run(monkeypatch, capsys, ["export", "entropy", "--from", str(source), "--format", "json,csv",
                                            "--out", str(out)])
    assert code == 2 and f"{source} does not hold a result the 'entropy' figure draws" in text, text
    assert not out.exists() or list(out.iterdir()) == []


def test_an_export_never_writes_over_its_own_source(monkeypatch, capsys, tmp_path):
    source = tmp_path / "entropy.json"
    source.write_text(json.dumps({"tokens": ["a"], "entropies": [0.1]}))
    before = source.read_bytes()
    code, text = _run(monkeypatch, capsys, ["export", "entropy", "--from", str(source), "--format", "json",
                                            "--out", str(tmp_path)])
    assert code == 2 and "would write" in text and "over itself" in text, text
    assert source.read_bytes() == before


def test_a_direction_exported_into_a_new_folder_is_kept(tmp_path):
    """`contrast run --export new/x.safetensors` ran the whole contrast, then failed on the missing folder (which
    the command-line check allows: it can be made) and lost the result."""
    from safetensors.torch import load_file

    from analyses.contrast.core import save_direction

    path = tmp_path / "new" / "deeper" / "x.safetensors"
    save_direction(torch.arange(4.0), "resid_post.0", path)
    assert torch.equal(load_file(str(path))["vector"], torch.arange(4.0))


def test_rlkv_methods_that_name_nothing_are_refused():
    from analyses.rlkv.evaluate import _methods
    from thoughtscope.errors import BadInputError

    with pytest.raises(BadInputError, match="--methods names no method"):
        _methods(",", have_gates=False, random_seeds=3)
