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
    w, out, me = comm.world, {}, comm.rank
    # pair by pair in one order every rank agrees on (the lower rank, then the higher), so no two ranks wait for
    # each other whatever the matrix; a pair that sends both ways syncs twice, the lower rank pinging first
    for p in sorted(set(sources) | set(dests), key=lambda p: (min(me, p), max(me, p))):
        turns = sorted(([me] if p in dests else []) + ([p] if p in sources else []))
        for pinger in turns:
            if pinger == me:
                best = (float("inf"), 0.0)
                for _ in range(samples):
                    a = clk()
                    w.send(a, dest=p, tag=TAG_SYNC)
                    b = w.recv(source=p, tag=TAG_SYNC)
                    c = clk()
                    best = min(best, (c - a, b - (a + c) / 2))
                w.send((best[1], best[0]), dest=p, tag=TAG_SYNC)
            else:
                for _ in range(samples):
                    w.recv(source=p, tag=TAG_SYNC)
                    w.send(clk(), dest=p, tag=TAG_SYNC)
                out[p] = tuple(w.recv(source=p, tag=TAG_SYNC))
    return out
