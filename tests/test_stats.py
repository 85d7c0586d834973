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
