"""staged: device -> bounce buffer (gather) -> an inner host transport -> bounce buffer -> device (scatter).

The host-staged fallback for GPU pairs without peer-to-peer or GPUDirect.  A layer is cut into chunks of one
slot (``slot_mib``; ``chunk_kib`` for a finer size); per peer and direction a ring of ``slots`` slots in one
bounce buffer (page-locked beside a GPU; plain page-aligned memory on CPU tensors: nothing page-locks without
CUDA), registered once by the inner transport.

Pipelined (default), per peer and direction two threads run beside each other: at the source a gather thread
fills free slots and a wire thread sends the filled ones; at the destination a wire thread receives into free
slots and a scatter thread empties the landed ones.  Copying and the wire wait for each other only for a slot.
On a GPU a copy into or out of a slot is queued on its thread's stream between the slot's two events, and the
thread that takes the slot next waits for that event, never for the stream: the copying thread goes on with
the next slot meanwhile.  ``-O pipeline=off`` makes a ring one slot as large as the pool: each layer moves
whole, one stage after the other.

Both ends number a peer's chunks alike (the harness handles a peer's layers in one order): chunk n uses slot
n % slots on both.  A source reuses a slot once its send is complete; a destination posts a slot's next receive
only after its scatter has read it, so the inner transport must be two-sided (tcp, ucx, mpi in sendrecv mode): a
one-sided write could land in a slot still being scattered.

Rows carry gather_s, wire_s and scatter_s, each counted by the threads that run it, so stages that overlap add
up to more than the transfer: a copy on the host counts its thread's time, a copy on a GPU the device time
between its slot's events.
"""
from __future__ import annotations

import collections
import queue
import threading
import time

import numpy as np

from kvbench.memory import copy as C
from kvbench.memory import driver
from kvbench.transports import load

from ..memory import device
from .base import Caps, Context, Transport, TransportError, Unavailable, check_descs
from .staging import EMPTY, _Job, _Ring, _Slot, _tag, _take, _tensor, bounce_buffer, pieces

INNER = {"tcp": {}, "ucx": {"mode": "tag"}, "mpi": {"mode": "sendrecv"}}  # two-sided host transports and the options they need


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
        kib = o.get("chunk_kib")
        self.chunk = int(kib) << 10 if kib is not None else int(o.get("slot_mib", 4)) << 20
        self.slots = int(o.get("slots", 3)) if self.pipeline else 1
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
        self.queues: dict[tuple[int, str], queue.SimpleQueue] = {}  # (peer, "src" | "dst") -> its jobs, in order
        self.rings: dict[tuple[int, str], _Ring] = {}
        self.bounce = None
        self.gpu: int | None = None

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
        self.gpu = C._dev(self.dev)  # None: host bytes, whose copies are done when the call returns
        if self.engine == C.AUTO:
            self.engine = C.default(self.name, pool.kind)[0]
        if not self.pipeline:  # a layer moves whole: a ring is one slot as large as the pool (a layer fits in it)
            self.chunk = pool.nbytes
        self.per = self.slots * self.chunk
        nbytes = 2 * self.per * max(1, self.ctx.world_size - 1)
        self.bounce, self._keep = bounce_buffer(self.inner, nbytes, pool.kind, self.ctx.pages)
        self.btensor = _tensor(self.bounce.array)
        return self.inner.register(self.bounce)

    def connect(self, peers: dict[int, bytes]) -> None:
        self.inner.connect(peers)
        me = self.ctx.rank
        for p in peers:
            for role, (src, dst) in (("src", (self._ring(me, p, True), self._ring(p, me, False))),
                                     ("dst", (self._ring(p, me, True), self._ring(me, p, False)))):
                here = src if role == "src" else dst
                slots = [_Slot(k * self.chunk, self.btensor[here + k * self.chunk:here + (k + 1) * self.chunk])
                         for k in range(self.slots)]
                self.rings[(p, role)] = _Ring(slots, src, dst, "gather" if role == "src" else "scatter")
                self.queues[(p, role)] = queue.SimpleQueue()
            for fn in (self._gather_loop, self._send_loop, self._recv_loop, self._scatter_loop):
                self._start(fn, p)

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
        # the harness reuses a request's arrays every iteration: each chunk's copy is made once per array
        chunks = C.prepared(descs, ("staged", source, self.chunk), lambda: pieces(descs, self.chunk, source))
        job = _Job(op, peer, chunks, tag)
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

    # ----- copies between the pool and a slot ----------------------------------------------
    def _add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        with self.lock:
            self.stats[stage] += now - since
        return now

    def _bind(self, copies: bool) -> None:
        """A thread's first step on a GPU: bind the device's context (a fresh thread has none) and, where it copies,
        make its stream, before any work is handed to it."""
        if self.gpu is not None and copies:
            C._stream(None, self.gpu)
        elif self.gpu is not None:
            driver.ensure_context(self.gpu)

    def _fill(self, ring: _Ring, slot: _Slot, descs: np.ndarray) -> None:
        """Copy one chunk between the pool and ``slot`` (into it at a source, out of it at a destination).  Host
        bytes: done on return, this thread's time counts.  A GPU: queued on this thread's stream between the slot's
        events, whose device time counts once a thread has waited for them (_await_copy)."""
        dst, src = (slot.view, self.dev) if ring.stage == "gather" else (self.dev, slot.view)
        if self.gpu is None:
            t = time.perf_counter()
            C.copy(self.engine, dst, src, descs)
            self._add(ring.stage, t)
            return
        handle = C._stream(None, self.gpu)
        if slot.end is None:
            slot.start, slot.end = driver.event(self.gpu), driver.event(self.gpu)
        driver.record(slot.start, handle)
        C.copy(self.engine, dst, src, descs, device=self.gpu)
        driver.record(slot.end, handle)
        slot.busy = True

    def _await_copy(self, ring: _Ring, slot: _Slot) -> None:
        """Wait for the copy that last filled or emptied ``slot`` (its event, not the stream) and count its time."""
        with ring.lock:  # a destination's wire thread and its scatter thread (at a layer's end) both settle
            if not slot.busy:
                return
            driver.event_synchronize(slot.end)
            took = driver.elapsed(slot.start, slot.end)
            slot.busy = False
        with self.lock:
            self.stats[ring.stage] += took

    def _copy(self, descs: np.ndarray, to_bounce: bool) -> None:
        """One copy between the pool and the whole bounce buffer, complete on return (offsets in the buffer): off
        the pipeline's path; tests/test_cuda_driver.py holds it to the driver's rules from a fresh thread."""
        dst, src = (self.btensor, self.dev) if to_bounce else (self.dev, self.btensor)
        C.copy(self.engine, dst, src, np.ascontiguousarray(descs))
        C.sync(dst, src)

    # ----- threads ------------------------------------------------------------------------
    def _guard(self, fn, peer: int) -> None:
        try:
            fn(peer)
        except Exception as exc:  # fail every job of this transport: both ends stop instead of hanging
            self.error = self.error or exc
            for job in list(self.live):
                job.error = job.error or exc
                job.done.set()
            self._close_queues()

    def _close_queues(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for ring in self.rings.values():
            ring.free.put(None)
            ring.full.put(None)

    def _gather_loop(self, peer: int) -> None:
        """Source: copy each layer's chunks, in order, into the free slots and hand them to the wire thread."""
        ring = self.rings[(peer, "src")]
        self._bind(True)
        while True:
            job = _take(self.queues[(peer, "src")])
            if job is None:
                return self._fail_pending()
            if not job.chunks:
                job.done.set()
                continue
            for i, (descs, n) in enumerate(job.chunks):
                slot = _take(ring.free)
                if slot is None:
                    return None
                self._fill(ring, slot, descs)
                ring.full.put((job, i, slot, n))

    def _send_loop(self, peer: int) -> None:
        """Source: send the filled slots in order, at most slots - 1 in flight (a slot stays free for the gather); a
        slot whose send is complete goes back to the gather thread, and a layer is done when its last chunk's is."""
        ring = self.rings[(peer, "src")]
        self._bind(False)
        window: collections.deque = collections.deque()
        while True:
            item = _take(ring.full, block=not window)
            if item is EMPTY:  # nothing gathered yet: finish the oldest send, which frees a slot for the gather
                self._retire(ring, window)
                continue
            if item is None:
                return None
            job, i, slot, n = item
            while len(window) > max(0, self.slots - 2):  # a slot stays free for the next gather while this is sent
                self._retire(ring, window)
            self._await_copy(ring, slot)  # the chunk is in the slot (a GPU's copy: its event)
            t = time.perf_counter()
            if job.op == "push":
                h = self.inner.post("push", peer, ring.wire(slot, n), _tag(job.tag, i))  # tcp: the bytes go out here
            else:
                h = self.inner.serve("pull", peer, ring.wire(slot, n), _tag(job.tag, i))
                self.inner.answer(h)
            self._add("wire", t)
            window.append((job, i, slot, h))

    def _retire(self, ring: _Ring, window: collections.deque) -> None:
        job, i, slot, h = window.popleft()
        t = time.perf_counter()
        self.inner.wait(h)
        self._add("wire", t)
        ring.free.put(slot)
        if i == len(job.chunks) - 1:
            job.done.set()

    def _recv_loop(self, peer: int) -> None:
        """Destination: keep a receive posted in every free slot, chunks in order; hand each landed slot to the
        scatter thread."""
        ring, jobs = self.rings[(peer, "dst")], self.queues[(peer, "dst")]
        self._bind(False)
        window: collections.deque = collections.deque()
        pending: collections.deque = collections.deque()
        while True:
            while True:  # post every receive that has a free slot, without waiting while one is out
                if not pending:
                    job = _take(jobs, block=not window)
                    if job is EMPTY:
                        break
                    if job is None:
                        return self._fail_pending()
                    if not job.chunks:
                        job.done.set()
                        continue
                    pending.extend((job, i) for i in range(len(job.chunks)))
                slot = _take(ring.free, block=not window)
                if slot is EMPTY:
                    break
                if slot is None:
                    return None
                self._await_copy(ring, slot)  # its last scatter has read it before new bytes land there
                job, i = pending.popleft()
                d = ring.wire(slot, job.chunks[i][1])
                t = time.perf_counter()
                if job.op == "push":
                    h = self.inner.serve("push", peer, d, _tag(job.tag, i))
                else:
                    h = self.inner.post("pull", peer, d, _tag(job.tag, i))
                self._add("wire", t)
                window.append((job, i, slot, h))
            job, i, slot, h = window.popleft()
            t = time.perf_counter()  # wire: the time this thread waits for bytes (not the time they are in flight)
            self.inner.wait(h)
            self._add("wire", t)
            ring.full.put((job, i, slot))

    def _scatter_loop(self, peer: int) -> None:
        """Destination: copy each landed slot into the pool and give it back to the wire thread; a layer is done
        when its last chunk's copy is (a GPU's stream runs them in order)."""
        ring = self.rings[(peer, "dst")]
        self._bind(True)
        while True:
            item = _take(ring.full)
            if item is None:
                return None
            job, i, slot = item
            self._fill(ring, slot, job.chunks[i][0])
            if i == len(job.chunks) - 1:
                self._await_copy(ring, slot)
                for s in ring.slots:  # complete with the last (one stream): counted in this layer's iteration
                    self._await_copy(ring, s)
                job.at = time.perf_counter()
                job.done.set()
            ring.free.put(slot)

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
        return {"inner": self.inner_name, "pipeline": "on" if self.pipeline else "off", "slot_bytes": self.chunk,
                "slots": self.slots, "copy": self.engine, "bounce": kind, "inner_info": self.inner.info()}

    def close(self) -> None:
        self._close_queues()
        for th in self.threads:
            th.join(timeout=5)
        self.inner.close()
        if self.bounce is not None:
            self.bounce.release()
            self.bounce = None
        if self.gpu is not None:
            driver.ensure_context(self.gpu)  # the closing thread may never have made a driver call
            for ring in self.rings.values():
                for s in ring.slots:
                    for ev in (s.start, s.end):
                        if ev is not None:
                            driver.destroy(ev)
                    s.start = s.end = None
