"""Settings that hold (issue 20): a widget keeps the user's value on every navigation path.

Streamlit drops the state of a widget that a run does not draw (a page's own settings after a visit
to another page), and a widget given its value only through session state reaches the browser with
its own default (a slider's minimum) as the fallback. app/persist.py fixes both once for every widget;
tests/test_browser_settings.py checks the same in a real browser.
"""

from __future__ import annotations

import pytest

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamlit.testing.v1 import AppTest  # noqa: E402

PAGE_WIDGET = """
import streamlit as st
from app.persist import hold_widgets
if {hold}:
    hold_widgets()
if st.session_state.get("on_this_page", True):  # another page: the widget is not drawn
    st.slider("Calibration problems", 4, 64, 12, key="cot_n_cal")
    st.selectbox("Task", ["add", "sub", "mul"], key="cot_task")
"""


def visit_elsewhere_and_back(hold: bool) -> AppTest:
    at = AppTest.from_string(PAGE_WIDGET.format(hold=hold)).run()
    at.slider(key="cot_n_cal").set_value(30).run()
    at.selectbox(key="cot_task").set_value("mul").run()
    at.session_state["on_this_page"] = False
    at.run()
    at.session_state["on_this_page"] = True
    return at.run()


def test_streamlit_alone_drops_a_page_setting_after_a_visit_elsewhere():
    at = visit_elsewhere_and_back(hold=False)
    assert at.slider(key="cot_n_cal").value == 12 and at.selectbox(key="cot_task").value == "add"


def test_held_page_settings_come_back_as_the_user_left_them():
    at = visit_elsewhere_and_back(hold=True)
    assert not at.exception
    assert at.slider(key="cot_n_cal").value == 30 and at.selectbox(key="cot_task").value == "mul"


def test_buttons_and_selections_are_never_held():
    script = """
import streamlit as st
from app.persist import held, hold_widgets
hold_widgets()
st.button("Go", key="go")
st.slider("n", 0, 9, 3, key="n")
st.text(repr(sorted(held())))
"""
    at = AppTest.from_string(script).run()
    at.button(key="go").click().run()
    at.run()
    assert not at.exception
    assert at.text[-1].value == "['n']"


def sidebar_app(**query) -> AppTest:
    at = AppTest.from_string("from app.main import main\nmain(only='home')\n", default_timeout=120)
    for key, value in query.items():
        at.query_params[key] = value
    return at


def test_the_sidebar_sends_the_users_value_as_the_browsers_fallback_and_into_the_url():
    at = sidebar_app().run()
    assert at.slider(key="max_new_tokens").value == 48
    at.slider(key="max_new_tokens").set_value(64)
    at.slider(key="alternatives").set_value(3)
    at.toggle(key="chat").set_value(False)
    at.run()
    at.run()  # a run that changes nothing
    assert not at.exception
    # The browser re-creates a widget it has no state for from `default`: it must be the user's value.
    assert list(at.slider(key="max_new_tokens").proto.default) == [64.0]
    assert list(at.slider(key="alternatives").proto.default) == [3.0]
    assert at.toggle(key="chat").proto.default is False
    assert at.query_params["max_new_tokens"] == "64" and at.query_params["alternatives"] == "3"
    assert at.query_params["chat"] == "0" and "top_p" not in at.query_params  # defaults stay out of the URL


def test_a_reload_with_settings_in_the_url_opens_with_them():
    at = sidebar_app(max_new_tokens="64", top_p="0.5", chat="0", prompt="Two plus two?").run()
    assert not at.exception
    assert at.slider(key="max_new_tokens").value == 64 and at.slider(key="top_p").value == 0.5
    assert at.toggle(key="chat").value is False and at.text_area(key="prompt").value == "Two plus two?"
    assert at.slider(key="alternatives").value == 5  # not in the URL: the default


def test_a_hand_edited_url_value_is_ignored_not_a_traceback():
    at = sidebar_app(max_new_tokens="lots", chat="maybe").run()
    assert not at.exception
    assert at.slider(key="max_new_tokens").value == 48 and at.toggle(key="chat").value is True


@pytest.mark.parametrize("query", [
    {"seed": "-5"}, {"seed": "99999999999999999999999"},  # each stopped the page with a traceback
    {"temperature": "1e309"}, {"temperature": "nan"}, {"temperature": "-1"},
    {"max_new_tokens": "999999"}, {"max_new_tokens": "0"}, {"top_p": "5"}, {"top_k": "-2"}, {"alternatives": "11"},
])
def test_a_url_value_outside_its_widgets_range_is_ignored(query):
    from app.sidebar import SETTING_DEFAULTS

    at = sidebar_app(**{"alternatives": "3", **query}).run()
    assert not at.exception, [e.value for e in at.exception]
    (key, _), = query.items()
    widget = at.number_input(key=key) if key in ("seed", "top_k") else at.slider(key=key)
    assert widget.value == SETTING_DEFAULTS[key]  # the default stands
    if key != "alternatives":
        assert at.slider(key="alternatives").value == 3  # the link's other settings still open
