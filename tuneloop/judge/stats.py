"""Paired comparisons of per-item eval scores: bootstrap intervals and the items they need.

Every figure the gate compares is a weighted mean over a suite's items,
``sum(weight * value) / sum(weight)``: a plain mean has weight 1 on every item; a
rate over a subset (the hallucination rate, over the unanswerable items only) has
weight 0 outside it. Two models scored on the same items are compared *paired*: a
bootstrap resample draws items, not scores, so an item that both models get right
(or both wrong) moves neither side, and only the items where they differ make the
interval wide.

The resampling is vectorised: each replicate is a row of item counts, and every
figure of every model on every replicate comes out of one matrix product, in chunks
of about two million cells. A seeded generator makes the same scores give the same
intervals.

Why a bootstrap rather than an exact McNemar test: the gate's rules are thresholds
on the size of a difference (``min_gain``, ``max_regression``), which needs an
interval for the difference, not a p-value for "no difference"; and the same method
then serves rates over a subset and non-binary scores alike.

The end of the module holds the release analysis' tests, one interval of live traffic
at a time: two proportions, an exact binomial, an exact McNemar, a Mann-Whitney U, a p99.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Power of the "how many more items" estimate: the chance that an interval on that
# many items clears the threshold, if the observed difference is the true one.
POWER = 0.8
CHUNK_CELLS = 2_000_000  # resample cells per chunk: ~16 MB of counts


@dataclass(frozen=True)
class Interval:
    """A paired difference (``model`` better than ``reference`` by ``diff``) and its interval."""

    diff: float
    low: float
    high: float
    se: float  # standard deviation of the bootstrap differences


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> float | None:
    """``sum(w * v) / sum(w)``; None when no item carries weight."""
    total = float(weights.sum())
    return float((weights * values).sum() / total) if total > 0 else None


def bootstrap_means(
    values: np.ndarray, weights: np.ndarray, samples: int, seed: int | list[int]
) -> np.ndarray:
    """Weighted means of ``samples`` item resamples, for every column at once.

    ``values`` and ``weights`` are ``(items, columns)``; the result is
    ``(samples, columns)``, NaN where a resample holds no weight for a column (a
    small slice drawn empty). Every column sees the same resampled items, which is
    what makes differences between columns paired.
    """
    items, columns = values.shape
    if items == 0:
        return np.full((samples, columns), np.nan)
    rng = np.random.default_rng(seed)
    # float32 products: counts are small integers, and a sum of 10k scores keeps ~7 digits,
    # more than any threshold needs; BLAS does them about twice as fast as float64.
    both = np.concatenate([weights * values, weights], axis=1).astype(np.float32)
    sums = np.empty((samples, 2 * columns))
    rows = max(1, CHUNK_CELLS // items)
    for start in range(0, samples, rows):
        count = min(rows, samples - start)
        drawn = rng.integers(0, items, size=(count, items), dtype=np.int64)
        # Row r's draws land in bins r * items ... r * items + items - 1: one bincount does all.
        drawn += (np.arange(count, dtype=np.int64) * items)[:, None]
        counts = np.bincount(drawn.ravel(), minlength=count * items).astype(np.float32)
        sums[start : start + count] = counts.reshape(count, items) @ both
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[:, :columns] / sums[:, columns:]


def interval(estimate: float, replicates: np.ndarray, confidence: float) -> Interval | None:
    """The percentile interval of paired ``replicates`` around the observed ``estimate``."""
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0:
        return None
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    se = float(finite.std(ddof=1)) if finite.size > 1 else 0.0
    return Interval(diff=estimate, low=float(low), high=float(high), se=se)


def items_to_settle(found: Interval, threshold: float, items: int, confidence: float) -> int | None:
    """About how many items in all would put the interval clear of ``threshold``.

    From the observed paired spread (``se`` on ``items`` items, shrinking as one
    over the square root of the count) and the observed difference, with power
    ``POWER``. None when no number would: the difference sits on the threshold, or
    the items do not vary at all.
    """
    gap = abs(found.diff - threshold)
    if gap < 1e-12 or found.se <= 0 or items <= 0:
        return None
    z = NormalDist().inv_cdf((1 + confidence) / 2) + NormalDist().inv_cdf(POWER)
    return max(items + 1, math.ceil(items * (z * found.se / gap) ** 2))


# --- the release analysis' tests -----------------------------------------------------------------
# One interval of canary traffic, the challenger against the champion (tuneloop/release/checks.py).
# scipy is imported where it is used: importing scipy.stats takes seconds, and the gate, which
# imports this module, never needs it.


def two_proportion_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value of the pooled two-proportion z-test, H1: x1/n1 > x2/n2.

    Written out (scipy has no two-proportion test and statsmodels is not a
    dependency); it is the textbook statistic. When neither arm has an event
    there is no difference to find: p = 1.
    """
    from scipy import stats as scipy_stats

    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    return float(scipy_stats.norm.sf((x1 / n1 - x2 / n2) / se))


def mcnemar_p(worse: int, better: int) -> float:
    """One-sided exact McNemar p-value: of the pairs where the arms differ, the challenger
    is the worse one in ``worse`` and the better one in ``better``; H1: it is worse more often.
    """
    from scipy.stats import binomtest

    if worse + better == 0:
        return 1.0
    return float(binomtest(worse, worse + better, 0.5, alternative="greater").pvalue)


def binomial_p(events: int, trials: int, rate: float) -> float:
    """One-sided exact binomial p-value, H1: the rate behind ``events`` in ``trials`` > ``rate``."""
    from scipy.stats import binomtest

    return float(binomtest(events, trials, rate, alternative="greater").pvalue)


def mann_whitney_p(slower: Sequence[float], faster: Sequence[float]) -> float:
    """One-sided Mann-Whitney U p-value, H1: ``slower``'s values tend to be larger (as Kayenta's
    judge tests latency)."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(slower, faster, alternative="greater").pvalue)


def p99(values: Sequence[float]) -> float:
    """The nearest-rank 99th percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(0.99 * len(ordered))) - 1]
