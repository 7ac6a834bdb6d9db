"""tcp: one TCP connection per peer; scatter-gather straight out of and into the pools.

* Address: ``kvbench.net.select_addr`` (NCCL's rules: ``-O addr=``, ``-O ifname=``
  or KVBENCH_SOCKET_IFNAME).  The listener binds it, never 0.0.0.0; ``connect``
  refuses loopback between two hosts.
* Setup: in ``connect`` the higher rank of a pair dials the lower (dials only go
  downwards: no cycle of waits) and presents its rank and the run's token; a
  wrong one, or one not complete within a few seconds (``net.HANDSHAKE_S``), is
  closed and logged while the acceptor keeps accepting, up to connect_timeout.
  Once every peer is connected the listener is closed: a later caller is
  refused by the kernel.
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
* Buffers: left to the kernel's autotuning by default, which grows them to the
  path's bandwidth-delay product up to tcp_rmem/tcp_wmem max.  Forcing them
  large was slower: llama-3-8b 4 MiB layers over loopback moved at 2.0-2.1 GB/s
  with 64 MiB forced buffers and 2.75-2.9 GB/s autotuned (a sender that runs
  64 MiB ahead of its receiver pushes both copies out of the cache).
  ``-O sockbuf=N`` forces N bytes (the *FORCE options when permitted, else up to
  the sysctl caps); info() records what the kernel granted.
* Layer-ready signals (pull): with ``-O ready=socket`` (default) each pair has
  a second, control connection.  The source writes a 32-byte READY header on
  it when a layer is final; the destination posted every read up front
  (``post_when_ready``), and its control thread sends the request the moment
  the READY arrives (``kvbench._native.relay``: no Python at all between the
  two; an interpreter that has not run for a few ms on an idle core took
  40-60 us for the same few lines), so no MPI message and no decode-loop Python
  sit between the signal and the read.  On the data connection a READY would queue behind
  the previous layer's reply: one round trip of bubble per layer when the
  transfer is the bottleneck.  ``-O ready=mpi`` leaves the signal to the
  harness's MPI message (one connection per pair).
* Polling: ``-O poll=spin`` makes a receive busy-poll the socket (non-blocking
  reads and sched_yield, without the GIL, like a UCX progress loop) instead of
  sleeping in the kernel: an isolated 4 MiB layer after a 10 ms idle wait landed
  in 1.55 ms instead of 2.08 (bound ranks), at the price of a CPU per waiting
  receive.  ``-O poll=control`` busy-polls only the 32-byte control messages
  (a pull's layer-ready signals and requests) and sleeps for payloads.  Default
  ``block``.
"""
from __future__ import annotations

import json
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import replace

import numpy as np

from kvbench.job import faults
from kvbench.transports.sockets import accept_peers, dial, py_vec, recv_exact, select_addr, tune

from .base import DST, LEN, SRC, Caps, Transport, TransportError, check_descs

_HDR = struct.Struct("<4sB3xQQQ")  # magic, kind, tag, payload bytes, descriptors
MAGIC = b"KVBt"
PUSH, REQUEST, REPLY, READY = 1, 2, 3, 4
_KINDS = {PUSH: "push data", REQUEST: "pull request", REPLY: "pull data", READY: "layer ready"}
# (op, initiator) -> one layer's steps (caller's, receive thread's); a step is (sending, kind, column
# moved or None).  The pull source answers on its receive thread, right after reading the request.
_PLAN = {
    ("push", True): (((True, PUSH, SRC),), ()),
    ("push", False): ((), ((False, PUSH, DST),)),
    ("pull", True): (((True, REQUEST, None),), ((False, REPLY, DST),)),
    ("pull", False): ((), ((False, REQUEST, None), (True, REPLY, SRC))),
}


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
    return _HDR.pack(MAGIC, kind, tag, int(descs[0, LEN]) if n == 1 else int(descs[:, LEN].sum()), n)


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


class _Job:
    """One post's or serve's steps.  ``claim``: a receive-only job's lock, taken by whichever of the receive
    thread and a waiting caller reads it (``_Conn.run_waited``); None for a job only the thread runs."""
    __slots__ = ("steps", "args", "done", "error", "at", "claim", "conn")

    def __init__(self, steps, args, done, claim=None, conn=None):
        self.steps, self.args, self.done, self.error, self.at = steps, args, done, None, None
        self.claim, self.conn = claim, conn


class _Conn:
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
        self.head: _Job | None = None  # the last receive-only job the thread reached: every earlier one is done
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

    def submit(self, here: tuple, queued: tuple, descs: np.ndarray, heads: tuple) -> _Job:
        """Run the ``here`` steps now, then queue the ``queued`` ones; the handle of the last.  ``heads``: the
        steps' headers (``headers``), packed ahead."""
        job = None
        if here:
            job = _Job(here, (descs, heads[0]), _DONE)
            self._do(job, True)
        if queued:  # after a failed send too: the receive job then reports the connection's error
            claim = threading.Lock() if self.claims and not any(sending for sending, _, _ in queued) else None
            job = _Job(queued, (descs, heads[1]), threading.Event(), claim, self)
            self.queue.put(job)
        return job

    def run_waited(self, job: _Job) -> None:
        """A caller about to block on ``job``: read it on this thread if the receive thread is at it (every
        earlier job done) and has not taken it, so the landing wakes the waiter itself rather than the
        receive thread, which then has to wake the waiter.  A caller that never waits (blocked in a send of
        its own, or in MPI) leaves the job to the thread, which is what keeps several peers from deadlocking."""
        if job.claim is not None and self.head is job and job.claim.acquire(blocking=False):
            os.eventfd_write(self.taken, 1)
            self._do(job)

    def when_ready(self, tag: int, descs: np.ndarray) -> _Job:
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
                                 f"expected a layer-ready signal, got {_describe(_HDR.unpack(got))}")
        except Exception as exc:  # closed (error already set), or a failure that must stop both ends
            if self.error is None:
                self.fail(exc if isinstance(exc, TransportError) else
                          TransportError(f"tcp: control connection to rank {self.peer} failed: {exc}"))

    def _relay_py(self) -> bytes:
        """Fallback for kvbench._native.relay: the first header that is not a layer-ready signal."""
        while True:
            got = recv_exact(self.ctl, _HDR.size)
            magic, kind, tag, _, _ = _HDR.unpack(got)
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

    def _do(self, job: _Job, inline: bool = False) -> None:
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

    def push(self, hdr: bytes, descs: np.ndarray) -> _Job:
        """A push source's post: header and ranges in one writev, in the caller (``submit``'s one step without
        its general plan: the Python between the barrier and the write is the per-request cost at small layers)."""
        job = _Job(None, None, _DONE)
        try:
            if self.error is not None:
                raise self.error
            job.at = self._move(True, PUSH, SRC, hdr, descs, True)
        except Exception as exc:
            self._failed(job, exc)
        return job

    def _failed(self, job: _Job, exc: Exception) -> None:
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
        if isinstance(got := self.recv(hdr, descs, col), bytes):
            raise TransportError(f"tcp: stream from rank {self.peer} out of step: expected {_describe(_HDR.unpack(hdr))}, "
                                 f"got {_describe(_HDR.unpack(got))}")
        return got

    def _close_mid_layer(self, hdr: bytes, descs: np.ndarray, col: int) -> None:
        """Fault injection (KVBENCH_FAULT=tcp-close:<rank>): the header and half of the layer, then hang up."""
        half = descs[:1].copy()
        half[0, LEN] = max(1, int(half[0, LEN]) // 2)
        self.send(hdr, half, col)
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


class TcpTransport(Transport):
    name = "tcp"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = Caps(memory=("host",), ops=("push", "pull"), one_sided=False, multi_node=True, notifies=True, network=True,
                signals_ready=True, stamps=True, codec_frames="stream")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.timeout = float(ctx.options.get("connect_timeout", 60))
        self.sockbuf = int(ctx.options.get("sockbuf", 0))  # 0: leave to autotuning
        self.poll = str(ctx.options.get("poll", "block"))
        if self.poll not in ("block", "control", "spin"):
            raise TransportError(f"tcp option poll='{self.poll}' is not one of: block, control, spin")
        self.ready_via = str(ctx.options.get("ready", "socket"))  # how a pull's layer-ready signal travels
        if self.ready_via not in ("socket", "mpi"):
            raise TransportError(f"tcp option ready='{self.ready_via}' is not one of: socket, mpi")
        if self.ready_via == "mpi":
            self.caps = replace(self.caps, signals_ready=False)
        self.listener = self.pool = self.addr = self.ifname = None
        self.conns: dict[int, _Conn] = {}
        self.peer_nbytes: dict[int, int] = {}
        # the receive threads need the GIL for a few microseconds per layer; at the default 5 ms switch
        # interval they wait behind the posting thread instead (restored in close)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(float(ctx.options.get("switch_interval_us", 50)) * 1e-6)

    def register(self, pool) -> bytes:
        """Open the listener; the metadata is JSON: host, addr, port, rank, nbytes."""
        self.pool = pool
        self.addr, self.ifname = select_addr(self.ctx.hostname, self.ctx.options)
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(ls, self.sockbuf)  # accepted sockets inherit the buffer sizes
        try:
            ls.bind((self.addr, 0))
        except OSError as exc:
            ls.close()
            raise TransportError(f"tcp: cannot listen on {self.addr}: {exc.strerror}") from None
        ls.listen(max(16, 2 * self.ctx.world_size))
        self.listener = ls
        c, port = self.ctx, ls.getsockname()[1]
        return json.dumps(dict(host=c.hostname, addr=self.addr, port=port, rank=c.rank, nbytes=pool.nbytes)).encode()

    def connect(self, peers: dict[int, bytes]) -> None:
        """One connection per peer (two with ready=socket: data, then control): the higher rank dials,
        the lower accepts; then the listener is closed."""
        metas = {int(p): json.loads(m) for p, m in peers.items()}
        me = self.ctx.rank
        for p, m in metas.items():
            if m["host"] != self.ctx.hostname and "127.0.0.1" in (m["addr"], self.addr):
                raise TransportError(
                    f"tcp: ranks {me} ({self.ctx.hostname}, {self.addr}) and {p} ({m['host']}, {m['addr']}) "
                    "are on different hosts but one listens on loopback; set KVBENCH_SOCKET_IFNAME"
                )
            self.peer_nbytes[p] = int(m["nbytes"])
        deadline, c, n = time.monotonic() + self.timeout, self.ctx, 1 + self.caps.signals_ready
        try:
            socks = {p: [dial(metas[p]["addr"], metas[p]["port"], p, c.rank, c.token, deadline, self.sockbuf)
                         for _ in range(n)] for p in sorted(metas) if p < me}
            socks.update(accept_peers(self.listener, {p for p in metas if p > me}, c.rank, c.token, deadline,
                                      self.timeout, channels=n))
        finally:  # nobody accepts after setup: a later caller is refused by the kernel, not left waiting
            self.listener.close()
            self.listener = None
        for p, ss in socks.items():
            for s in ss:
                s.settimeout(None)  # a blocking fd, as the native writev/readv expect
            self.conns[p] = _Conn(p, ss[0], self.pool.array, self.poll, ss[1] if n > 1 else None)
            self.conns[p].fault_close = faults.armed("tcp-close", c.rank)

    def _conn(self, peer: int) -> _Conn:
        if peer not in self.conns:
            raise TransportError(f"tcp: rank {self.ctx.rank} has no connection to rank {peer}")
        return self.conns[peer]

    def _checked(self, op: str, peer: int, descs: np.ndarray, initiator: bool) -> _Conn:
        """The connection to ``peer``, once the op and the descriptors (against both pools) are valid."""
        if op not in ("push", "pull"):
            raise TransportError(f"tcp: unknown op '{op}'")
        conn = self._conn(peer)
        local, remote = self.pool.nbytes, self.peer_nbytes[peer]
        source_here = (op == "push") == initiator
        check_descs(descs, *((local, remote) if source_here else (remote, local)))
        return conn

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> _Job:
        """push: send this layer from the SRC ranges; pull: request it, receive into the DST ranges."""
        return self.start(self.prepare(op, peer, descs, tag))

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> tuple:
        """The checks and the headers, ahead of the layer: ``start`` only writes (push) or queues (pull)."""
        plan = _PLAN[(op, True)]
        conn, heads = self._checked(op, peer, descs, True), headers(plan, tag, descs)
        if op == "push":  # one write in the caller: Conn.push
            return conn, None, descs, heads[0][0]
        return conn, plan, descs, heads

    def start(self, prepared: tuple) -> _Job:
        conn, plan, descs, heads = prepared
        return conn.push(heads, descs) if plan is None else conn.submit(*plan, descs, heads)

    @property
    def lib_s(self) -> float:
        """Seconds in the caller's sends, over every connection (base.Transport.lib_s)."""
        return sum(c.lib_s for c in self.conns.values())

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> _Job:
        """push: receive this layer into the DST ranges; pull: await the request, then send."""
        plan = _PLAN[(op, False)]
        return self._checked(op, peer, descs, False).submit(*plan, descs, headers(plan, tag, descs))

    def post_when_ready(self, peer: int, descs: np.ndarray, tag: int = 0) -> _Job:
        """Pull: receive into the DST ranges; the request goes out when ``peer`` signals ``tag``."""
        if not self.caps.signals_ready:
            raise TransportError("tcp: post_when_ready needs -O ready=socket")
        return self._checked("pull", peer, descs, True).when_ready(tag, descs)

    def prepare_signal(self, peer: int, tags: list[int]) -> tuple:
        """Pull source: the connection to ``peer`` and the READY headers for ``tags``, packed ahead."""
        if not self.caps.signals_ready:
            raise TransportError("tcp: signal_ready needs -O ready=socket")
        return self._conn(peer), b"".join(_HDR.pack(MAGIC, READY, t, 0, 0) for t in tags)

    def start_signal(self, prepared: tuple) -> None:
        """One write of the packed headers on the control connection."""
        conn, signals = prepared
        conn.signal(signals)

    def wait(self, handle: _Job) -> float:
        """Block until the job is done (on the destination: the bytes are in the pool); when it was."""
        if handle.conn is not None and not handle.done.is_set():
            handle.conn.run_waited(handle)
        handle.done.wait()
        if handle.error is not None:
            raise TransportError(str(handle.error))
        return handle.at

    def info(self) -> dict:
        """Address, interface, I/O path and the socket buffer sizes the kernel granted."""
        try:
            from .. import _native  # noqa: F401

            io = "writev/readv (kvbench._native)"
        except ImportError:
            io = "sendmsg/recvmsg_into"
        out = {"addr": self.addr, "ifname": self.ifname, "io": io, "sockbuf_requested": self.sockbuf,
               "poll": self.poll, "ready": self.ready_via}
        s = next(iter(self.conns.values())).sock if self.conns else self.listener
        if s is not None and s.fileno() >= 0:
            out["sndbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            out["rcvbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        return out

    def close(self) -> None:
        """Stop the threads, close every socket and the listener if setup did not (idempotent)."""
        conns, self.conns = self.conns, {}
        for c in conns.values():
            c.close()
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
