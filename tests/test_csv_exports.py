"""Every figure a page draws exports a tidy CSV and a JSON whose provenance names what made it: a table builder of its own (`TABLES` in app/figures), one
row per observation, a plain value in every cell. The generic flattener once wrote Python dict reprs into
cells (RISE's step timeline, fuzzy metrics and tuning grids), glued vectors of different lengths into one
table (CoT calibration) or left the plotted values out (MoE expert heat map, one row of 178 columns for the
visual-attribution faithfulness). Here each page opens on SmolLM2-135M and its stored results, and every
figure it draws has its CSV made as the download button would make it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from app import export, jobs  # noqa: E402
from tests import apptest_helpers as helpers  # noqa: E402
from tests.export_helpers import tidy_rows  # noqa: E402

pytestmark = pytest.mark.model

# the pages that open on stored results (the trace explorer, Home and Correctness draw figures only on request)
PAGES = ("rise", "fuzzy_concepts", "cot_entropy", "visual_attribution", "rlkv", "moe_router", "feature_browser",
         "contrast", "steering")


@pytest.fixture(scope="module")
def drawn_from() -> str:
    """When the pages were opened (UTC, as provenance records write it)."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@pytest.fixture(scope="module")
def drawn(drawn_from):
    """{page: [(figure name, table name, data, the provenance its exports carry)]} of every figure drawn when
    each page opens."""
    seen: list[tuple[str, str, object, object]] = []
    original = export.export_buttons

    def record(fig, data, name, provenance=None, figure=None):
        seen.append((name, figure or name, data, export.record_of(data, provenance)))  # as the buttons read it
        return original(fig, data, name, provenance, figure)

    mp = pytest.MonkeyPatch()
    mp.setattr(export, "export_buttons", record)
    mp.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")
    out = {}
    try:
        for page in PAGES:
            seen.clear()
            at = helpers.open_page(page, max_new_tokens=None)  # the page's own defaults: its stored result
            helpers.assert_clean(at)
            out[page] = list(seen)
            for job in jobs.registry().running():  # a job a page started on opening: not this test's subject
                job.stop("the test ended")
                job.thread.join(120)
    finally:
        mp.undo()
        jobs.registry.clear()
    return out


def test_the_pages_draw_their_stored_figures(drawn):
    names = {name for figures in drawn.values() for name, _, _, _ in figures}
    assert {"rise_timeline", "rise_feature_histogram", "fuzzy_metrics", "fuzzy_tuning", "cot_calibration",
            "vis_attr_faithfulness", "rlkv_head_map", "rlkv_memory", "moe_heatmap", "moe_divergence",
            "contrast_volcano", "feature_contexts"} <= names


def test_every_drawn_figure_has_a_tidy_table_of_plain_values(drawn):
    for page, figures in drawn.items():
        for name, table, data, _ in figures:
            rows, _ = tidy_rows(data, table)  # its own TABLES builder (not the generic flattener), plain cells
            assert rows, f"{page}: {name}'s table is empty"


def test_the_tables_hold_the_plotted_values(drawn):
    figures = {name: (table, data) for fs in drawn.values() for name, table, data, _ in fs}
    table, data = figures["vis_attr_faithfulness"]
    rows = export.table_rows(data, table)
    metrics = export.plain(data)["metrics"]
    assert len(rows) == len(metrics)  # one row per (method, measure), not one row of 178 columns
    lds = next(r for r in rows if (r["method"], r["measure"]) == ("amortized", "lds"))
    assert (lds["estimate"], lds["low"], lds["high"]) == tuple(metrics["amortized_lds"][k]
                                                              for k in ("estimate", "low", "high"))
    table, data = figures["rlkv_head_map"]
    scores = export.plain(data)["scores"]
    rows = export.table_rows(data, table)
    assert len(rows) == len(scores) * len(scores[0])
    assert rows[len(scores[0]) + 1]["score"] == scores[1][1] and rows[len(scores[0]) + 1]["layer"] == 1


# pages whose figures, on opening, are all drawn from a stored result (`thoughtscope ship ...`)
STORED = ("rise", "fuzzy_concepts", "cot_entropy", "visual_attribution", "moe_router", "contrast")


def test_a_stored_results_figures_export_its_own_record_not_the_pages(drawn, drawn_from):
    """The exports of a stored result's figures once carried the page's record ("thoughtscope app", made now,
    the sidebar's generation settings) or a record without its command; they carry the stored one."""
    for page in STORED:
        for name, _, data, record in drawn[page]:
            assert record and "ship" in str(record.get("command")), (page, name, record and record.get("command"))
            assert record["created"] < drawn_from, (page, name)  # made before this test ran, not by the page
    rise = {name: record for name, _, _, record in drawn["rise"]}
    assert rise["rise_timeline"]["command"] == "thoughtscope ship rise-saes"  # the command that rebuilds it
    assert rise["rise_timeline"]["settings"]["augment"] == "templated"  # the stored run's own settings


def test_the_head_maps_figures_name_the_gates_and_the_run_that_learned_them(drawn):
    records = {name: record for name, _, _, record in drawn["rlkv"]}
    head_map = records["rlkv_head_map"]["settings"]
    assert head_map["head_map"]["kind"] == "learned" and head_map["head_map"]["gates_file"].endswith("gates.safetensors")
    log = next(data for name, _, data, _ in drawn["rlkv"] if name == "rlkv_training")["log"]
    training = head_map["head_map"]["training"]
    assert training["model"] == "smollm2-135m" and training["steps"] == len(log) and "lr" in training["settings"]
    assert head_map["sparsity"] == 0.5 and (head_map["sink"], head_map["recent"]) == (4, 32)
    assert records["rlkv_training"]["settings"]["head_map"] == head_map["head_map"]
