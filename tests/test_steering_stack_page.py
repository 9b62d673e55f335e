"""The Steering page's stack (AppTest, tiny-random:llama): the page's direction added to the stack, one slider
per term and the global multiplier; the stack's text is the plain generation with the stack's interventions."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.apptest_helpers import assert_clean, finish_jobs, open_page  # noqa: E402

MODEL = "tiny-random:llama"


@pytest.fixture(autouse=True)
def _model(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)


def test_the_pages_direction_goes_into_the_stack_and_its_sliders_steer(llama):
    from analyses.steering import GeneratedText, diff_of_means_direction, site_norm
    from analyses.steering_defaults import chat_input
    from app.figures.trace import display_text
    from app.steering_stack_ui import STACK
    from app.views.steering import PROMPT, SET_A, SET_B
    from probes.edits import Additive

    at = open_page("steering", max_new_tokens=6)
    assert_clean(at)
    assert "empty" in at.info[-1].value  # no term yet
    at.button(key="steer_add_to_stack").click().run()
    assert_clean(at)
    stack = at.session_state[STACK]["stack"]
    assert len(stack.terms) == 1 and stack.terms[0].source["kind"] == "diff_of_means"
    site = stack.terms[0].site
    v = diff_of_means_direction(llama, SET_A.splitlines(), SET_B.splitlines(), site)
    assert torch.allclose(stack.terms[0].direction, v)
    prompt = chat_input(PROMPT)
    norm = site_norm(llama, prompt, site, chat=True)
    eos = llama.eos_ids()
    texts = []
    for strength, multiplier in ((-1.0, 1.0), (1.5, 0.5), (1.5, 0.0)):
        finish_jobs(at.select_slider(key="stack_strength_0").set_value(strength).run())  # the term's stops: a job
        at.select_slider(key="stack_multiplier").set_value(multiplier).run()
        assert_clean(at)
        shown = at.session_state[STACK]["stack"]
        assert (shown.terms[0].strength, shown.multiplier) == (strength, multiplier)
        edits = [Additive(site, v / v.norm() * norm, strength * multiplier, term="x")] if multiplier else []
        records = list(llama.generate(prompt, max_new_tokens=6, chat=True, interventions=edits))
        direct = GeneratedText.from_records(records)
        assert at.text[2].value == display_text(direct.tokens, direct.token_ids, eos).strip()  # st.text strips
        strip = at.text[3].value
        texts.append(at.text[2].value)
        if multiplier:
            acted = sum("x" in r.fired for r in records)  # the engine's own records of the same edit
            assert acted > 0 and strip.startswith(f"1. difference of means: acted at {acted} of {len(records)} tokens")
        else:
            assert "(strength 0: off)" in strip and not at.warning  # an inactive term is not a silent one
    assert len(set(texts)) > 1
    # the same stack with attention frozen to the unsteered model's, beside the steered text
    from analyses.steering import generate_text
    from probes.frozen_attention import FrozenAttention

    at.select_slider(key="stack_multiplier").set_value(1.0).run()
    at.toggle(key="stack_frozen").set_value(True).run()
    assert_clean(at)
    frozen = generate_text(llama, prompt, max_new_tokens=6, chat=True,
                           interventions=[Additive(site, v / v.norm() * norm, 1.5, term="x"), FrozenAttention()])
    assert at.text[3].value == display_text(frozen.tokens, frozen.token_ids, eos).strip()


def test_the_stacks_per_token_kl_is_drawn_on_demand_from_the_analysis(llama):
    """"Per-token KL to the unsteered model" runs `stack_token_kl` as a job and draws its bars: the chart's values
    are the analysis' own on the same stack, prompt and tokens."""
    import json

    from analyses.steering_stack import stack_generation, stack_token_kl
    from analyses.steering_defaults import chat_input
    from app.steering_stack_ui import STACK
    from app.views.steering import PROMPT

    at = open_page("steering", max_new_tokens=5)
    at.button(key="steer_add_to_stack").click().run()
    at.select_slider(key="stack_multiplier").set_value(2.0).run()
    assert_clean(at)
    assert not [c for c in at.get("plotly_chart") if "next-token distribution" in c.proto.spec]  # on demand only
    finish_jobs(at.button(key="stack_kl").click().run())
    assert_clean(at)
    (chart,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart") if "next-token distribution" in c.proto.spec]
    stack = at.session_state[STACK]["stack"]
    prompt = chat_input(PROMPT)
    want = stack_token_kl(llama, prompt, stack, stack_generation(llama, prompt, stack, max_new_tokens=5, chat=True),
                          chat=True)
    assert chart["data"][0]["y"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-7) and max(want["kl"]) > 0


def test_the_stack_slider_benchmark_row():
    from app.bench import GOALS, bench_stack_slider

    row = bench_stack_slider(MODEL, moves=(1.0, -0.5), max_new_tokens=4, layers=(0, 1))
    assert (row["bench"], row["page"], row["terms"], len(row["runs_s"])) == ("steer_slider_s", "steering stack", 2, 2)
    assert row["ratio"] == pytest.approx(row["seconds"] / GOALS["steer_slider"], abs=1e-3)


def test_a_terms_edit_method_is_chosen_on_the_page(llama):
    from app.steering_stack_ui import STACK

    at = open_page("steering", max_new_tokens=4)
    at.button(key="steer_add_to_stack").click().run()
    assert at.selectbox(key="stack_method_0").options == ["additive", "norm_scaled", "project_out"]
    at.selectbox(key="stack_method_0").set_value("project_out").run()
    assert_clean(at)
    term = at.session_state[STACK]["stack"].terms[0]
    assert term.method == "project_out" and "\u00d7 mean" not in at.select_slider(key="stack_strength_0").label
