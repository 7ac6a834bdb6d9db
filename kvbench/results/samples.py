"""Samples earned: how many samples a percentile needs, the p50's bootstrap confidence interval, and when a case
has enough of them (``--target-ci``: pure functions, no MPI).

A percentile q is printed only from n >= 100 / (100 - q) samples (p95 from 20, p99 from 100): below that it is
the largest sample or an interpolation towards it, not a tail.  The p50's 95% interval is a percentile
bootstrap, resampled with a fixed seed so that a report of the same rows is the same report.
"""
from __future__ import annotations

import math

import numpy as np

LEVEL = 95.0  # the confidence of the p50's interval, %
RESAMPLES = 1000  # bootstrap resamples per case
SEED = 20261203  # fixed: the same samples give the same interval on every reading
CHUNK = 2_000_000  # resampled values held at once (a case of many samples is resampled in slices)
BOOTSTRAP_MAX = 2000  # above this many samples, the distribution-free order-statistic interval (the same one, asymptotically)
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


def p50_ci(x, level: float = LEVEL, resamples: int = RESAMPLES) -> tuple[float, float]:
    """The p50's ``level``% confidence interval (percentile bootstrap, fixed seed); NaNs below 2 samples.  Past
    BOOTSTRAP_MAX samples, whose resampling would hold up the live table, the order statistics around the median
    that a binomial count puts the interval at."""
    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    n = len(x)
    if n < 2:
        return math.nan, math.nan
    if n > BOOTSTRAP_MAX:
        z = {95.0: 1.959964}.get(level) or _z(level)
        k = int(z * math.sqrt(n) / 2)
        srt = np.sort(x)
        return float(srt[max(n // 2 - k - 1, 0)]), float(srt[min(n // 2 + k, n - 1)])
    rng = np.random.default_rng(SEED)
    step = max(1, CHUNK // n)
    medians = np.concatenate([np.median(x[rng.integers(0, n, size=(min(step, resamples - i), n))], axis=1)
                              for i in range(0, resamples, step)])
    lo, hi = np.percentile(medians, [(100 - level) / 2, (100 + level) / 2])
    return float(lo), float(hi)


def _z(level: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + level / 200)


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
    included, in ``spent_s`` seconds): ('target', 0) when the p50's half-width is within ``target_pct``;
    ('budget', 0) when another iteration would not fit in ``budget_s``; else (None, k): run k more iterations
    (enough to reach the target if the half-width shrinks as 1/sqrt(n), at most as many again as so far, at most
    what the budget holds)."""
    half = ci_half_pct(x)
    if half <= target_pct:
        return "target", 0
    timed = max(int(timed), 1)
    per_iter = spent_s / max(int(ran or timed), 1)
    room = int((budget_s - spent_s) / per_iter) if per_iter > 0 else timed
    n = max(len(x), 1)
    want = n if math.isnan(half) else math.ceil(n * (half / target_pct) ** 2) - n
    per_sample = n / timed  # samples one iteration adds (pairs x requests)
    batch = min(max(1, math.ceil(want / per_sample)), timed, room)
    return ("budget", 0) if batch < 1 else (None, batch)
