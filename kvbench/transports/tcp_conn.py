"""tcp's connection to one peer: the wire's headers, the job FIFO and the threads that drain it.

* Wire: per layer a 32-byte header (magic, kind, tag, bytes, descriptors), then
  the payload by writev from the source ranges and readv into the destination
  ranges (kvbench._native, GIL released; fallback sendmsg/recvmsg_into).  Pull:
  the destination sends a header-only request and the source answers like a
  push.  An unexpected header raises TransportError naming both and shuts the
  socket, so the peer fails too instead of hanging.
* Concurrency: sends run in post() itself (no thread wake-up per layer); each
  connection has a receive thread draining a FIFO of receive jobs, which
  serve (and a pull's post) enqueue; wait waits for one job.  Both ends handle
  a peer's layers in the same order, so the stream and the FIFO pair up.  A pull
  source answers on its receive thread right after reading the request.  A
  blocked send waits only for its peer's receive thread, whose jobs every rank
  queues (serve) before it posts anything, so no order of posts and waits over
  several peers can deadlock (sending inside wait() could: A->B, B->C, C->A
  with full socket buffers).  A receive-only job (a push's data, a pull's
  reply) goes to whichever of the two takes it first once the thread has
  reached it: the thread waits for its first bytes and takes it unless a
  caller already waits for it; such a caller reads it on its own thread, so
  the landing wakes the waiter directly instead of the receive thread, which
  would then have to wake the waiter.  A job nobody waits for (while the
  caller is blocked in a send, say) stays the thread's.  A serial request is
  one job, so its waiter reads it; streaming waits for its last layer first,
  so the thread reads the layers before it.  Not with ``poll=spin``.
"""
from __future__ import annotations

import os
import queue
import select
import socket
import struct
import threading
import time

import numpy as np

from kvbench.transports.sockets import py_vec, recv_exact

from .base import DST, LEN, SRC, TransportError

HDR = struct.Struct("<4sB3xQQQ")  # magic, kind, tag, payload bytes, descriptors
MAGIC = b"KVBt"
PUSH, REQUEST, REPLY, READY = 1, 2, 3, 4
_KINDS = {PUSH: "push data", REQUEST: "pull request", REPLY: "pull data", READY: "layer ready"}

_NO_DESCS = np.empty((0, 3), dtype=np.int64)


def _py_recv(sock: socket.socket, mv: memoryview, hdr: bytes, descs: np.ndarray, col: int) -> bytes | float:
    """Fallback for kvbench._native.recvv with a header: the header read if it differs, else when the
    last byte landed."""
    if (got := recv_exact(sock, len(hdr))) != hdr:
        return got
    if len(descs):
        py_vec(sock, mv, descs, col, False)
    return time.perf_counter()


def _header(kind: int, tag: int, descs: np.ndarray) -> bytes:
    n = len(descs)
    return HDR.pack(MAGIC, kind, tag, int(descs[0, LEN]) if n == 1 else int(descs[:, LEN].sum()), n)


def headers(plan: tuple, tag: int, descs: np.ndarray) -> tuple:
    """Per part of a plan (the caller's steps, the receive thread's), its steps' headers."""
    return tuple(tuple(_header(kind, tag, descs) for _, kind, _ in steps) for steps in plan)


def _describe(h: tuple) -> str:
    magic, kind, tag, nbytes, n = h
    if magic != MAGIC:
        return f"bad magic {magic!r}"
    return f"{_KINDS.get(kind, f'kind {kind}')} req {tag >> 16} layer {tag & 0xFFFF} ({nbytes} B, {n} descriptors)"


_DONE = threading.Event()  # shared by jobs that ran in the caller: done before anyone waits
_DONE.set()


class Job:
    """One post's or serve's steps.  ``claim``: a receive-only job's lock, taken by whichever of the receive
    thread and a waiting caller reads it (``Conn.run_waited``); None for a job only the thread runs."""
    __slots__ = ("steps", "args", "done", "error", "at", "claim", "conn")

    def __init__(self, steps, args, done, claim=None, conn=None):
        self.steps, self.args, self.done, self.error, self.at = steps, args, done, None, None
        self.claim, self.conn = claim, conn


class Conn:
    """One peer's socket: sends run in the caller, receives on a thread draining a FIFO of jobs.

    Every write holds ``wlock`` (the caller, a pull source's receive thread and the control
    thread all write), so no two threads interleave bytes.  ``ctl``: the control connection
    that carries layer-ready signals, and the thread that turns each into its read request.
    ``pending``: tag -> the request header a posted read sends on its signal, or None for a
    signal that came first; ``dict.setdefault`` is atomic under the GIL, so whichever of the
    post and the signal comes second sends the request, once.
    """

    def __init__(self, peer: int, sock: socket.socket, array: np.ndarray, poll: str = "block",
                 ctl: socket.socket | None = None):
        self.peer, self.sock, self.fd, self.array, self.error = peer, sock, sock.fileno(), array, None
        self.wlock, self.ctl, self.relay = threading.Lock(), ctl, None
        self.lib_s = 0.0  # seconds in the caller's sends (TcpTransport.lib_s)
        self.pending: dict[int, bytes | None] = {}
        self.fault_close = False  # fault injection only
        try:
            from .. import _native

            # the header goes out in the payload's writev (one system call and one segment per layer);
            # the receiver reads and compares it in C, then reads the payload, in one call
            self.send = lambda h, d, col: _native.sendv(self.fd, self.array, d, col, h)
            spin = {"block": (False, False), "control": (False, True), "spin": (True, True)}[poll]
            # (payload receives, header-only receives: a pull's request) busy-poll?
            self.recv = lambda h, d, col: _native.recvv(self.fd, self.array, d, col, h, spin[not len(d)])
            if ctl is not None:  # a signal's 32 bytes busy-polled like a request; no Python per signal
                self.relay = lambda: _native.relay(ctl.fileno(), self.fd, self.pending, self.wlock, spin[1])
        except ImportError:
            mv = memoryview(array)
            self.send = lambda h, d, col: (sock.sendall(h), py_vec(sock, mv, d, col, True), time.perf_counter())[2]
            self.recv = lambda h, d, col: _py_recv(sock, mv, h, d, col)
        self.queue = queue.SimpleQueue()
        # a waiting caller may read a receive-only job itself when it would block anyway (payloads are not
        # busy-polled): the thread waits for the bytes and takes the job if nobody waits for it (run_waited)
        self.head: Job | None = None  # the last receive-only job the thread reached: every earlier one is done
        self.claims = poll != "spin"
        # a caller that takes the job counts one here, so the thread leaves its poll at once rather than
        # when the bytes arrive (or, were the caller to drain them first, when the next job's bytes do)
        self.taken = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC)
        self.readable = select.poll()
        self.readable.register(self.fd, select.POLLIN | select.POLLPRI)
        self.readable.register(self.taken, select.POLLIN)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if ctl is not None:
            self.ctl_thread = threading.Thread(target=self._signals, daemon=True)
            self.ctl_thread.start()

    def submit(self, here: tuple, queued: tuple, descs: np.ndarray, heads: tuple) -> Job:
        """Run the ``here`` steps now, then queue the ``queued`` ones; the handle of the last.  ``heads``: the
        steps' headers (``headers``), packed ahead."""
        job = None
        if here:
            job = Job(here, (descs, heads[0]), _DONE)
            self._do(job, True)
        if queued:  # after a failed send too: the receive job then reports the connection's error
            claim = threading.Lock() if self.claims and not any(sending for sending, _, _ in queued) else None
            job = Job(queued, (descs, heads[1]), threading.Event(), claim, self)
            self.queue.put(job)
        return job

    def run_waited(self, job: Job) -> None:
        """A caller about to block on ``job``: read it on this thread if the receive thread is at it (every
        earlier job done) and has not taken it, so the landing wakes the waiter itself rather than the
        receive thread, which then has to wake the waiter.  A caller that never waits (blocked in a send of
        its own, or in MPI) leaves the job to the thread, which is what keeps several peers from deadlocking."""
        if job.claim is not None and self.head is job and job.claim.acquire(blocking=False):
            os.eventfd_write(self.taken, 1)
            self._do(job)

    def when_ready(self, tag: int, descs: np.ndarray) -> Job:
        """Pull initiator: queue the reply's receive now, send the request once ``tag`` is signalled."""
        now = self.pending.setdefault(tag, _header(REQUEST, tag, descs)) is None  # its signal came first
        if now:
            del self.pending[tag]
        here, queued = ((True, REQUEST, None),) if now else (), ((False, REPLY, DST),)
        return self.submit(here, queued, descs, headers((here, queued), tag, descs))

    def signal(self, signals: bytes) -> None:
        """Pull source: READY headers, packed ahead (``TcpTransport.prepare_signal``), in one write."""
        try:
            self.ctl.sendall(signals)
        except OSError as exc:
            raise TransportError(self.error or f"tcp: signalling rank {self.peer} failed: {exc}") from None

    def _signals(self) -> None:
        """Control thread: each READY releases the request of the read that waits for it (in C when
        kvbench._native is built: no Python between the signal and the request)."""
        try:
            got = self.relay() if self.relay is not None else self._relay_py()
            raise TransportError(f"tcp: control stream from rank {self.peer} out of step: "
                                 f"expected a layer-ready signal, got {_describe(HDR.unpack(got))}")
        except Exception as exc:  # closed (error already set), or a failure that must stop both ends
            if self.error is None:
                self.fail(exc if isinstance(exc, TransportError) else
                          TransportError(f"tcp: control connection to rank {self.peer} failed: {exc}"))

    def _relay_py(self) -> bytes:
        """Fallback for kvbench._native.relay: the first header that is not a layer-ready signal."""
        while True:
            got = recv_exact(self.ctl, HDR.size)
            magic, kind, tag, _, _ = HDR.unpack(got)
            if (magic, kind) != (MAGIC, READY):
                return got
            if (request := self.pending.setdefault(tag, None)) is not None:  # posted: its header is packed
                del self.pending[tag]
                with self.wlock:
                    self.send(request, _NO_DESCS, SRC)

    def _run(self) -> None:
        waited = None  # a job its waiter took: its bytes are read before the next job's
        while (job := self.queue.get()) is not None:
            if waited is not None:
                waited.done.wait()
                waited = None
            if job.claim is not None:
                self.head = job
                self.readable.poll()  # its first bytes, a hang-up, an error or a caller took it (the GIL released)
                if not job.claim.acquire(blocking=False):
                    os.eventfd_read(self.taken)  # the one count its taker adds right after taking it
                    waited = job
                    continue
            self._do(job)

    def _do(self, job: Job, inline: bool = False) -> None:
        try:
            if self.error is not None:
                raise self.error
            descs, heads = job.args
            for step, hdr in zip(job.steps, heads):
                job.at = self._move(*step, hdr, descs, inline)  # when the last byte landed (or left), before anyone is woken
        except Exception as exc:
            self._failed(job, exc)
        except BaseException:  # an interrupt in a caller's read: the stream may be mid-layer, so it ends here
            self._failed(job, TransportError(f"tcp: interrupted while moving a layer with rank {self.peer}"))
            raise
        finally:
            if job.done is not _DONE:
                job.done.set()

    def push(self, hdr: bytes, descs: np.ndarray) -> Job:
        """A push source's post: header and ranges in one writev, in the caller (``submit``'s one step without
        its general plan: the Python between the barrier and the write is the per-request cost at small layers)."""
        job = Job(None, None, _DONE)
        try:
            if self.error is not None:
                raise self.error
            job.at = self._move(True, PUSH, SRC, hdr, descs, True)
        except Exception as exc:
            self._failed(job, exc)
        return job

    def _failed(self, job: Job, exc: Exception) -> None:
        if not isinstance(exc, TransportError):
            exc = TransportError(f"tcp: connection to rank {self.peer} failed: {exc}")
        self.fail(exc)
        job.error = self.error  # the first error on this connection is the cause

    def _move(self, sending: bool, kind: int, col: int | None, hdr: bytes, descs: np.ndarray,
              inline: bool = False) -> float:
        if col is None or not len(descs):
            descs, col = _NO_DESCS, SRC  # header only (a pull request)
        if sending:
            with self.wlock:
                if self.fault_close and len(descs) and descs[:, LEN].sum() > 1:
                    self._close_mid_layer(hdr, descs, col)
                if not inline:
                    return self.send(hdr, descs, col)
                a = time.perf_counter()
                at = self.send(hdr, descs, col)
                self.lib_s += time.perf_counter() - a  # the caller's writev: the wire, not kvbench (costs.py)
                return at
        if self.fault_close and len(descs) and descs[:, LEN].sum() > 1:
            self._close_mid_layer(hdr, descs, col, sending=False)
        if isinstance(got := self.recv(hdr, descs, col), bytes):
            raise TransportError(f"tcp: stream from rank {self.peer} out of step: expected {_describe(HDR.unpack(hdr))}, "
                                 f"got {_describe(HDR.unpack(got))}")
        return got

    def _close_mid_layer(self, hdr: bytes, descs: np.ndarray, col: int, sending: bool = True) -> None:
        """Fault injection (KVBENCH_FAULT=tcp-close:<rank>): the header and half of the layer, sent or
        received (a push's receiver never sends a layer), then hang up."""
        half = descs[:1].copy()
        half[0, LEN] = max(1, int(half[0, LEN]) // 2)
        self.send(hdr, half, col) if sending else self.recv(hdr, half, col)
        self.sock.shutdown(socket.SHUT_RDWR)
        raise TransportError(f"tcp: injected fault: closed the connection to rank {self.peer} half-way through a layer")

    def fail(self, err: TransportError) -> None:
        """Record the first error and shut the socket, so both ends stop rather than hang."""
        if self.error is None:
            self.error = err
        for s in (self.sock, self.ctl):
            try:
                if s is not None:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.fail(TransportError(f"tcp: connection to rank {self.peer} closed"))
        self.queue.put(None)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            os.close(self.taken)
        if self.ctl is not None:
            self.ctl_thread.join(timeout=5)
            self.ctl.close()
        self.sock.close()
