"""Setup rows: each phase of a transport's setup timed on each rank (allocate, fill, register per pool, exchange,
connect per peer), the --pool-sizes sweep of registration against pool size, and a case's first transfer.

They are rows of kind ``setup`` in the run's one result file (results/store.py, schema 6): iter -2, status
``setup`` (a reader of the ``ok`` rows reads transfers alone), the phase in ``phase``, its seconds in ``seconds``.  The transport-level ones wait on this rank until its transport's first
case is delivered and go with that case's rows, under its number (a run killed before it keeps no setup rows of a
case it does not keep); a case's first transfer goes with its own rows (rows.py).  The first transfer is the
case's first iteration (a warm-up unless ``-w 0``): nothing is added to measure it.
"""
from __future__ import annotations

import time

from kvbench import memory
from kvbench.harness.state import UserError
from kvbench.job import faults
from kvbench.memory import device
from kvbench.model.layout import Pool
from kvbench.transports.base import Transport

nan = float("nan")
PHASES = ("alloc", "fill", "register", "exchange", "connect", "first", "pool-register", "pool-deregister")


def row(base: dict, phase: str, seconds: float, region_bytes: float = nan, peer: int = -1, reason: str = "",
        status: str = "setup") -> dict:
    """One setup row: ``base`` (the case keys, rank and role of rows.py) with the phase's columns."""
    return dict(base, row_kind="setup", phase=phase, peer=peer, region_bytes=region_bytes, iter=-2, round=-1,
                seconds=seconds, harness_seconds=nan, status=status, reason=reason, nwrong=None, handshake_s=nan,
                exposed_s=nan, skew_s=nan, clock_err_s=nan, clock_offset_s=nan, queue_s=nan, arrival_s=nan)


class Phases:
    """This rank's phases of one transport's setup, as (phase, seconds, region bytes, peer, reason, status)."""

    def __init__(self):
        self.got: list[tuple] = []

    def add(self, phase: str, seconds: float, region_bytes: float = nan, peer: int = -1, reason: str = "",
            status: str = "setup") -> None:
        self.got.append((phase, seconds, region_bytes, peer, reason, status))

    def connect(self, seconds: float, peers: list[int]) -> None:
        """One connect row per peer: a transport connects all its peers in one call, so each row holds an equal
        share of it, and says so, where there is more than one."""
        many = f"connect() to {len(peers)} peers at once, divided equally" if len(peers) > 1 else ""
        for p in peers or [-1]:
            self.add("connect", seconds / max(len(peers), 1), peer=p, reason=many)

    def rows(self, base: dict) -> list[dict]:
        return [row(base, *g) for g in self.got]


def alloc_pool(h, t, nbytes: int, kind: str, ph: Phases) -> Pool:
    """A transport's pool, allocated then filled, each timed (a device pool is filled where it lives)."""
    a = time.perf_counter()
    if kind != "host":
        try:
            gpu = h.my_place()["gpu"] if kind == "cuda" else -1
            pool = device.alloc(nbytes, kind, pages=h.opts.pages, device=gpu if gpu >= 0 else None)
        except device.DeviceMemoryError as exc:
            raise UserError(str(exc)) from None
        b = time.perf_counter()
        device.fill(pool.tensor, h.rank)
        device.sync(pool)
    else:
        buf = t.alloc(nbytes)
        if buf is not None:
            pool = Pool(buf.array, "host", buf.release)
            pool.own_pages = True
        else:
            pool = Pool(memory.alloc_host(nbytes, pages=h.opts.pages))
        b = time.perf_counter()
        faults.at("fill", h.rank)
        memory.fill(pool.array, h.rank)
    ph.add("alloc", b - a, nbytes)
    ph.add("fill", time.perf_counter() - b, nbytes)
    return pool


def sweepable(cls) -> bool:
    """The transport registers regions that --pool-sizes can sweep."""
    return not cls.caps.unregistered and cls.register_region is not Transport.register_region


def sweep(h, t, sizes: tuple, kind: str, collective: bool, ph: Phases) -> None:
    """--pool-sizes: per size, a pool allocated (untimed), registered and deregistered (each timed), released.
    Every rank sweeps the same sizes in the same order, a barrier before each (mpi's windows are collective)."""
    if not sizes:
        return
    if not sweepable(type(t)):
        why = t.caps.unregistered or f"{t.name}: no region registration to sweep (not implemented for it)"
        for size in sizes:
            ph.add("pool-register", nan, size, reason=why, status="none")  # nothing to measure
        return
    for size in sizes:
        if kind != "host":
            gpu = h.my_place()["gpu"] if kind == "cuda" else -1
            pool = device.alloc(size, kind, pages=h.opts.pages, device=gpu if gpu >= 0 else None)
        else:
            pool = Pool(memory.alloc_host(size, pages=h.opts.pages))  # pre-faulted: pinning finds its pages
        try:
            if collective:
                h.comm.barrier()
            a = time.perf_counter()
            handle = t.register_region(pool)
            b = time.perf_counter()
            t.deregister_region(handle)
            ph.add("pool-register", b - a, size)
            ph.add("pool-deregister", time.perf_counter() - b, size)
        finally:
            pool.release()


def first_rows(base_of, first: list | None) -> list[dict]:
    """A case's first transfer on this rank, per entry: ``base_of(k)`` is entry k's row base, ``first[k]`` its
    seconds from the iteration's start (on this rank's clock: no clock match is made for a warm-up)."""
    return [row(base_of(k), "first", float(s)) for k, s in enumerate(first or [])]


def pages_of(t, pools: list, requested: str) -> dict:
    """For the sidecar: the page size asked for, and per pool what was applied and what the kernel gave."""
    got = [t.pages(p) if p.own_pages else dict(memory.page_report(p.array), applied=requested)
           if p.array is not None else {"applied": p.kind, "note": "device memory: no host pages"} for p in pools]
    out = {"requested": requested, **(got[0] if got else {})}
    if len(got) > 1:
        out["more_pools"] = got[1:]
    return out
