"""Value types that both the run's suite axes (suite.py) and `kvbench plan`'s inputs (report/plan.py) take.

One place, so a model, block size, prompt length or dtype is refused in the same words by every command.
Each is a pydantic type whose check raises ValueError with the line the user sees.  Only model/shapes.py is
imported: report/plan.py reads result files and must not pull in the harness or a transport.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator

from kvbench.model import shapes as M
from kvbench.model.limits import MAX_BYTES, MAX_CELL, clip, whole

# the longest wait a run takes (a timeout, a hold, a gap between requests): a week.  Longer is a typo, and
# seconds near float's range overflow the clocks and waits the harness hands them to, failing mid-run
MAX_SECONDS = 7 * 24 * 3600.0
MAX_MS = MAX_SECONDS * 1e3
# a seed is a 32-bit unsigned integer, as the generators' streams are mixed from it (workload.rng_for)
MAX_SEED = 2**32 - 1


def unique(v: list) -> list:
    """A list in which no value is given twice (a sweep or a plan would repeat its rows)."""
    seen = set()
    for x in v:
        if x in seen:
            raise ValueError(f"{x!r} is listed twice")
        seen.add(x)
    return v


def check_model(name: str) -> str:
    """A preset name or a model .yaml file that loads."""
    M.get_model(name)
    return name


def check_tokens(n: int) -> int:
    """A prompt length in tokens: positive."""
    if n <= 0:
        raise ValueError(f"{n} is not a positive prompt length")
    return n


def check_positive(n: int) -> int:
    """A count (ranks per TP or PP group, requests in flight): positive."""
    if n <= 0:
        raise ValueError(f"{n} is not a positive integer")
    return n


def check_prefix_hit(n: int) -> int:
    """Prompt tokens already cached at decode: zero or more."""
    if n < 0:
        raise ValueError(f"{n} is negative (prompt tokens already cached at decode: 0 or more)")
    return n


ModelName = Annotated[str, AfterValidator(check_model)]
BlockSize = Annotated[int, AfterValidator(M.check_block_size)]
Tokens = Annotated[int, AfterValidator(check_tokens)]
Positive = Annotated[int, AfterValidator(check_positive)]
PrefixHit = Annotated[int, AfterValidator(check_prefix_hit)]
# the dtypes model.DTYPES sizes per element; nvfp4's bytes depend on its scale planes and fp8-ds-mla's on its
# packed MLA row (formats.py), so only a run, which builds its formats, takes them
KVDType = Literal[tuple(M.DTYPES)]
DType = Literal[KVDType, "nvfp4", "fp8-ds-mla"]


UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30,
         "kb": 10**3, "mb": 10**6, "gb": 10**9}


def sizes(v) -> list[int]:
    """Byte sizes as users write them: "0.25,1,4GiB" (a unit after the last applies to those without one), a
    list of such strings, or of integers (bytes); each a positive whole number of bytes, none given twice."""
    if isinstance(v, list) and not v:  # none: no sweep
        return []
    seq = v.split(",") if isinstance(v, str) else v if isinstance(v, (list, tuple)) else [v]  # one size as a scalar
    if len(seq) > 64:
        raise ValueError(f"{len(seq):,} sizes: give at most 64")
    items = [str(x).strip() for x in seq]
    if not items or "" in items:
        raise ValueError(f"{clip(v)}: give sizes as a comma-separated list, e.g. 0.25,1,4GiB")
    parts = [re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)", x) if len(x) <= MAX_CELL else None
             for x in items]
    for x, p in zip(items, parts):
        if p is None or p.group(2).lower() not in UNITS:
            raise ValueError(f"{clip(x)} is not a size (a number with KiB, MiB, GiB or TiB, e.g. 256MiB)")
    last = parts[-1].group(2)
    out = [whole(float(p.group(1)) * UNITS[(p.group(2) or last).lower()], MAX_BYTES, f"{clip(x)} in bytes")
           for x, p in zip(items, parts)]
    for x, n in zip(items, out):
        if n <= 0:
            raise ValueError(f"{clip(x)}: a pool size must be positive")
    return unique(out)


CHECK_LEVELS = "0 (none), 1 (one checked transfer after timing, the default) or all (every timed iteration too)"


def check_level(v):
    """-c / check: 0, 1, all (also every, true, false) -> False, True or "all"; anything else is refused."""
    if isinstance(v, bool):
        return v
    word = str(v).strip().lower()
    if word in ("all", "every"):
        return "all"
    if word in ("0", "1", "false", "true", "off", "on"):
        return word in ("1", "true", "on")
    raise ValueError(f"check must be {CHECK_LEVELS}, not {v!r}")
