"""One clock for a pair of ranks: each destination learns its sources' clock offsets by ping-pong.

The best of a few round trips (the shortest) bounds the offset's error by half
that round trip.  Single requests and workloads both use it, so exposed times
and landing stamps are compared on one clock, not on two ranks' barrier exits.
"""
from __future__ import annotations

import time

from kvbench.job.comm import TAG_SYNC

SAMPLES = 8


def sync(comm, sources: list[int], dests: list[int], clk=time.perf_counter, samples: int = SAMPLES) -> dict:
    """Collective over the pairs: on a destination, {source: (this clock minus the source's, round trip)}.

    ``sources`` are the ranks this rank receives from, ``dests`` those it sends to (either may be empty).
    """
    w, out = comm.world, {}
    for d in dests:
        best = (float("inf"), 0.0)
        for _ in range(samples):
            a = clk()
            w.send(a, dest=d, tag=TAG_SYNC)
            b = w.recv(source=d, tag=TAG_SYNC)
            c = clk()
            best = min(best, (c - a, b - (a + c) / 2))
        w.send((best[1], best[0]), dest=d, tag=TAG_SYNC)
    for s in sources:
        for _ in range(samples):
            w.recv(source=s, tag=TAG_SYNC)
            w.send(clk(), dest=s, tag=TAG_SYNC)
        out[s] = tuple(w.recv(source=s, tag=TAG_SYNC))
    return out
