"""The mpi transport's per-request calls made from C (kvbench/_mpicalls.c): a request's Puts or Gets, the
Flush and its completion notice, and the destination's receive and Win.Sync, each one Python call.

They are the same MPI functions mpi4py calls, found in the MPI library mpi4py loaded and called with
mpi4py's own handles; mpi4py's per-call Python (about a microsecond a call) would otherwise be part of
every small layer's time.  ``-O calls=mpi4py`` keeps every call in mpi4py, for comparison.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

FUNCTIONS = ("MPI_Put", "MPI_Get", "MPI_Win_flush", "MPI_Send", "MPI_Recv", "MPI_Get_count", "MPI_Win_sync",
             "MPI_Comm_rank")


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the shared libraries in this process whose name starts with libmpi (MPICH's, Open MPI's,
    Intel MPI's, Cray's libmpich, the MPI ABI's libmpi_abi), in load order."""
    import psutil

    seen: list[str] = []
    for m in psutil.Process().memory_maps(grouped=True):
        base = os.path.basename(m.path)
        if base.startswith("libmpi") and ".so" in base and m.path not in seen:
            seen.append(m.path)
    return seen


def _addresses() -> tuple[dict[str, int] | None, str]:
    """The functions' addresses from a loaded MPI library, or (None, why not)."""
    # mpi4py loads its MPI without exporting it to the process (RTLD_LOCAL): open the loaded library again
    flags = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_NOW", 2)
    tried = []
    for path in _loaded_mpi_libraries():
        try:
            lib = ctypes.CDLL(path, mode=flags)
            return {f: ctypes.cast(getattr(lib, f), ctypes.c_void_p).value for f in FUNCTIONS}, path
        except (OSError, AttributeError) as exc:
            tried.append(f"{os.path.basename(path)}: {str(exc).splitlines()[0]}")
    return None, "no loaded libmpi* library exports " + ", ".join(FUNCTIONS) + (f" ({'; '.join(tried)})" if tried else "")


class NativeCalls:
    """Bound to one window, communicator and the transport's two notice buffers (their addresses taken once:
    numpy's ``ctypes.data`` costs a microsecond a call); ``reason`` says why it is off (then nothing else is
    used)."""

    def __init__(self, MPI, comm, win, one: np.ndarray, notes: np.ndarray):
        self.reason = ""
        self.library = ""
        try:
            from kvbench import _mpicalls
        except ImportError as exc:
            self.reason = f"kvbench._mpicalls is not built ({exc}): run make install"
            return
        fns, where = _addresses()
        if fns is None:
            self.reason = where
            return
        self.c, self.library = _mpicalls, where
        hsize = MPI._sizeof(MPI.Win)
        self.win, self.comm = MPI._handleof(win), MPI._handleof(comm)
        self.hsize, self.byte, int64 = hsize, MPI._handleof(MPI.BYTE), MPI._handleof(MPI.INT64_T)
        # the library found must be the one behind mpi4py's handles: ask it this rank through the handle
        rc, rank = _mpicalls.comm_rank(fns["MPI_Comm_rank"], hsize, self.comm)
        if rc != 0 or rank != comm.Get_rank():
            self.reason = f"{os.path.basename(where)} does not answer for mpi4py's communicator (rc {rc}, rank {rank})"
        self.fns = {"push": fns["MPI_Put"], "pull": fns["MPI_Get"]}
        self._keep = (one, notes)  # the buffers whose addresses the calls below use
        self._flush = (fns["MPI_Win_flush"], fns["MPI_Send"], hsize, self.win)
        self._note = (one.ctypes.data, len(one), int64)
        self._recv = (fns["MPI_Recv"], fns["MPI_Get_count"], fns["MPI_Win_sync"], hsize, notes.ctypes.data,
                      len(notes), int64)

    def rma(self, op: str, peer: int, base: int, descs: np.ndarray, ocol: int, tcol: int) -> tuple[int, int]:
        """Put (push) or Get (pull) every row of ``descs`` as its own contiguous call: (rc, failing row)."""
        return self.c.rma(self.fns[op], self.hsize, base, descs, ocol, tcol, peer, self.byte, self.win)

    def flush_send(self, peer: int, send: bool, tag: int) -> int:
        """Flush the peer; then (``send``) send it the one-tag buffer with ``tag``."""
        flush, fsend, hsize, win = self._flush
        return self.c.flush_send(flush, fsend if send else 0, hsize, win, peer, *self._note, tag, self.comm)

    def recv_sync(self, peer: int, tag: int) -> tuple[int, int]:
        """Receive int64s from ``peer`` into the notice buffer, then Win.Sync: (rc, how many arrived)."""
        return self.c.recv_sync(*self._recv, peer, tag, self.comm, self.win)
