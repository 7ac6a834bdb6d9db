"""Transports that lie, each in one way, for the honesty tests (tests/test_honesty.py).

Registered through KVBENCH_TRANSPORTS for a launch; each is the shm transport
(one-sided copies between the ranks' shared pools) with one lie added.  The
harness must catch every one: as wrong elements, or as a time that cannot be.
"""
from __future__ import annotations

import threading
import time

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
