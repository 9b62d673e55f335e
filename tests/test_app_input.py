"""The workbench's pages against careless input (a fuzzing pass of 2026-12-07): each test failed before, with
Streamlit's exception box (or, for the task file, a wrong stored answer).

A job id with a non-ASCII character, a site or latent written with a superscript digit, a feature-browser SAE
folder that cannot be read, evaluation files that are JSON but not a report (or nested past Python's stack), a
server URL the HTTP client cannot parse: each is said on the page, and the page goes on. Numbers past float's
range are refused by name; an answer in exponent form keeps its value.
"""

from __future__ import annotations

import json

import pytest

from tests import apptest_helpers as helpers

MODEL = "tiny-random:llama"
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON nested past Python's recursion limit


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch, tmp_path):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))


def _page(name: str, **query: str):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string(f"from app.main import main\nmain(only={name!r})\n", default_timeout=180)
    at.session_state["max_new_tokens"] = 6
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def _errors(at) -> str:
    return " ".join(e.value for e in at.error)


def test_a_job_id_with_a_non_ascii_character_is_dropped_with_a_warning():
    at = _page("feature_browser", job="abc.\u00e9")  # hmac.compare_digest raised TypeError on non-ASCII str
    helpers.assert_clean(at, no_errors=False)
    assert any("is not one this app made" in w.value for w in at.warning)


def test_a_site_or_latent_written_with_a_superscript_digit_opens_the_default():
    """'²'.isdigit() is True, int('²') a ValueError: the page stopped before drawing anything."""
    from probes.sites import parse_site
    from thoughtscope.errors import UnknownSiteError

    at = _page("feature_browser", site="resid_post.\u00b2", latent="\u00b2")
    helpers.assert_clean(at, no_errors=False)
    assert at.selectbox(key="fb_site_kind").value == "resid_post"
    with pytest.raises(UnknownSiteError, match="unknown site 'resid_post.²'"):
        parse_site("resid_post.\u00b2")


def test_a_feature_browser_sae_folder_that_cannot_be_read_is_an_error_only(tmp_path):
    """The folder's error showed, then an UnboundLocalError ('hit') in the exception box below it."""
    at = _page("feature_browser")
    at.selectbox(key="fb_corpus").set_value("arith-problems").run()
    at.number_input(key="fb_n").set_value(4).run()
    at.button(key="fb_index").click().run()
    at = helpers.finish_jobs(at, 180)
    at.radio(key="fb_kind").set_value("SAE latent").run()
    pick = at.selectbox(key="fb_sae_pick")
    pick.set_value(pick.options[-1]).run()
    at.text_input(key="fb_sae_folder").set_value(str(tmp_path / "nowhere")).run()
    helpers.assert_clean(at, no_errors=False)
    assert "nowhere" in _errors(at)


RLKV_FILES = [  # (content, what the page says), one page session for all of them
    ("[1, 2]", "is not an RLKV evaluation report: a JSON list"),
    ("{}", "is not an RLKV evaluation report: an object without 'curves', 'rows'"),  # drew nothing, silently
    ('{"rows": "x", "curves": {}}', "an object without 'rows' as a report has them"),
    ('{"rows": [], "curves": {"full cache": 3}}', "does not hold an RLKV evaluation report the page can draw"),
    (DEEP, "cannot read"),
]
ACTIVE_FILES = [
    ("{}", "is not an active-experts report: an object without 'rows'"),
    ('{"rows": "x"}', "is not an active-experts report"),
    ('{"rows": [{"active_experts": 1}]}', "does not hold an active-experts report the page can draw (the field"),
]


def _each_file_said(at, key: str, folder, files) -> None:
    for i, (content, says) in enumerate(files):
        path = folder / f"report{i}.json"
        path.write_text(content)
        at.text_input(key=key).set_value(str(path)).run()
        helpers.assert_clean(at, no_errors=False)
        assert says in _errors(at), (content[:40], _errors(at))


def test_an_rlkv_file_that_is_not_a_report_is_said_on_the_page(tmp_path):
    _each_file_said(_page("rlkv"), "rlkv_eval_path", tmp_path, RLKV_FILES)


def test_an_active_experts_file_that_is_not_a_report_is_said_on_the_page(monkeypatch, tmp_path):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:qwen3_moe")
    _each_file_said(_page("moe_router"), "moe_active_path", tmp_path, ACTIVE_FILES)


def test_a_server_url_the_http_client_cannot_parse_is_said_once():
    """`http://256.0.0.1:1` passed urlsplit, then httpx raised InvalidURL under the error already shown."""
    at = _page("home")
    at.sidebar.radio(key="backend_kind").set_value("server").run()
    at.sidebar.text_input(key="server_url").set_value("http://256.0.0.1:1").run()
    helpers.assert_clean(at, no_errors=False)
    assert "is not a URL (Invalid IPv4 address: '256.0.0.1')" in _errors(at) + " ".join(
        e.value for e in at.sidebar.error)


def test_json_nested_past_the_stack_is_not_json_to_every_reader(tmp_path):
    from analyses.steering_stack import preset_from_bytes
    from analyses.tasks import load_task_file
    from analyses.visual_attribution.regions import regions_from_json
    from app.context import read_json
    from thoughtscope.errors import BadInputError

    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    with pytest.raises(BadInputError, match="cannot read"):
        read_json(deep)
    with pytest.raises(BadInputError, match="the preset is not a JSON file"):
        preset_from_bytes(DEEP.encode())
    with pytest.raises(BadInputError, match="the regions file is not JSON"):
        regions_from_json(None, DEEP, (64, 64))  # the text is read before the spec is used
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"question": "q", "answer": 1})[:-1] + ', "x": ' + DEEP + "}\n")
    with pytest.raises(BadInputError, match="line 1 is not JSON \\(nested too deeply\\)"):
        load_task_file(str(task), 1)


def test_numbers_past_floats_range_and_answers_in_exponent_form():
    from analyses.tasks import normalize_answer
    from thoughtscope import checks
    from thoughtscope.errors import BadInputError

    with pytest.raises(BadInputError, match=r"multiplier must be a finite number in \[0, 10\], got 1000000000"):
        checks.number("multiplier", 10**400, low=0, high=10)  # math.isfinite raised OverflowError
    assert normalize_answer("2.5e-3") == "0.0025"  # was '-2500': the exponent's minus read as the number's
    assert normalize_answer("1e-5") == "0.00001"
    assert normalize_answer("-2E3") == "-2000"
    assert normalize_answer("9" * 5000) is None  # was a ValueError past Python's 4,300-digit limit
    assert normalize_answer("1e999") is None


def test_the_steering_pages_own_empty_prompt_is_said_to_be_there():
    """It said "type a question in the sidebar", whose prompt the page was not reading."""
    at = _page("steering")
    at.text_area(key="steer_prompt").set_value("   ").run()
    helpers.assert_clean(at, no_errors=False)
    assert "the prompt is empty; type a question in this page's prompt box" in _errors(at), _errors(at)
