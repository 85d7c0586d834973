"""Paired bootstrap intervals (numpy, vectorised, seeded), exact paired tests, equivalence and power.

Every comparison of two runs is question by question: the statistic is the mean of the paired
differences ``b - a`` and its 95% interval is the percentile interval of that mean over resamples
of the questions. Two paths draw from the same bootstrap distribution:

* right/wrong scores: each paired difference is -1, 0 or +1, so a resample of n questions is fully
  described by how many of each it holds; those counts are drawn at once with a multinomial
  (``resamples x 3`` numbers instead of ``resamples x n``);
* any other scores: question indices are resampled in chunks that bound memory.

Values that come in clusters (the tokens of a text's chunks, scored in one context each, so not independent
of their neighbours) are resampled as whole clusters, and any statistic of the pooled values (a mean, a
percentile; of several paired quantities at once) is taken over each resample (:func:`bootstrap_clusters`).

Bench speed ratios resample each side's per-repetition samples independently (repetitions of two
artifacts are not paired) and take the ratio of the means.

Beside the interval, each paired comparison gets a test of "no difference" (scipy does the sums):

* right/wrong scores: McNemar's exact test, i.e. the discordant questions (``b``: A right and B wrong,
  ``c``: A wrong and B right) as a binomial test of ``c`` out of ``b + c`` at one half;
* graded scores: a sign-flip permutation test of the mean difference (exact below 2**n <= resamples);
* across the comparisons of one campaign: Holm's step-down adjustment of those p-values.

Equivalence is Schuirmann's two one-sided tests (TOST) on the paired differences: B - A is shown to
lie within ``±margin`` when both one-sided tests reject at ``alpha`` (the ``1 - 2 alpha`` interval lies
inside the band): score tests for right/wrong scores, t-tests for graded ones. :func:`detectable_gap`
is the other side of the same arithmetic: the smallest gap a two-sided test at 5 % finds with 80 %
power, given the questions and the observed discordance.

Every function is deterministic per seed and safe on empty input (an :class:`Interval` with
``n == 0`` and NaN bounds, a test with p = NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

# scipy is imported by the functions that use it: it takes a second, and every `rigctl` command imports this
# module for its defaults.

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95
#: Elements per chunk of the index path (resamples x questions): ~32 MB of int64 indices at a time.
_CHUNK_ELEMENTS = 4_000_000

Method = Literal["counts", "indices", "clusters", "none"]


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


def bootstrap_clusters(
    values: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``statistic`` of values in equal clusters with its percentile interval over resamples of whole
    clusters. ``values``: ``(clusters, per_cluster)``, or ``(clusters, per_cluster, k)`` for k quantities
    measured on the same items (paired: one resample draws the same clusters for all). ``statistic`` maps
    pooled draws ``(r, clusters * per_cluster[, k])`` to ``(r,)`` (e.g. ``lambda d: d.mean(axis=1)``,
    ``lambda d: np.percentile(d, 99, axis=1)``); the estimate is it over the values as they are. ``n`` counts
    the clusters. Draws are made in chunks that bound memory."""
    _check(resamples, level)
    x = np.asarray(values, dtype=np.float64)
    if x.ndim not in (2, 3):
        raise ValueError(f"clustered values need shape (clusters, per_cluster[, k]), got {x.shape}")
    clusters = x.shape[0]
    if clusters == 0 or x.shape[1] == 0:
        return _empty(resamples, level)
    pooled = x.reshape(1, clusters * x.shape[1], *x.shape[2:])
    estimate = float(statistic(pooled)[0])
    rng = np.random.default_rng(seed)
    per_chunk = max(1, _CHUNK_ELEMENTS // x.size)
    draws = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, per_chunk):
        stop = min(resamples, start + per_chunk)
        idx = rng.integers(0, clusters, size=(stop - start, clusters))
        draws[start:stop] = statistic(x[idx].reshape(stop - start, clusters * x.shape[1], *x.shape[2:]))
    low, high = _bounds(draws, level)
    return Interval(estimate, low, high, clusters, resamples, level, "clusters")


# ----------------------------------------------------------------------------------------------- tests

TestMethod = Literal["mcnemar-exact", "sign-flip", "none"]
DEFAULT_ALPHA = 0.05
DEFAULT_POWER = 0.80


@dataclass(frozen=True)
class PairedTest:
    """A test of "B and A score the same" on paired questions. ``b`` and ``c`` count the discordant
    questions for right/wrong scores (A right and B wrong, A wrong and B right); None for graded scores."""

    method: TestMethod
    p: float
    n: int
    b: int | None = None
    c: int | None = None
    resamples: int | None = None  # sign-flip permutations drawn; None when every one was enumerated

    @property
    def discordance(self) -> float:
        """Share of questions on which the two runs disagree (right/wrong scores)."""
        return (self.b + self.c) / self.n if self.n and self.b is not None and self.c is not None else math.nan

    def mirrored(self) -> PairedTest:
        """The same test read as A - B (b and c swap)."""
        return PairedTest(self.method, self.p, self.n, self.c, self.b, self.resamples)

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {"method": self.method, "p": None if math.isnan(self.p) else self.p, "n": self.n, "b": self.b,
                "c": self.c, "resamples": self.resamples}


def _pair(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape or xa.ndim != 1:
        raise ValueError(f"paired scores need two 1-d arrays of one length, got {xa.shape} and {xb.shape}")
    return xa, xb


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (1.0 when there are none)."""
    from scipy import stats as sps

    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must not be negative, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return float(sps.binomtest(int(c), int(b + c), 0.5, alternative="two-sided").pvalue)


def sign_flip_p(diffs: Sequence[float] | np.ndarray, *, resamples: int = DEFAULT_RESAMPLES,
                seed: int = DEFAULT_SEED) -> tuple[float, int | None]:
    """Two-sided sign-flip permutation p-value of the mean paired difference, and the permutations drawn
    (None when all ``2**n`` sign patterns were enumerated)."""
    from scipy import stats as sps

    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return math.nan, None
    if not np.any(d):
        return 1.0, None
    exact = d.size < 63 and 2 ** d.size <= resamples
    result = sps.permutation_test((d,), lambda x, axis: np.mean(x, axis=axis), vectorized=True,
                                  permutation_type="samples", alternative="two-sided", n_resamples=resamples,
                                  rng=np.random.default_rng(seed))
    return float(result.pvalue), None if exact else resamples


def paired_test(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *,
                resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> PairedTest:
    """McNemar's exact test for right/wrong scores, a sign-flip permutation test for any others."""
    xa, xb = _pair(a, b)
    if xa.size == 0:
        return PairedTest("none", math.nan, 0)
    if is_binary(xa) and is_binary(xb):
        right_to_wrong = int(np.count_nonzero((xa == 1) & (xb == 0)))
        wrong_to_right = int(np.count_nonzero((xa == 0) & (xb == 1)))
        return PairedTest("mcnemar-exact", mcnemar_exact(right_to_wrong, wrong_to_right), int(xa.size),
                          right_to_wrong, wrong_to_right)
    p, drawn = sign_flip_p(xb - xa, resamples=resamples, seed=seed)
    return PairedTest("sign-flip", p, int(xa.size), resamples=drawn)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order; NaN entries stay NaN and do not count."""
    indexed = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(indexed)
    out = [math.nan] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


# ----------------------------------------------------------------------------------------------- equivalence


@dataclass(frozen=True)
class Equivalence:
    """TOST of ``|mean(b - a)| < margin``: ``p`` is the larger one-sided p-value; ``low``/``high`` the
    ``1 - 2 alpha`` interval it corresponds to. ``equivalent`` when ``p < alpha``."""

    margin: float
    alpha: float
    p: float
    low: float
    high: float
    n: int

    @property
    def equivalent(self) -> bool:
        return not math.isnan(self.p) and self.p < self.alpha

    def mirrored(self) -> Equivalence:
        return Equivalence(self.margin, self.alpha, self.p, -self.high, -self.low, self.n)

    def to_dict(self) -> dict[str, float | int | bool | None]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"margin": self.margin, "alpha": self.alpha, "p": num(self.p), "low": num(self.low),
                "high": num(self.high), "n": self.n, "equivalent": self.equivalent}


def _restricted_score(b: int, c: int, n: int, delta: float) -> float:
    """Tango's score statistic for ``p01 - p10 = delta`` on paired right/wrong scores (``b`` questions A
    right and B wrong, ``c`` the other way round): the observed gap over its standard error under the
    constrained maximum-likelihood cell probabilities, so the variance comes from the hypothesis, not
    from the sample (the paired t-test's sample variance shrinks with the gap and makes it liberal)."""
    rest = n - b - c
    # d/dx of b log x + c log(x + delta) + rest log(1 - 2x - delta) = 0, x = p10, cleared of denominators.
    quad_b = (b + c) * (1.0 - delta) - 2.0 * delta * (b + rest)
    quad_c = b * delta * (1.0 - delta)
    root = (quad_b + math.sqrt(quad_b * quad_b + 8.0 * n * quad_c)) / (4.0 * n)
    p10 = min(max(root, max(0.0, -delta)), (1.0 - delta) / 2.0)
    variance = (2.0 * p10 + delta) - delta * delta
    gap = (c - b) / n
    if variance <= 0:
        return math.copysign(math.inf, gap - delta) if gap != delta else 0.0
    return (gap - delta) / math.sqrt(variance / n)


def tost(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, margin: float, *,
         alpha: float = DEFAULT_ALPHA) -> Equivalence:
    """Two one-sided tests of ``-margin < mean(b - a) < margin`` (Schuirmann).

    Right/wrong scores: each side is Tango's score test for paired proportions (normal, variance under
    the hypothesis; it also decides when no question is discordant), and the interval is the score
    test inverted. Graded scores: paired t-tests, the interval the t interval."""
    from scipy import optimize
    from scipy import stats as sps

    if not margin > 0:
        raise ValueError(f"the equivalence margin must be positive, got {margin}")
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be between 0 and 0.5, got {alpha}")
    xa, xb = _pair(a, b)
    n = int(xa.size)
    if n == 0:
        return Equivalence(margin, alpha, math.nan, math.nan, math.nan, 0)
    d = xb - xa
    if is_binary(xa) and is_binary(xb):
        b_count = int(np.count_nonzero(d == -1))
        c_count = int(np.count_nonzero(d == 1))
        upper = float(sps.norm.cdf(_restricted_score(b_count, c_count, n, min(margin, 1.0))))
        lower = float(sps.norm.sf(_restricted_score(b_count, c_count, n, -min(margin, 1.0))))
        z = float(sps.norm.ppf(1.0 - alpha))
        eps = 1e-9

        def bound(target: float) -> float:
            f = lambda delta: _restricted_score(b_count, c_count, n, delta) - target  # noqa: E731
            lo, hi = -1.0 + eps, 1.0 - eps
            if f(lo) < 0:
                return lo
            if f(hi) > 0:
                return hi
            return float(optimize.brentq(f, lo, hi, xtol=1e-10))

        return Equivalence(margin, alpha, max(lower, upper), bound(z), bound(-z), n)
    if n < 2 or not np.any(d - d[0]):
        return Equivalence(margin, alpha, math.nan, float(d[0]), float(d[0]), n)  # no spread to test against
    lower_t = sps.ttest_1samp(d, -margin, alternative="greater")
    upper_t = sps.ttest_1samp(d, margin, alternative="less")
    half = float(sps.t.ppf(1.0 - alpha, n - 1) * d.std(ddof=1) / math.sqrt(n))
    mean = float(d.mean())
    return Equivalence(margin, alpha, float(max(lower_t.pvalue, upper_t.pvalue)), mean - half, mean + half, n)


Verdict = Literal["equivalent", "different", "not shown"]


def verdict(test: PairedTest, equivalence: Equivalence | None, *, alpha: float = DEFAULT_ALPHA,
            p: float | None = None) -> Verdict:
    """What a reader may conclude: equivalent within the margin (TOST), different (the paired test
    rejects at ``alpha``; ``p`` overrides its p-value, e.g. Holm-adjusted), or neither shown."""
    if equivalence is not None and equivalence.equivalent:
        return "equivalent"
    p = test.p if p is None else p
    if not math.isnan(p) and p < alpha:
        return "different"
    return "not shown"


def verdict_text(kind: Verdict, margin_points: float | None) -> str:
    if kind == "equivalent":
        return f"equivalent within ±{margin_points:g}"
    return "different" if kind == "different" else "not shown either way"


# ----------------------------------------------------------------------------------------------- power


def detectable_gap(n: int, *, discordance: float | None = None, sd: float | None = None,
                   alpha: float = DEFAULT_ALPHA, power: float = DEFAULT_POWER) -> float:
    """The smallest |B - A| (score units) a two-sided test at ``alpha`` detects with ``power`` on ``n``
    paired questions.

    Right/wrong scores (``discordance``: share of questions on which the runs disagree, psi): Connor's
    normal approximation to McNemar's test, ``n d^2 = (z_a sqrt(psi) + z_b sqrt(psi - d^2))^2``, solved
    for d; infinity when no gap up to psi itself is detectable. Graded scores (``sd`` of the paired
    differences): ``(z_a + z_b) sd / sqrt(n)``. NaN without a spread to work from."""
    from scipy import optimize
    from scipy import stats as sps

    if n < 1:
        return math.nan
    z_a = float(sps.norm.ppf(1.0 - alpha / 2.0))
    z_b = float(sps.norm.ppf(power))
    if discordance is not None:
        psi = float(discordance)
        if not psi > 0:
            return math.nan

        def shortfall(d: float) -> float:
            return n * d * d - (z_a * math.sqrt(psi) + z_b * math.sqrt(max(0.0, psi - d * d))) ** 2

        if shortfall(psi) < 0:
            return math.inf
        return float(optimize.brentq(shortfall, 1e-12, psi, xtol=1e-10))
    if sd is not None and sd > 0:
        return (z_a + z_b) * float(sd) / math.sqrt(n)
    return math.nan


def planned_gap(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, n: int | None = None, *,
                alpha: float = DEFAULT_ALPHA, power: float = DEFAULT_POWER) -> float:
    """:func:`detectable_gap` for ``n`` questions (default: as many as given) with the discordance (or
    the spread of differences) observed between ``a`` and ``b``."""
    xa, xb = _pair(a, b)
    n = int(xa.size) if n is None else n
    if xa.size == 0:
        return math.nan
    if is_binary(xa) and is_binary(xb):
        return detectable_gap(n, discordance=float(np.mean(xa != xb)), alpha=alpha, power=power)
    d = xb - xa
    return detectable_gap(n, sd=float(d.std(ddof=1)) if d.size > 1 else None, alpha=alpha, power=power)
