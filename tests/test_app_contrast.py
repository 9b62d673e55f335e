"""The contrast page (issue 25 item 4): it opens on the stored contrast of toy-reasoner:small, runs its own
as a job, and says what is wrong with a contrast it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import apptest_helpers as helpers
from thoughtscope import numerics, shipped

REPO_SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "shipped"
TOY = "toy-reasoner:small"


@pytest.mark.model
def test_the_contrast_page_opens_on_the_stored_result_then_runs_its_own(monkeypatch):
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TOY)
    at = helpers.open_page("contrast", None)
    helpers.assert_clean(at)
    found = shipped.find("contrast", TOY, None, root=REPO_SHIPPED)
    assert found, found
    assert any(s.value.startswith(found.label()) for s in at.success)
    stored = found.json("contrast.json")["result"]
    assert helpers.chart_titles(at)[0].startswith(f"reflection steps vs other steps: {stored['n_significant']} features")
    assert helpers.metric(at, "Set A steps (dev / held-out)") == f"{stored['n']['dev_a']} / {stored['n']['heldout_a']}"

    at.slider(key="ct_traces").set_value(24)
    at.button(key="ct_run").click().run()
    at = helpers.finish_jobs(at)
    helpers.assert_clean(at)
    from analyses.contrast import ContrastSettings
    from analyses.contrast.run import run_contrast
    from probes import Engine

    want, _, _ = run_contrast(Engine.from_id(TOY), ["direction:resid_post.1", "heads:1"], "kind:reflection",
                              ContrastSettings(), organism=24)
    assert helpers.metric(at, "Set A steps (dev / held-out)") == f"{want.n['dev_a']} / {want.n['heldout_a']}"
    assert at.dataframe[0].value["site"][0] == want.top[0]["site"]

    at.multiselect(key="ct_sites").set_value([]).run()
    at.button(key="ct_run").click().run()
    at = helpers.finish_jobs(at)
    assert not at.exception
    assert any("choose at least one site" in e.value for e in at.error)


@pytest.mark.model
def test_the_page_contrasts_the_steps_of_a_rise_harvest(monkeypatch, tmp_path):
    """The "a RISE harvest" source: residual sites only (no head norms offered), the judge's kinds as the rules;
    the page's result equals `run_contrast(..., harvest="auto")`'s, and the run is stored for the next one."""
    from analyses.contrast import ContrastSettings
    from analyses.contrast.run import run_contrast
    from probes import Engine

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TOY)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    at = helpers.open_page("contrast", None)
    at.radio(key="ct_source").set_value("a RISE harvest (the judge's step kinds)").run()
    helpers.assert_clean(at)
    assert at.multiselect(key="ct_harvest_sites").value == ["direction:resid_post.1"]
    assert at.selectbox(key="ct_harvest_task").value == TOY  # the model's own task first; a problem file is a choice
    assert not any(o.startswith("heads:") for o in at.multiselect(key="ct_harvest_sites").options)
    assert "backtracking steps vs the rest" in at.selectbox(key="ct_harvest_rule").options
    at.slider(key="ct_harvest_n").set_value(40)
    at.select_slider(key="ct_resamples").set_value(200)
    at.button(key="ct_run").click().run()
    at = helpers.finish_jobs(at)
    helpers.assert_clean(at)
    want, steps, _ = run_contrast(Engine.from_id(TOY), ["direction:resid_post.1"], "kind:reflection",
                                  ContrastSettings(n_resamples=200), harvest="auto", harvest_n=40,
                                  store=str(tmp_path / "store"))
    assert helpers.metric(at, "Set A steps (dev / held-out)") == f"{want.n['dev_a']} / {want.n['heldout_a']}"
    assert helpers.metric(at, "Set B steps (dev / held-out)") == f"{want.n['dev_b']} / {want.n['heldout_b']}"
    assert any(c.value == f"{len(steps):,} steps of 40 traces." for c in at.caption)
    assert any((tmp_path / "store").iterdir())  # the page's harvest, in the cache the page was given


@pytest.mark.model
def test_the_stored_direction_steers_its_own_model_and_is_not_offered_to_another(monkeypatch):
    """On toy-reasoner:small the stored top direction goes into the steering stack at its width; on another
    model the stored (toy-reasoner) direction is only a download: it once went into a 576-wide model's stack
    as a 64-wide term, labelled "feature browser"."""
    import torch

    from app.steering_stack_ui import STACK
    from probes import Engine
    from probes.interventions import load_vector

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TOY)
    at = helpers.open_page("contrast", None)
    at.button(key="ct_add_to_stack").click().run()
    helpers.assert_clean(at)
    (term,) = at.session_state[STACK]["stack"].terms
    found = shipped.find("contrast", TOY, None, root=REPO_SHIPPED)
    stored = load_vector(found.path("direction.safetensors"))
    assert term.name.startswith("contrast: the top direction") and term.site == "resid_post.1"
    assert term.direction.numel() == Engine.from_id(TOY).arch().d_model == stored.numel()
    assert torch.allclose(term.direction, stored / stored.norm())  # the unit direction, scaled by the term's unit

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    at = helpers.open_page("contrast", None)
    helpers.assert_clean(at)
    assert "ct_add_to_stack" not in [b.key for b in at.button]
    assert any(f"The stored direction is `{TOY}`'s" in c.value for c in at.caption)
    assert STACK not in at.session_state or not at.session_state[STACK]["stack"].terms


@pytest.mark.model
def test_on_the_embedded_model_the_pages_default_question_sets_contrast_without_error(monkeypatch):
    """A newcomer on SmolLM2 presses Contrast with the page's defaults: its two question boxes (16 seeded word
    problems a set, adding against taking away) at the middle layer. The page's first defaults, two questions a
    set, ended in "set B holds steps of a single trace" after generating for minutes."""
    from analyses.contrast.steps import default_question_sets

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    at = helpers.open_page("contrast", None)
    helpers.assert_clean(at)
    a, b = default_question_sets()
    assert at.text_area(key="ct_set_a").value.splitlines() == a and at.text_area(key="ct_set_b").value.splitlines() == b
    assert at.multiselect(key="ct_sites").value == ["direction:resid_post.15", "heads:15"]
    at.select_slider(key="ct_resamples").set_value(200)
    at.button(key="ct_run").click().run()
    at = helpers.finish_jobs(at)
    helpers.assert_clean(at)
    assert at.metric, ([c.value for c in at.caption], [i.value for i in at.info])
    dev_a, held_a = (int(x) for x in helpers.metric(at, "Set A steps (dev / held-out)").split(" / "))
    dev_b, held_b = (int(x) for x in helpers.metric(at, "Set B steps (dev / held-out)").split(" / "))
    caption = next(c.value for c in at.caption if c.value.endswith("traces."))
    assert caption.endswith(" of 32 traces.")  # every question of both sets answered and cut into steps
    assert f"{dev_a + held_a + dev_b + held_b:,} steps" in caption  # every step is in A or B
    assert min(dev_a, held_a, dev_b, held_b) >= 2
    assert any(c.value.startswith("A: A; B: B. Ranked by") for c in at.caption)  # the source rule, box by box


@pytest.mark.model
def test_trace_explorer_lists_the_latents_of_a_token_equal_to_a_direct_encode(monkeypatch, tmp_path):
    """An SAE saved for the model (as RISE saves them) appears on the trace explorer; the latents listed for
    the chosen token are the SAE's encode of that token's residual row in a plain capture of the trace."""
    import ast

    import torch

    from analyses.rise import pipeline
    from probes import Engine
    from saes.io import save_sae
    from saes.train import SAETrainSettings, make_training_sae

    engine = Engine.from_id(TOY)
    sae = make_training_sae(64, SAETrainSettings(d_sae=32, seed=3), metadata={"model_name": TOY,
                                                                            "hook_name": "resid_post.1"}).eval()
    folder = save_sae(sae, tmp_path / "sae")
    saved = pipeline.SavedSAE(str(folder), TOY, "resid_post.1", 64, 32, None, None, {})
    monkeypatch.setattr("app.sections.sae_latents.saved_saes", lambda model_id, site=None: [saved])
    monkeypatch.setenv("THOUGHTSCOPE_MODEL", TOY)
    at = helpers.open_page("trace_explorer", max_new_tokens=12)
    at.button(key="generate").click().run()
    helpers.assert_clean(at)
    token_box = next(s for s in at.selectbox if str(s.key).startswith("te_token_"))
    tokens = [ast.literal_eval(option.split(": ", 1)[1]) for option in token_box.options]
    ids = engine.encode("".join(tokens))
    assert engine.token_texts(ids) == tokens  # the word-level vocabulary reads the shown tokens back exactly
    position = int(token_box.value)
    with torch.no_grad():
        row = sae.encode(engine.capture(ids, ["resid_post.1"])["resid_post.1"][position].float())
    want = sorted(((float(row[j]), j) for j in range(32) if row[j] > 0), key=lambda t: (-t[0], t[1]))[:20]
    assert want, "no latent fires at the chosen token: the comparison would be empty"
    shown = next(d.value for d in at.dataframe if "activation" in d.value.columns)
    assert list(shown["latent"]) == [j for _, j in want]
    assert list(shown["activation"]) == pytest.approx([round(v, 4) for v, _ in want], abs=1e-4)


@pytest.mark.model
def test_the_shipped_contrast_is_rebuilt_exactly_by_its_command(tmp_path):
    from analyses.contrast import ship

    folder = ship.build(TOY, "thoughtscope ship contrast", root=tmp_path)
    stored = shipped.find("contrast", TOY, None, root=REPO_SHIPPED)
    rebuilt = shipped.find("contrast", TOY, None, root=tmp_path)
    assert rebuilt and rebuilt.folder == folder
    # the same bytes on the float arithmetic it was shipped from; made on another kind of CPU, the same
    # result within float tolerance (the direction's largest difference there: 1.2e-7 of 0.70)
    assert shipped.rebuild_differences(rebuilt, stored) == []
    if numerics.same_numerics(stored.manifest):
        assert (folder / "contrast.json").read_bytes() == stored.path("contrast.json").read_bytes()
    assert stored.command == "thoughtscope ship contrast"


def test_a_harvest_of_an_uploaded_problem_file_takes_at_most_what_it_holds(monkeypatch, tmp_path):
    """The harvest's problem count stops at the file's size (64 asked of a 5-problem file once failed after the
    press: "holds 5 problems; ask for at most that many")."""
    import json

    import app.sections.tasks as tasks_section
    from analyses import tasks

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setattr(tasks_section, "store_problem_file",
                        lambda data, name: tasks.store_problem_file(data, name, folder=tmp_path))
    at = helpers.open_page("contrast", None)
    at.radio(key="ct_source").set_value("a RISE harvest (the judge's step kinds)").run()
    at.selectbox(key="ct_harvest_task").set_value(tasks_section.OWN_PROBLEMS).run()
    lines = [json.dumps({"question": f"What is {k} + 1?", "answer": k + 1}) for k in range(5)]
    at.file_uploader(key="ct_harvest_task_file").set_value(("five.jsonl", "\n".join(lines).encode(), "application/json"))
    at.run()
    helpers.assert_clean(at)
    assert at.slider(key="ct_harvest_n").value == 64
    assert any(c.value == "The file holds 5 problems: the harvest takes all of them." for c in at.caption)
