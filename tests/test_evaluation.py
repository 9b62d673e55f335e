"""The shared evaluation protocol (analyses/evaluation.py) against values worked out by hand.

A tour: split a pool three ways, choose a setting on development, put a bootstrap interval on an
accuracy, test a method against its baseline on the same problems, and ask how many problems a
difference would need.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from analyses.evaluation import (Choice, bootstrap_interval, choose_on_dev, compare, detectable_statement,
                                 fewest_cost_within, mcnemar_exact, mcnemar_sample_size, paired_difference_interval,
                                 paired_mean_sample_size, pass_at_k_interval, resample_indices, sign_test,
                                 split_three, wilcoxon_test)
from analyses.tasks import load_task
from thoughtscope.errors import BadInputError

# --------------------------------------------------------------------------- splits


def test_three_way_split_is_disjoint_seeded_and_keeps_the_pool_order():
    pool = load_task("arith", 30, seed=0)
    s = split_three(pool, 5, 10, 12, seed=3)
    assert s.sizes() == {"calibration": 5, "development": 10, "evaluation": 12}
    ids = [set(p.id for p in part) for part in s]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    order = {p.id: i for i, p in enumerate(pool)}
    for part in s:
        assert [order[p.id] for p in part] == sorted(order[p.id] for p in part)
    again = split_three(pool, 5, 10, 12, seed=3)
    assert again.to_dict() == s.to_dict()
    assert split_three(pool, 5, 10, 12, seed=4).to_dict() != s.to_dict()
    assert split_three(pool, 5, 10, seed=3).sizes()["evaluation"] == 15  # the rest
    with pytest.raises(BadInputError, match="cannot give"):
        split_three(pool, 10, 10, 11)
    with pytest.raises(BadInputError, match="duplicates"):
        split_three(pool + pool[:1], 1, 1)


# --------------------------------------------------------------------------- choice on development


def test_choose_on_dev_records_the_grid_and_breaks_ties_towards_the_first():
    seen = []

    def dev(h):
        seen.append(h)
        return {"accuracy": {0.5: 0.30, 1.0: 0.40, 2.0: 0.40, 4.0: 0.35}[h], "mean_tokens": 10 * h}

    choice = choose_on_dev([0.5, 1.0, 2.0, 4.0], dev, "accuracy", name="h")
    assert seen == [0.5, 1.0, 2.0, 4.0]  # each setting measured once, in grid order
    assert isinstance(choice, Choice) and choice.chosen == 1.0 and choice.index == 1
    d = choice.to_dict()
    assert d["split"] == "development" and d["chosen"] == 1.0
    assert [row["setting"] for row in d["grid"]] == [0.5, 1.0, 2.0, 4.0]
    assert [row["accuracy"] for row in d["grid"]] == [0.30, 0.40, 0.40, 0.35]
    with pytest.raises(BadInputError, match="grid is empty"):
        choose_on_dev([], dev, "accuracy")


def test_fewest_cost_within_tolerance_of_the_baseline():
    rows = {"a": {"accuracy": 0.50, "mean_tokens": 40.0},   # as accurate as vanilla, long
            "b": {"accuracy": 0.48, "mean_tokens": 30.0},   # 2 points down: within the tolerance
            "c": {"accuracy": 0.40, "mean_tokens": 10.0}}   # cheap but 10 points down
    choice = choose_on_dev(["a", "b", "c"], rows.get, fewest_cost_within(0.50, tolerance=0.02))
    assert choice.chosen == "b"
    assert choose_on_dev(["a", "b", "c"], rows.get, fewest_cost_within(0.50, tolerance=0.0)).chosen == "a"
    # nothing within the tolerance: the most accurate wins
    assert choose_on_dev(["b", "c"], rows.get, fewest_cost_within(0.60, tolerance=0.0)).chosen == "b"


# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_interval_of_a_three_problem_sample_matches_the_exact_resampling_distribution():
    # Resampling [0, 0, 1]: the number of ones is Binomial(3, 1/3): P = 8/27, 12/27, 6/27, 1/27 for 0..3.
    # P(mean <= 2/3) = 26/27 = 0.963 < 0.975, so the 97.5th percentile is 1; P(mean = 0) = 0.296 > 0.025,
    # so the 2.5th percentile is 0: the interval is [0, 1] around 1/3.
    ci = bootstrap_interval([0, 0, 1], n_resamples=20000, seed=0)
    assert (ci.estimate, ci.low, ci.high) == (pytest.approx(1 / 3), 0.0, 1.0)
    # and the resampled means hit the exact probabilities
    means = np.asarray([0, 0, 1], float)[resample_indices(3, 20000, seed=0)].mean(1)
    for k, p in enumerate((8 / 27, 12 / 27, 6 / 27, 1 / 27)):
        assert np.mean(np.isclose(means, k / 3)) == pytest.approx(p, abs=0.01)


def test_bootstrap_interval_is_the_percentiles_of_the_seeded_resamples():
    x = [3.0, 7.0, 8.0, 12.0, 20.0]
    ci = bootstrap_interval(x, n_resamples=1000, seed=7)
    means = np.asarray(x)[np.random.default_rng(7).integers(0, 5, size=(1000, 5))].mean(1)
    assert ci.estimate == 10.0 and ci.n == 5
    assert (ci.low, ci.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert bootstrap_interval(x, n_resamples=1000, seed=7) == ci  # seeded: the same interval
    assert bootstrap_interval([4.0] * 6).to_dict()["low"] == 4.0 == bootstrap_interval([4.0] * 6).high
    median = bootstrap_interval(x, "median", n_resamples=1000, seed=7)
    assert median.estimate == 8.0 and 3.0 <= median.low <= 8.0 <= median.high <= 20.0
    with pytest.raises(BadInputError):
        bootstrap_interval([])


def test_paired_difference_and_pass_at_k_intervals():
    d = paired_difference_interval([10, 12, 9, 11], [12, 12, 12, 12], n_resamples=4000, seed=1)
    assert d.estimate == pytest.approx(-1.5)  # (-2 + 0 - 3 - 1) / 4
    assert -3.0 <= d.low < d.estimate < d.high <= 0.0
    # pass@2 of (4 samples, 1 correct) = 1 - C(3,2)/C(4,2) = 1/2; (4, 0) -> 0; (4, 4) -> 1: mean 1/2
    ci = pass_at_k_interval([(4, 1), (4, 0), (4, 4)], k=2, n_resamples=4000)
    assert ci.estimate == pytest.approx(0.5) and ci.low == 0.0 and ci.high == 1.0


# --------------------------------------------------------------------------- paired tests


def test_exact_mcnemar_on_a_hand_table():
    # 20 problems: both right on 9, both wrong on 3, the method alone right on 2, the baseline alone on 6.
    method = [1] * 9 + [0] * 3 + [1] * 2 + [0] * 6
    baseline = [1] * 9 + [0] * 3 + [0] * 2 + [1] * 6
    test = mcnemar_exact(method, baseline)
    # two-sided binomial: 2 * P(X <= 2 | n = 8, p = 1/2) = 2 * (1 + 8 + 28) / 256 = 0.2890625
    assert (test.gains, test.losses, test.ties) == (2, 6, 12)
    assert test.p_value == pytest.approx(74 / 256)
    assert test.difference.estimate == pytest.approx(-4 / 20)
    assert not test.significant
    assert test.verdict.startswith("n = 20 cannot tell these apart (exact McNemar p = 0.29; 2 gained, 6 lost)")
    # 0 gained, 9 lost: p = 2 / 2^9 = 0.0039
    strong = mcnemar_exact([0] * 9 + [1] * 11, [1] * 9 + [1] * 11)
    assert strong.p_value == pytest.approx(2 / 512) and strong.significant
    assert strong.verdict.startswith("the method is worse than the baseline")
    assert mcnemar_exact([1, 0], [1, 0]).p_value == 1.0  # no discordant problem: no evidence
    with pytest.raises(BadInputError, match="0/1"):
        mcnemar_exact([2, 0], [1, 0])


def test_sign_test_and_wilcoxon_on_paired_token_counts():
    method = [30, 28, 25, 31, 22, 26, 29, 40, 33]
    baseline = [35, 35, 35, 35, 35, 35, 35, 35, 33]  # the last pair ties
    sign = sign_test(method, baseline, what="tokens")
    # 7 lower, 1 higher, 1 tie: 2 * P(X <= 1 | n = 8) = 2 * 9 / 256 = 0.0703125
    assert (sign.gains, sign.losses, sign.ties) == (7, 1, 1)
    assert sign.p_value == pytest.approx(18 / 256)
    assert sign.verdict.startswith("n = 9 cannot tell these apart on tokens (sign test p = 0.07")
    # Wilcoxon on the 8 non-zero differences -5 -7 -10 -4 -13 -9 -6 +5:
    # |d| = 5, 7, 10, 4, 13, 9, 6, 5 -> ranks 2.5, 5, 7, 1, 8, 6, 4, 2.5; W+ = 2.5 (the one positive) = min(W+, W-)
    wil = wilcoxon_test(method, baseline, what="tokens")
    assert wil.statistic == pytest.approx(2.5)
    from scipy.stats import wilcoxon

    assert wil.p_value == pytest.approx(float(wilcoxon(method, baseline, zero_method="wilcox").pvalue))
    assert wil.p_value < 0.05 and wil.verdict.startswith("the method is better on tokens")
    assert wilcoxon_test([1, 2], [1, 2]).p_value == 1.0


def test_compare_puts_intervals_and_tests_together():
    correct = [1, 0, 1, 1, 0, 1, 1, 0]
    base = [1, 1, 1, 0, 0, 1, 1, 1]
    tokens, base_tokens = [10, 12, 9, 11, 14, 10, 8, 9], [20] * 8
    c = compare("cusum", {"h": 2.0}, correct, {"generated": tokens}, base, {"generated": base_tokens}, seed=0)
    assert c.accuracy.estimate == 5 / 8 and c.costs["generated"].estimate == pytest.approx(10.375)
    assert c.accuracy_test.gains == 1 and c.accuracy_test.losses == 2
    sign, wil = c.cost_tests["generated"]
    assert sign.gains == 8 and sign.p_value == pytest.approx(2 / 256)
    d = c.to_dict()
    assert d["setting"] == {"h": 2.0} and d["accuracy_test"]["test"] == "exact McNemar"


# --------------------------------------------------------------------------- power


def test_sample_sizes_by_hand():
    # Connor (1987): n = (z_.975 sqrt(psi) + z_.8 sqrt(psi - delta^2))^2 / delta^2
    # psi = 0.2, delta = 0.1: (1.95996 * 0.44721 + 0.84162 * 0.43589)^2 / 0.01 = 154.6 -> 155
    assert mcnemar_sample_size(0.2, 0.1) == 155
    z = 1.959963984540054 + 0.8416212335729143
    assert paired_mean_sample_size(10.0, 2.0) == math.ceil((z * 5) ** 2) == 197
    with pytest.raises(BadInputError):
        mcnemar_sample_size(0.05, 0.1)  # a difference larger than the discordant share is impossible
    text = detectable_statement([1, 0, 1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 0, 0, 1, 1, 1, 1], (0.1, 0.3))
    # 2 of 10 discordant: 10 points need 155 problems; 30 points exceed the 20% discordant
    assert "20% of problems discordant" in text and "10 points: about 155 problems" in text
    assert "30 points: more discordant problems" in text
