"""Workload generators and the pure helpers of kvbench/harness/load.py (no MPI, no transport).

Generators: when requests arrive and how long their prompts are (seeded).

A prefill rank's workload is ``n`` requests.  Arrival times come from
``poisson:<req/s>`` (exponential gaps, per prefill rank) or
``interval:<ms>``; prompt lengths from ``N``, ``a,b,c`` (cycled),
``uniform:lo:hi`` or ``lognormal:median:sigma``.  Both draw from a generator
seeded by (seed, prefill rank) only, so every arrival rate of a sweep sees the
same prompts and the same *shape* of gaps, scaled by the rate (common random
numbers: differences between cases come from the load, not from the dice).
"""
from __future__ import annotations

import math

import numpy as np

from kvbench.model.inputs import MAX_MS, MAX_SECONDS

PROMPT_HELP = "N, a,b,c (cycled), uniform:lo:hi or lognormal:median:sigma (token counts)"
# prompt lengths are drawn into int64 arrays: a longer one would overflow there, mid-run
MAX_PROMPT = 2**31 - 1


ARRIVAL_HELP = ("none, poisson:<requests per second>, interval:<ms between requests> or trace:<speed> (a trace's "
                "timestamps divided by speed; with workload.trace)")


def parse_arrival(spec: str) -> tuple[str, float]:
    """'poisson:20' -> ('poisson', 20.0); 'interval:50' -> ('interval', 50.0); 'trace:50' -> ('trace', 50.0);
    'none' -> ('none', 0)."""
    kind, _, val = spec.partition(":")
    if kind == "none" and not val:
        return "none", 0.0
    try:
        x = float(val)
    except ValueError:
        x = -1.0
    if kind not in ("poisson", "interval", "trace") or not x > 0 or not math.isfinite(x):  # nan compares false: refused
        raise ValueError(f"arrival '{spec}' is not one of: {ARRIVAL_HELP}")
    # mean gap 1/x s (poisson) or x ms (interval): beyond the longest wait a run takes is a typo, not a workload
    if (kind == "poisson" and x * MAX_SECONDS < 1) or (kind == "interval" and x > MAX_MS):
        raise ValueError(f"arrival '{spec}': requests farther apart than {MAX_SECONDS / 86400:.0f} days")
    return kind, x



def parse_prompt(spec: str) -> tuple[str, tuple]:
    """'128' -> ('list', (128,)); 'uniform:64:512' -> ('uniform', (64, 512)); ValueError if malformed."""
    kind, _, rest = str(spec).partition(":")
    try:
        if kind == "uniform":
            lo, hi = (int(x) for x in rest.split(":"))
            if 1 <= lo <= hi <= MAX_PROMPT:
                return "uniform", (lo, hi)
        elif kind == "lognormal":
            med, sigma = (float(x) for x in rest.split(":"))
            if 0 < med <= MAX_PROMPT and 0 <= sigma <= 10:  # nan fails both; a wider sigma draws lengths past int64
                return "lognormal", (med, sigma)
        elif not rest:
            vals = tuple(int(x) for x in kind.split(","))
            if vals and min(vals) >= 1 and max(vals) <= MAX_PROMPT:
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


def occupancy_stats(timelines: dict) -> dict:
    """Blocks in use per layer of one decode pool: peak (max over decode ranks) and time-weighted mean
    (averaged over decode ranks), from (time, used) steps."""
    peaks, means = [0], []
    for tl in timelines.values():
        a = np.asarray(tl, dtype=float).reshape(-1, 2)
        dt = np.diff(a[:, 0])
        if len(dt) and dt.sum() > 0:
            peaks.append(int(a[:, 1].max()))
            means.append(float((a[:-1, 1] * dt).sum() / dt.sum()))
    return {"peak": max(peaks), "mean": float(np.mean(means)) if means else 0.0}


# ----- per-case summary (rank 0; pure, from rows) ----------------------------------------------
SUMMARY_HEADER = ("# load: queue = wait for decode blocks; exposed = prefill end -> KV landed at decode (ms, admitted "
                  "requests); pool = decode blocks per layer in use (peak, time-weighted mean)")


def summarize(rows: list[dict], infos: list[dict]) -> dict:
    """A case's counts, queue and exposed tails (s, admitted requests), occupancy and violations."""
    dec = [r for r in rows if r["role"] == "decode"]
    ok = [r for r in dec if r["status"] == "ok"]
    out = {"admitted": len(ok), "dropped": len(dec) - len(ok),
           "violations": sum(i.get("violations") or 0 for i in infos)}
    for key in ("queue", "exposed"):
        vals = [r[key + "_s"] for r in ok]
        for q in (50, 95, 99):
            out[f"{key}_p{q}"] = float(np.percentile(vals, q)) if vals else float("nan")
    return out | occupancy_stats({i["rank"]: i["occupancy"] for i in infos})


def summary_line(case_no: int, case: dict, cap: int, st: dict, checked: bool) -> str:
    """The '# load:' line rank 0 prints after a case's table row."""
    def ms(key):
        return "/".join(f"{st[f'{key}_p{q}'] * 1e3:.2f}" for q in (50, 95, 99))

    return (f"# load: case {case_no} {case['transport']} {case['op']} {case['overlap']} {case['arrival']}  "
            f"admitted {st['admitted']} dropped {st['dropped']}  queue p50/p95/p99 {ms('queue')} ms  exposed "
            f"p50/p95/p99 {ms('exposed')} ms  pool cap {cap} peak {st['peak']} mean {st['mean']:.1f}  "
            f"violations {st['violations'] if checked else '-'}" + most_dropped(st))


def most_dropped(st: dict) -> str:
    """The load line's warning when most requests never moved: its numbers describe the few that did."""
    n = st["admitted"] + st["dropped"]
    if st["dropped"] * 2 <= n:
        return ""
    return (f"  MOST DROPPED: {st['dropped']} of {n} requests found no decode blocks within the allocation timeout, "
            "so the tails above are of the rest (a larger --decode-pool-tokens or --alloc-timeout, or a lower rate)")
