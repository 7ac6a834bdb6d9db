"""staged: device -> bounce buffer (gather) -> an inner host transport -> bounce buffer -> device (scatter).

The host-staged fallback for GPU pairs without peer-to-peer or GPUDirect.  A layer is cut into chunks of
``chunk_kib``; per peer and direction a ring of ``slots`` chunk-sized slots in one bounce buffer (page-locked
beside a GPU; plain page-aligned memory on CPU tensors: nothing page-locks without CUDA), registered once by the
inner transport.  Pipelined (default): the source gathers chunk k+1 while chunk k is on the wire, the destination
scatters chunk k while chunk k+1 lands; ``-O pipeline=off`` moves each layer whole, one stage after the other.

Both ends number a peer's chunks alike (the harness handles a peer's layers in one order): chunk n uses slot
n % slots on both.  A source reuses a slot once its send is complete; a destination gives a slot back (its next
receive) only after scattering it, so the inner transport must be two-sided (tcp, ucx, mpi in sendrecv mode): a
one-sided write could land in a slot still being scattered.  Rows carry gather_s, wire_s and scatter_s.
"""
from __future__ import annotations

import collections
import queue
import threading
import time

import numpy as np

from kvbench.memory import copy as C
from kvbench.transports import load

from ..memory import device
from .base import Caps, Context, Transport, TransportError, Unavailable, check_descs
from .staging import _Job, _tag, _tensor, bounce_buffer, split

INNER = {"tcp": {}, "ucx": {}, "mpi": {"mode": "sendrecv"}}  # two-sided host transports and the options they need


class StagedTransport(Transport):
    name = "staged"
    caps = Caps(memory=("torch-cpu", "pinned", "cuda"), ops=("push", "pull"), one_sided=False, multi_node=True,
                notifies=True, network=True, stamps=True)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        o = ctx.options
        self.inner_name = str(o.get("inner", "tcp"))
        if self.inner_name not in INNER:
            raise TransportError(f"staged: inner '{self.inner_name}' is not one of {', '.join(INNER)} (two-sided "
                                 "host transports: a one-sided write would land in a slot still being scattered)")
        self.pipeline = o.get("pipeline", "on") == "on"
        self.chunk = int(o.get("chunk_kib", 1024)) << 10
        self.slots = int(o.get("slots", 2)) if self.pipeline else 1
        self.engine = ctx.copy
        try:
            cls = load(self.inner_name)
        except Unavailable as exc:
            raise TransportError(f"staged: inner transport {self.inner_name}: {exc}") from None
        self.inner = cls(Context(ctx.rank, ctx.world_size, ctx.hostname, ctx.run_id + "s", ctx.token,
                                 dict(INNER[self.inner_name]), pages=ctx.pages))
        self.stats = collections.Counter()
        self.lock = threading.Lock()
        self.error: Exception | None = None
        self.live: set[_Job] = set()  # posted and not yet waited for: failed at once when a thread fails
        self.threads: list[threading.Thread] = []
        self.queues: dict[tuple[int, str], queue.SimpleQueue] = {}
        self.bounce = None

    @classmethod
    def probe(cls) -> str | None:
        why = device.probe("torch-cpu")  # every device kind needs torch; cuda and pinned are checked per case
        return f"no device memory here: {why}" if why else None

    # ----- setup --------------------------------------------------------------------------
    def _ring(self, rank: int, peer: int, sending: bool) -> int:
        """Offset in ``rank``'s bounce buffer of its ring towards (sending) or from ``peer``."""
        j = peer if peer < rank else peer - 1
        return (2 * j + (0 if sending else 1)) * self.per

    def register(self, pool) -> bytes:
        self.pool, self.dev = pool, device.buf(pool)
        # pipeline off: a layer moves whole, so a ring is one slot as large as the pool (a layer fits in it)
        self.per = self.slots * self.chunk if self.pipeline else pool.nbytes
        if not self.pipeline:
            self.chunk = self.per
        nbytes = 2 * self.per * max(1, self.ctx.world_size - 1)
        self.bounce, self._keep = bounce_buffer(self.inner, nbytes, pool.kind, self.ctx.pages)
        self.btensor = _tensor(self.bounce.array)
        return self.inner.register(self.bounce)

    def connect(self, peers: dict[int, bytes]) -> None:
        self.inner.connect(peers)
        for p in peers:
            for role, target in (("src", self._src_loop), ("dst", self._dst_loop)):
                self.queues[(p, role)] = queue.SimpleQueue()
                self._start(target, p)

    def ready(self) -> None:
        self.inner.ready()

    def _start(self, fn, peer: int) -> None:
        th = threading.Thread(target=self._guard, args=(fn, peer), daemon=True)
        th.start()
        self.threads.append(th)

    # ----- the protocol -------------------------------------------------------------------
    def _job(self, op: str, peer: int, descs: np.ndarray, tag: int, source: bool) -> _Job:
        if self.error is not None:
            raise TransportError(f"staged: {self.error}")
        big = 1 << 62  # the peer's side is checked there
        check_descs(descs, self.pool.nbytes if source else big, big if source else self.pool.nbytes)
        job = _Job(op, peer, split(descs, self.chunk), tag)
        self.live.add(job)
        return job

    ahead = False  # a registration starts the destination thread's wire clock: inside the iteration only

    def post(self, op, peer, descs, tag=0):
        job = self._job(op, peer, descs, tag, op == "push")
        self.queues[(peer, "src" if op == "push" else "dst")].put(job)
        return job

    def serve(self, op, peer, descs, tag=0):
        job = self._job(op, peer, descs, tag, op == "pull")
        if op == "push":
            self.queues[(peer, "dst")].put(job)
        return job

    def answer(self, handle) -> None:
        """Pull source: the layer is final: gather and send it as its destination asks for it."""
        self.queues[(handle.peer, "src")].put(handle)

    def wait(self, handle) -> float | None:
        handle.done.wait()
        self.live.discard(handle)
        if handle.error is not None:
            raise TransportError(f"staged: {handle.error}")
        return handle.at

    def take_stages(self) -> dict:
        """Seconds this rank's threads spent per stage since the last call (the harness takes them per iteration):
        gather and scatter copying, wire posting and waiting for the inner transport.  Stages overlap in time, so
        they add up to more than the transfer when the pipeline works and to about it when it does not."""
        with self.lock:
            out = {k: self.stats[k] for k in ("gather", "wire", "scatter")}
            self.stats.clear()
        return out

    # ----- threads ------------------------------------------------------------------------
    def _add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        with self.lock:
            self.stats[stage] += now - since
        return now

    def _guard(self, fn, peer: int) -> None:
        try:
            fn(peer)
        except Exception as exc:  # fail every job of this transport: both ends stop instead of hanging
            self.error = self.error or exc
            for job in list(self.live):
                job.error = job.error or exc
                job.done.set()
            for q in self.queues.values():
                q.put(None)

    def _copy(self, descs: np.ndarray, to_bounce: bool) -> None:
        dst, src = (self.btensor, self.dev) if to_bounce else (self.dev, self.btensor)
        C.copy(self.engine, dst, src, np.ascontiguousarray(descs))
        C.sync(dst, src)

    def _src_loop(self, peer: int) -> None:
        """Gather chunk n into slot n % slots once that slot's previous send is complete, and post it; the wire
        (the kernel's socket buffers, the inner transport's threads) carries chunk n while chunk n+1 is gathered.
        One thread: a hand-off between threads per chunk cost more than a chunk's copy on a busy 2-core VM."""
        base, there = self._ring(self.ctx.rank, peer, True), self._ring(peer, self.ctx.rank, False)
        window, n = collections.deque(), 0
        while True:
            job = self._next((peer, "src"), block=not window)
            if job is None and window:  # nothing new to gather: finish the oldest send
                self._retire(window)
                continue
            if job is None:
                return self._fail_pending()
            for i, ch in enumerate(job.chunks):
                if len(window) == self.slots:
                    self._retire(window)
                off = (n % self.slots) * self.chunk
                n += 1
                t = time.perf_counter()
                self._copy(np.stack([ch[:, 0], base + off + ch[:, 3], ch[:, 2]], axis=1), True)
                t = self._add("gather", t)
                d = np.array([[base + off, there + off, int(ch[:, 2].sum())]], dtype=np.int64)
                if job.op == "push":
                    h = self.inner.post("push", peer, d, _tag(job.tag, i))  # tcp: the bytes go out in this call
                else:
                    h = self.inner.serve("pull", peer, d, _tag(job.tag, i))
                    self.inner.answer(h)
                self._add("wire", t)
                window.append((job, i, h))
            if not job.chunks:
                job.done.set()

    def _retire(self, window) -> None:
        """The oldest send of a source's window is complete: its slot is free (and its layer, if last, done)."""
        job, i, h = window.popleft()
        t = time.perf_counter()
        self.inner.wait(h)
        self._add("wire", t)
        if i == len(job.chunks) - 1:
            job.done.set()

    def _dst_loop(self, peer: int) -> None:
        """Keep ``slots`` receives out; as the oldest lands, scatter it and give its slot back."""
        here, there = self._ring(self.ctx.rank, peer, False), self._ring(peer, self.ctx.rank, True)
        window, pending, n = collections.deque(), collections.deque(), 0
        while True:
            while len(window) < self.slots:
                if not pending:
                    job = self._next((peer, "dst"), block=not window)
                    if job is None:
                        if not window:
                            return self._fail_pending()
                        break
                    if not job.chunks:
                        job.done.set()
                        continue
                    pending.extend((job, i) for i in range(len(job.chunks)))
                job, i = pending.popleft()
                off = (n % self.slots) * self.chunk
                n += 1
                ch = job.chunks[i]
                d = np.array([[there + off, here + off, int(ch[:, 2].sum())]], dtype=np.int64)
                op = "push" if job.op == "push" else "pull"
                h = (self.inner.serve if op == "push" else self.inner.post)(op, peer, d, _tag(job.tag, i))
                window.append((job, i, off, h))
            job, i, off, h = window.popleft()
            t = time.perf_counter()  # wire: the time this thread waits for bytes (not the time they are in flight)
            self.inner.wait(h)
            t = self._add("wire", t)
            ch = job.chunks[i]
            self._copy(np.stack([here + off + ch[:, 3], ch[:, 1], ch[:, 2]], axis=1), False)
            job.at = self._add("scatter", t)
            if i == len(job.chunks) - 1:
                job.done.set()

    def _next(self, key, block: bool = True):
        try:
            item = self.queues[key].get(block=block)
        except queue.Empty:
            return None
        if item is None:
            self.queues[key].put(None)  # every loop of this key sees the end
        return item

    def _fail_pending(self) -> None:
        """After an error or close: jobs still queued fail instead of leaving their waiters hanging."""
        for q in self.queues.values():
            while True:
                try:
                    job = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, _Job):
                    job.error = job.error or self.error or "closed"
                    job.done.set()
            q.put(None)

    def info(self) -> dict:
        kind = "page-locked" if self.bounce is not None and self.bounce.kind == "pinned" else \
            "pageable (page-locking needs CUDA)"
        return {"inner": self.inner_name, "pipeline": "on" if self.pipeline else "off", "chunk_bytes": self.chunk,
                "slots": self.slots, "copy": self.engine, "bounce": kind, "inner_info": self.inner.info()}

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for th in self.threads:
            th.join(timeout=5)
        self.inner.close()
        if self.bounce is not None:
            self.bounce.release()
            self.bounce = None
