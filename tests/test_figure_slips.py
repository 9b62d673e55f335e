"""Figure slips of issue 20, each read off the figure object (or the control that frames it)."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from app.figures.trace import MAX_TICK_LABELS, entropy_figure


def rows(tokens):
    return {"tokens": tokens, "token_ids": list(range(len(tokens))), "special": [False] * len(tokens),
            "entropies": [0.5] * len(tokens), "logprobs": [-0.1] * len(tokens),
            "top_tokens": [[]] * len(tokens), "top_probs": [[]] * len(tokens)}


def test_the_entropy_axis_names_the_tokens_not_their_indices():
    fig = entropy_figure(rows([" The", " answer", " is", "\n", " 20"]))
    axis = fig.layout.xaxis
    assert list(axis.tickvals) == [0, 1, 2, 3, 4]
    assert list(axis.ticktext) == [" The", " answer", " is", "\\n", " 20"]


def test_a_long_generation_labels_every_kth_token_within_the_tick_budget():
    tokens = [f"t{i}" for i in range(200)]
    axis = entropy_figure(rows(tokens)).layout.xaxis
    assert list(axis.tickvals) == list(range(0, 200, 4)) and len(axis.tickvals) <= MAX_TICK_LABELS
    assert list(axis.ticktext) == [f"t{i}" for i in range(0, 200, 4)]


def test_the_default_logit_lens_window_holds_the_prompt_generation_boundary():
    script = """
import streamlit as st
from app.views.trace_explorer import LENS_WIDTH, PROMPT_SHOWN, _window_slider
prompt_len, n = 40, 120  # a 40-token prompt and 80 generated tokens
st.text(repr(_window_slider("Logit-lens positions", n, LENS_WIDTH, "lens_window", first=prompt_len - PROMPT_SHOWN)))
"""
    at = AppTest.from_string(script, default_timeout=120).run()
    assert not at.exception
    assert at.text[0].value == "(32, 64)"  # 8 prompt tokens, the boundary at 40, then 24 generated
