"""--cache: where a request's bytes are when its iteration starts (host pools).

The time a library's call takes depends on whether the bytes it reads and
writes are in the CPU's caches.  A plain loop that re-sends one request keeps
them there; kvbench's own work between iterations (bookkeeping, other
requests, the check) evicts part of them, and a serving engine's pools are far
larger than any cache.  ``as-is`` leaves the caches as that work leaves them;
``warm`` reads every line of this rank's ranges of each request (source ranges
on a source, destination ranges on a destination) just before the barrier
that starts the iteration; ``cold`` flushes them from every cache level there,
so the transfer starts from DRAM.  Outside the timed window either way; the
rows' ``cache`` column says which.
"""
from __future__ import annotations

import numpy as np

from kvbench.model.descriptors import DST, SRC

MODES = ("as-is", "warm", "cold")
HELP = ("where each request's bytes are when its iteration starts (host pools): as-is (default: what the harness's "
        "work between iterations leaves), warm (this rank's ranges of every request read just before the barrier: "
        "what a loop re-sending one request measures) or cold (flushed from every CPU cache there: the bytes start "
        "in DRAM, as in a pool far larger than the cache)")
SAYS = {"warm": "each rank read its ranges of every request before each iteration's barrier",
        "cold": "each rank flushed its ranges of every request from the CPU caches before each iteration's barrier"}


class CacheState:
    """Per case: the (pool bytes, descriptor array, column) ranges this rank sets before each barrier;
    ``per_entry``: their bytes per request (the rows' ``cache_bytes``); ``count``: how often they were set."""

    def __init__(self, mode: str, ranges: list[tuple[np.ndarray, np.ndarray, int]], per_entry: list[int]):
        self.mode, self.ranges, self.per_entry, self.count = mode, ranges, per_entry, 0
        from kvbench import _native  # a compiled extension: only a run that sets a cache state needs it

        self.fn = _native.touch if mode == "warm" else _native.evict

    def apply(self) -> None:
        for buf, descs, col in self.ranges:  # one C call per layer array, outside the timed window
            if self.fn(buf, descs, col) is False:
                raise RuntimeError("--cache cold: this CPU has no cache-line flush kvbench can call "
                                   "(clflush on x86-64, dc civac on aarch64)")
        self.count += 1


def make(mode: str, pools: list, entries: list, rank: int, local: bool) -> CacheState | None:
    """The case's cache setting on this rank (None: as-is, or no host pool to set)."""
    if mode == "as-is" or not pools or getattr(pools[0], "array", None) is None:
        return None  # (device pools are refused by the suite's validation)
    src_pool, dst_pool = pools[0].array, pools[-1].array
    ranges, per_entry = [], []
    for e in entries:
        sides = [(src_pool, SRC)] * (e.src == rank or local) + [(dst_pool, DST)] * (e.dst == rank or local)
        ranges += [(buf, np.ascontiguousarray(d), col) for buf, col in sides for d in e.layers]
        per_entry.append(len(sides) * e.payload)
    return CacheState(mode, ranges, per_entry)
