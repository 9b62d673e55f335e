"""The `thoughtscope` command line, run as a user would (through typer's runner)."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
from typer.testing import CliRunner

from thoughtscope import cli as cli_module

runner = CliRunner()


@pytest.fixture(scope="module")
def app():
    return cli_module.build()


def test_the_entry_point_discovers_every_method_package(app):
    """Sub-commands and benchmark groups come from the packages; no central list names them."""
    names = {c.name or c.callback.__name__ for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert {"models", "sites", "generate", "serve", "app", "export", "bench", "eval", "rise"} <= names
    assert {"analyses.cot_entropy", "analyses.rise"} <= set(cli_module.method_packages())
    assert {"hooks", "server", "cot", "rise"} <= set(cli_module.benchmark_groups())


def test_models_lists_the_zoo(app):
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    ids = [json.loads(line)["id"] for line in result.output.splitlines()]
    assert ids[0] == "smollm2-135m" and "tiny-random:qwen3_moe" in ids


def test_sites_lists_every_site_of_a_layer(app):
    result = runner.invoke(app, ["sites", "--model", "tiny-random:qwen3_moe", "--layer", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert {r["site"] for r in rows} >= {"resid_post.1", "router.1", "attn_pattern.1", "z.1"}
    assert next(r for r in rows if r["site"] == "resid_pre.1")["tl_hook"] == "blocks.1.hook_resid_pre"


def test_generate_streams_json_records(app):
    result = runner.invoke(app, ["generate", "--model", "tiny-random:llama", "--prompt", "2 + 2 =",
                                 "--max-new-tokens", "4", "--capture", "resid_post.1", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["activations"]["resid_post.1"]["shape"] == [64]
    from probes import Engine

    want = list(Engine.from_id("tiny-random:llama").generate("2 + 2 =", max_new_tokens=4, capture=["resid_post.1"],
                                                             chat=True))
    assert [r["token_id"] for r in rows] == [w.token_id for w in want]
    assert [r["entropy"] for r in rows] == pytest.approx([w.entropy for w in want], abs=1e-5)
    assert [r["top_ids"] for r in rows] == [w.top_ids for w in want] and len(rows[0]["top_ids"]) == 5


def test_user_errors_are_messages_not_tracebacks(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["thoughtscope", "generate", "--model", "tiny-random:llama",
                                     "--prompt", "hi", "--capture", "resid_post.99"])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "layer 99 is out of range" in err and "Traceback" not in err


def test_an_error_message_with_brackets_is_printed_as_it_is(monkeypatch, capsys):
    """A message naming the rule form `kind:<A>[/<B>]` (an unknown contrast rule) crashed the error printer with
    rich's MarkupError and a traceback: `[/<B>]` read as a closing tag."""
    monkeypatch.setattr("sys.argv", ["thoughtscope", "contrast", "run", "--model", "tiny-random:llama", "--rule", "foo"])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "error: unknown rule 'foo'; use one of kind:<A>[/<B>], correct, alarm, source:<A>/<B>, random" in err


@pytest.mark.parametrize("argv, says", [
    (["rlkv", "map", "--model", "tiny-random:llama", "--gates", "g" * 5000],
     "error: the --gates is 5,000 bytes long"),
    (["router", "profile", "--model", "toy-moe", "--task", "t" * 300 + ".jsonl"],
     "error: the problem file holds a name of 306 bytes"),
    (["features", "top", "--model", "tiny-random:llama", "--site", "resid_post.0", "--neuron", "0",
      "--corpus", "c" * 5000], "error: the --corpus is 5,000 bytes long"),
])
def test_an_over_long_path_is_a_message_not_a_traceback(monkeypatch, capsys, argv, says):
    """`Path.is_file()` raises "File name too long" (OSError) past 255 bytes a name: these commands printed a
    traceback before `checks.user_path` looked at what the user typed."""
    monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert says in err


def test_a_place_to_write_that_cannot_be_written_is_refused_before_the_work(monkeypatch, capsys, tmp_path):
    """An output folder under a file, or a file name that is a folder, is refused when the command line is read:
    `rlkv train --out` (80 s a GRPO step here) and `eval vis-attr --save` once reached their write at the end, and
    `export --out` raised NotADirectoryError with a traceback."""
    import app.export as export_module

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    curve = Path(__file__).resolve().parents[1] / "docs" / "curves" / "batch_rows.json"
    cases = [(["rlkv", "train", "--model", "tiny-random:llama", "--out", str(a_file)],
              f"error: the --out {a_file} is a file, not a folder"),
             (["eval", "vis-attr", "--model", "toy-vlm", "--save", str(tmp_path)],
              f"error: the --save {tmp_path} is a folder; give a file name"),
             (["export", "growth_curve", "--from", str(curve), "--out", str(a_file / "figs")],
              f"error: the --out {a_file / 'figs'} cannot be made: {a_file} is a file, not a folder")]
    loads = []
    monkeypatch.setattr("analyses.clikit.backend", lambda *a, **k: loads.append(a))  # no model may load
    for argv, says in cases:
        monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli_module.main()
        err = "".join(capsys.readouterr().err.split())  # rich wraps a long line anywhere, inside a path too
        assert exit_info.value.code == 2 and "Traceback" not in err and "".join(says.split()) in err, (argv, err)
    assert loads == []
    # what no check can foresee (a full disk, a folder made read-only meanwhile): the file system's refusal, said
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "figs" / "growth_curve.json"))

    monkeypatch.setattr(export_module, "save_figure", refuse)
    monkeypatch.setattr("sys.argv", ["thoughtscope", "export", "growth_curve", "--from", str(curve), "--out",
                                     str(tmp_path / "figs"), "--format", "json"])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    err = "".join(capsys.readouterr().err.split())  # rich wraps a long line anywhere
    assert exit_info.value.code == 2
    assert err == "".join(f"error: Permission denied: {tmp_path / 'figs' / 'growth_curve.json'}".split())


def test_every_command_prints_its_help(app):
    """`--help` of every command and group renders (a help text with rich markup such as `[/x]` once
    crashed `thoughtscope contrast run --help` with a traceback)."""
    import click
    import typer

    failed, seen = [], 0

    def walk(command: click.Command, path: list[str]) -> None:
        nonlocal seen
        seen += 1
        result = runner.invoke(app, [*path, "--help"])
        if result.exit_code != 0 or "Usage" not in result.output:
            failed.append((" ".join(path), result.exit_code, repr(result.exception)))
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    assert seen >= 30 and not failed, failed  # 39 commands and groups today


@pytest.mark.parametrize("command", ["serve", "app"])
@pytest.mark.parametrize("port, says", [("99999", "less than or equal to 65535"), ("0", "greater than or equal to 1")])
def test_a_port_outside_1_to_65535_is_a_usage_error_before_anything_loads(app, command, port, says):
    """`serve --port 99999` loaded the model, then died in uvicorn's bind() with an OverflowError traceback."""
    result = CliRunner().invoke(app, [command, "--model", "tiny-random:llama", "--port", port])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("option, value, says", [
    ("--max-body-bytes", "0", "max_body_bytes must be an integer >= 1"),
    ("--max-new-tokens-cap", "0", "max_new_tokens_cap must be an integer >= 1"),
    ("--max-states", "0", "max_states must be an integer >= 1"),
    ("--state-ttl-s", "nan", "state_ttl_s must be a finite number > 0"),
    ("--send-timeout-s", "-5", "send_timeout_s must be a finite number > 0"),
    ("--max-sequences", "0", "max_sequences must be an integer >= 1"),
])
def test_a_servers_nonsense_limit_is_refused_at_start(app, monkeypatch, option, value, says):
    """Each of these started a server that refused every request (or never expired a state) without a word."""
    import uvicorn

    import probes.server as server

    loaded = []
    monkeypatch.setattr(server.Engine, "from_id", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: loaded.append("served"))  # never listens here
    result = CliRunner().invoke(app, ["serve", "--model", "tiny-random:llama", "--port", "8799", option, value])
    assert result.exit_code != 0 and says in str(result.exception) + result.output
    assert loaded == []


def test_a_bad_count_or_window_is_refused_before_the_model_works(monkeypatch, capsys):
    """`features top --k -1` was refused only after the whole corpus was indexed (1,823 texts), and `rlkv map
    --sink -1` drew a head map from a negative window."""
    from analyses.feature_browser import cli as features_cli
    from analyses.rlkv import head_map

    indexed, traced = [], []
    monkeypatch.setattr(features_cli, "build_index", lambda *a, **k: indexed.append(a))
    monkeypatch.setattr(head_map, "problem_texts", lambda *a, **k: traced.append(a))
    for argv, code, says in (
            (["features", "top", "--model", "tiny-random:llama", "--site", "resid_post.0", "--neuron", "0", "--k", "-1"],
             2, "Invalid value for '--k': Input should be greater than or equal to 1"),
            (["sites", "--model", "tiny-random:llama", "--layer", "99", "--json"], 2,  # printed nothing, exit 0
             "error: --layer must be an integer in 0..1 (tiny-random:llama has 2 layers), got 99"),
            (["rlkv", "map", "--model", "tiny-random:llama", "--sink", "-1"], 2,
             "error: sink must be an integer >= 0, got -1"),
            (["rlkv", "map", "--model", "tiny-random:llama", "--sink", "100000"], 2,
             "a local head would read everything; choose a smaller window")):
        monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli_module.main()
        err = " ".join(capsys.readouterr().err.replace("│", " ").split())
        assert exit_info.value.code == code and "Traceback" not in err and says in err, (argv, err)
    assert indexed == [] and traced == []


def test_a_list_of_numbers_that_is_not_is_refused_before_any_model_loads(monkeypatch, capsys):
    """`eval rlkv --snapkv-windows abc` gave int()'s ValueError with a traceback; `eval active-experts --k 2.5`
    ran as top-2 (int(float('2.5'))), and only after the model had loaded."""
    loaded = []
    for module in ("analyses.rlkv.cli", "analyses.moe_router.cli", "analyses.rise.cli", "analyses.fuzzy_concepts.cli"):
        monkeypatch.setattr(f"{module}.backend", lambda *a, **k: loaded.append(a))
    for argv, says in (
            (["eval", "rlkv", "--model", "tiny-random:llama", "--snapkv-windows", "abc"],
             "error: --snapkv-windows takes integers such as 1,2,4; got 'abc'"),
            (["eval", "rlkv", "--model", "tiny-random:llama", "--snapkv-windows", "4,0"],
             "error: --snapkv-windows takes integers of at least 1; got '0'"),
            (["eval", "active-experts", "--model", "tiny-random:qwen3_moe", "--k", "4,2.5"],
             "error: --k takes integers such as 1,2,4; got '2.5'"),
            (["eval", "expert-sample", "--model", "tiny-random:qwen3_moe", "--temperature", "0.5,warm"],
             "error: --temperature takes numbers such as 1,2,4; got 'warm'"),
            # the same reading in the RISE and fuzzy commands (each had its own, without the option's name)
            (["rise", "steer", "--model", "tiny-random:llama", "--layers", "1.5"],
             "error: --layers takes integers such as 1,2,4; got '1.5'"),
            (["eval", "fuzzy-concepts", "--model", "tiny-random:llama", "--token", "water", "--features", "8,x"],
             "error: --features takes integers such as 1,2,4; got 'x'")):
        monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli_module.main()
        err = " ".join(capsys.readouterr().err.replace("│", " ").split())
        assert exit_info.value.code == 2 and "Traceback" not in err and says in err, (argv, err)
    assert loaded == []


def test_every_seed_option_takes_the_apps_range_when_the_command_line_is_read(app):
    """`eval vis-attr --seed -1` raised numpy's ValueError with a traceback, `contrast run --seed -1` was refused
    after its steps were read, `eval expert-sample --seed -1` named a derived seed (-100003) and `rlkv map --seed -1`
    ran (seeded like --seed 1). Every command's --seed now takes 0..2**31 - 1, as the app's seed box does."""
    import click
    import typer

    from app.sidebar import SETTING_RANGES
    from thoughtscope import checks

    assert SETTING_RANGES["seed"] == (0, checks.SEED_MAX)
    seen = []

    def walk(command: click.Command, path: list[str]) -> None:
        for param in getattr(command, "params", []):
            if "--seed" in getattr(param, "opts", []):
                seen.append(" ".join(path))
                for bad in ("-1", str(checks.SEED_MAX + 1)):
                    result = runner.invoke(app, [*path, "--seed", bad])
                    assert result.exit_code == 2 and "Invalid value for '--seed'" in result.output, (path, bad)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    assert len(seen) >= 14, seen  # generate, rise (harvest, ...), contrast run, eval cot-*, rlkv, moe, vis-attr, fuzzy


def test_an_options_numbers_are_read_or_refused_by_name():
    from analyses.clikit import numbers
    from thoughtscope.errors import BadInputError

    assert numbers(["0.3,0.6", "1"], "--temperature") == [0.3, 0.6, 1.0]
    assert numbers("4, 16", "--snapkv-windows", integer=True, low=1) == [4, 16]
    assert numbers(["2e1"], "--k", integer=True) == [20] and numbers([], "--k") == [] == numbers(None, "--k")
    for values, integer, says in ((["1,x"], False, "got 'x'"), (["nan"], False, "finite numbers"),
                                  (["inf"], True, "got 'inf'"), (["2.5"], True, "got '2.5'")):
        with pytest.raises(BadInputError, match=says):
            numbers(values, "--flag", integer=integer)
    with pytest.raises(BadInputError, match="at least 1; got '0'"):
        numbers("0", "--flag", integer=True, low=1)


def test_serve_and_app_refuse_a_port_in_use_before_the_model_loads(monkeypatch, capsys):
    """`thoughtscope app` printed "the workbench is at http://localhost:N" and then Streamlit's "Port N is not
    available"; `serve` loaded the model before uvicorn's bind error."""
    import socket

    from app import cli as app_cli
    from probes import server_cli

    started = []
    monkeypatch.setattr(server_cli, "serve", lambda *a, **k: started.append("serve"))
    monkeypatch.setattr(app_cli, "run_app", lambda *a, **k: started.append("app") or 0)
    with socket.socket() as listening:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = str(listening.getsockname()[1])
        for argv in (["serve", "--model", "tiny-random:llama", "--port", port],
                     ["app", "--port", port, "--address", "127.0.0.1", "--headless"]):
            monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
            with pytest.raises(SystemExit) as exit_info:
                cli_module.main()
            err = " ".join(capsys.readouterr().err.split())
            assert exit_info.value.code == 2 and f"error: port {port} on 127.0.0.1 is in use" in err, (argv, err)
    assert started == []
