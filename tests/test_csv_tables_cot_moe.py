"""Tidy CSV tables of the CoT-entropy and MoE-router figures (`TABLES` of app/figures/cot_entropy.py and
app/figures/moe_router.py): one row per plotted observation, plain scalars, the CSV download parses into them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector
from analyses.moe_router.maps import RouterMap, divergence_data, heatmap_data
from app.export import build_figure, plain, table_registry
from tests.export_helpers import tidy_rows

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["app/sections/cot_entropy.py", "app/views/cot_entropy.py", "app/sections/moe_router.py",
         "app/views/moe_router.py"]


def _tidy(data, name: str) -> list[dict]:
    return tidy_rows(data, name)[0]


def test_every_figure_of_the_two_pages_has_a_table():
    drawn = set()
    for page in PAGES:
        drawn |= set(re.findall(r'show_figure\(.*?"(\w+)"', (ROOT / page).read_text()))
    assert {"cot_calibration", "cot_entropy_curve", "cot_cusum", "cot_answer_strip", "cot_voting",
            "moe_heatmap", "moe_divergence", "moe_active_experts"} <= drawn
    assert drawn <= set(table_registry())


# ----------------------------------------------------------------- CoT entropy

def _trace() -> dict:
    """A trace analysis' `to_dict()`: 8 tokens, steps ending after tokens 2 and 5, probes at 2, 5 and 8."""
    return {"problem_id": "p1", "target": "5", "text": "abcdefgh", "token_ids": list(range(8)),
            "token_texts": list("abcdefgh"), "entropies": [2.0, 1.8, 1.5, 1.2, 0.9, 0.5, 0.2, 0.1],
            "final_answer": "5", "step_ends": [[2, 3], [5, 6]], "probes": [],
            "smoothed_entropies": [2.0, 1.9, 1.77, 1.63, 1.48, 1.18, 0.86, 0.58], "smoothing_window": 5,
            "step_probe_tokens": [2, 5, 8], "step_probe_entropies": [1.1, 0.4, 0.05],
            "step_probe_answers": ["3", "5", "5"], "step_probe_correct": [False, True, True],
            "log_ratios": [-0.5, 2.5, 1.5], "statistic": [0.0, 2.5, 4.0], "threshold": 2.0,
            "alarm_step": 1, "exit_token": 6, "exit_answer": "5", "redundant_tail": 2}


def test_entropy_curve_table_is_one_row_per_token_with_its_phase():
    d = _trace()
    build_figure("cot_entropy_curve", d)  # the data is what the figure draws
    rows = _tidy(d, "cot_entropy_curve")
    assert len(rows) == 8 and [r["token"] for r in rows] == list(range(1, 9))
    assert rows[2] == {"token": 3, "text": "c", "entropy": 1.5, "smoothed_entropy": 1.77, "step_end": False,
                       "phase": "uncertainty"}
    assert [r["token"] for r in rows if r["step_end"]] == [2, 5]
    # the alarm at step 2 (boundary 5, detected after token 6): tokens 7 and 8 are the redundant confidence tail
    assert [r["token"] for r in rows if r["phase"] == "confidence"] == [7, 8]


def test_cusum_table_is_one_row_per_probed_step():
    d = _trace()
    build_figure("cot_cusum", d)
    rows = _tidy(d, "cot_cusum")
    assert rows == [{"step": i + 1, "probe_token": x, "log_ratio": z, "statistic": s, "threshold": 2.0, "alarm": i == 1}
                    for i, (x, z, s) in enumerate([(2, -0.5, 0.0), (5, 2.5, 2.5), (8, 1.5, 4.0)])]


def test_answer_strip_table_is_one_row_per_probe_and_the_final_answer():
    d = _trace()
    build_figure("cot_answer_strip", d)
    rows = _tidy(d, "cot_answer_strip")
    assert len(rows) == 3 + 1 and [r["point"] for r in rows] == ["probe"] * 3 + ["final"]
    assert rows[0]["answer"] == "3" and rows[0]["correct"] is False and rows[0]["mean_entropy"] == 1.1
    assert [r["at_alarm"] for r in rows] == [False, True, False, False]
    assert rows[-1]["generated_tokens"] == 8 and rows[-1]["answer"] == "5" and rows[-1]["target"] == "5"


def _detector(density: str) -> CusumDetector:
    rng = np.random.default_rng(0)
    traces = [CalibrationTrace(list(rng.uniform(0.5, 2.0, 3)) + list(rng.uniform(0.0, 0.3, 2)),
                               ["1", "2", "3", "7", "7"], "7") for _ in range(6)]
    return CusumDetector(density=density, bins=6).fit(traces)


def test_calibration_table_kde_is_long_by_series():
    det = _detector("kde")
    d = plain(det)
    build_figure("cot_calibration", d)
    rows = _tidy(det, "cot_calibration")
    series = [r["series"] for r in rows]
    n_bins, n_curve = len(d["bin_edges"]) - 1, len(d["curve"]["x"])
    assert n_bins == 6 and n_curve == 200
    assert {s: series.count(s) for s in set(series)} == {
        "histogram uncertain": n_bins, "histogram confident": n_bins, "density uncertain": n_curve,
        "density confident": n_curve, "log ratio": n_curve}
    assert len(rows) == 2 * n_bins + 3 * n_curve
    bar = next(r for r in rows if r["series"] == "histogram confident")
    assert (bar["bin_low"], bar["bin_high"]) == (d["bin_edges"][0], d["bin_edges"][1])
    assert bar["y"] == d["empirical_confident"][0] and bar["count"] == d["counts_confident"][0]
    assert sum(r["count"] for r in rows if r["series"] == "histogram uncertain") == d["n_uncertain"] == 18
    ratio = [r for r in rows if r["series"] == "log ratio"]
    assert ratio[10]["x"] == d["curve"]["x"][10] and ratio[10]["y"] == d["curve"]["log_ratio"][10]
    assert ratio[10]["bin_low"] is None and ratio[10]["count"] is None


def test_calibration_table_histogram_is_per_bin():
    det = _detector("histogram")
    d = plain(det)
    build_figure("cot_calibration", d)
    rows = _tidy(d, "cot_calibration")
    assert len(rows) == 3 * 6 and [r["series"] for r in rows[::6]] == ["density uncertain", "density confident",
                                                                        "log ratio"]
    assert rows[6 + 2]["y"] == d["density_confident"][2] and rows[6 + 2]["count"] == d["counts_confident"][2]
    assert rows[12]["y"] == d["log_ratio"][0] and rows[12]["x"] == (d["bin_edges"][0] + d["bin_edges"][1]) / 2


def test_voting_table_is_one_row_per_vote():
    ci = lambda e, lo, hi: {"estimate": e, "low": lo, "high": hi, "n": 4}  # noqa: E731
    d = {"command": "eval cot-vote", "split": "evaluation", "model": "m", "task": "arith", "n_eval": 4,
         "n_calibration": 2, "samples": 3, "temperature": 0.7, "threshold": 2.0, "majority_accuracy": 0.75,
         "weighted_accuracy": 1.0, "sample_accuracy": 0.5, "seconds": 1.0,
         "per_problem": [{"id": "a", "target": "1", "answers": ["1", "2", None], "weights": [1.0, 0.0, 0.0],
                          "majority": "1", "weighted": "1"}],
         "intervals": {"single": ci(0.5, 0.25, 0.75), "majority": ci(0.75, 0.25, 1.0), "weighted": ci(1.0, 1.0, 1.0)},
         "weighted_vs_majority": {"p_value": 1.0}, "provenance": {}}
    build_figure("cot_voting", d)
    rows = _tidy(d, "cot_voting")
    assert [r["vote"] for r in rows] == ["single sample", "majority", "CUSUM-weighted"]
    assert rows[1] == {"vote": "majority", "accuracy": 0.75, "low": 0.25, "high": 1.0, "n_problems": 4, "samples": 3,
                       "split": "evaluation"}


def test_dev_choice_table_holds_the_plotted_methods_and_no_score_tuples():
    def grid(*accs: float) -> list[dict]:
        return [{"setting": s, "score": [1, -10.0, -10.0], "accuracy": a, "mean_generated_tokens": 10.0,
                 "mean_probe_tokens": 2.0, "mean_tokens_with_probes": 12.0, "exit_rate": 0.5, "n": 4}
                for s, a in zip(([1.0], [2.0]), accs)]

    d = {"settings": {"cost": "generated"}, "n_dev": 4, "dev_vanilla": {"accuracy": 0.5, "mean_generated_tokens": 20.0},
         "choices": {"density": {"chosen_index": 0, "grid": [{"setting": 0.1, "score": -1.0, "dev_log_likelihood": -1.0,
                                                              "dev_steps": 8}]},
                     "cusum": {"chosen_index": 1, "grid": grid(0.5, 0.75)},
                     "deer": {"chosen_index": 0, "grid": grid(0.25, 0.5)}}}
    build_figure("cot_dev_choice", d)
    rows = _tidy(d, "cot_dev_choice")
    assert [(r["method"], r["chosen"]) for r in rows] == [("cusum", False), ("cusum", True), ("deer", True),
                                                          ("deer", False)]
    assert rows[1]["accuracy"] == 0.75 and rows[1]["setting"] == "[2.0]" and "score" not in rows[1]


# ----------------------------------------------------------------- MoE router

def _router_map() -> RouterMap:
    """2 samples, 3 steps, layers 0 and 3, k = 2 of 4 experts; sample 1 stops after 2 tokens, and sample 0's
    second slot at step 1 of layer 3 is empty (-1)."""
    experts = np.array([[[[0, 1], [2, 3]], [[0, 1], [1, -1]], [[0, 2], [2, 3]]],
                        [[[0, 1], [2, 3]], [[0, 3], [1, 2]], [[-1, -1], [-1, -1]]]])
    gates = np.where(experts >= 0, 0.5, np.nan) + np.arange(3)[None, :, None, None] / 10
    logits = np.zeros((2, 3, 2, 4))
    return RouterMap([0, 3], 2, 4, [["a", "b", "c"], ["a", "x"]], [[1, 2, 3], [1, 9]], logits, experts, gates,
                     "a rule")


def test_heatmap_table_is_one_row_per_layer_position_and_used_slot():
    d = heatmap_data(_router_map(), 0)
    build_figure("moe_heatmap", plain(d))
    rows = _tidy(d, "moe_heatmap")
    assert len(rows) == 2 * 3 * 2 - 1  # layers x positions x slots, less the empty slot
    assert list(rows[0]) == ["layer", "position", "token", "slot", "expert", "gate", "sample"]
    cell = next(r for r in rows if r["layer"] == 3 and r["position"] == 2 and r["slot"] == 1)
    assert cell == {"layer": 3, "position": 2, "token": "c", "slot": 1, "expert": 3, "gate": d["gates"][1][2][1],
                    "sample": 0}
    assert cell["gate"] == pytest.approx(0.7)
    assert not [r for r in rows if r["layer"] == 3 and r["position"] == 1 and r["slot"] == 1]
    assert len(_tidy(heatmap_data(_router_map(), 1), "moe_heatmap")) == 2 * 2 * 2  # sample 1: 2 tokens


def test_divergence_table_is_one_row_per_layer_and_step():
    d = divergence_data(_router_map())
    build_figure("moe_divergence", plain(d))
    rows = _tidy(d, "moe_divergence")
    assert len(rows) == 2 * 3 and [(r["layer"], r["step"]) for r in rows[:3]] == [(0, 0), (0, 1), (0, 2)]
    assert rows[0]["divergence"] == 0.0 and rows[0]["same_prefix_divergence"] == 0.0
    # step 1, layer 0: {0, 1} vs {0, 3}, Jaccard distance 1 - 1/3; the tokens differ, so no same-prefix pair
    assert rows[1]["divergence"] == pytest.approx(0.6667, abs=1e-4) and rows[1]["same_prefix_divergence"] is None
    assert rows[1]["distinct_tokens"] == 2
    assert rows[2]["divergence"] is None and rows[5]["divergence"] is None  # one sample still generating at step 2


def test_active_experts_table_is_one_row_per_k():
    ci = lambda e: {"estimate": e, "low": e - 0.1, "high": min(1.0, e + 0.1), "n": 10}  # noqa: E731
    d = {"model": "toy-moe", "task": "arith", "k": 2, "settings": {"n": 10},
         "rows": [{"active_experts": 2, "accuracy": ci(0.8), "mean_tokens": 12.0, "vs_model_k": None},
                  {"active_experts": 1, "accuracy": ci(0.5), "mean_tokens": 14.5,
                   "vs_model_k": {"test": "exact McNemar", "p_value": 0.25, "gains": 0, "losses": 3,
                                  "difference": ci(-0.3)}}]}
    build_figure("moe_active_experts", d)
    rows = _tidy(d, "moe_active_experts")
    assert [r["active_experts"] for r in rows] == [1, 2]
    assert rows[0] == {"active_experts": 1, "model_k": 2, "accuracy": 0.5, "low": 0.4, "high": 0.6, "n": 10,
                       "mean_tokens": 14.5, "mcnemar_p": 0.25, "gained": 0, "lost": 3}
    assert rows[1]["mcnemar_p"] is None
