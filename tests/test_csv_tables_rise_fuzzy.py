"""The CSV of every figure of the RISE and fuzzy-concepts pages is a tidy table: one row per observation of what
the figure plots, one column per variable, plain scalars in every cell. The `data` of each test has the shape the
page's `show_figure` call passes (app/sections/rise.py, app/sections/fuzzy_concepts.py); no model is loaded."""

from __future__ import annotations

from typing import Any

import torch

from analyses.problem import Problem
from analyses.rise.confidence import ConfidenceResult
from analyses.rise.dashboard import FeatureDashboard
from analyses.rise.harvest import TraceRecord
from analyses.steps import Step
from tests.export_helpers import tidy_rows

PROVENANCE = {"model": "toy", "commit": "abc"}


# ----------------------------------------------------------------------------- RISE


def _trace() -> TraceRecord:
    text = "Let me check. 2 + 3 = 5. Wait, that is wrong. The answer is 6"
    steps = [Step(0, "Let me check.", 0, 14, token=3, label="reflection"),
             Step(1, "2 + 3 = 5.", 14, 25, token=9, label="other"),
             Step(2, "Wait, that is wrong.", 25, 46, token=14, label="backtracking"),
             Step(3, "The answer is 6", 46, len(text), token=-1, closed=False, label="other")]
    return TraceRecord(Problem("p-7", "What is 2 + 4?", "6", "test", 2), text, [1, 2], list(range(20)), [], steps, True)


def test_rise_timeline_is_one_row_per_step_with_top_latents_as_columns():
    trace = _trace()
    per_step = [[14, 3, 6], [11, 0, 9], [10, 11, 12], []]  # the last step has no row in the harvest
    data = {"trace": trace.to_dict(), "top_latents": per_step, "site": "resid_post.15"}
    rows, parsed = tidy_rows(data, "rise_timeline")
    assert len(rows) == len(trace.steps) == 4
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["label"] == "backtracking" and rows[2]["text"] == "Wait, that is wrong." and rows[2]["token"] == 14
    assert (rows[0]["top1"], rows[0]["top2"], rows[0]["top3"]) == (14, 3, 6)
    assert rows[3]["top1"] is None and rows[3]["closed"] is False
    assert {r["problem_id"] for r in rows} == {"p-7"} and {r["site"] for r in rows} == {"resid_post.15"}
    assert parsed[1]["top3"] == "9" and parsed[0]["correct"] == "True"
    assert not any(k.startswith("trace.") for k in parsed[0])


def test_rise_decoder_map_is_one_row_per_column():
    data = {"site": "resid_post.10", "coords": [[0.5, 1.5], [2.0, -1.0], [3.25, 0.0]],
            "column_labels": ["other", None, "reflection"], "silhouette": 0.21, "projection": "umap"}
    rows, parsed = tidy_rows(data, "rise_decoder_map")
    assert len(rows) == 3
    assert rows[2] == {"site": "resid_post.10", "projection": "umap", "column": 2, "x": 3.25, "y": 0.0,
                       "label": "reflection", "silhouette": 0.21}
    assert parsed[1]["label"] == "" and float(parsed[1]["y"]) == -1.0


def test_rise_silhouette_is_one_row_per_site_in_layer_order():
    data = {"resid_post.22": 0.137, "resid_post.10": 0.0165, "resid_post.15": None}  # silhouette_per_layer
    rows, parsed = tidy_rows(data, "rise_silhouette")
    assert [(r["site"], r["layer"], r["silhouette"]) for r in rows] == [
        ("resid_post.10", 10, 0.0165), ("resid_post.15", 15, None), ("resid_post.22", 22, 0.137)]
    assert list(parsed[0]) == ["site", "layer", "silhouette"] and parsed[1]["silhouette"] == ""


def _board() -> FeatureDashboard:
    return FeatureDashboard(
        site="resid_post.15", latent=14, density=0.155, max_activation=26.9,
        top_steps=[{"row": 0, "trace": 0, "step": 0, "activation": 26.9, "text": "Let me check.",
                    "label": "reflection", "problem_id": "p-7"}],
        histogram_counts=[2, 1, 0, 4], histogram_edges=[0.0, 1.5, 3.0, 4.5, 6.0],
        promoted_tokens=[(" check", 0.4), ("wait", 0.3)], suppressed_tokens=[(" tqdm", -0.44), ("rizes", -0.43)],
        label_frequency={"reflection": 1, "backtracking": 4, "other": 2})


def test_rise_feature_histogram_is_one_row_per_bin():
    board = _board()
    rows, parsed = tidy_rows(board, "rise_feature_histogram")  # the page passes the dashboard itself
    assert len(rows) == len(board.histogram_counts) == 4
    assert rows[3] == {"site": "resid_post.15", "latent": 14, "bin_low": 4.5, "bin_high": 6.0, "count": 4}
    assert [int(r["count"]) for r in parsed] == board.histogram_counts
    assert all(float(a["bin_high"]) == float(b["bin_low"]) for a, b in zip(parsed, parsed[1:]))


def test_rise_feature_labels_and_tokens_are_one_row_per_label_and_per_token():
    board = _board()
    rows, parsed = tidy_rows(board.label_frequency, "rise_feature_labels")
    assert rows == [{"label": "reflection", "steps": 1}, {"label": "backtracking", "steps": 4},
                    {"label": "other", "steps": 2}]
    tokens = {"promoted": board.promoted_tokens, "suppressed": board.suppressed_tokens}
    rows, parsed = tidy_rows(tokens, "rise_feature_tokens")
    assert len(rows) == 4
    assert rows[2] == {"direction": "suppressed", "rank": 1, "token": " tqdm", "logit_effect": -0.44}
    assert parsed[0]["token"] == " check" and parsed[1]["rank"] == "2"  # leading spaces survive the CSV


def test_rise_confidence_is_one_row_per_iteration():
    result = ConfidenceResult("resid_post.15", torch.tensor([0.1, -0.5, 0.2]), [1, 2, 0], [2.5, 2.25, 2.0],
                              {"iterations": 3})
    rows, parsed = tidy_rows(result, "rise_confidence")
    assert len(rows) == 3
    assert rows[1] == {"site": "resid_post.15", "iteration": 1, "entropy": 2.25}
    assert float(parsed[2]["entropy"]) == 2.0


def test_rise_quality_auroc_and_steering_keep_their_tables():
    layer = {"site": "resid_post.10",
             "quality": {"train": {"explained_variance": 0.78, "l0": 2.3}, "heldout": {"explained_variance": 0.65,
                                                                                        "l0": 4.6}},
             "auroc": {"reflection": {"latent": 10, "train_auroc": 1.0, "heldout_auroc": 0.9}}}
    rows, _ = tidy_rows({"layers": [layer]}, "rise_quality")
    assert [(r["split"], r["explained_variance"]) for r in rows] == [("train", 0.78), ("heldout", 0.65)]
    rows, _ = tidy_rows({"layers": [layer]}, "rise_auroc")
    assert rows == [{"site": "resid_post.10", "label": "reflection", "latent": 10, "train_auroc": 1.0,
                     "heldout_auroc": 0.9}]
    steering = {"behaviour": "reflection", "site": "resid_post.10", "mode": "projection", "split": "eval",
                "rows": [{"alpha": a, "n": 2, "mean_reflection_steps": 1.0, "mean_backtracking_steps": 0.0,
                          "mean_steps": 4.0, "mean_tokens": 40.0, "accuracy": 0.5,
                          "intervals": {"reflection": {"estimate": 1.0, "low": 0.5, "high": 1.5}}}
                         for a in (0.0, 1.0)]}
    rows, _ = tidy_rows(steering, "rise_steering")
    assert [r["alpha"] for r in rows] == [0.0, 1.0] and rows[0]["reflection_low"] == 0.5


# ----------------------------------------------------------------------------- fuzzy concepts


def test_fuzzy_metrics_is_one_row_per_method_and_metric():
    def row(method: str, base: float) -> dict[str, Any]:
        out: dict[str, Any] = {"method": method}
        for i, name in enumerate(("reconstruction_error", "active_concepts", "ami_template")):
            out[name], out[f"{name}_low"], out[f"{name}_high"] = base + i, base + i - 0.1, base + i + 0.1
        return out

    data = {"metric_table": [row("fuzzy", 1.0), row("k-means", 2.0)], "seeds": 3, "provenance": PROVENANCE}
    rows, parsed = tidy_rows(data, "fuzzy_metrics")
    assert len(rows) == 2 * 3
    assert [r["metric"] for r in rows[:3]] == ["reconstruction_error", "active_concepts", "ami_template"]
    assert rows[4] == {"method": "k-means", "metric": "active_concepts", "estimate": 3.0, "low": 2.9, "high": 3.1,
                       "seeds": 3}
    assert "provenance" not in parsed[0] and parsed[0]["method"] == "fuzzy"


def test_fuzzy_tuning_is_one_row_per_candidate():
    grid = [{"setting": {"lr": lr, "n_features": 8, "sparsity": 0.003}, "score": [1, -err],
             "dev_active_concepts": act, "dev_reconstruction_error": err, "steps_run": 300}
            for lr, err, act in ((0.01, 0.94, 1.8), (0.03, 1.01, 2.27), (0.1, 0.99, 1.2))]
    data = {"name": "fuzzy settings", "split": "development", "objective": "lowest FVU",
            "chosen": grid[2]["setting"], "chosen_index": 2, "grid": grid}
    rows, parsed = tidy_rows(data, "fuzzy_tuning")
    assert len(rows) == len(grid) == 3
    assert rows[1] == {"candidate": 1, "lr": 0.03, "n_features": 8, "sparsity": 0.003,
                       "dev_reconstruction_error": 1.01, "dev_active_concepts": 2.27, "steps_run": 300,
                       "chosen": False}
    assert [r["chosen"] for r in parsed] == ["False", "False", "True"]


def test_fuzzy_firing_is_one_row_per_rule():
    chain = [{"rule": 2, "firing": 0.7, "membership": 0.01,
              "clauses": [{"feature": 3, "value": 0.1, "centre": 0.4, "width": 0.2, "membership": 0.3}]},
             {"rule": 0, "firing": 0.25, "membership": 0.004, "clauses": []}]
    data = {"firing": [0.25, 0.05, 0.7], "memberships": [0.004, 0.0008, 0.01], "chain": chain,
            "snippet": "a [water] snippet", "rule_labels": ["rule 1", "rule 2", "rule 3"], "provenance": PROVENANCE}
    rows, parsed = tidy_rows(data, "fuzzy_firing")
    assert len(rows) == len(data["firing"]) == 3
    assert rows[2] == {"rule": 3, "label": "rule 3", "firing": 0.7, "membership": 0.01, "chain_rank": 1,
                       "snippet": "a [water] snippet"}
    assert [r["chain_rank"] for r in parsed] == ["2", "", "1"]


def test_fuzzy_overlap_is_one_row_per_pair_of_concepts():
    matrix = [[0.0, 0.5, 0.25], [1.0, 0.0, 0.0], [0.125, 0.0, 0.0]]
    data = {"method": "semi-NMF", "overlap_matrix": matrix, "mean": 0.3125, "words": [["a"], ["b", "c"], []],
            "provenance": PROVENANCE}
    rows, parsed = tidy_rows(data, "fuzzy_overlap")
    assert len(rows) == 9
    assert rows[3] == {"method": "semi-NMF", "concept_k": 2, "concept_l": 1, "overlap": 1.0}
    assert [float(r["overlap"]) for r in parsed] == [v for row in matrix for v in row]
