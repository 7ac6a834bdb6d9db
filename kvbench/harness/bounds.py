"""The bounds a run measures on its own machine (results/bounds.py holds the arithmetic and the verdict).

``wake_samples``: how long a thread takes to wake another here, at each transport's setup on every rank
(a stamping thread sets an event, as a transport's receive thread does, and the waiter notes its return).
``Beside``: beside each timed iteration, on its destination, the harness's own copy of the same bytes (a pair on
one host): each iteration is judged against the copy made next to it, so load that comes and goes on a shared
machine moves a row and its bound alike.  ``entry_bounds``: per request this rank receives from another host, the
NIC's link rate.  All of it outside the timed iterations.
"""
from __future__ import annotations

import math
import os
import threading
import time

import numpy as np

from kvbench import _native, memory
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.results import bounds as B

WAKE_SAMPLES = 100  # wake-ups measured per setup of a transport that stamps
WAKE_BUDGET_S = 0.3  # ... or fewer when a loaded machine makes them slower
CASE_WAKE_SAMPLES, CASE_WAKE_BUDGET_S = 30, 0.05  # again after each case: a shared machine's load comes and goes
WORK = 1 << 20  # bytes the stamping thread copies before each stamp, as a receive thread reads before its own
SCRATCH = 256 << 20  # the most bytes the copy's target holds: a larger request's bytes wrap around in it
BESIDE_COPIES = 2  # beside each timed iteration, the better of this many copies: a time slice lost to another job
# in one of them is not the bound


def setup_wake(t, rank: int, hosts: list[str]) -> tuple[float, float]:
    """At a transport's setup, on every rank: its wake-up bound (results/bounds.py); NaN where more ranks share
    this host than it has CPUs (a woken thread may then wait for a CPU another rank holds, for as long as the
    scheduler likes: no bound measured in one process holds for that), infinite where it never stamps (a stamp
    it returns anyway is judged against its own time alone); and the p99 of its samples (NaN without any)."""
    if oversubscribed(rank, hosts):
        return B.NAN, B.NAN
    if not t.caps.stamps:
        return float("inf"), B.NAN
    s = wake_samples()
    return B.wake_bound(s), B.wake_p99(s)


def oversubscribed(rank: int, hosts: list[str]) -> bool:
    """More ranks on this rank's host than CPUs it may run on."""
    return hosts.count(hosts[rank]) > len(os.sched_getaffinity(0))


def wake_samples(n: int = WAKE_SAMPLES, budget_s: float = WAKE_BUDGET_S) -> np.ndarray:
    """Seconds from a thread's stamp to the moment the thread waiting for it returned, ``n`` times.

    The stamping thread copies WORK bytes first (the GIL released, as a receive thread's read): a thread that
    has just used the CPU is the one a loaded machine's scheduler makes wait, between its stamp and the wake-up
    it owes (a thread that only sleeps and stamps is woken at once and measures none of that)."""
    go, done, stop = threading.Event(), threading.Event(), []
    at = [0.0]
    buf = memory.alloc_host(2 * WORK)
    work = np.array([[0, WORK, WORK]], np.int64)

    def stamper():
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            _native.copy_batch(buf, buf, work)  # the waiter is asleep by now: a real wake-up
            at[0] = time.perf_counter()
            done.set()

    th = threading.Thread(target=stamper, name="kvbench-wake", daemon=True)
    th.start()
    out, end = [], time.perf_counter() + budget_s
    try:
        while len(out) < n and (len(out) < min(n, 20) or time.perf_counter() < end):
            done.clear()
            go.set()
            done.wait()
            out.append(time.perf_counter() - at[0])
    finally:
        stop.append(True)
        go.set()
        th.join()
    return np.asarray(out)


def entry_bounds(entries, rank: int, hosts: list[str], pools, ifname: str | None) -> dict:
    """Per request this rank receives: (GB/s bound, kind) where no copy beside its iterations measures it: across
    hosts the link rate (results/bounds.network_bound); device memory: none.  A pair on one host: ``Beside``."""
    out = {}
    for e in entries if pools else ():  # a local-only transport's idle rank holds no pool
        if e.dst != rank:
            continue
        if hosts[e.src] != hosts[e.dst]:
            out[id(e)] = B.network_bound(ifname)
        elif pools[-1].array is None or pools[-1].kind == "cuda":
            out[id(e)] = (B.NAN, "none (device memory: no harness copy)")
    return out


class Beside:
    """The harness's copy of each request this rank receives from its own host, beside every timed iteration.

    ``any``: whether any rank copies (collective, so that every rank waits at the same sleeping barriers);
    ``copy()`` after each timed iteration, on every rank: a sleeping barrier (no peer still checking or spinning
    in MPI beside the copy), the destinations' copies (each the better of BESIDE_COPIES), another sleeping barrier,
    the sources' copies of their own ranges, a last one; ``gbps``: id(entry) -> per timed iteration GB/s (on each
    side of a pair: the verdict takes the better)."""

    def __init__(self, h, entries, pools, variant: str = ""):
        """``h``: the harness (its comm, rank, every rank's host, and --pages)."""
        comm, rank, hosts, pages = h.comm, h.rank, h.hosts, h.opts.pages
        pool = pools[-1] if pools else None
        host = pool is not None and pool.array is not None and pool.kind != "cuda" and variant != "hot"
        mine = [e for e in entries if host and e.dst == rank and hosts[e.src] == hosts[e.dst]]
        self.jobs = [(id(e), e.payload, packed_descs(e.layers)) for e in mine]
        # the source copies its own ranges too, after the destination: the bytes a push's source just wrote lie
        # dirty in its caches, which a destination core elsewhere (another CCD) reads slower than the source copied
        # them, so the destination's copy alone bounded an honest push too low; a row's bound is the better of two
        sent = [e for e in entries if host and e.src == rank and e.dst != rank and hosts[e.src] == hosts[e.dst]]
        self.sends = [(id(e), e.payload, packed_descs(e.layers, SRC)) for e in sent]
        self.gbps = {k: [] for k, _, _ in self.jobs + self.sends}
        size = max((int(min(d[:, 2].sum(), SCRATCH) + d[:, 2].max()) for _, _, d in self.jobs + self.sends),
                   default=0)
        # page-aligned, and on huge pages where the pools are: on 4k pages beside a huge-page pool the copy paid
        # TLB misses the transport did not, and bounded it too low
        self.scratch = memory.alloc_host(size, pages="4k" if pages == "4k" else "thp") if size else None
        self.pool, self.comm = pool.array if mine else None, comm
        self.src_pool = pools[0].array if sent else None  # a local-only transport's source pool is its first
        self.any, self.both = (any(x) for x in zip(*comm.allgather((bool(self.jobs or self.sends), bool(self.sends)))))

    def copy(self) -> None:
        if not self.any:
            return
        self.comm.barrier_asleep()
        self._copies(self.jobs, self.pool)
        if self.both:  # one side at a time: two copies at once would share the memory bus and bound both low
            self.comm.barrier_asleep()
            self._copies(self.sends, self.src_pool)
        self.comm.barrier_asleep()

    def _copies(self, jobs, pool) -> None:
        for k, payload, d in jobs:
            best = float("inf")
            for _ in range(BESIDE_COPIES):
                a = time.perf_counter()
                _native.copy_batch(self.scratch, pool, d)
                best = min(best, time.perf_counter() - a)
            self.gbps[k].append(B.copy_gbps(payload, best))


def after_case(m, s) -> tuple[float, float, dict]:
    """After a case's check, on every rank: (its wake-up bound: the higher of its transport's setup's and one
    measured now; the higher p99 of their wake-up samples; per row index of its entries, (GB/s bound, kind): a list of one per timed iteration where the
    harness copied beside them, else one value).  ``m``: the case's Measurement, ``s``: the transport's Session."""
    per = dict(m.bounds) | {k: (v, "memory copy") for k, v in m.beside.gbps.items() if v}
    wake, p99 = s.wake
    if math.isfinite(wake):  # a transport that stamps: measured again now
        now = wake_samples(CASE_WAKE_SAMPLES, CASE_WAKE_BUDGET_S)
        wake, p99 = max(wake, B.wake_bound(now)), max(p99, B.wake_p99(now))
    return wake, p99, {i: per[id(e)] for i, e in enumerate(m.entries) if id(e) in per}


def packed_descs(layers: list[np.ndarray], col: int = DST) -> np.ndarray:
    """Descriptors of a copy that reads a request's destination ranges where they lie in its pool and writes them
    one after another into a scratch buffer (wrapping at SCRATCH): the same bytes, read as the transport wrote
    them, and the pool left as it is (bulk ranges lie at the same offsets on both sides, so a copy from the pool's
    source ranges to its destination ranges could be a copy onto itself)."""
    d = np.concatenate(layers)
    lens = d[:, LEN]
    at = (np.cumsum(lens) - lens) % SCRATCH
    return np.ascontiguousarray(np.stack([d[:, col], at, lens], axis=1), dtype=np.int64)
