"""The validation vocabulary (thoughtscope.checks): exact messages, returned values, nothing mutated."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from thoughtscope import checks
from thoughtscope.errors import BadInputError


def message(fn, *args, **kwargs) -> str:
    with pytest.raises(BadInputError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_integer_returns_the_value_and_names_the_parameter():
    assert checks.integer("n", 3, low=1) == 3
    assert checks.integer("n", np.int64(7), low=0, high=7) == 7
    assert type(checks.integer("n", np.int64(7))) is int
    assert checks.integer("max_head", None, low=1, none_ok=True) is None
    assert message(checks.integer, "n", 0, low=1) == "n must be an integer >= 1, got 0"
    assert message(checks.integer, "k", 9, low=1, high=8) == "k must be an integer in 1..8, got 9"
    assert message(checks.integer, "k", 9, high=8) == "k must be an integer <= 8, got 9"
    assert message(checks.integer, "n", True, low=0) == "n must be an integer >= 0, got True"
    assert message(checks.integer, "n", np.bool_(True)) == "n must be an integer, got np.True_"
    assert message(checks.integer, "n", 2.0) == "n must be an integer, got 2.0"
    assert message(checks.integer, "n", "3") == "n must be an integer, got '3'"
    assert message(checks.integer, "max_head", 0, low=1, none_ok=True) == \
        "max_head must be an integer >= 1 or None, got 0"
    assert message(checks.integer, "recent", 0, low=1, why="a token must see itself") == \
        "recent must be an integer >= 1 (a token must see itself), got 0"


def test_number_bounds_open_and_closed():
    assert checks.number("t", 0.5, low=0, high=1) == 0.5
    assert checks.number("t", 0, low=0, high=1) == 0
    assert type(checks.number("t", 1, low=0)) is int          # 1 stays 1 (provenance keeps its spelling)
    assert type(checks.number("t", np.float32(0.25))) is float
    assert checks.number("t", None, none_ok=True) is None
    assert message(checks.number, "t", 0, low=0, low_open=True) == "t must be a finite number > 0, got 0"
    assert message(checks.number, "p", 1.0, low=0, high=1, high_open=True) == \
        "p must be a finite number in [0, 1), got 1.0"
    assert message(checks.number, "p", -0.1, low=0, high=1, low_open=True) == \
        "p must be a finite number in (0, 1], got -0.1"
    assert message(checks.number, "x", 2, high=1) == "x must be a finite number <= 1, got 2"
    assert message(checks.number, "x", 1, high=1, high_open=True) == "x must be a finite number < 1, got 1"
    assert message(checks.number, "x", math.nan) == "x must be a finite number, got nan"
    assert message(checks.number, "x", math.inf, low=0) == "x must be a finite number >= 0, got inf"
    assert message(checks.number, "x", False) == "x must be a finite number, got False"
    assert message(checks.number, "T_e", "hot", low=0, low_open=True) == "T_e must be a finite number > 0, got 'hot'"


def test_choice():
    assert checks.choice("rule", "fixed", ("fixed", "nucleus")) == "fixed"
    assert checks.choice("k", 2, [1, 2]) == 2
    assert message(checks.choice, "rule", "top", ("fixed", "nucleus")) == \
        "rule 'top' is not an option; use one of 'fixed', 'nucleus'"
    assert message(checks.choice, "rule", ["fixed"], ("fixed",)) == "rule ['fixed'] is not an option; use one of 'fixed'"


def test_int_list_checks_every_entry_and_copies():
    given = (3, np.int64(0), 2)
    got = checks.int_list("layers", given, low=0, high=3)
    assert got == [3, 0, 2] and all(type(v) is int for v in got)
    assert given == (3, np.int64(0), 2)
    original = [1, 2]
    assert checks.int_list("layers", original) is not original
    assert checks.int_list("layers", [], empty_ok=True) == []
    assert message(checks.int_list, "layers", [], low=0, high=3) == \
        "layers must be a non-empty list of integers in 0..3, got an empty list"
    assert message(checks.int_list, "layers", [0, 4], low=0, high=3) == \
        "layers must be a non-empty list of integers in 0..3, got 4 among them"
    assert message(checks.int_list, "layers", [0, True], low=0) == \
        "layers must be a non-empty list of integers >= 0, got True among them"
    assert message(checks.int_list, "layers", "12") == "layers must be a non-empty list of integers, got '12'"
    assert message(checks.int_list, "layers", 3) == "layers must be a non-empty list of integers, got 3"


def test_window():
    assert checks.window(4, 16, 64) == (4, 16)
    assert checks.window(0, 1, 2) == (0, 1)
    assert message(checks.window, -1, 16, 64) == "sink must be an integer >= 0, got -1"
    assert message(checks.window, 4, 0, 64) == "recent must be an integer >= 1 (a token must see itself), got 0"
    assert message(checks.window, 4, True, 64, owner="SinkRecent") == \
        "SinkRecent.recent must be an integer >= 1 (a token must see itself), got True"
    assert message(checks.window, 48, 16, 64) == \
        "sink + recent = 64 reaches this model's context (64): choose a smaller window"
    assert message(checks.window, 48, 20, 64, hint="use KeepAll or a smaller window") == \
        "sink + recent = 68 reaches this model's context (64): use KeepAll or a smaller window"


def test_a_check_never_mutates_the_object_it_reads():
    class Params:
        sink = 4
        recent = 8

    p = Params()
    checks.window(p.sink, p.recent, 64)
    checks.integer("sink", p.sink, low=0)
    assert (p.sink, p.recent) == (4, 8)


def test_user_path_refuses_what_the_file_system_would_raise_on(tmp_path):
    """An over-long name raised OSError ("File name too long") from `Path.is_file()`, a NUL ValueError from
    `open`: tracebacks on the RLKV page's gates box and in `thoughtscope rlkv map --gates`."""
    import os
    from pathlib import Path

    long_name = "x" * 300
    cases = {"x" * 5000: "is 5,000 bytes long ('xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'...); a path has at most 4,096",
             f"{tmp_path}/{long_name}/f": "holds a name of 300 bytes",
             "a\x00b": "holds a NUL character",
             "  ": "is empty",
             "~no-such-user-here/x": "starts with an unknown user's home"}
    for value, says in cases.items():
        with pytest.raises(BadInputError, match=re.escape(says)) as caught:
            checks.user_path("gates file", value)
        assert str(caught.value).startswith("the gates file ") and len(str(caught.value)) < 300
    assert checks.user_path("gates file", "~/g.safetensors") == Path(os.path.expanduser("~/g.safetensors"))
    assert checks.user_path("gates file", tmp_path / "g") == tmp_path / "g"
    assert checks.user_path("gates file", "é" * 127) == Path("é" * 127)  # 254 bytes: a name may hold that


def test_free_port_refuses_a_port_a_server_listens_on():
    import socket

    with socket.socket() as listening:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        with pytest.raises(BadInputError, match=f"port {port} on 127.0.0.1 is in use .*choose another with --port"):
            checks.free_port("127.0.0.1", port)
    assert checks.free_port("127.0.0.1", port) == port  # released: free again
    with pytest.raises(BadInputError, match="cannot listen on"):
        checks.free_port("no-such-host.invalid", port)
