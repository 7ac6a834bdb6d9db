"""mpi-sendrecv (or ``mpi`` with ``-O mode=sendrecv``): two-sided Isend/Irecv
straight from and into the pools, for comparison with one-sided ``mpi``.
Options: ``prep`` (see mpi.py).
"""
from __future__ import annotations

import numpy as np

from .base import DST, OPS, SRC, Buffer, Caps, TransportError
from .mpi_common import MpiBase, fail, mpi


class MpiSendRecvTransport(MpiBase):
    """Two-sided MPI: the source Isends straight from its pool and the
    destination Irecvs into its pool, each with its own hindexed datatype
    (MPI packs internally); wait = Wait.  No window."""

    name = "mpi-sendrecv"
    caps = Caps(one_sided=False, multi_node=True, notifies=True, network=True)
    MODE = "sendrecv"

    def alloc(self, nbytes: int) -> Buffer | None:
        """The harness allocates: two-sided needs no window."""
        return None

    def register(self, pool) -> bytes:
        """Keep the pool; metadata = its size."""
        self._setup()
        self._arr = pool.array
        return int(pool.nbytes).to_bytes(8, "little")

    def ready(self) -> None:
        """Nothing to open."""
        self._open = True

    def _xfer(self, sending: bool, peer: int, descs: np.ndarray, tag: int):
        (dtype,) = self._types.get(descs, (SRC if sending else DST,), self._bounds(peer, sending))
        msg, tag = [self._arr, 1, dtype], tag % self._tag_mod
        req = self._comm.Isend(msg, peer, tag) if sending else self._comm.Irecv(msg, peer, tag)
        self._types.done((dtype,))
        return ("req", req)

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: Isend from the pool; pull: Irecv into the pool."""
        if op not in OPS:
            raise TransportError(f"op '{op}' is not one of: {', '.join(OPS)}")
        return self._xfer(op == "push", peer, descs, tag)

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: Irecv into the pool; pull: Isend from the pool."""
        return self._xfer(op == "pull", peer, descs, tag)

    def wait(self, handle) -> None:
        """Wait for the send or receive."""
        if handle is not None:
            try:
                handle[1].Wait()
            except mpi().Exception as exc:
                raise fail(exc) from None

    def close(self) -> None:
        """Free cached datatypes; idempotent."""
        self._open = False
        self._types.clear()
