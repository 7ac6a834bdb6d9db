"""Workload generators: when requests arrive and how long their prompts are (seeded, pure).

A prefill rank's workload is ``n`` requests.  Arrival times come from
``poisson:<req/s>`` (exponential gaps, per prefill rank) or
``interval:<ms>``; prompt lengths from ``N``, ``a,b,c`` (cycled),
``uniform:lo:hi`` or ``lognormal:median:sigma``.  Both draw from a generator
seeded by (seed, prefill rank) only, so every arrival rate of a sweep sees the
same prompts and the same *shape* of gaps, scaled by the rate (common random
numbers: differences between cases come from the load, not from the dice).
"""
from __future__ import annotations

import numpy as np

PROMPT_HELP = "N, a,b,c (cycled), uniform:lo:hi or lognormal:median:sigma (token counts)"


def parse_prompt(spec: str) -> tuple[str, tuple]:
    """'128' -> ('list', (128,)); 'uniform:64:512' -> ('uniform', (64, 512)); ValueError if malformed."""
    kind, _, rest = str(spec).partition(":")
    try:
        if kind == "uniform":
            lo, hi = (int(x) for x in rest.split(":"))
            if 1 <= lo <= hi:
                return "uniform", (lo, hi)
        elif kind == "lognormal":
            med, sigma = (float(x) for x in rest.split(":"))
            if med > 0 and sigma >= 0:
                return "lognormal", (med, sigma)
        elif not rest:
            vals = tuple(int(x) for x in kind.split(","))
            if vals and min(vals) >= 1:
                return "list", vals
    except ValueError:
        pass
    raise ValueError(f"workload prompt '{spec}' is not one of: {PROMPT_HELP}")


def rng_for(seed: int, stream: str, prefill_index: int) -> np.random.Generator:
    """An independent generator per (seed, what it draws, prefill rank)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, {"arrival": 1, "prompt": 2}[stream], prefill_index])


def prompts(spec: str, n: int, rng: np.random.Generator, limit: int | None = None) -> np.ndarray:
    """``n`` prompt lengths (int64, >= 1, and <= ``limit`` when given)."""
    kind, p = parse_prompt(spec)
    if kind == "list":
        out = np.resize(np.asarray(p, dtype=np.int64), n)
    elif kind == "uniform":
        out = rng.integers(p[0], p[1] + 1, size=n, dtype=np.int64)
    else:
        out = np.rint(p[0] * np.exp(p[1] * rng.standard_normal(n))).astype(np.int64)
    return np.clip(out, 1, limit if limit is not None else None)


def arrivals(kind: str, value: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds from the workload's start (float64, non-decreasing).

    poisson: exponential gaps with mean 1/value (value in req/s), the first
    request one gap after the start; interval: one request every value ms,
    the first at 0.
    """
    if kind == "poisson":
        return np.cumsum(rng.standard_exponential(n)) / value
    if kind == "interval":
        return np.arange(n, dtype=np.float64) * value / 1e3
    raise ValueError(f"arrival kind '{kind}' has no generator")
