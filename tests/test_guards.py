"""Guards and outages (issue 20): a long prompt waits for a confirmation before any model work, a lost
model server is said at the top of the page with the page's results kept, and the server-mode Home
shows the same model facts as the in-process one.

The guard is `PageContext.model_input()` (app/context.py): every page asks it for the prompt before it
runs the model. The banner is app/outage.py, drawn by app/main.py's `run_page`.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from app.context import (CONFIRM_LABEL, GenerationSettings, GenerationSpeed, LongPromptError,  # noqa: E402
                         PageContext, measured_speed, prompt_warn_default, record_speed)
from probes.arch import ArchInfo  # noqa: E402
from probes.tokens import MAX_PROMPT_CHARS  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402

MODEL = "tiny-random:llama"  # context 512


class CountingBackend:
    """`backend` with a log of every call: the tests read which ones ran before a refusal."""

    def __init__(self, backend, info_override: dict | None = None):
        self._backend, self.calls, self._info = backend, [], info_override

    def info(self):
        self.calls.append("info")
        return self._info if self._info is not None else self._backend.info()

    def arch(self):
        self.calls.append("arch")
        return ArchInfo.from_dict(self._info["arch"]) if self._info is not None else self._backend.arch()

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def logged(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return logged


class RoomyBackend(CountingBackend):
    """tiny-random's tokenizer, as if its context were as large as `info_override` says."""

    def encode(self, prompt, chat=False, add_special_tokens=True):
        self.calls.append("encode")
        return self._backend.ops.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]


MODEL_WORK = {"generate", "trace", "capture", "capture_batch", "prefill", "fork", "readout", "head_means",
              "minimize_entropy", "input_x_gradient"}


def context(backend, prompt: str, **kw) -> PageContext:
    return PageContext(backend=backend, model_id=MODEL, prompt=prompt, chat=False,
                       settings=GenerationSettings(max_new_tokens=kw.pop("max_new_tokens", 4)), **kw)


def words(n: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(n))


# ----- the long-prompt guard -----


def test_a_long_prompt_raises_with_its_estimate_before_any_model_call(llama):
    prompt = words(150)
    n_tokens = len(llama.encode(prompt))
    assert 150 < n_tokens < 500  # under the context of 512, over the limit of 100 below
    backend = CountingBackend(llama)
    ctx = context(backend, prompt, prompt_warn_tokens=100)
    with pytest.raises(LongPromptError) as caught:
        ctx.generate()
    assert not MODEL_WORK & set(backend.calls), backend.calls
    est = caught.value.estimate
    assert (est.n_tokens, est.n_chars, est.warn_tokens, est.context_length) == (n_tokens, len(prompt), 100, 512)
    assert est.over_warning and not est.past_context
    message = str(caught.value)
    assert f"{n_tokens:,} tokens ({len(prompt):,} characters)" in message and "100-token" in message
    assert CONFIRM_LABEL in message
    # the same prompt, confirmed: the generation runs, and equals the engine's own
    ctx.long_prompt_confirmed = True
    got = [r.token_id for r in ctx.generate()]
    assert got == [r.token_id for r in llama.generate(prompt, max_new_tokens=4, seed=0)]


def test_a_generation_past_the_context_needs_the_confirmation_too(llama):
    prompt = words(150)
    n_tokens = len(llama.encode(prompt))
    backend = CountingBackend(llama)
    ctx = context(backend, prompt, prompt_warn_tokens=10_000, max_new_tokens=512 - n_tokens + 1)
    with pytest.raises(LongPromptError) as caught:
        ctx.model_input()
    assert caught.value.estimate.past_context and not caught.value.estimate.over_warning
    assert "context of 512 tokens" in str(caught.value)
    assert not MODEL_WORK & set(backend.calls)


def test_a_20000_character_prompt_never_starts_model_work_unconfirmed(llama):
    prompt = ("Twenty thousand characters of a pasted paper. " * 500)[:20_000]
    # on a model with a large context it warns (20,000 characters are thousands of tokens)
    roomy = RoomyBackend(llama, info_override={**llama.info(), "arch": {**llama.info()["arch"],
                                                                          "context_length": 1_000_000}})
    ctx = context(roomy, prompt)
    with pytest.raises(LongPromptError) as caught:
        ctx.generate()
    assert caught.value.estimate.n_tokens == len(llama.ops.tok(prompt)["input_ids"])
    assert not MODEL_WORK & set(roomy.calls)
    # on tiny-random's context of 512 it cannot run at all: the engine's own refusal, with the length
    small = CountingBackend(llama)
    with pytest.raises(BadInputError, match="this model's context is 512"):
        context(small, prompt, long_prompt_confirmed=True).generate()
    assert not MODEL_WORK & set(small.calls)


def test_a_short_prompt_is_not_even_tokenized(llama):
    backend = CountingBackend(llama)
    assert context(backend, "2 + 2 =").model_input() == "2 + 2 ="
    assert backend.calls == ["arch"]


def test_over_the_character_cap_is_a_clear_error_before_any_call(llama):
    backend = CountingBackend(llama)
    with pytest.raises(BadInputError, match=f"at most {MAX_PROMPT_CHARS:,}"):
        context(backend, "x" * (MAX_PROMPT_CHARS + 1), long_prompt_confirmed=True).model_input()
    assert backend.calls == []


def test_the_estimate_uses_the_speed_measured_on_this_backend(llama):
    ctx = context(llama, "Count: 1 2 3", max_new_tokens=6)
    ctx.server_url = "timed-test"  # its own speed record
    assert measured_speed("timed-test", MODEL) is None
    untimed = context(llama, words(150), prompt_warn_tokens=100, server_url="timed-test").prompt_estimate()
    assert untimed.seconds is None and "unknown (no generation on this backend" in untimed.message()
    list(ctx.generate())
    speed = measured_speed("timed-test", MODEL)
    assert speed.prefill_tps > 0 and speed.decode_tps > 0
    record_speed("timed-test", MODEL, GenerationSpeed(prefill_tps=50.0, decode_tps=5.0))
    long = context(llama, words(150), prompt_warn_tokens=100, server_url="timed-test")
    est = long.prompt_estimate()
    assert est.seconds == est.n_tokens / 50.0 + 4 / 5.0
    assert f"about {est.seconds:,.0f} s on this backend" in est.message()


def test_the_warning_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_PROMPT_WARN_TOKENS", "123")
    assert prompt_warn_default() == 123
    monkeypatch.setenv("THOUGHTSCOPE_PROMPT_WARN_TOKENS", "many")
    assert prompt_warn_default() == 2000
    monkeypatch.delenv("THOUGHTSCOPE_PROMPT_WARN_TOKENS")
    assert prompt_warn_default() == 2000


def test_the_app_asks_before_generating_with_a_long_prompt(monkeypatch, llama):
    """Trace explorer under AppTest: the sidebar warns and offers the checkbox; Generate refuses until it is
    ticked (no engine generation ran), then generates; another prompt starts unconfirmed again."""
    from probes.engine import Engine

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    monkeypatch.setenv("THOUGHTSCOPE_PROMPT_WARN_TOKENS", "100")
    started = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: started.append(1) or real(self, *a, **k))
    at = AppTest.from_string("from app.main import main\nmain(only='trace_explorer')\n", default_timeout=120)
    at.session_state["max_new_tokens"] = 4
    at.session_state["chat"] = False
    at.session_state["prompt"] = words(150)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("This prompt is long" in w.value for w in at.sidebar.warning)
    box = at.sidebar.checkbox(key="long_prompt_ok")
    assert box.label == CONFIRM_LABEL and box.value is False
    at.button(key="generate").click().run()
    assert started == [] and any("This prompt is long" in e.value for e in at.main.error)
    at.sidebar.checkbox(key="long_prompt_ok").check().run()
    at.button(key="generate").click().run()
    assert started == [1] and not at.main.error
    at.sidebar.text_area(key="prompt").set_value(words(160)).run()
    assert at.sidebar.checkbox(key="long_prompt_ok").value is False


# ----- a lost server -----


def first_main_element(at: AppTest):
    """The first element the page draws in the main area (containers looked into)."""
    node = at.main
    while getattr(node, "children", None):
        node = node.children[min(node.children)]
    return node


def test_a_closed_port_opens_the_page_on_the_banner(monkeypatch):
    from probes.server_bench import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", url)
    at = AppTest.from_string("from app.main import main\nmain(only='trace_explorer')\n", default_timeout=60).run()
    assert not at.exception
    first = first_main_element(at)
    assert first.type == "error"  # st.error, before anything of the page
    assert first.value.startswith(f"**The model server at {url} stopped answering**: ConnectError")
    assert f"--port {url.rsplit(':', 1)[1]}" in first.value and "reconnects by itself" in first.value
    assert not any("No model is loaded" in w.value for w in at.warning)


@pytest.fixture(scope="module")
def server():
    from probes.server_bench import free_port, start_server, stop_server, wait_ready

    port = free_port()
    proc = start_server(MODEL, port, device="cpu", torch_threads=1)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout=120)
        yield proc, url
    finally:
        stop_server(proc)


def test_the_server_mode_home_shows_the_in_process_model_facts(monkeypatch, server, llama):
    _, url = server
    facts = {}
    for env, value in (("THOUGHTSCOPE_MODEL", MODEL), ("THOUGHTSCOPE_SERVER", url)):
        monkeypatch.delenv("THOUGHTSCOPE_SERVER", raising=False)
        monkeypatch.setenv(env, value)
        at = AppTest.from_string("from app.main import main\nmain(only='home')\n", default_timeout=120).run()
        assert not at.exception and not at.error, [e.value for e in at.error]
        facts[env] = {m.label: m.value for m in at.metric}
    arch = llama.info()["arch"]
    expected = {"Layers": str(arch["n_layers"]), "Heads": str(arch["n_heads"]), "Width": str(arch["d_model"]),
                "Device": "cpu"}
    assert facts["THOUGHTSCOPE_MODEL"] == expected == facts["THOUGHTSCOPE_SERVER"]


def test_a_lost_server_keeps_the_trace_on_the_page_under_the_banner(monkeypatch, server):
    """Generate through the server, stop the server: the next run opens on the banner and still draws the
    generated tokens and their entropy figure (kept by the page); new model work fails with the cause."""
    from probes.server_bench import stop_server

    proc, url = server
    monkeypatch.setenv("THOUGHTSCOPE_SERVER", url)
    at = AppTest.from_string("from app.main import main\nmain(only='trace_explorer')\n", default_timeout=120)
    at.session_state["max_new_tokens"] = 4
    at.session_state["prompt"] = "Count to three: 1, 2,"
    at.session_state["chat"] = False
    at.run()
    at.button(key="generate").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    tokens_before = [h.proto.body for h in at.get("html")]
    entropy_before = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert tokens_before and entropy_before
    stop_server(proc)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    first = first_main_element(at)
    assert first.type == "error" and first.value.startswith(f"**The model server at {url} stopped answering**")
    assert "--model tiny-random:llama" in first.value
    assert [h.proto.body for h in at.get("html")] == tokens_before
    assert json.loads(at.get("plotly_chart")[0].proto.spec)["data"] == entropy_before


# ----- the RLKV page's end -----


def test_the_rlkv_page_ends_on_tables_that_fit_not_on_empty_looking_cells(monkeypatch, tmp_path, llama):
    """The evaluation's 13 columns in one table ran past the page's width: its last columns (the error modes)
    showed as empty cells at the end of the page. Now two tables, each of at most 9 columns, hold every value,
    and the page ends on the report's last note."""
    from analyses.rlkv.evaluate import evaluate_rlkv
    from tests import apptest_helpers as helpers

    from app import jobs

    report = evaluate_rlkv(llama, "arith", [0.5], n=2, n_dev=1, n_calibration=1, sink=1, recent=4, random_seeds=1,
                           snapkv_windows=[2], max_new_tokens=4, methods="random,streaming").to_dict()
    (tmp_path / "eval.json").write_text(json.dumps(report))
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    jobs.registry.clear()
    at = helpers.open_page("rlkv", 6)
    at.text_input(key="rlkv_eval_path").set_value(str(tmp_path / "eval.json")).run()
    helpers.assert_clean(at)
    runs, modes = at.dataframe[-2].value, at.dataframe[-1].value
    assert all(len(table.value.columns) <= 9 for table in at.dataframe)
    assert list(runs["accuracy"]) == [r["accuracy"]["estimate"] for r in report["rows"]]
    assert list(modes.columns) == ["method", "sparsity", "seed", *report["rows"][0]["error_modes"]]
    for name in report["rows"][0]["error_modes"]:
        assert list(modes[name]) == [r["error_modes"][name] for r in report["rows"]]
    last = list(at.main)[-1]
    assert last.type == "caption" and last.value == report["notes"][-1]
    jobs.registry.clear()
