"""The bounds a run measures on its own machine (results/bounds.py holds the arithmetic and the verdict).

``wake_samples``: how long a thread takes to wake another here, at each transport's setup on every rank
(a stamping thread sets an event, as a transport's receive thread does, and the waiter notes its return).
``entry_bounds``: after a case's check, per request this rank receives, the GB/s its path can carry: the
harness's own copy of the same bytes (a pair on one host) or the NIC's link rate (across hosts).
Both run outside the timed iterations.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from kvbench import _native, memory
from kvbench.model.descriptors import DST, LEN
from kvbench.results import bounds as B

WAKE_SAMPLES = 100  # wake-ups measured per setup of a transport that stamps
WAKE_BUDGET_S = 0.3  # ... or fewer when a loaded machine makes them slower
CASE_WAKE_SAMPLES, CASE_WAKE_BUDGET_S = 30, 0.05  # again after each case: a shared machine's load comes and goes
WORK = 1 << 20  # bytes the stamping thread copies before each stamp, as a receive thread reads before its own
COPIES, MIN_COPIES, COPY_BUDGET_S = 12, 5, 0.25  # the best of up to COPIES copies, at least MIN_COPIES, until COPY_BUDGET_S are spent
COPY_SPAN_S, MAX_COPIES = 0.005, 200  # small copies go on for this long (up to MAX_COPIES): a best that spans a time slice
SCRATCH = 256 << 20  # the most bytes the copy's target holds: a larger request's bytes wrap around in it


def setup_wake(t, rank: int, hosts: list[str]) -> float:
    """At a transport's setup, on every rank: its wake-up bound (results/bounds.py); NaN where it never stamps, or
    where more ranks share this host than it has CPUs (a woken thread may then wait for a CPU another rank holds,
    for as long as the scheduler likes: no bound measured in one process holds for that)."""
    if not t.caps.stamps or oversubscribed(rank, hosts):
        return B.NAN
    return B.wake_bound(wake_samples())


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


def best_copy_s(dst: np.ndarray, src: np.ndarray, descs: np.ndarray) -> float:
    """The shortest of several harness copies of ``descs`` (one native call each)."""
    best, spent, k = float("inf"), 0.0, 0
    while k < MIN_COPIES or (k < COPIES and spent < COPY_BUDGET_S) or (k < MAX_COPIES and spent < COPY_SPAN_S):
        a = time.perf_counter()
        _native.copy_batch(dst, src, descs)
        took = time.perf_counter() - a
        best, spent, k = min(best, took), spent + took, k + 1
    return best


def alone(comm, entries, rank: int, hosts: list[str], pools, ifname: str | None, pages: str = "4k") -> dict:
    """``entry_bounds`` on every rank at once (collective), between two barriers that sleep: no peer is still
    filling or checking its pool, or spinning in MPI, while a rank copies (either made the copy, and so the bound,
    slower than the path itself on a loaded machine: a row beyond it was called SUSPECT)."""
    comm.barrier_asleep()
    out = entry_bounds(entries, rank, hosts, pools, ifname, pages)
    comm.barrier_asleep()
    return out


def entry_bounds(entries, rank: int, hosts: list[str], pools, ifname: str | None, pages: str = "4k") -> dict:
    """Per request this rank receives: (GB/s bound, kind).  One host: the harness's own copy of the same bytes
    (``packed``); across hosts: the link rate (results/bounds.network_bound); device memory: none."""
    out = {}
    for e in entries if pools else ():  # a local-only transport's idle rank holds no pool
        if e.dst != rank:
            continue
        if hosts[e.src] != hosts[e.dst]:
            out[id(e)] = B.network_bound(ifname)
            continue
        dst = pools[-1].array
        if dst is None or pools[-1].kind == "cuda":
            out[id(e)] = (B.NAN, "none (device memory: no harness copy)")
            continue
        out[id(e)] = (B.copy_gbps(e.payload, best_copy_s(*packed(dst, e.layers, pages))), "memory copy")
    return out


def after_case(m, s, comm, rank: int, hosts: list[str], pages: str = "4k") -> tuple[float, dict]:
    """After a case's check, on every rank: (its wake-up bound: the higher of its transport's setup's and one
    measured now; per row index of its entries, (GB/s bound, kind): the better of before and after its timed
    iterations).  ``m``: the case's Measurement, ``s``: the transport's Session (harness/state.py)."""
    per = best(m.bounds, alone(comm, m.entries, rank, hosts, s.pools, s.ifname, pages))
    wake = s.wake_bound
    if wake == wake:  # a transport that stamps: measured again now
        wake = max(wake, B.wake_bound(wake_samples(CASE_WAKE_SAMPLES, CASE_WAKE_BUDGET_S)))
    return wake, {i: per[id(e)] for i, e in enumerate(m.entries) if id(e) in per}


def best(before: dict, after: dict) -> dict:
    """Per request, the higher of two measurements of its bound (before and after its timed iterations: a
    phase of a shared machine that slows one copy does not make the bound)."""
    return {k: max(before.get(k, v), v, key=lambda x: x[0] if x[0] == x[0] else -1.0) for k, v in after.items()}


def packed(pool: np.ndarray, layers: list[np.ndarray], pages: str = "4k") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scratch, pool, descriptors) of a copy that reads a request's destination ranges where they lie in
    ``pool`` and writes them one after another into a scratch buffer: the same bytes, read as the transport
    wrote them, and the pool left as it is (bulk ranges lie at the same offsets on both sides, so a copy
    from the pool's source ranges to its destination ranges could be a copy onto itself)."""
    d = np.concatenate(layers)
    lens = d[:, LEN]
    at = (np.cumsum(lens) - lens) % SCRATCH
    # page-aligned, and on huge pages where the pools are (thp: a hugetlb reservation may not hold it too); on 4k
    # pages beside a huge-page pool the copy paid TLB misses the transport did not, and bounded it too low
    scratch = memory.alloc_host(int(min(lens.sum(), SCRATCH) + lens.max()), pages="4k" if pages == "4k" else "thp")
    return scratch, pool, np.ascontiguousarray(np.stack([d[:, DST], at, lens], axis=1), dtype=np.int64)
