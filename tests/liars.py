"""Transports that lie, each in one way, for the honesty tests (tests/test_honesty.py).

Registered through KVBENCH_TRANSPORTS for a launch; each is the shm transport
(one-sided copies between the ranks' shared pools) with one lie added.  The
harness must catch every one: as wrong elements, or as a time that cannot be.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np

from kvbench import _native
from kvbench.model.descriptors import DST, LEN
from kvbench.transports.shm import ShmTransport
from kvbench.transports.tcp import TcpTransport

LIARS = {
    "lie-nothing": "liars:MovesNothing",
    "lie-wrong-block": "liars:WrongBlock",
    "lie-early": "liars:CompletesEarly",
    "lie-read-early": "liars:ReadsBeforeFinal",
    "lie-stamp": "liars:StampsSendersTime",
}


class MovesNothing(ShmTransport):
    """Reports every transfer done and moves no byte."""

    name = "lie-nothing"

    def start(self, prepared):
        return None


class WrongBlock(ShmTransport):
    """Moves every byte, each block to its neighbour's place."""

    name = "lie-wrong-block"

    def start(self, prepared):
        dst, src, descs = prepared
        d = descs.copy()
        if len(d) > 1:
            d[:, DST] = np.roll(d[:, DST], 1)
            d[:, LEN] = d[:, LEN].min()
        else:  # one descriptor: half a block further on
            d[:, DST] += d[:, LEN] // 2
            d[:, LEN] -= d[:, LEN] // 2
        _native.copy_batch(dst, src, d)


class CompletesEarly(ShmTransport):
    """Returns from the post at once and copies 50 ms later on a thread: the completion comes before the bytes."""

    name = "lie-early"

    def start(self, prepared):
        def later():
            time.sleep(0.05)
            _native.copy_batch(*prepared)

        threading.Thread(target=later, daemon=True).start()


class ReadsBeforeFinal(ShmTransport):
    """A pull that reads each layer when the read is prepared, before the source says the layer is final."""

    name = "lie-read-early"

    def prepare(self, op, peer, descs, tag=0):
        prepared = super().prepare(op, peer, descs, tag)
        if op == "pull":
            _native.copy_batch(*prepared)
            return None
        return prepared

    def start(self, prepared):
        if prepared is not None:
            _native.copy_batch(*prepared)


class StampsSendersTime(TcpTransport):
    """Moves every byte but reports, as the moment the bytes landed, the moment the receive was posted."""

    name = "lie-stamp"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._posted: dict[int, float] = {}

    def serve(self, op, peer, descs, tag=0):
        job = super().serve(op, peer, descs, tag)
        self._posted[id(job)] = time.perf_counter()
        return job

    def wait(self, handle):
        landed = super().wait(handle)
        return self._posted.pop(id(handle), landed)


# liars about the time only, for the bounds on a landing time (tests/test_bounds.py): every byte lands where it
# must, the check passes, and only a bound measured in the run can tell
BOUND_LIARS = {
    "lie-stamp-half": "liars:StampsHalfway",
    "lie-half-time": "liars:HalvesTheTime",
}


class StampsHalfway(TcpTransport):
    """Moves every byte but reports, as the moment the bytes landed, the moment halfway between its receive post
    and the real landing (the wait returns long after such a stamp: beyond the wake-up bound)."""

    name = "lie-stamp-half"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._posted: dict[int, float] = {}
        # a pull's layer-ready signal by the harness (tcp -O ready=mpi): the read is posted once the layer is final
        self.ready_via, self.caps = "mpi", replace(self.caps, signals_ready=False)

    def serve(self, op, peer, descs, tag=0):
        job = super().serve(op, peer, descs, tag)
        self._posted[id(job)] = time.perf_counter()
        return job

    def post_when_ready(self, peer, descs, tag=0):
        job = super().post_when_ready(peer, descs, tag)
        self._posted[id(job)] = time.perf_counter()
        return job

    def start(self, prepared):
        a = time.perf_counter()
        job = super().start(prepared)
        if prepared[1] is not None:  # a pull's read request: its receive
            self._posted[id(job)] = a
        return job

    def wait(self, handle):
        landed = super().wait(handle)
        posted = self._posted.pop(id(handle), None)
        return landed if posted is None else (posted + landed) / 2


class HalvesTheTime(ShmTransport):
    """Copies every byte in its post (a pull's reads) and reports half the time since the request's first post as
    its landing: twice the GB/s the copy made, beyond the harness's own copy of the same bytes."""

    name = "lie-half-time"
    batches = True  # a request's layers in one post (one copy): its first post is its last
    _since: float | None = None

    def start(self, prepared):
        if self._since is None:
            self._since = time.perf_counter()
        super().start(prepared)
        return self._since

    def wait(self, handle):
        if handle is None:
            return super().wait(handle)
        self._since = None
        return handle + (time.perf_counter() - handle) / 2
