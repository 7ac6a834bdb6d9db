"""shm: one-sided copies through POSIX shared memory (the host analogue of CUDA IPC).

Each rank's pool *is* a named segment in /dev/shm, registered once; a peer
maps it and then push copies straight into the peer's pool and pull copies
straight out of it: one memcpy per descriptor in C, one call per layer.

Segments are unlinked as soon as every rank has mapped its peers
(``ready``), so a crash or a killed rank later in the run cannot leave them
behind in /dev/shm; the mappings stay valid until the process exits.  An
``atexit`` hook covers the short window before that; a segment is named by
``cleanup.segment_path`` (run id, rank and pid), so that what a killed rank
leaves can be swept by a later run (``cleanup.sweep_orphans``).

Filling a segment past the free space of /dev/shm is a SIGBUS, not a Python
error (a container's may be small: docs/pitfalls.md#small-dev-shm), so ``alloc`` checks the free space first.
"""
from __future__ import annotations

import atexit
import errno
import mmap
import os
import time

import numpy as np

from kvbench import _native, memory
from kvbench.job import cleanup

from .base import Buffer, Caps, Transport, TransportError, check_descs


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmTransport(Transport):
    name = "shm"
    caps = Caps(memory=("host",), one_sided=True, notifies=False, codec_frames="doorbell",
                unregistered="shm registers nothing: its pool is a shared-memory segment its peer maps at connect",
                no_hugetlb="shm's pool is a /dev/shm segment (tmpfs), which takes no hugetlb pages: --pages thp "
                           "asks tmpfs for huge pages (docs/pages.md)")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.path = None
        self.pool = None
        self.peers: dict[int, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []

    @classmethod
    def probe(cls):
        shm_dir = cleanup.SHM_DIR
        if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
            return f"{shm_dir} is not a writable directory"
        return None

    @classmethod
    def memory_needs(cls, nbytes, options):
        return {"shm": nbytes}

    def alloc(self, nbytes: int) -> Buffer:
        """The pool lives in a named shared segment so that peers can map it."""
        size = max(nbytes, mmap.PAGESIZE)
        free = cleanup.shm_free_bytes()
        if size > free:  # past this the fill below is a SIGBUS, not an exception (docs/pitfalls.md#small-dev-shm)
            raise TransportError(
                f"shm: the pool needs {_size(size)} in {cleanup.SHM_DIR} but {_size(free)} is free: give the "
                "container a larger /dev/shm (docker run --shm-size=..., Kubernetes: an emptyDir with medium: "
                "Memory), or lower --tokens/--pool-factor")
        self.path = cleanup.segment_path(self.ctx.run_id, self.ctx.rank)
        atexit.register(_unlink, self.path)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            try:  # reserve the pages now: another rank on this host may have taken the space since the check
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # those: no fallocate here, statvfs only
                    _unlink(self.path)
                    raise TransportError(f"shm: cannot reserve {_size(size)} in {cleanup.SHM_DIR}: {exc.strerror}: "
                                         "give the container a larger /dev/shm (docker run --shm-size=...), "
                                         "or lower --tokens/--pool-factor") from None
            arr = self._map(fd, size)[:nbytes]
        finally:
            os.close(fd)
        arr.fill(0)  # pre-fault (the pages are reserved above: no SIGBUS here or mid-run)
        if self.ctx.pages == "thp":  # fallocate took 4 KiB pages before any advice could apply: collapse them
            memory.collapse(arr)
        return Buffer(arr, lambda: _unlink(self.path))

    def register(self, pool) -> bytes:
        if self.path is None:
            raise TransportError("shm pools must come from ShmTransport.alloc")
        self.pool = pool
        return self.path.encode()

    def connect(self, peers: dict[int, bytes]) -> None:
        for rank, meta in peers.items():
            path = meta.decode()
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise TransportError(f"cannot open rank {rank}'s segment {path}: {exc.strerror} "
                                     "(shm needs all ranks on one host)") from None
            try:
                size = os.fstat(fd).st_size
                # populate the page tables now: a peer's first touch of each page must not land in a timed copy
                self.peers[rank] = self._map(fd, size, getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)

    def _map(self, fd: int, size: int, extra_flags: int = 0) -> np.ndarray:
        """A segment mapped MAP_SHARED.  Pages "thp": on a huge page boundary, marked MADV_HUGEPAGE, so that
        the segment's huge pages (``alloc`` collapses them) are mapped with PMDs here and in the peers;
        "4k": marked MADV_NOHUGEPAGE; "huge": hugetlb pages do not live on tmpfs (``pages`` says so)."""
        if self.ctx.pages == "thp":
            arr = memory.map_shared(fd, size, memory.thp_size(), extra_flags)
            advice = memory.host.MADV_HUGEPAGE
        else:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | extra_flags)
            self._maps.append(mm)
            arr = np.frombuffer(mm, dtype=np.uint8)
            advice = memory.host.MADV_NOHUGEPAGE if self.ctx.pages == "4k" else None
        if advice is not None:
            memory.host.madvise(arr, advice)
        return arr

    def ready(self) -> None:
        if self.path:
            _unlink(self.path)

    def post(self, op, peer, descs, tag=0):
        return self.start(self.prepare(op, peer, descs, tag))

    def prepare(self, op, peer, descs, tag=0):
        """The checks, ahead of the layer: ``start`` is the copy alone."""
        remote = self.peers[peer]
        if op == "push":
            check_descs(descs, self.pool.nbytes, remote.nbytes)
            return remote, self.pool.array, descs
        check_descs(descs, remote.nbytes, self.pool.nbytes)
        return self.pool.array, remote, descs

    def start(self, prepared):
        a = time.perf_counter()
        _native.copy_batch(*prepared)
        self.lib_s += time.perf_counter() - a  # the copy is this path's wire, not kvbench's own cost (costs.py)
        return None

    def pages(self, pool) -> dict:
        """What the segment got, here and as the peers map it: /dev/shm is tmpfs, whose mount's ``huge=``
        policy decides (memory.tmpfs_huge); hugetlb pages are not offered (they need a hugetlbfs mount)."""
        want, policy = self.ctx.pages, memory.tmpfs_huge(cleanup.SHM_DIR)
        rep = dict(memory.page_report(pool.array), applied=want if want in ("4k", "thp") else "own",
                   tmpfs_huge=policy)
        if self.peers:
            rep["peer_huge_share"] = {r: memory.page_report(a)["huge_share"] for r, a in sorted(self.peers.items())}
        if want == "huge":
            rep["note"] = f"shm: a {cleanup.SHM_DIR} segment (tmpfs) cannot take hugetlb pages; page size is tmpfs's"
        elif want == "thp" and not rep["huge_share"]:
            rep["note"] = (f"shm: the kernel gave the segment no huge pages (MADV_COLLAPSE refused; {cleanup.SHM_DIR} "
                           f"is mounted huge={policy})")
        return rep

    def info(self):
        return {"segment": self.path}

    def close(self):
        self.peers.clear()
        self._maps.clear()  # the arrays hold the maps; they go with the last reference
        if self.path:
            _unlink(self.path)
