"""mpi-sendrecv (or ``mpi`` with ``-O mode=sendrecv``): two-sided Isend/Irecv
straight from and into the pools, for comparison with one-sided ``mpi``.
Options: ``prep`` (see mpi.py).
"""
from __future__ import annotations

import time

import numpy as np

from .base import DST, OPS, SRC, Buffer, Caps, TransportError
from .mpi_common import MpiBase, fail, mpi


class MpiSendRecvTransport(MpiBase):
    """Two-sided MPI: the source Isends straight from its pool and the
    destination Irecvs into its pool, each with its own hindexed datatype
    (MPI packs internally); wait = Wait.  No window."""

    name = "mpi-sendrecv"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = Caps(one_sided=False, multi_node=True, notifies=True, network=True,
                unregistered="mpi-sendrecv registers nothing itself: the MPI library registers (if at all) per message")
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
        self._empty = [b"", 0, mpi().BYTE]  # a pull's request: zero bytes
        self._open = True

    def _msg(self, sending: bool, peer: int, descs: np.ndarray) -> tuple:
        """The pool as a message of the descriptors' datatype, and the datatype to free after posting."""
        (dtype,) = self._types.get(descs, (SRC if sending else DST,), self._bounds(peer, sending))
        return [self._arr, 1, dtype], dtype

    def _irecv(self, peer: int, descs: np.ndarray, tag: int):
        """Post the receive of ``descs`` into the pool."""
        msg, dtype = self._msg(False, peer, descs)
        a = time.perf_counter()
        req = self._comm.Irecv(msg, peer, tag)
        self.lib_s += time.perf_counter() - a
        self._types.done((dtype,))
        return req

    def _isend(self, msg: list, dtype, peer: int, tag: int):
        """Send a message built ahead (``_msg``, held since): post it, then release its datatype."""
        a = time.perf_counter()
        req = self._comm.Isend(msg, peer, tag)
        self.lib_s += time.perf_counter() - a
        self._types.done((dtype,))
        self._types.posted()
        return req

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Ahead of the layer: the message; a pull also posts its receive into the pool here (a receive needs
        nothing from the source, whose data goes out only when asked), so ``start`` sends one message."""
        if op not in OPS:
            raise TransportError(f"op '{op}' is not one of: {', '.join(OPS)}")
        tag %= self._tag_mod
        if op == "push":
            msg = self._msg(True, peer, descs)
            self._types.hold()  # its datatype stays alive until start posts it
            return op, peer, tag, *msg
        return op, peer, tag, self._empty, None, self._irecv(peer, descs, tag)

    def start(self, prepared):
        """Push: Isend from the pool; pull: ask for the layer (a zero-byte request); its receive is posted."""
        op, peer, tag, msg, dtype = prepared[:5]
        if op == "push":
            return [self._isend(msg, dtype, peer, tag)]
        return [self._comm.Isend(msg, peer, tag), prepared[5]]

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: Isend from the pool; pull: Irecv into the pool, then ask for the layer (a zero-byte request)."""
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: Irecv into the pool.  Pull: only the receive of the destination's request; the data goes
        out in ``answer`` once that request has arrived (never before the destination asked)."""
        tag %= self._tag_mod
        if op == "push":
            return [self._irecv(peer, descs, tag)]
        msg, dtype = self._msg(True, peer, descs)  # the answer's message, built ahead
        self._types.hold()  # until answer posts it
        return _Answer(self._comm.Irecv([bytearray(0), 0, mpi().BYTE], peer, tag), peer, msg, dtype, tag)

    def answer(self, handle) -> None:
        """Pull source: wait for the destination's request, then Isend the layer."""
        if isinstance(handle, _Answer) and handle.send is None:
            try:
                handle.asked.Wait()
                handle.send = self._isend(handle.msg, handle.dtype, handle.peer, handle.tag)
            except mpi().Exception as exc:
                raise fail(exc) from None

    def wait(self, handle) -> None:
        """Wait for the sends and receives (a pull source answers first, if the harness has not)."""
        if handle is None:
            return
        if isinstance(handle, _Answer):
            self.answer(handle)
            handle = [handle.send]
        try:
            mpi().Request.Waitall(handle)
        except mpi().Exception as exc:
            raise fail(exc) from None

    def close(self) -> None:
        """Free cached datatypes; idempotent."""
        self._open = False
        self._types.clear(closing=True)


class _Answer:
    """A pull source's layer: the destination's request being received, then the send."""

    __slots__ = ("asked", "peer", "msg", "dtype", "tag", "send")

    def __init__(self, asked, peer: int, msg: list, dtype, tag: int):
        self.asked, self.peer, self.msg, self.dtype, self.tag, self.send = asked, peer, msg, dtype, tag, None
