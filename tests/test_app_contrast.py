"""The contrast page (issue 25 item 4): it opens on the stored contrast of toy-reasoner:small, runs its own
as a job, and says what is wrong with a contrast it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import apptest_helpers as helpers
from thoughtscope import shipped

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
