"""Samples earned: how many samples a percentile needs, the p50's order-statistic confidence interval, and when a
case has enough of them (``--target-ci``: pure functions, no MPI).

A percentile q is printed only from n >= 100 / (100 - q) samples (p95 from 20, p99 from 100): below that it is
the largest sample or an interpolation towards it, not a tail.  The p50's 95% interval is the distribution-free
order-statistic (binomial) interval for the median: [x_(k), x_(n-k+1)] of the sorted samples, k the largest rank
with P(Binomial(n, 1/2) < k) <= 2.5%.  Its coverage is at least its level for any continuous distribution at any n;
it needs n >= 6 for 95% (CI_MIN_SAMPLES), and with fewer samples it is NaN and the tables print '-'.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

LEVEL = 95.0  # the confidence of the p50's interval, %
DEFAULT_BUDGET_S = 60.0  # --ci-budget's default: seconds of iterations one case may spend reaching its target
FOOTNOTE = ("- = fewer samples than the percentile needs: p95 from 20, p99 from 100 (with fewer it is the "
            "largest sample, not a tail)")


def needed(q: float) -> int:
    """Samples a q-th percentile needs: one sample beyond it on average (p95: 20, p99: 100; p50 and below: 1)."""
    return 1 if q <= 50 else math.ceil(round(100.0 / (100.0 - q), 9))


def percentile(x, q: float) -> float:
    """The q-th percentile of ``x``, or NaN when ``x`` is too small to hold it (``needed``)."""
    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if len(x) >= max(needed(q), 1) else math.nan


def ci_min_samples(level: float = LEVEL) -> int:
    """The fewest samples whose p50 has a ``level``% order-statistic interval: the extremes [x_(1), x_(n)] miss
    the median with probability 2 / 2^n, which must be at most 1 - level (95%: 6 samples)."""
    return math.ceil(round(math.log2(200.0 / (100.0 - level)), 9))


CI_MIN_SAMPLES = ci_min_samples()  # 6: --target-ci never stops a case below it (next_batch)


@lru_cache(maxsize=256)
def ci_rank(n: int, level: float = LEVEL) -> int:
    """k of the interval [x_(k), x_(n-k+1)] (1-based ranks): the largest k with P(Binomial(n, 1/2) < k) <=
    (1 - level) / 2; 0 when no k holds (n < ``ci_min_samples(level)``)."""
    if n < 1:
        return 0
    tail = (100.0 - level) / 200.0
    i = np.arange(n // 2 + 1)
    # log pmf by the ratio pmf(i+1)/pmf(i) = (n-i)/(i+1): no factorial overflows at any n
    logpmf = -n * math.log(2.0) + np.concatenate(([0.0], np.cumsum(np.log((n - i[:-1]) / (i[:-1] + 1.0)))))
    cdf = np.cumsum(np.exp(logpmf))  # cdf[j] = P(B <= j) = P(B < j + 1)
    return int(np.searchsorted(cdf, tail * (1 + 1e-12), side="right"))  # the tolerance keeps an exact tie in


def p50_ci(x, level: float = LEVEL) -> tuple[float, float]:
    """The p50's ``level``% confidence interval: the order statistics [x_(k), x_(n-k+1)] (``ci_rank``); NaNs when
    n is below ``ci_min_samples(level)`` (6 at 95%)."""
    x = np.asarray(x, dtype=float)
    x = np.sort(x[~np.isnan(x)])
    n = len(x)
    k = ci_rank(n, float(level))
    if k < 1:
        return math.nan, math.nan
    return float(x[k - 1]), float(x[n - k])


def ci_half_pct(x) -> float:
    """Half the width of the p50's interval, in % of the p50 (NaN when there is no interval)."""
    lo, hi = p50_ci(x)
    mid = float(np.nanmedian(x)) if len(x) else math.nan
    return 100.0 * (hi - lo) / 2 / mid if mid > 0 else math.nan


def parse_target(text, name: str = "--target-ci") -> float:
    """``--target-ci``: '2%', '2' or 2.0 -> 2.0 (% of the p50); ValueError with the one line otherwise."""
    if isinstance(text, bool):  # YAML's yes/no is no percentage
        raise ValueError(f"{name} {text!r}: expected a percentage of the p50 such as 2%")
    try:
        v = float(str(text).strip().removesuffix("%"))
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected a percentage of the p50 such as 2%") from None
    if not (math.isfinite(v) and 0 < v < 100):
        raise ValueError(f"{name} {text!r}: the p50 interval's half-width, in % of the p50: above 0% and below 100%")
    return v


def next_batch(x, target_pct: float, timed: int, spent_s: float, budget_s: float,
               ran: int | None = None) -> tuple[str | None, int]:
    """After ``timed`` timed iterations of a case that gave the samples ``x`` (``ran`` iterations in all, warm-ups
    included, in ``spent_s`` seconds): (None, k) with the k iterations that reach CI_MIN_SAMPLES while the case has
    fewer, whatever the budget; then ('target', 0) when the p50's half-width is within ``target_pct``; ('budget', 0)
    when another iteration would not fit in ``budget_s``; else (None, k): run k more iterations (enough to reach
    the target if the half-width shrinks as 1/sqrt(n), at most as many again as so far, at most what the budget
    holds)."""
    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    timed = max(int(timed), 1)
    per_sample = max(len(x), 1) / timed  # samples one iteration adds (pairs x requests)
    if len(x) < CI_MIN_SAMPLES:
        # below it the interval does not exist: stopping there would record a case with no verdict on its p50
        return None, max(1, math.ceil((CI_MIN_SAMPLES - len(x)) / per_sample))
    half = ci_half_pct(x)
    if half <= target_pct:
        return "target", 0
    per_iter = spent_s / max(int(ran or timed), 1)
    room = int((budget_s - spent_s) / per_iter) if per_iter > 0 else timed
    n = len(x)
    want = n if math.isnan(half) else math.ceil(n * (half / target_pct) ** 2) - n
    batch = min(max(1, math.ceil(want / per_sample)), timed, room)
    return ("budget", 0) if batch < 1 else (None, batch)
