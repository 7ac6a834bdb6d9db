"""loopback: an in-process copy from one pool to another; the reference path.

World size 1 is enough: the harness gives this rank both a source and a
destination pool.  Push and pull are the same memcpy (initiated by the
prefill or the decode role); the rows are the memory-copy ceiling of this
machine for the same descriptors, against which every other path is read.
"""
from __future__ import annotations

import time

from .. import _native
from .base import Caps, Transport, check_descs


class LoopbackTransport(Transport):
    name = "loopback"
    caps = Caps(memory=("host",), one_sided=True, notifies=True, local_only=True,
                unregistered="loopback registers nothing: it copies in one process")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pools = []

    def register(self, pool) -> bytes:
        """The first pool registered is the source, the second the destination."""
        self.pools.append(pool)
        return b""

    def post(self, op, peer, descs, tag=0):
        src, dst = self.pools[0], self.pools[1]
        check_descs(descs, src.nbytes, dst.nbytes)
        a = time.perf_counter()
        _native.copy_batch(dst.array, src.array, descs)
        self.lib_s += time.perf_counter() - a  # the copy is this path's wire, not kvbench's own cost (costs.py)
        return None

    def close(self):
        self.pools = []
