"""The paired bootstrap: coverage of a known difference, empty input, determinism, both paths alike."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rigctl.stats import bootstrap_mean, bootstrap_ratio, paired_bootstrap


def _binary_pair(rng: np.random.Generator, n: int, p_a: float, p_b: float) -> tuple[np.ndarray, np.ndarray]:
    """Right/wrong scores of two models on n questions, correlated through a shared question difficulty."""
    difficulty = rng.random(n)
    a = (difficulty < p_a).astype(float)
    # B is right wherever A is, plus on a band of harder questions: true difference p_b - p_a.
    b = (difficulty < p_b).astype(float)
    return a, b


def test_counts_path_covers_the_true_difference_in_about_95_percent_of_seeds():
    true_diff = 0.65 - 0.55
    covered = 0
    for seed in range(200):
        a, b = _binary_pair(np.random.default_rng(10_000 + seed), 400, 0.55, 0.65)
        interval = paired_bootstrap(a, b, seed=seed)
        assert interval.method == "counts"
        covered += interval.low <= true_diff <= interval.high
    # 200 draws of a 95% interval: the count is Binomial(200, 0.95), sd ~3; percentile intervals run a bit short.
    assert 180 <= covered <= 198, covered


def test_indices_path_covers_the_true_difference_in_about_95_percent_of_seeds():
    true_diff = 0.3
    covered = 0
    for seed in range(200):
        rng = np.random.default_rng(20_000 + seed)
        base = rng.normal(0.0, 1.0, 150)
        a = base + rng.normal(0.0, 0.5, 150)
        b = base + true_diff + rng.normal(0.0, 0.5, 150)
        interval = paired_bootstrap(a, b, seed=seed, resamples=2_000)
        assert interval.method == "indices"
        covered += interval.low <= true_diff <= interval.high
    assert 180 <= covered <= 198, covered


def test_empty_input_gives_an_empty_interval_not_an_error():
    for interval in (paired_bootstrap([], []), bootstrap_mean([]), bootstrap_ratio([], [1.0, 2.0])):
        assert interval.empty and interval.n == 0
        assert math.isnan(interval.estimate) and math.isnan(interval.low) and math.isnan(interval.high)
        assert not interval.excludes(0.0)
        assert interval.to_dict()["estimate"] is None


def test_same_seed_same_interval_other_seed_other_interval():
    a, b = _binary_pair(np.random.default_rng(1), 300, 0.5, 0.6)
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    # Right/wrong means live on a grid of 1/n, so two seeds may share bounds; continuous scores do not.
    x = np.random.default_rng(2).normal(size=50)
    y = x + np.random.default_rng(5).normal(size=50)
    assert paired_bootstrap(x, y, seed=3) == paired_bootstrap(x, y, seed=3)
    assert paired_bootstrap(x, y, seed=3) != paired_bootstrap(x, y, seed=4)
    assert bootstrap_ratio([1.0, 1.1, 0.9], [2.0, 2.2, 1.9], seed=4) == bootstrap_ratio(
        [1.0, 1.1, 0.9], [2.0, 2.2, 1.9], seed=4)


def test_counts_and_indices_paths_draw_the_same_distribution():
    a, b = _binary_pair(np.random.default_rng(3), 500, 0.5, 0.58)
    counts = paired_bootstrap(a, b, seed=1, resamples=40_000, method="counts")
    indices = paired_bootstrap(a, b, seed=2, resamples=40_000, method="indices")
    assert counts.estimate == indices.estimate == pytest.approx(b.mean() - a.mean())
    # The bootstrap sd of the mean here is ~0.013; Monte-Carlo error of a 2.5% quantile at 40k draws ~0.0003.
    assert counts.low == pytest.approx(indices.low, abs=0.002)
    assert counts.high == pytest.approx(indices.high, abs=0.002)
    # And the width matches the normal approximation sd(d)/sqrt(n) * 2 * 1.96.
    d = b - a
    expected_width = 2 * 1.96 * d.std() / math.sqrt(d.size)
    assert counts.high - counts.low == pytest.approx(expected_width, rel=0.05)


def test_counts_path_refuses_non_binary_differences():
    with pytest.raises(ValueError, match="-1, 0, \\+1"):
        paired_bootstrap([0.0, 0.5], [1.0, 1.0], method="counts")


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap([1, 0, 1], [1, 0])


def test_ratio_of_means_from_repetition_samples():
    a = [100.0, 101.0, 99.0, 100.5, 99.5]
    b = [150.0, 151.0, 149.0, 150.5, 149.5]
    ratio = bootstrap_ratio(a, b)
    assert ratio.estimate == pytest.approx(1.5)
    assert ratio.low < 1.5 < ratio.high
    assert ratio.high - ratio.low < 0.03
    assert ratio.excludes(1.0)


def test_mean_of_one_run_with_interval():
    scores = [1, 0, 1, 1, 0, 1, 1, 1, 0, 1] * 20
    interval = bootstrap_mean(scores)
    assert interval.estimate == pytest.approx(0.7)
    assert interval.low < 0.7 < interval.high
    assert interval.method == "counts"


# ----------------------------------------------------------------------------------------------- exact tests

# Student's sleep data (Cushny & Peebles 1905, R's `sleep`): extra hours of sleep under two drugs, same patients.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_mcnemar_exact_on_a_published_table():
    from rigctl.stats import mcnemar_exact, paired_test

    # Fagerland, Lydersen & Laake (2013, BMC Med Res Methodol 13:91), airway hyper-responsiveness before and
    # after stem cell transplantation (Bentur et al. 2009): 1 / 1 / 7 / 12, discordant b = 1 and c = 7;
    # the exact conditional McNemar p-value they report is 0.070 (= 2 * 9 / 256).
    assert mcnemar_exact(1, 7) == pytest.approx(0.0703125)
    assert mcnemar_exact(7, 1) == pytest.approx(0.0703125)
    a = [1] * 1 + [1] * 1 + [0] * 7 + [0] * 12  # before: yes yes | yes no | no yes | no no
    b = [1] * 1 + [0] * 1 + [1] * 7 + [0] * 12
    test = paired_test(a, b)
    assert (test.method, test.b, test.c, test.n) == ("mcnemar-exact", 1, 7, 21)
    assert test.p == pytest.approx(0.0703125) and test.discordance == pytest.approx(8 / 21)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(0, 5) == pytest.approx(2 / 32)


def test_sign_flip_test_matches_full_enumeration():
    import itertools

    from rigctl.stats import paired_test

    d = np.subtract(SLEEP_2, SLEEP_1)
    observed = abs(d.mean())
    flips = [abs(np.mean(d * signs)) for signs in itertools.product((1, -1), repeat=d.size)]
    expected = np.mean([f >= observed - 1e-12 for f in flips])
    test = paired_test(SLEEP_1, SLEEP_2)
    assert test.method == "sign-flip" and test.resamples is None  # 2**10 <= resamples: every pattern
    assert test.p == pytest.approx(expected) and test.b is None
    drawn = paired_test(np.tile(SLEEP_1, 3), np.tile(SLEEP_2, 3), resamples=2_000)
    assert drawn.resamples == 2_000 and drawn.p < 0.01


def test_holm_adjustment_by_hand():
    from rigctl.stats import holm

    # Sorted 0.01, 0.03, 0.04 times 3, 2, 1 -> 0.03, 0.06, 0.04 -> kept monotone: 0.03, 0.06, 0.06.
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    first, missing = holm([0.5, math.nan])  # a comparison without a test does not count
    assert first == 0.5 and math.isnan(missing)
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([]) == []


# ----------------------------------------------------------------------------------------------- equivalence


def test_tost_on_the_sleep_data():
    from rigctl.stats import tost

    # R: t.test(extra ~ group, data = sleep, paired = TRUE) gives t = -4.0621, df = 9, mean difference -1.58,
    # so the standard error is 1.58 / 4.0621; the TOST's 90% interval is 1.58 ± t(0.95, 9) * se.
    se = 1.58 / 4.0621
    half = 1.8331129 * se
    wide = tost(SLEEP_1, SLEEP_2, 2.5)
    assert wide.low == pytest.approx(1.58 - half, abs=1e-4) and wide.high == pytest.approx(1.58 + half, abs=1e-4)
    # The binding side is the upper one: t = (1.58 - 2.5) / se = -2.3653 on 9 df, one-sided p = 0.0211.
    assert wide.p == pytest.approx(0.0211, abs=2e-4) and wide.equivalent
    narrow = tost(SLEEP_1, SLEEP_2, 2.0)  # t = -1.0798: p = 0.154, 2.0 is inside the interval
    assert narrow.p == pytest.approx(0.154, abs=1e-3) and not narrow.equivalent


def test_tost_right_wrong_without_any_discordance():
    from rigctl.stats import tost

    same = np.array([1.0, 0.0] * 200)
    assert tost(same, same, 0.02).equivalent  # 400 questions, not one flipped: within ±2 points
    assert not tost(same[:20], same[:20], 0.02).equivalent  # 20 questions cannot show that
    with pytest.raises(ValueError, match="positive"):
        tost(same, same, 0.0)


def _binary_at_gap(rng: np.random.Generator, n: int, right_to_wrong: float, wrong_to_right: float):
    a = (rng.random(n) < 0.6).astype(float)
    b = a.copy()
    kind = rng.choice(3, size=n, p=[right_to_wrong, wrong_to_right, 1 - right_to_wrong - wrong_to_right])
    a[kind == 0], b[kind == 0] = 1, 0
    a[kind == 1], b[kind == 1] = 0, 1
    return a, b


@pytest.mark.parametrize(("n", "right_to_wrong", "wrong_to_right"), [(400, 0.10, 0.05), (200, 0.01, 0.06)])
def test_tost_false_equivalence_at_the_margin_at_most_5_percent(n, right_to_wrong, wrong_to_right):
    """The true gap sits exactly on the margin (-5 or +5 points): TOST may call that equivalent in at
    most 5 % of 200 seeds. (Over 4000 seeds these two cases give 5.2 % and 4.0 %: the score tests hold
    their size; the paired t-test on the same differences gives 5.7 % and 7.9 %.)"""
    from rigctl.stats import tost

    margin = 0.05
    assert abs(wrong_to_right - right_to_wrong) == pytest.approx(margin)
    false_equivalent = sum(tost(*_binary_at_gap(np.random.default_rng(seed), n, right_to_wrong, wrong_to_right),
                                margin).equivalent for seed in range(200))
    assert false_equivalent <= 10, false_equivalent
    # And the test has power where the runs are equivalent: no true gap, same discordance.
    shown = sum(tost(*_binary_at_gap(np.random.default_rng(seed), 2000, 0.05, 0.05), margin).equivalent
                for seed in range(50))
    assert shown >= 45, shown


def test_verdicts():
    from rigctl.stats import PairedTest, tost, verdict, verdict_text

    same = np.array([1.0, 0.0] * 200)
    equivalent = tost(same, same, 0.02)
    assert verdict(PairedTest("mcnemar-exact", 1.0, 400, 0, 0), equivalent) == "equivalent"
    assert verdict(PairedTest("mcnemar-exact", 0.001, 400, 0, 12), None) == "different"
    assert verdict(PairedTest("mcnemar-exact", 0.001, 400, 0, 12), None, p=0.2) == "not shown"
    assert verdict_text("equivalent", 2) == "equivalent within ±2"
    assert verdict_text("not shown", 2) == "not shown either way"


# ----------------------------------------------------------------------------------------------- power


def test_detectable_gap():
    from rigctl.stats import detectable_gap, planned_gap

    # Connor (1987): n d^2 = (z_a sqrt(psi) + z_b sqrt(psi - d^2))^2; at the solution both sides agree.
    n, psi = 400, 0.15
    d = detectable_gap(n, discordance=psi)
    assert n * d * d == pytest.approx((1.959964 * math.sqrt(psi) + 0.841621 * math.sqrt(psi - d * d)) ** 2, rel=1e-5)
    assert 0.05 < d < 0.06
    assert detectable_gap(4 * n, discordance=psi) < d / 1.9  # four times the questions: about half the gap
    assert detectable_gap(9, discordance=0.3) == math.inf  # nine questions detect nothing
    assert math.isnan(detectable_gap(100, discordance=0.0))
    assert detectable_gap(100, sd=1.0) == pytest.approx((1.959964 + 0.841621) / 10, rel=1e-5)
    a = np.array([1, 0] * 200, dtype=float)
    b = a.copy()
    b[:60] = 1 - b[:60]  # 60 of 400 discordant
    assert planned_gap(a, b) == pytest.approx(detectable_gap(400, discordance=0.15))
