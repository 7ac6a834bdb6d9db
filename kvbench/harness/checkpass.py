"""The check pass after a case's timed iterations: one clock per pair, then one more transfer built to catch lies.

Functions take what they use (the comm, this rank, the case's ``Measurement``, the pools and a callable that
runs one iteration), never the harness; ``Harness.finish`` calls them.
"""
from __future__ import annotations

import pickle

import numpy as np

from kvbench.codecs.path import lossy_check
from kvbench.harness import clocks
from kvbench.harness.state import Measurement
from kvbench.job.comm import TAG_FINAL, TAG_T0
from kvbench.memory import device, verify
from kvbench.model import shapes as M
from kvbench.model.layout import Pool
from kvbench.transports.base import TransportError


def one_clock(comm, rank: int, m: Measurement) -> dict[int, tuple]:
    """On a destination, per source: (barrier-exit skew per timed iteration, on the source's clock; the
    offset's error bound, half the best round trip; the offset).  Exposed times and the pair's time are
    corrected by the skew (clocks.py)."""
    itr = m.itr
    offsets = clocks.sync(comm, itr.sources, itr.dests)
    t0s = np.asarray(m.t0s, dtype=np.float64)
    reqs = [comm.isend_bytes(t0s.tobytes(), d, TAG_T0) for d in itr.dests]
    out = {rank: (np.zeros(len(t0s)), 0.0, 0.0)}  # source and destination in one process
    for src, (off, rtt) in offsets.items():
        theirs = bytearray(t0s.nbytes)
        comm.recv_bytes(theirs, src, TAG_T0)
        out[src] = (t0s - off - np.frombuffer(theirs, np.float64), rtt / 2, off)
    comm.waitall(reqs)
    return out


def check(comm, rank: int, m: Measurement, pools: list[Pool], run_once, inject_corruption: int = 0) -> list[int]:
    """One more transfer, built to catch lies (verify.py): the source's layers take a new epoch of the
    pattern when final, the destination's ranges hold the complement of what they must receive, and the
    destination copies them aside the moment it believes them complete; wrong elements per entry.

    ``run_once(m, it)`` runs one iteration as the timed ones do; ``inject_corruption`` flips that many of the
    first destination bytes before they are counted (the fault test's proof that the check sees them)."""
    case, entries, itr = m.case, m.entries, m.itr
    epoch = 1 + (m.no * 40503) % 0xFFFF
    src_pool, dst_pool = (device.buf(pools[0]), device.buf(pools[-1])) if pools else (None, None)
    chk = device.checker(pools[-1]) if pools else verify  # device pools: the same rules, on the device
    mine = [e for e in entries if e.dst == rank]
    for e in mine:
        for d in e.layers:
            chk.poison(dst_pool, d, e.src, epoch)
    if mine:  # device pools: the poison is queued GPU work; it must land before any peer writes these ranges
        device.sync(pools[-1])
    copies: dict[int, tuple] = {}
    landed: dict[int, float] = {}

    def final(ks):
        wrote = False
        for e in entries:
            if e.src == rank:
                for k in ks:
                    chk.write_epoch(src_pool, e.layers[k], rank, epoch)
                    wrote = True
        if wrote:  # ... and the epoch must be in the source's memory before a peer (or a NIC) reads it
            device.sync(pools[0])

    itr.on_final = final
    itr.on_landed = lambda e, at: (copies.setdefault(id(e), chk.snapshot(dst_pool, e.layers)),
                                   landed.setdefault(id(e), at))
    try:
        run_once(m, -1)  # from the end of a barrier, in the timed iterations' order of calls
    finally:
        itr.on_final = itr.on_landed = None
    landed_after_posted(comm, m, mine, landed, dict(itr.bound_at))
    if mine and inject_corruption:
        copy = copies[id(mine[0])][0]
        copy[:inject_corruption] ^= 0xFF
    elem = m.g.get("elem") or M.dtype_bytes(case["dtype"])  # scaled formats: bytes (values share them)
    if case.get("codec", "").startswith("cast-"):  # lossy: elements outside the codec's stated tolerance
        m.errors = {id(e): lossy_check(copies[id(e)], e, epoch, case) for e in mine}
        return [m.errors[id(e)][0] if e.dst == rank else 0 for e in entries]
    return [chk.count_wrong(*copies[id(e)], e.src, elem, epoch) if e.dst == rank else 0 for e in entries]


def landed_after_posted(comm, m: Measurement, mine: list, landed: dict, bounds: dict) -> None:
    """A destination's completion stamp cannot precede the moment its source posted the request's last layer
    (a pull: made it final), on one clock: a transport whose stamp does is not reporting when bytes landed."""
    itr = m.itr
    reqs = [comm.isend_bytes(pickle.dumps(bounds), d, TAG_FINAL) for d in itr.dests]
    for src in itr.sources:
        st = comm.probe(src, TAG_FINAL)
        buf = bytearray(st)
        comm.recv_bytes(buf, src, TAG_FINAL)
        bounds = {**pickle.loads(bytes(buf)), **bounds}
    comm.waitall(reqs)
    for e in mine:
        _, err, off = m.clock[e.src]
        early = bounds[(e.pair, e.req)] - (landed[id(e)] - off)
        if early > err + 1e-4:
            raise TransportError(
                f"its completion stamp says the bytes landed {early * 1e6:.0f} us before the source posted the "
                f"last layer (clocks matched within {err * 1e6:.0f} us): the transport's completion time "
                "is not when the bytes landed")
