"""The harness's only door to MPI: rank, roles, barrier, gathers, notifications, abort.

MPI is initialised lazily, on first use, so that ``kvbench size`` and
``kvbench list`` never start MPI, and so that a transport whose library
must be loaded before MPI (ucxx, docs/pitfalls.md#ucx-first) can be imported first.
A process started without ``mpirun`` runs as a world of one.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

_MPI = None

# Every MPI tag kvbench uses, in one place so that no two messages can share one.
_NOTIFY_TAG = 7001  # comm.notify / wait_notify
# an iteration's control plane: what real engines send beside the KV
TAG_REQUEST, TAG_GRANT, TAG_LAYER_READY, TAG_CLOCK, TAG_STATE = 7101, 7102, 7103, 7104, 7105
TAG_T0, TAG_FINAL = 7106, 7107  # after timing: barrier exits, and when the check pass's first layer was final
TAG_P2D, TAG_D2P, TAG_FACTS = 7201, 7202, 7204  # the workload loop: prefill to decode, back, and facts
TAG_FAIL, TAG_ACK = 7301, 7302  # the guard: a rank's failure line to rank 0, and its acknowledgement
TAG_CODEC_TABLE = 7205  # a codec's exponent table, once per connection
TAG_SYNC = 7401  # clock offsets by ping-pong
TAG_CI = 7501  # --target-ci: each rank's samples to rank 0, and rank 0's word on going on (Comm.agree)

NAP_S, NAP_MAX_S = 50e-6, 1e-3  # a sleeping wait's first nap, and its longest


MIN_OPEN_FILES = 64  # MPICH's UCX fails MPI_Init below this (seen at ulimit -n 32), with no word of the limit


def open_files_short() -> str:
    """Why MPI cannot start under this process's open-files limit ('' where it can): said before MPI_Init, whose
    own failure is a UCX traceback on every rank."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= MIN_OPEN_FILES:
        return ""
    fix = ("ulimit -n 4096" if hard == resource.RLIM_INFINITY or hard >= 4096 else
           f"its hard limit is {hard} too: ulimit -Hn 4096 as root, or limits.conf")
    return (f"open files limit (ulimit -n) is {soft}: MPI and its transports need at least {MIN_OPEN_FILES}, and a "
            f"run of several engines more: raise it before mpirun ({fix})")


def _mpi():
    global _MPI
    if _MPI is None:
        import mpi4py

        mpi4py.rc.threads = True
        mpi4py.rc.thread_level = "multiple"  # the tcp transport uses threads beside MPI calls
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def preload(transports: list[str]) -> None:
    """Import libraries that must be loaded before MPI (ucxx's UCX; docs/pitfalls.md#ucx-first)."""
    # several UCX copies (mpich's, NIXL's, ucxx's) each warn about the others' variables
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if "ucx" in transports and _MPI is None:
        # importing ucxx sets UCX_* defaults for itself (rendezvous threshold, memtype cache...);
        # MPICH's own UCX reads the same variables, so keep them out of everybody else's way
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            import ucxx  # noqa: F401
        except Exception:  # missing or broken: the ucx transport reports why
            pass
        for k in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
            del os.environ[k]
        os.environ.update(before)


class Comm:
    """MPI COMM_WORLD as the harness needs it."""

    def __init__(self):
        MPI = _mpi()
        self.world = MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        self.hostname = socket.gethostname()
        self._transport_comm = None
        # zero-byte messages' buffers, built once: notifications sit on timed paths
        self._empty, self._empty_in = [b"", 0, MPI.BYTE], [bytearray(0), 0, MPI.BYTE]

    def barrier(self) -> None:
        """A barrier that spins in MPI: where its exit starts a timed iteration (the ranks leave it together)."""
        self.world.Barrier()

    def barrier_asleep(self) -> None:
        """A barrier that sleeps between tests instead of spinning in MPI, so that a rank done early leaves its
        CPU to the threads of a library still moving its peer's bytes, or to a peer still working (rank 0
        writing the table, another job on a shared node)."""
        asleep(self.world.Ibarrier())

    # The control plane's collectives first wait asleep for every rank to arrive: a rank waiting on its peer's
    # setup, table or footer, or on a stopped peer until a deadline fires, would otherwise spin on a CPU.
    def bcast(self, obj, root: int = 0):
        self.barrier_asleep()
        return self.world.bcast(obj, root=root)

    def allgather(self, obj) -> list:
        self.barrier_asleep()
        return self.world.allgather(obj)

    def gather(self, obj, root: int = 0):
        self.barrier_asleep()
        return self.world.gather(obj, root=root)

    def send(self, obj, dest: int, tag: int = 0) -> None:
        self.world.send(obj, dest=dest, tag=tag)

    def recv(self, source: int, tag: int = 0):
        return self.world.recv(source=source, tag=tag)

    def notify(self, dest: int, tag: int = _NOTIFY_TAG) -> None:
        """Tell ``dest`` that bytes it is waiting for have landed (zero-byte send)."""
        self.world.Send(self._empty, dest, tag)

    def wait_notify(self, source: int, tag: int = _NOTIFY_TAG) -> None:
        """Block until ``source`` calls ``notify`` for us."""
        self.world.Recv(self._empty_in, source, tag)

    def isend_bytes(self, buf, dest: int, tag: int):
        """Non-blocking send of a bytes-like control message; returns a request to ``waitall``."""
        return self.world.Isend([buf, _mpi().BYTE], dest=dest, tag=tag)

    def recv_bytes(self, buf, source: int, tag: int) -> None:
        """Receive a control message of known size into ``buf``."""
        self.world.Recv([buf, _mpi().BYTE], source=source, tag=tag)

    def probe(self, source: int, tag: int) -> int:
        """Block until a message from ``source`` with ``tag`` is there; its size in bytes."""
        st = _mpi().Status()
        self.world.Probe(source=source, tag=tag, status=st)
        return st.Get_count(_mpi().BYTE)

    def waitall(self, requests) -> None:
        if requests:
            _mpi().Request.Waitall(requests)

    def local_rank(self) -> int:
        """This rank's index among the ranks sharing its node (MPI_COMM_TYPE_SHARED; collective)."""
        node = self.world.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank)
        try:
            return node.Get_rank()
        finally:
            node.Free()

    def agree(self, mine, decide, tag: int = TAG_CI):
        """Every rank sends ``mine`` to rank 0, which calls ``decide`` on all of them (in rank order); every rank
        returns rank 0's word, so no two ranks can take different turns (one loops on while another stops)."""
        if self.rank != 0:
            self.send(mine, 0, tag)
            return self.recv(0, tag)
        word = decide([mine] + [self.recv(r, tag) for r in range(1, self.size)])
        for r in range(1, self.size):
            self.send(word, r, tag)
        return word

    def transport_comm(self):
        """A duplicate of COMM_WORLD reserved for the ``mpi`` transport."""
        if self._transport_comm is None:
            self._transport_comm = self.world.Dup()
        return self._transport_comm

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (after the error has been printed)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.world.Abort(code)

    def finalize(self) -> None:
        if self._transport_comm is not None:
            self._transport_comm.Free()
            self._transport_comm = None
        MPI = _mpi()
        if not MPI.Is_finalized():
            MPI.Finalize()

    def library(self) -> str:
        """First line of the MPI library's version string."""
        return _mpi().Get_library_version().strip().splitlines()[0]


def asleep(req) -> None:
    """Wait for an MPI request with naps between tests that grow with the wait (a twentieth of it so far, from
    NAP_S to NAP_MAX_S): a short wait ends within tens of microseconds of its request, a long one costs almost
    no CPU."""
    began = time.perf_counter()
    while not req.Test():
        time.sleep(min(NAP_MAX_S, max(NAP_S, (time.perf_counter() - began) / 20)))


_COMM: Comm | None = None
_LOCK = threading.Lock()


def get() -> Comm:
    """The process's Comm (initialises MPI on first call)."""
    global _COMM
    with _LOCK:
        if _COMM is None:
            _COMM = Comm()
        return _COMM


def transport_comm():
    """For the ``mpi`` transport only: its own communicator."""
    return get().transport_comm()

