"""The validator (probes.validate): the engine's site captures against a plain HF forward, nnsight and the
TransformerLens bridge, and the correctness badge it leaves in the cache, in `info()` and in provenance."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from probes import Engine
from probes import validate as V
from probes.validate_cli import validate_model_id
from probes.sites import SITE_KINDS, Site
from probes.zoo import TINY_ARCHS
from thoughtscope.errors import BadInputError, UnknownSiteError

TINY_VLMS = ("llava", "smolvlm", "qwen2_vl")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Validations go to a private folder (the embedded tokenizer stays in the real cache)."""
    monkeypatch.setattr(V, "validation_dir", lambda: tmp_path / "validation")
    V._SUMMARIES.clear()
    return tmp_path / "validation"


@pytest.mark.parametrize("arch", [*TINY_ARCHS, *TINY_VLMS])
def test_every_tiny_random_family_passes_against_hf_and_nnsight(arch):
    engine = Engine.from_id(f"tiny-random:{arch}", device="cpu")
    report = V.validate(engine)
    assert report.verdict == "pass", V.format_table(report)
    every = {row["site"] for row in engine.sites()}
    assert set(report.site_verdicts()) == every and not report.unchecked
    readers = {c.reader for c in report.checks}
    assert {"hf", "nnsight"} <= readers
    # the same forward in the same dtype: the HF hidden states and the engine's residuals are bit-equal
    hf_resid = [c for c in report.checks if c.reader == "hf" and c.site.startswith(("resid_pre", "resid_post"))]
    assert len(hf_resid) == 2 * engine.handle.arch.n_layers and all(c.max_abs == 0.0 for c in hf_resid)
    # nnsight reads every site
    assert {c.site for c in report.checks if c.reader == "nnsight"} == every
    # a reader that did not read a site says so
    if "bridge" not in readers:
        assert any(s["reader"] == "bridge" for s in report.skipped)
    assert report.generation["verdict"] == "pass" and report.logits["top1_agreement"] == 1.0


def test_swapped_layers_fail_on_exactly_those_sites(llama, monkeypatch):
    """A wrong site table (resid_post of layers 0 and 1 swapped) must fail there, and nowhere else."""
    original = Site.module_path

    def swapped(self, family="decoder"):
        if self.kind == "resid_post":
            return original(Site("resid_post", 1 - self.layer), family)
        return original(self, family)

    monkeypatch.setattr(Site, "module_path", swapped)
    report = V.validate(llama, generation=False, save=False)
    assert report.failing_sites() == ["resid_post.0", "resid_post.1"]
    assert report.verdict == "fail"
    by = {(c.site, c.reader): c for c in report.checks}
    # HF's own indexing and the bridge's own hook names catch it; nnsight shares the table, so it agrees
    assert by[("resid_post.0", "hf")].verdict == "fail" and by[("resid_post.0", "bridge")].verdict == "fail"
    assert by[("resid_post.0", "nnsight")].verdict == "pass"


def test_reading_the_layer_input_instead_of_its_output_fails_resid_post_only(llama, monkeypatch):
    wrong = dataclasses.replace(SITE_KINDS["resid_post"], read="input", index=None)
    monkeypatch.setitem(SITE_KINDS, "resid_post", wrong)
    report = V.validate(llama, generation=False, save=False)
    assert report.failing_sites() == ["resid_post.0", "resid_post.1"]


def test_bf16_drift_is_measured_against_a_float32_copy_and_classified_by_bf16_tolerance():
    engine = Engine.from_id("tiny-random:llama", device="cpu", dtype="bfloat16")
    report = V.validate(engine, sites=["resid_post", "logits"], readers=("hf",), save=False)
    logits = report.logits
    assert report.key["dtype"] == "bfloat16" and logits["reference"] == "a float32 copy of the bfloat16 weights"
    # the same numbers by hand: the engine's bf16 logits against the upcast weights' forward
    ids = engine.encode(V.VALIDATION_TEXT)
    ours = engine.capture(ids, ["logits"])["logits"].float()
    with torch.no_grad():
        ref = copy.deepcopy(engine.model).float()(input_ids=torch.tensor([ids])).logits[0]
    tv = 0.5 * (ours.softmax(-1) - ref.softmax(-1)).abs().sum(-1)
    assert logits["max_tv"] == pytest.approx(tv.max().item(), rel=1e-6) and logits["max_tv"] > 0
    assert logits["top1_agreement"] == (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert logits["verdict"] == V.classify_logits(logits["max_tv"], logits["top1_agreement"], V.TOLERANCES["bfloat16"])
    # the drift a bf16 model is allowed would not pass as float32
    assert V.classify_logits(logits["max_tv"], logits["top1_agreement"], V.TOLERANCES["float32"]) != "pass"
    assert report.tolerance == dataclasses.asdict(V.TOLERANCES["bfloat16"])
    # engine and HF run the same bf16 forward: the sites still agree exactly
    assert all(c.max_abs == 0.0 for c in report.checks if c.site != "resid_post.1")


def test_the_float32_reference_that_does_not_fit_says_how_much_it_needs(monkeypatch):
    engine = Engine.from_id("tiny-random:llama", device="cpu", dtype="bfloat16")
    monkeypatch.setattr(V, "free_memory_bytes", lambda device: 1000)
    out = V.check_logits(engine, V.TOLERANCES["bfloat16"])
    n = sum(p.numel() for p in engine.model.parameters())
    assert out["verdict"] == "warn" and out["reference"] == "not loaded"
    assert f"needs about {n * 4 / 2**30:.2f} GiB" in out["note"] and "0.00 GiB is free" in out["note"]


def test_sites_a_model_lacks_are_refused(llama):
    with pytest.raises(UnknownSiteError, match="has no router sites: it has no MoE router"):
        V.validate(llama, sites=["router"])
    with pytest.raises(UnknownSiteError, match="layer 7 is out of range"):
        V.validate(llama, sites=["resid_post.7"])


def test_ndif_models_are_refused_before_loading_with_what_can_be_checked():
    with pytest.raises(BadInputError, match="load the same weights locally with hf:"):
        validate_model_id("ndif:meta-llama/Llama-3.1-8B")


def test_readers_that_cannot_read_a_family_are_named_with_the_reason():
    report = V.validate(Engine.from_id("tiny-random:qwen2_vl", device="cpu"), sites=["resid_post"], save=False)
    bridge = [s for s in report.skipped if s["reader"] == "bridge"]
    assert bridge and "TransformerLens does not bridge qwen2_vl" in bridge[0]["reason"]
    # DeepSeek: the bridge boots, but its logits are not the model's, so its hooks are set aside
    report = V.validate(Engine.from_id("tiny-random:deepseek_v2", device="cpu"), sites=["resid_post"], save=False)
    reason = next(s["reason"] for s in report.skipped if s["reader"] == "bridge")
    assert reason.startswith("its logits differ from the plain HF forward's") and report.verdict == "pass"
    assert "bridge" not in {c.reader for c in report.checks}


def test_a_full_validation_is_the_cached_badge_in_info_and_provenance(private_cache):
    from thoughtscope.provenance import provenance

    engine = Engine.from_id("tiny-random:qwen3", device="cpu")
    assert engine.info()["validation"] is None and provenance(engine.info())["validation"] is None
    report = V.validate(engine)
    path = V.cache_path(engine.handle)
    assert path.parent == private_cache and path.name == (f"{engine.handle.fingerprint}-float32-cpu-sdpa.json")
    assert json.loads(path.read_text())["summary"] == report.summary()
    assert engine.info()["validation"] == report.summary()
    record = provenance(engine.info(), seed=0)
    assert record["validation"]["verdict"] == "pass" and record["validation"]["fingerprint"] == engine.handle.fingerprint
    # a figure's exported JSON carries it
    from app.export import data_json

    exported = json.loads(data_json({"x": [1]}, provenance=record))
    assert exported["provenance"]["validation"]["sites"] == len(engine.sites())
    # another attention implementation is another key: no badge until it is validated too
    engine.model.set_attn_implementation("eager")
    try:
        assert engine.info()["validation"] is None
    finally:
        engine.model.set_attn_implementation("sdpa")
    # a --sites subset is not the badge
    V.validate(Engine.from_id("tiny-random:qwen2", device="cpu"), sites=["resid_pre"])
    assert [p.name.split("-")[0] for p in private_cache.iterdir()] == [engine.handle.fingerprint]


def test_a_background_badge_leaves_no_half_imported_pandas_to_the_callers_figures(tmp_path):
    """The validation thread imports pandas (TransformerLens -> datasets); plotly in the page's thread reads it
    from `sys.modules` however far its import has got. So pandas is imported whole before the thread starts: in a
    fresh interpreter, right after `badge` starts the thread, pandas is loaded and not initialising. (Before, it
    was absent then, and half-imported a moment later while the page drew its figures.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; from probes import Engine, validate as V; e = Engine.from_id('tiny-random:llama'); "
              "before = 'pandas' in sys.modules; assert V.badge(e, background=True) is None; "
              "m = sys.modules.get('pandas'); "
              "print(before, V.badge_running(e), m is not None and not m.__spec__._initializing, flush=True); "
              "import os; os._exit(0)")  # at once: an interpreter exit under a validating daemon thread aborts
    from probes.paths import user_cache_dir

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(user_cache_dir() / "models")  # no badge cached, the models built
    env = {**os.environ, "THOUGHTSCOPE_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_the_badge_is_computed_in_the_background_once_then_read_from_the_cache(llama, monkeypatch):
    assert V.badge(llama, background=True) is None  # nothing cached: a thread starts, the caller goes on
    thread = V._RUNNING[str(V.cache_path(llama.handle))]
    assert V.badge(llama, background=True) is None and V._RUNNING[str(V.cache_path(llama.handle))] is thread
    thread.join(timeout=300)
    summary = V.badge(llama, background=True)
    assert summary == V.cached_report(llama.handle).summary() and summary["verdict"] == "pass"
    # a validation that fails in the background leaves the reason for the badge, not a dead page
    llama_bf16 = Engine.from_id("tiny-random:llama", device="cpu", dtype="bfloat16")

    def broken(engine, **kwargs):
        raise BadInputError("no memory left")

    monkeypatch.setattr(V, "validate", broken)
    assert V.badge(llama_bf16, background=True) is None
    V._RUNNING[str(V.cache_path(llama_bf16.handle))].join(timeout=60)
    assert V.background_error(llama_bf16) == "BadInputError: no memory left"


def test_a_page_does_not_restart_a_background_validation_that_failed(monkeypatch):
    from app.badge import badge_state

    engine = Engine.from_id("tiny-random:llama", device="cpu", dtype="float16")
    calls = []

    def broken(engine, **kwargs):
        calls.append(engine)
        raise BadInputError("no memory left")

    monkeypatch.setattr(V, "validate", broken)
    monkeypatch.setattr(V, "_FAILED", {})
    assert badge_state(engine) == (None, True, None)  # the first page run starts it, the badge polls
    V._RUNNING[str(V.cache_path(engine.handle))].join(timeout=60)
    # every later run draws the failure without polling and without starting it again
    for _ in range(3):
        assert badge_state(engine) == (None, False, "BadInputError: no memory left")
    assert len(calls) == 1 and not V.badge_running(engine)


def test_badge_text_carries_the_numbers():
    from app.badge import badge_markdown, badge_tooltip

    report = V.validate(Engine.from_id("tiny-random:llama", device="cpu"), generation=False, save=False)
    summary = report.summary()
    assert badge_markdown(summary) == ":green-badge[:material/verified: numbers checked]"
    tip = badge_tooltip(summary)
    n = len(report.site_verdicts())
    # a plain HF forward reads no attn_out, mlp_out, q, k, v, z: the tooltip says a reader was skipped for some
    assert tip.startswith(f"{n} of {n} sites pass, 0 warn, 0 fail, against bridge, hf, nnsight "
                          "(hf skipped for some sites).")
    assert "Logits vs a float32 copy: top-1 agreement 1.0000, max total variation 0." in tip


def test_cli_prints_the_table_and_exits_1_on_a_failure(monkeypatch, capsys):
    from typer.testing import CliRunner

    from thoughtscope.cli import build

    result = CliRunner().invoke(build(), ["validate", "--model", "tiny-random:llama", "--device", "cpu",
                                          "--sites", "resid_pre,logits", "--no-generation", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output.strip().splitlines()[-1])
    assert body["verdict"] == "pass" and {c["site"] for c in body["checks"]} == {"resid_pre.0", "resid_pre.1", "logits"}


def test_the_server_reports_its_models_validation_in_info():
    import httpx

    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread
    from thoughtscope.provenance import provenance

    engine = Engine.from_id("tiny-random:qwen3", device="cpu")
    with serving_in_thread(create_app(engine)) as url:
        assert httpx.get(f"{url}/info").json()["validation"] is None
        summary = V.validate(engine, generation=False, save=True).summary()
        assert httpx.get(f"{url}/info").json()["validation"] == summary
        with RemoteBackend(url) as remote:  # a remote page's badge, and its provenance records
            assert remote.info()["validation"]["verdict"] == "pass"
            assert provenance(remote.info())["validation"] == summary


@pytest.mark.browser
def test_the_trace_explorer_shows_the_badge_with_its_numbers_on_hover(browser, tiny_app_url):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    from tests.test_browser import SLOW

    url = tiny_app_url  # the session's app on tiny-random:llama and its Chromium (tests/conftest.py)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(SLOW)
    page.goto(f"{url}/trace_explorer")
    page.locator(".st-key-generate button").first.click()
    page.locator('[data-testid="stPlotlyChart"]').first.locator(".main-svg").first.wait_for()
    # checked in the background after the first figure (or found cached): the fragment shows it when done
    badge = page.locator('[data-testid="stElementContainer"]', has_text="numbers checked").last
    badge.wait_for()
    tip = page.locator('[data-testid="stTooltipContent"]').first
    # the badge's fragment may redraw while the pointer rests on it (the tooltip then closes with the old
    # element): hover again until the tooltip stays, as a user would
    for _ in range(12):
        badge.locator('[data-testid="stTooltipHoverTarget"]').first.hover()
        try:
            tip.wait_for(timeout=10_000)
            break
        except PlaywrightTimeout:
            page.mouse.move(0, 0)
    tip.wait_for()
    text = tip.inner_text()
    assert "sites pass, 0 warn, 0 fail, against bridge, hf, nnsight" in text
    assert "Logits vs a float32 copy: top-1 agreement 1.0000" in text and "tiny-random:llama" in text
    page.close()


@pytest.mark.model
def test_the_embedded_model_validates_on_every_site_with_three_readers(smollm2):
    report = V.validate(smollm2)
    assert report.verdict == "pass", V.format_table(report)
    assert len(report.site_verdicts()) == len(smollm2.sites()) == 30 * 9 + 1
    assert {c.reader for c in report.checks} == {"hf", "nnsight", "bridge"} and not report.unchecked
    # float32 on CPU: HF and nnsight read exactly what the engine reads
    assert all(c.max_abs == 0.0 for c in report.checks if c.reader == "hf")
    assert report.logits["top1_agreement"] == 1.0 and report.logits["max_tv"] == 0.0


@pytest.mark.model
def test_the_correctness_page_runs_the_validation_and_shows_the_table():
    from tests.apptest_helpers import assert_clean, open_page

    at = open_page("correctness")
    assert_clean(at)
    assert any("has not been validated yet" in i.value for i in at.info)
    at.button(key="run_validation").click().run()
    assert_clean(at)
    assert any(":green-badge[:material/verified: numbers checked]" in m.value for m in at.markdown)
    kinds = at.dataframe[0].value
    assert set(kinds["reader"]) == {"hf", "nnsight", "bridge"} and set(kinds["verdict"]) == {"pass"}


def test_serve_validate_fills_info_with_the_badge_in_the_background():
    """`thoughtscope serve --validate`: the server validates its model once loaded, so a remote page's badge
    needs no validation run by hand on the server host."""
    import time

    import httpx

    from probes.server import _start_validation, create_app
    from probes.server_bench import serving_in_thread

    engine = Engine.from_id("tiny-random:qwen2", device="cpu")
    with serving_in_thread(create_app(engine, on_ready=_start_validation)) as url:
        deadline = time.monotonic() + 300  # a generous wait for a state; nothing here is timed
        while (found := httpx.get(f"{url}/info").json()["validation"]) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    assert found is not None and found["verdict"] == "pass"
    assert found == V.cached_summary(engine.handle)
    assert found["fingerprint"] == engine.info()["fingerprint"]


def test_booting_a_vlm_bridge_installs_no_package(monkeypatch, caplog):
    """TransformerLens runs `pip install torchvision` when a multimodal model's processor does not load
    (offline, as here): that once swapped torch for a CUDA build in the middle of `make test`. The bridge
    boots with the install refused before anything runs."""
    import logging
    import subprocess
    import sys

    calls = []

    def recorder(args, *a, **k):
        calls.append(list(args))
        return 0

    monkeypatch.setattr(subprocess, "check_call", recorder)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` fails, as in a clean set-up
    engine = Engine.from_id("tiny-random:llava", device="cpu")
    with caplog.at_level(logging.WARNING, logger="probes.zoo"):
        bridge = engine.handle.bridge
    refused = [r.getMessage() for r in caplog.records if "refused a package install" in r.getMessage()]
    assert refused and "install torchvision" in refused[0]  # TransformerLens asked ...
    assert calls == []  # ... and nothing ran
    assert subprocess.check_call is recorder  # the guard is gone once the bridge is up
    assert len(bridge.blocks) == engine.handle.arch.n_layers


def test_a_bridge_booting_in_another_thread_leaves_this_threads_stdout(monkeypatch, capsys):
    """The bridge's boot prints; its output is dropped in the booting thread only. (It once set `sys.stdout` to
    None for the whole process: the badge's background validation booting a bridge made uvicorn, starting a
    test server in the main thread, fail on `sys.stdout.isatty()`.)"""
    import sys
    import threading
    import types

    import torch

    import thoughtscope.imports
    from probes import zoo

    inside, release = threading.Event(), threading.Event()

    class FakeBridge:
        @staticmethod
        def boot_transformers(name, hf_model, tokenizer, device):
            print("noise from the bridge's boot")
            inside.set()
            assert release.wait(60)
            return "booted"

    monkeypatch.setattr(thoughtscope.imports, "import_from", lambda module, name: FakeBridge)
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(architectures=["Linear"])
    handle = types.SimpleNamespace(remote=False, model_id="fake", model=model, tokenizer=None, device="cpu")
    result = []
    thread = threading.Thread(target=lambda: result.append(zoo._boot_bridge(handle)), daemon=True)
    thread.start()
    assert inside.wait(60)
    try:  # the boot is under way in the other thread
        assert sys.stdout is not None and sys.stdout.isatty() in (True, False)
        print("this thread still prints")
    finally:
        release.set()
        thread.join(60)
    assert result == ["booted"]
    out = capsys.readouterr().out
    assert "this thread still prints" in out and "noise from the bridge's boot" not in out
    assert not isinstance(sys.stdout, zoo._QuietInSomeThreads)  # the wrapper left with the last quiet thread


def test_install_guards_of_overlapping_boots_leave_the_original_when_the_last_ends(monkeypatch):
    """Two bridges booting at once in two threads, the first to start ending first: while either is inside, a
    pip install is refused; after both, `subprocess.check_call` is the original again. (Each boot saved and
    restored it on its own: the second restored the first's guard, which then refused installs for good.)"""
    import subprocess
    import threading

    from probes import zoo

    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda args, *a, **k: calls.append(list(args)) or 0)
    original = subprocess.check_call
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]

    def boot(i):
        with zoo._no_package_installs():
            entered[i].set()
            assert leave[i].wait(60)

    threads = [threading.Thread(target=boot, args=(i,), daemon=True) for i in (0, 1)]
    threads[0].start()
    assert entered[0].wait(60)
    threads[1].start()
    assert entered[1].wait(60)
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.check_call(["pip", "install", "torchvision"])
    leave[0].set()  # the first boot ends first
    threads[0].join(60)
    with pytest.raises(subprocess.CalledProcessError):  # the second is still booting
        subprocess.check_call(["pip", "install", "torchvision"])
    subprocess.check_call(["echo", "hi"])  # anything else goes through
    leave[1].set()
    threads[1].join(60)
    assert subprocess.check_call is original
    subprocess.check_call(["pip", "install", "x"])  # no guard left
    assert calls == [["echo", "hi"], ["pip", "install", "x"]]
