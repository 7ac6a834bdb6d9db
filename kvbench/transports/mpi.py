"""mpi: one-sided MPI RMA on a window that exposes the pool (``-O mode=sendrecv``
selects the two-sided ``mpi-sendrecv`` of mpi_sendrecv.py, for comparison).
On clusters MPI runs over UCX/verbs/OFI, so this is also an RDMA path there.

A layer moves in ONE MPI call: the descriptor columns become hindexed byte
datatypes (origin and target side), so MPI walks the blocks, not Python; a
layer of at most ``split`` ranges (bulk, coalesced) moves as contiguous calls.

Options (``ctx.options``):
  window   "allocate" (default; MPI.Win.Allocate provides the pool, which MPICH
           shares between the ranks of a node) or "create" (Win.Create over
           the harness's pool; slower on MPICH within a node: docs/evidence.md)
  epoch    "lock_all" (default; one passive epoch from ready() to close()) or
           "lock" (Lock a peer at its first post, Unlock it at the last wait)
  prep     "on" (default): keep the committed datatypes while a descriptor array
           is unchanged (like nixl's prep=on: off the per-layer path); "off": build,
           commit and free them in every post, as a request with a new block table must
  split    N (default 4): a layer of at most N descriptors (bulk rows, coalesced
           contiguous allocations: 1-2 per layer) moves as N contiguous calls
           instead of one hindexed call.  MPICH copies between two non-contiguous
           datatypes through a 16 KiB bounce buffer (MPIR_Localcopy), slower than a
           contiguous Put within a node (docs/evidence.md); 0: always one hindexed call.
  calls    "native" (default): a request's contiguous Puts/Gets, the Flush with its
           completion notice and the destination's receive with Win.Sync are each
           one call into C (mpi_native.py), as a C engine makes them; "mpi4py":
           every MPI call through mpi4py (about a microsecond of Python each).
           Where the C calls cannot be set up, mpi4py is used and info() says why.
"""
from __future__ import annotations

import time

import numpy as np

from kvbench.transports.mpi_sendrecv import MpiSendRecvTransport

from .. import memory
from .base import DST, LEN, OPS, SRC, Buffer, Caps, TransportError, check_descs
from .mpi_common import MpiBase, fail, mpi
from .mpi_native import NativeCalls

_NOTE_TAG = 32000  # completion notifications (MPI guarantees tags up to 32767)
_NOTE_MAX = 1024  # tags per notification message


class MpiTransport(MpiBase):
    """One-sided MPI: push = Put, pull = Get, completion = Win.Flush(peer).

    notifies=True: a Flush completes every operation posted to the peer so
    far, so after each Flush the initiator Isends ONE message listing the tags
    of the pushes it completed (not one per layer: a message per layer cost
    measurable time, docs/evidence.md); the destination's wait receives messages until
    its tag is listed and calls Win.Sync once per message, which MPI's memory
    model requires at the target once it learns of the completion (it matters
    on weakly ordered CPUs such as Grace).  Only the window's owner can do
    that, so it is not left to the harness.
    """

    name = "mpi"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = Caps(one_sided=True, multi_node=True, notifies=True, network=True)

    def __new__(cls, ctx):
        # -O mode=sendrecv on transport "mpi" selects the two-sided class (also "mpi-sendrecv")
        if cls is MpiTransport and ctx.options.get("mode", "rma") == "sendrecv":

            return MpiSendRecvTransport(ctx)  # not an MpiTransport: built (and initialised) here
        return super().__new__(cls)

    def __init__(self, ctx):
        super().__init__(ctx)
        opts = ctx.options
        self.window = opts.get("window", "allocate")
        self.epoch = opts.get("epoch", "lock_all")
        if self.window not in ("allocate", "create"):
            raise TransportError(f"window '{self.window}' is not one of: allocate, create")
        if self.epoch not in ("lock_all", "lock"):
            raise TransportError(f"epoch '{self.epoch}' is not one of: lock_all, lock")
        try:
            self.split = int(opts.get("split", 4))
        except ValueError:
            raise TransportError(f"mpi option split='{opts['split']}' must be an integer >= 0") from None
        if self.split < 0:
            raise TransportError(f"mpi option split={self.split} must be >= 0")
        self.calls = opts.get("calls", "native")
        if self.calls not in ("native", "mpi4py"):
            raise TransportError(f"mpi option calls='{self.calls}' is not one of: native, mpi4py")
        self._native: NativeCalls | None = None
        self._native_off = "" if self.calls == "native" else "-O calls=mpi4py"  # why mpi4py makes every call
        self._win = None
        self._owned = False  # the window's memory came from Win.Allocate
        self._posted: dict[int, int] = {}  # peer -> operations posted so far
        self._flushed: dict[int, int] = {}  # peer -> operations known complete
        self._locked: set[int] = set()
        self._sends: list = []  # (request, tag array) of notifications in flight
        self._pending: dict[int, list[int]] = {}  # peer -> tags pushed since its last Flush
        self._landed: dict[int, set[int]] = {}  # peer -> tags notified but not yet waited for
        self._note_buf = np.empty(_NOTE_MAX, dtype=np.int64)
        self._one = np.empty(1, dtype=np.int64)  # a one-tag notification's buffer (sent eagerly)
        self._plans: dict = {}  # (id(descs), op, peer) -> (descs, call arguments): prep=on

    @classmethod
    def memory_needs(cls, nbytes, options):
        # MPICH backs a Win.Allocate window with a /dev/shm segment shared by the node's ranks
        return {"shm": nbytes} if options.get("window", "allocate") == "allocate" and options.get("mode") != "sendrecv" else {}

    def alloc(self, nbytes: int) -> Buffer | None:
        """window == "allocate": Win.Allocate the pool (collective)."""
        if self.window != "allocate":
            return None
        MPI, c = mpi(), self._setup()
        self._win = MPI.Win.Allocate(nbytes, 1, MPI.INFO_NULL, c)
        self._owned = True
        arr = np.frombuffer(self._win.tomemory(), dtype=np.uint8, count=nbytes)
        # pools are released after close(); freeing the window in close()
        # would pull the memory from under the pool, so its release does it
        return Buffer(arr, release=self._free_window)

    def register(self, pool) -> bytes:
        """Expose the pool as the window (collective); metadata = its size."""
        MPI, c = mpi(), self._setup()
        if self._arr is not None:
            raise TransportError("mpi: one pool per transport instance")
        if not self._owned:
            self._win = MPI.Win.Create(pool.array, 1, MPI.INFO_NULL, c)
        elif self._win is None or pool.addr != np.frombuffer(self._win.tomemory(), np.uint8).ctypes.data:
            raise TransportError("mpi: the pool is not the window this transport allocated")
        self._arr = pool.array
        return int(pool.nbytes).to_bytes(8, "little")

    def register_region(self, pool):
        """--pool-sizes: one more window over a region (Win.Create: collective, every rank the same sizes)."""
        return mpi().Win.Create(pool.array, 1, mpi().INFO_NULL, self._comm)

    def deregister_region(self, handle) -> None:
        handle.Free()  # collective

    def ready(self) -> None:
        """Open the passive-target epoch (lock_all: once for the whole run)."""
        if self.epoch == "lock_all" and not self._open:
            self._win.Lock_all(mpi().MODE_NOCHECK)
        if self.calls == "native" and self._native is None and not self._native_off:
            native = NativeCalls(mpi(), self._comm, self._win, self._one, self._note_buf)
            self._native, self._native_off = (None, native.reason) if native.reason else (native, "")
            self._base = self._arr.ctypes.data
        self._open = True

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """The MPI calls' arguments, built (prep=on: found) before the layer is final: ``start`` only calls MPI."""
        if op not in OPS:
            raise TransportError(f"op '{op}' is not one of: {', '.join(OPS)}")
        if not self._open:
            raise TransportError("mpi: post before ready()")
        calls, types = self._calls(op, peer, descs) if len(descs) else (None, None)
        if calls is not None:
            self._types.hold()  # its datatypes stay alive until start posts it
        return op, peer, tag, calls, types

    def start(self, prepared):
        """Put (push) or Get (pull) all of the layer's blocks (one hindexed call, or one call into C)."""
        op, peer, tag, calls, types = prepared
        seq = self._posted.get(peer, 0)
        if calls is not None:
            MPI = mpi()
            try:
                if self.epoch == "lock" and peer not in self._locked:
                    self._win.Lock(peer, MPI.LOCK_SHARED)
                    self._locked.add(peer)
                a = time.perf_counter()
                if type(calls) is tuple:  # native: (descs, origin column, target column), one call into C
                    rc, row = self._native.rma(op, peer, self._base, *calls)
                    if rc:
                        err = fail(MPI.Exception(rc))
                        raise TransportError(f"{err} (descriptor {row} of {len(calls[0])}, rank {peer})")
                else:
                    call = self._win.Put if op == "push" else self._win.Get
                    for origin, target in calls:
                        call(origin, peer, target)
                self.lib_s += time.perf_counter() - a  # within a node MPICH copies in the call
            except MPI.Exception as exc:
                raise fail(exc) from None
            if types is not None:  # prep=off: built for this post alone
                self._types.done(types)
            self._types.posted()
            seq = self._posted[peer] = seq + 1
            if op == "push":
                self._pending.setdefault(peer, []).append(tag)
        return ("rma", op, peer, seq, tag)

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Put (push) or Get (pull) all of the layer's blocks."""
        return self.start(self.prepare(op, peer, descs, tag))

    def _calls(self, op: str, peer: int, descs: np.ndarray) -> tuple[list | tuple, tuple | None]:
        """The (origin, target) arguments of the MPI calls that move ``descs`` (native calls: the rows and their
        origin and target columns), and the datatypes to free after posting (prep=off); prep=on builds them
        once per array (the harness never changes one in place)."""
        key = (id(descs), op, peer)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is descs:
            return hit[1], None
        if self._types.enabled and len(self._plans) >= 4096:  # together, and before building: no plan keeps a
            self._plans.clear()                                 # datatype its cache has freed
            self._types.clear()  # retired, not freed, while a prepared post holds them
        MPI, types = mpi(), None
        cols = (SRC, DST) if op == "push" else (DST, SRC)  # (origin, target)
        if len(descs) <= self.split * self.layers_in(descs):  # a few ranges a layer: contiguous calls (`split`)
            check_descs(descs, *self._bounds(peer, op == "push"))
            arr, o, t = self._arr, cols[0], cols[1]
            if self._native is not None and int(descs[:, LEN].max()) < 2 ** 31:  # C calls take int counts
                calls = (np.ascontiguousarray(descs, dtype=np.int64), o, t)
            else:
                calls = [([arr[r[o]:r[o] + r[LEN]], r[LEN], MPI.BYTE], (r[t], r[LEN], MPI.BYTE))
                         for r in descs.tolist()]
        else:
            types = self._types.get(descs, cols, self._bounds(peer, op == "push"))
            calls = [([self._arr, 1, types[0]], (0, 1, types[1]))]
        if self._types.enabled:
            self._plans[key] = (descs, calls)
            return calls, None
        return calls, types

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: the handle names the notification to wait for; pull: nothing."""
        return ("note", peer, tag) if op == "push" else None

    def _flush(self, peer: int) -> None:
        """Flush the peer (every operation posted to it so far completes), then tell it which of its pushes
        have landed."""
        tags = self._pending.pop(peer, [])
        if self._native is None:
            self._win.Flush(peer)
            self._notify(peer, tags)
            return
        # the Flush and a one-tag notice in one call into C
        if len(tags) == 1:
            self._one[0] = tags[0]
        rc = self._native.flush_send(peer, len(tags) == 1, _NOTE_TAG)
        if rc:
            raise fail(mpi().Exception(rc))
        if len(tags) > 1:
            self._notify(peer, tags)

    def _notify(self, peer: int, tags: list[int]) -> None:
        """Tell the peer which of its pushes have landed (one message per 1024 tags)."""
        MPI = mpi()
        # one push (a serial request): 8 bytes, which every MPI we know sends eagerly (MPICH, Open MPI), so
        # the blocking Send returns at once and there is no request to keep
        if len(tags) == 1:
            self._one[0] = tags[0]
            self._comm.Send([self._one, MPI.INT64_T], peer, _NOTE_TAG)
            return
        for i in range(0, len(tags), _NOTE_MAX):
            arr = np.array(tags[i:i + _NOTE_MAX], dtype=np.int64)
            self._sends.append((self._comm.Isend([arr, MPI.INT64_T], peer, _NOTE_TAG), arr))
        if len(self._sends) >= 256:
            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends.clear()

    def _await_note(self, peer: int, tag: int) -> None:
        """Destination: receive notifications from ``peer`` until ``tag`` is listed; Win.Sync after each."""
        MPI, landed = mpi(), self._landed.setdefault(peer, set())
        while tag not in landed:
            if self._native is not None and self.epoch == "lock_all":  # the receive and Win.Sync in one C call
                rc, n = self._native.recv_sync(peer, _NOTE_TAG)
                if rc:
                    raise fail(MPI.Exception(rc))
                landed.update(self._note_buf[:n].tolist())
                continue
            st = MPI.Status()
            self._comm.Recv([self._note_buf, MPI.INT64_T], peer, _NOTE_TAG, st)
            landed.update(self._note_buf[: st.Get_count(MPI.INT64_T)].tolist())
            if self.epoch == "lock":  # Win_sync needs a passive epoch (MPICH checks)
                self._win.Lock(self._comm.Get_rank(), MPI.LOCK_SHARED)
            self._win.Sync()
            if self.epoch == "lock":
                self._win.Unlock(self._comm.Get_rank())
        landed.discard(tag)

    def wait(self, handle) -> None:
        """Initiator: Flush the peer (once for all posted so far), then notify what it completed.
        Push destination: wait until the initiator lists this tag (Win.Sync done)."""
        if handle is None:
            return
        MPI = mpi()
        try:
            if handle[0] == "note":
                self._await_note(handle[1], handle[2])
                return
            _, op, peer, seq, tag = handle
            if peer in self._locked and seq == self._posted[peer]:
                self._win.Unlock(peer)  # epoch "lock": the peer's last handle
                self._locked.discard(peer)
                self._flushed[peer] = seq
                self._notify(peer, self._pending.pop(peer, []))
            elif self._flushed.get(peer, 0) < seq:
                self._flushed[peer] = self._posted[peer]  # Flush completes all of them
                self._flush(peer)
            # else: completed and notified by an earlier Flush
        except MPI.Exception as exc:
            raise fail(exc) from None

    def info(self) -> dict:
        """MPI library, mpi4py version, mode, prep, split, window kind, epoch, who makes the calls."""
        info = dict(super().info(), split=self.split, window=self.window, epoch=self.epoch)
        # who makes the per-request calls, and where C was asked for but could not be set up, why not
        info["calls"] = "native" if self._native is not None else "mpi4py" + (f": {self._native_off}" if
                                                                               self._native_off else "")
        if self._owned and self._arr is not None:  # the library chose the window's pages: record what it got
            info["window_pages"] = memory.page_report(self._arr)
        return info

    def close(self) -> None:
        """End the epoch, free datatypes and (window "create") the window; idempotent."""
        if self._sends:
            mpi().Request.Waitall([r for r, _ in self._sends])
            self._sends.clear()
        if self._win is not None and self._open:
            if self.epoch == "lock_all":
                self._win.Unlock_all()
            for peer in sorted(self._locked):
                self._win.Unlock(peer)
            self._locked.clear()
        self._open = False
        self._plans.clear()
        self._types.clear(closing=True)
        if not self._owned:
            self._free_window()

    def _free_window(self) -> None:
        win, self._win = self._win, None
        if win is not None:
            win.Free()  # collective: every rank frees, in the same order
