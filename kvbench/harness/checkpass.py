"""The check pass after a case's timed iterations: one clock per pair, then one more transfer built to catch lies;
and, under ``-c all``, the check of every timed iteration (``Every``).

Functions take what they use (the comm, this rank, the case's ``Measurement``, the pools and a callable that
runs one iteration), never the harness; ``Harness.finish`` and ``Harness.iterate`` call them.
"""
from __future__ import annotations

import pickle
import time

import numpy as np

from kvbench.codecs.path import lossy_check
from kvbench.harness import clocks
from kvbench.harness.state import Measurement
from kvbench.job.comm import TAG_FINAL, TAG_T0
from kvbench.memory import device, verify
from kvbench.model import shapes as M
from kvbench.model.descriptors import DST, LEN, SRC
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
    epoch = epoch_of(m.no, -1)
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
    in_place = hasattr(chk, "count_now") and not case.get("codec", "").startswith("cast-")
    first = mine[0] if mine else None

    def look(e):
        """At the landing: the fault test's bytes flipped in the pool itself (the landed bytes, so the check is
        proven from the pool on, not from its copy), then a device pool's ranges counted in place, host bytes
        copied aside."""
        d = np.concatenate(e.layers)
        if e is first and inject_corruption:
            at = int(d[0, DST])
            dst_pool[at : at + min(inject_corruption, int(d[0, LEN]))] ^= 0xFF
        if not in_place:
            return chk.snapshot(dst_pool, e.layers)
        return chk.count_now(dst_pool, d, e.src, elem_of(m), epoch)

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
    itr.on_landed = lambda e, at: (id(e) in copies or copies.setdefault(id(e), look(e)),
                                   landed.setdefault(id(e), at))
    try:
        run_once(m, -1)  # from the end of a barrier, in the timed iterations' order of calls
    finally:
        itr.on_final = itr.on_landed = None
    landed_after_posted(comm, m, mine, landed, dict(itr.bound_at))
    if in_place:
        return [int(copies[id(e)]) if e.dst == rank else 0 for e in entries]
    if case.get("codec", "").startswith("cast-"):  # lossy: elements outside the codec's stated tolerance
        m.errors = {id(e): lossy_check(copies[id(e)], e, epoch, case) for e in mine}
        return [m.errors[id(e)][0] if e.dst == rank else 0 for e in entries]
    return [chk.count_wrong(*copies[id(e)], e.src, elem_of(m), epoch) if e.dst == rank else 0 for e in entries]


def epoch_of(no: int, it: int) -> int:
    """The pattern's epoch for case ``no``'s iteration ``it`` (-1: the check pass): never 0 (the plain fill),
    never the same twice in a row, the same on every rank."""
    return 1 + (no * 40503 + (it + 1) * 7919) % 0xFFFF


def elem_of(m: Measurement) -> int:
    """Bytes of one element as the check counts them (scaled formats: bytes, the values share them)."""
    return m.g.get("elem") or M.dtype_bytes(m.case["dtype"])


class Every:
    """``-c all``: each timed iteration of a case on this rank, verified outside its timed window.

    Before the iteration's barrier the source's ranges take a new epoch and the destination's ranges the
    complement of it, and the destination copies its guard zones aside (the bytes around its ranges, which no
    transfer may touch); right after its last completion, before any further word from its peers, it copies
    its ranges aside; after the closing barrier it counts the wrong elements of each copy and the changed
    bytes of its guard zones.  So a stale, skipped, torn, misplaced or late byte of any iteration is wrong, and
    so is any write outside a transfer's ranges.  ``seconds``: what all this took on this rank.
    """

    def __init__(self, rank: int, m: Measurement, pools: list[Pool], nbytes: int):
        self.m, self.rank, self.pools = m, rank, pools
        self.chk = device.checker(pools[-1])
        self.src_pool, self.dst_pool = device.buf(pools[0]), device.buf(pools[-1])
        self.host = self.chk is verify  # host bytes: what the ranges must hold is computed once (verify.Expected)
        self.in_place = hasattr(self.chk, "count_now") and not m.case.get("codec", "").startswith("cast-")
        self.srcs = [(e, d, verify.Expected(rank, d) if self.host else None)
                     for e in m.entries if e.src == rank for d in [np.concatenate(e.layers)]]
        self.mine = [(e, d, verify.Expected(e.src, d) if self.host else None)
                     for e in m.entries if e.dst == rank for d in [np.concatenate(e.layers)]]
        ranges = [d[:, [DST, LEN]] for _, d, _ in self.mine]
        if len(pools) == 1:  # this rank's own source ranges share the pool: its epoch writes are no trespass
            ranges += [d[:, [SRC, LEN]] for _, d, _ in self.srcs]
        self.guard = verify.guard_zones(np.concatenate(ranges), nbytes) if self.mine else None
        self.wrong: list[list[int]] = []  # per timed iteration: wrong elements per entry, in ``entries`` order
        self.seconds = 0.0
        self.epoch = 0

    def before(self, it: int) -> None:
        """Before iteration ``it``'s barrier: a new epoch at the source, its complement at the destination."""
        a = time.perf_counter()
        self.epoch = epoch = epoch_of(self.m.no, it)
        for _, d, x in self.srcs:
            if x is not None:
                verify.scatter(self.src_pool, x.at(epoch), d, SRC)
            else:
                self.chk.write_epoch(self.src_pool, d, self.rank, epoch)
        for e, d, x in self.mine:
            if x is not None:
                verify.scatter(self.dst_pool, np.invert(x.at(epoch)), d, DST)
            else:
                self.chk.poison(self.dst_pool, d, e.src, epoch)
        self.fence = self._look(self.guard) if self.mine else None
        for p in self.pools:
            device.sync(p)
        self.seconds += time.perf_counter() - a

    def landed(self) -> None:
        """Right after the iteration's last completion on this rank: its ranges and guard zones copied aside."""
        a = time.perf_counter()
        if self.in_place:  # a device pool: counted where it lives, now; read after the closing barrier
            elem = elem_of(self.m)
            self.copies = [self.chk.count_now(self.dst_pool, d, e.src, elem, self.epoch) for e, d, _ in self.mine]
        else:
            self.copies = [self.chk.snapshot(self.dst_pool, [d]) for _, d, _ in self.mine]
        self.after = self._look(self.guard) if self.mine else None
        self.seconds += time.perf_counter() - a

    def _look(self, descs):
        """The guard zones' bytes as they are now (on the device for a device pool)."""
        return self.chk.gather(self.dst_pool, descs) if self.in_place else self.chk.snapshot(self.dst_pool, [descs])[0]

    def count(self) -> None:
        """After the closing barrier: this iteration's wrong elements per entry (a rank's trespasses in its guard
        zones count on its first request's row)."""
        a = time.perf_counter()
        m, elem = self.m, elem_of(self.m)
        got = {}
        for (e, d, x), snap in zip(self.mine, self.copies):
            if m.case.get("codec", "").startswith("cast-"):
                got[id(e)] = lossy_check(snap, e, self.epoch, m.case)[0]
            elif self.in_place:
                got[id(e)] = int(snap)
            elif x is not None:
                got[id(e)] = verify.count_diff(x.at(self.epoch), snap[0], d[:, LEN], elem)
            else:
                got[id(e)] = self.chk.count_wrong(*snap, e.src, elem, self.epoch)
        if self.mine:
            e0 = self.mine[0][0]
            if self.in_place:
                got[id(e0)] += int(self.chk.count_changed(self.fence, self.after, self.guard[:, LEN], elem))
            else:
                got[id(e0)] += verify.count_diff(_host(self.fence), _host(self.after), self.guard[:, LEN], elem)
        self.wrong.append([got.get(id(e), 0) for e in m.entries])
        self.copies = self.after = self.fence = None
        self.seconds += time.perf_counter() - a


def _host(x) -> np.ndarray:
    """A copy's bytes as a numpy array (a device copy comes to the host: guard zones are small)."""
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


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
