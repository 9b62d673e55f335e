"""app.warm: the libraries method pages load lazily are imported once per process, in the background."""

from __future__ import annotations

import sys

import pytest

from app import warm


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state where the warm-up has not run, and a package on the path that counts its imports."""
    monkeypatch.setattr(warm, "_thread", None)
    monkeypatch.setattr(warm, "loaded", {})
    pkg = tmp_path / "ts_warm_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import builtins\nbuiltins.TS_WARM_RUNS = getattr(builtins, 'TS_WARM_RUNS', 0) + 1\n")
    (pkg / "heavy.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in ("ts_warm_probe", "ts_warm_probe.heavy"):
        sys.modules.pop(name, None)
    import builtins

    if hasattr(builtins, "TS_WARM_RUNS"):
        del builtins.TS_WARM_RUNS


def test_imports_in_the_background_once_per_process(fresh):
    import builtins

    thread = warm.start(["ts_warm_probe.heavy"], first=())
    assert thread is not None and thread.daemon
    thread.join(30)
    assert sys.modules["ts_warm_probe.heavy"].VALUE == 42
    assert list(warm.loaded) == ["ts_warm_probe.heavy"]
    assert warm.start(["ts_warm_probe.heavy"]) is None  # a second session's run starts nothing
    import ts_warm_probe.heavy  # noqa: F401 - what a page would do next: no second execution

    assert builtins.TS_WARM_RUNS == 1


def test_a_missing_library_is_skipped_and_the_rest_imported(fresh):
    thread = warm.start(["ts_warm_probe_absent", "ts_warm_probe.heavy"], first=())
    thread.join(30)
    assert list(warm.loaded) == ["ts_warm_probe.heavy"]


def test_the_list_names_importable_libraries_of_this_environment():
    import importlib.util

    missing = [m for m in (*warm.FIRST, *warm.MODULES) if importlib.util.find_spec(m.split(".")[0]) is None]
    assert missing == []


def test_the_warm_up_and_the_bridge_import_take_turns(monkeypatch, tmp_path):
    """The warm-up thread and another background thread's `thoughtscope.imports.import_from` (the correctness
    badge's TransformerLens bridge) never import at the same time: two threads entering transformer_lens at once
    broke one of them, and the badge said the bridge was skipped. Here each module's import sleeps and records
    how many imports run at once."""
    import threading
    import time

    from thoughtscope import imports

    state = {"now": 0, "most": 0}
    for name in ("ts_turn_a", "ts_turn_b", "ts_turn_c"):
        (tmp_path / f"{name}.py").write_text(
            "import builtins, time\nst = builtins.TS_TURNS\nst['now'] += 1\nst['most'] = max(st['most'], st['now'])\n"
            "time.sleep(0.3)\nst['now'] -= 1\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    monkeypatch.setattr(builtins, "TS_TURNS", state, raising=False)
    try:
        warm_thread = threading.Thread(target=warm._import_all, args=(("ts_turn_a", "ts_turn_b"),))
        warm_thread.start()
        time.sleep(0.1)  # the warm-up is inside its first import
        assert imports.import_from("ts_turn_c", "VALUE") == 1
        warm_thread.join(10)
        assert state["most"] == 1 and state["now"] == 0
        assert set(warm.loaded) >= {"ts_turn_a", "ts_turn_b"}
    finally:
        for name in ("ts_turn_a", "ts_turn_b", "ts_turn_c"):
            sys.modules.pop(name, None)


def test_the_first_modules_are_imported_whole_before_the_thread_starts(fresh):
    """Plotly peeks at pandas in sys.modules when it builds a trace: a page drawing a figure while the warm-up
    thread was half-way through importing pandas failed ('partially initialized module'). `FIRST` is imported in
    the calling thread, so it is whole when `start` returns."""
    (fresh / "first.py").write_text("import time\ntime.sleep(0.3)\nVALUE = 7\n")
    thread = warm.start(["ts_warm_probe.heavy"], first=["ts_warm_probe.first"])
    assert sys.modules["ts_warm_probe.first"].VALUE == 7  # no join: already whole
    thread.join(30)
    sys.modules.pop("ts_warm_probe.first", None)
    assert warm.FIRST == ("pandas",) and "pandas" not in warm.MODULES


def test_settle_waits_for_a_module_another_thread_is_importing(tmp_path, monkeypatch):
    import threading
    import time

    from thoughtscope.imports import settle

    (tmp_path / "ts_settle_probe.py").write_text("import time\ntime.sleep(0.5)\nVALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importer = threading.Thread(target=__import__, args=("ts_settle_probe",))
        importer.start()
        while "ts_settle_probe" not in sys.modules:  # the other thread is inside the module's body
            time.sleep(0.01)
        assert not hasattr(sys.modules["ts_settle_probe"], "VALUE")  # what plotly would have read
        settle("ts_settle_probe")
        assert sys.modules["ts_settle_probe"].VALUE == 3  # whole once settle returns
        importer.join(10)
        settle("ts_settle_absent_module")  # nothing imported: nothing to wait for, nothing imported
        assert "ts_settle_absent_module" not in sys.modules
    finally:
        sys.modules.pop("ts_settle_probe", None)
