"""Paired bootstrap intervals (numpy, vectorised, seeded).

Every comparison of two runs is question by question: the statistic is the mean of the paired
differences ``b - a`` and its 95% interval is the percentile interval of that mean over resamples
of the questions. Two paths draw from the same bootstrap distribution:

* right/wrong scores: each paired difference is -1, 0 or +1, so a resample of n questions is fully
  described by how many of each it holds; those counts are drawn at once with a multinomial
  (``resamples x 3`` numbers instead of ``resamples x n``);
* any other scores: question indices are resampled in chunks that bound memory.

Bench speed ratios resample each side's per-repetition samples independently (repetitions of two
artifacts are not paired) and take the ratio of the means.

Every function is deterministic per seed and safe on empty input (an :class:`Interval` with
``n == 0`` and NaN bounds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95
#: Elements per chunk of the index path (resamples x questions): ~32 MB of int64 indices at a time.
_CHUNK_ELEMENTS = 4_000_000

Method = Literal["counts", "indices", "none"]


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap percentile interval. ``n`` counts the paired questions,
    the values, or (for a ratio) the samples on the smaller side."""

    estimate: float
    low: float
    high: float
    n: int
    resamples: int
    level: float
    method: Method

    @property
    def empty(self) -> bool:
        return self.n == 0

    def excludes(self, value: float) -> bool:
        """True when the interval lies wholly on one side of ``value`` (e.g. 0 for "a real difference")."""
        return not self.empty and (self.low > value or self.high < value)

    def to_dict(self) -> dict[str, float | int | str | None]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"estimate": num(self.estimate), "low": num(self.low), "high": num(self.high), "n": self.n,
                "resamples": self.resamples, "level": self.level, "method": self.method}


def _empty(resamples: int, level: float) -> Interval:
    return Interval(math.nan, math.nan, math.nan, 0, resamples, level, "none")


def _bounds(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(draws, [tail, 100.0 - tail])
    return float(low), float(high)


def _check(resamples: int, level: float) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1, got {level}")


def is_binary(values: np.ndarray) -> bool:
    """All values are exactly 0 or 1 (right/wrong scores)."""
    return bool(np.all((values == 0) | (values == 1)))


def bootstrap_means_counts(diffs: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means of differences that take only -1, 0 and +1, drawn as multinomial counts."""
    n = diffs.size
    counts = np.array([np.count_nonzero(diffs == -1), np.count_nonzero(diffs == 0), np.count_nonzero(diffs == 1)])
    if counts.sum() != n:
        raise ValueError("the counts path needs differences in {-1, 0, +1}")
    draws = rng.multinomial(n, counts / n, size=resamples)
    return (draws[:, 2] - draws[:, 0]) / n


def bootstrap_means_indices(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means of any values by resampling indices, in chunks of bounded memory."""
    n = values.size
    per_chunk = max(1, _CHUNK_ELEMENTS // n)
    out = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, per_chunk):
        stop = min(resamples, start + per_chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = values[idx].mean(axis=1)
    return out


def paired_bootstrap(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
    method: Method | None = None,
) -> Interval:
    """Mean of ``b - a`` over paired questions with its percentile interval.

    ``method`` picks the path: ``"counts"`` (right/wrong scores only), ``"indices"`` (any scores);
    by default the counts path whenever both sides are 0/1.
    """
    _check(resamples, level)
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape or xa.ndim != 1:
        raise ValueError(f"paired scores need two 1-d arrays of one length, got {xa.shape} and {xb.shape}")
    if xa.size == 0:
        return _empty(resamples, level)
    diffs = xb - xa
    if method is None:
        method = "counts" if is_binary(xa) and is_binary(xb) else "indices"
    rng = np.random.default_rng(seed)
    if method == "counts":
        draws = bootstrap_means_counts(diffs, resamples, rng)
    elif method == "indices":
        draws = bootstrap_means_indices(diffs, resamples, rng)
    else:
        raise ValueError(f"unknown bootstrap method {method!r}")
    low, high = _bounds(draws, level)
    return Interval(float(diffs.mean()), low, high, int(diffs.size), resamples, level, method)


def bootstrap_mean(
    values: Sequence[float] | np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """Mean of one run's scores with its percentile interval (binomial draws for right/wrong scores)."""
    _check(resamples, level)
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return _empty(resamples, level)
    rng = np.random.default_rng(seed)
    if is_binary(x):
        draws = rng.binomial(x.size, x.mean(), size=resamples) / x.size
        method: Method = "counts"
    else:
        draws = bootstrap_means_indices(x, resamples, rng)
        method = "indices"
    low, high = _bounds(draws, level)
    return Interval(float(x.mean()), low, high, int(x.size), resamples, level, method)


def bootstrap_ratio(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``mean(b) / mean(a)`` (e.g. tokens/s of B over A from llama-bench's per-repetition samples),
    each side resampled on its own; empty when either side is empty or A's mean is 0."""
    _check(resamples, level)
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    if xa.size == 0 or xb.size == 0 or xa.mean() == 0:
        return _empty(resamples, level)
    rng = np.random.default_rng(seed)
    means_a = bootstrap_means_indices(xa, resamples, rng)
    means_b = bootstrap_means_indices(xb, resamples, rng)
    valid = means_a != 0
    low, high = _bounds(means_b[valid] / means_a[valid], level)
    return Interval(float(xb.mean() / xa.mean()), low, high, int(min(xa.size, xb.size)), resamples, level,
                    "indices")


def bootstrap_rate_ratio(
    a: tuple[Sequence[float], Sequence[float]],
    b: tuple[Sequence[float], Sequence[float]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``(sum(num_b) / sum(den_b)) / (sum(num_a) / sum(den_a))`` for sides given as (numerators,
    denominators) paired by item (e.g. tokens and seconds per request), each side's items resampled
    on their own; empty when a side is empty or has a zero rate."""
    _check(resamples, level)
    (na, da), (nb, db) = ((np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)) for x, y in (a, b))
    if na.size != da.size or nb.size != db.size:
        raise ValueError("each side needs one denominator per numerator")
    if na.size == 0 or nb.size == 0 or na.sum() == 0 or da.sum() == 0 or db.sum() == 0:
        return _empty(resamples, level)
    rng = np.random.default_rng(seed)

    def rates(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        per_chunk = max(1, _CHUNK_ELEMENTS // num.size)
        out = np.empty(resamples, dtype=np.float64)
        for start in range(0, resamples, per_chunk):
            stop = min(resamples, start + per_chunk)
            idx = rng.integers(0, num.size, size=(stop - start, num.size))
            out[start:stop] = num[idx].sum(axis=1) / den[idx].sum(axis=1)
        return out

    rate_a, rate_b = rates(na, da), rates(nb, db)
    valid = rate_a != 0
    low, high = _bounds(rate_b[valid] / rate_a[valid], level)
    estimate = (nb.sum() / db.sum()) / (na.sum() / da.sum())
    return Interval(float(estimate), low, high, int(min(na.size, nb.size)), resamples, level, "indices")
