"""tcp: one TCP connection per peer; scatter-gather straight out of and into the pools.

* Address: ``kvbench.net.select_addr`` (NCCL's rules: ``-O addr=``, ``-O ifname=``
  or KVBENCH_SOCKET_IFNAME).  The listener binds it, never 0.0.0.0; ``connect``
  refuses loopback between two hosts.
* Setup: in ``connect`` the higher rank of a pair dials the lower (dials only go
  downwards: no cycle of waits) and presents its rank and the run's token; a
  wrong one, or one not complete within a few seconds (``net.HANDSHAKE_S``), is
  closed and logged while the acceptor keeps accepting, up to connect_timeout.
  The acceptor runs from the moment the listener listens (``register``), so a
  caller that comes while the peers still fill their pools gets its few seconds
  from its connect, not from ``connect``.
  Once every peer is connected the listener is closed: a later caller is
  refused by the kernel.
* Wire and concurrency: tcp_conn.py (one connection per peer, its receive
  thread and its control thread).
* Buffers: left to the kernel's autotuning by default, which grows them to the
  path's bandwidth-delay product up to tcp_rmem/tcp_wmem max.  Forcing them
  large was slower: llama-3-8b 4 MiB layers over loopback moved at 2.0-2.1 GB/s
  with 64 MiB forced buffers and 2.75-2.9 GB/s autotuned (a sender that runs
  64 MiB ahead of its receiver pushes both copies out of the cache).
  ``-O sockbuf=N`` forces N bytes (the *FORCE options when permitted, else up to
  the sysctl caps); info() records what the kernel granted.  Striped over rails,
  the default is RAIL_SOCKBUF (16 MiB): one thread writes the rails in turn, and
  an autotuned buffer smaller than a rail's share idles the other rails.
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
* Rails: ``-O addr=A,B``, ``-O ifname=eth0,eth1`` or ``-O rails=N`` (rails.select_rails: of --nic's NICs, else
  of the lab's KVBENCH_LAB_NICS) give every pair one connection (two with ready=socket) per rail, each bound
  to its NIC's address (and SO_BINDTODEVICE where permitted); a request's descriptors are cut by bytes
  (rails.split, cached per array), each rail carries its share as a stream of its own, and the request lands
  when its last rail lands.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import replace

import numpy as np

from kvbench.job import faults
from kvbench.transports import tcp_wire
from kvbench.transports.rails import Splits, Striped, select_rails
from kvbench.transports.sockets import Acceptor, bind_device, dial, tcp_bytes, tune

from .base import DST, SRC, Caps, Transport, TransportError, check_descs
from .tcp_conn import HDR, MAGIC, PUSH, READY, REPLY, REQUEST, Conn, Job, headers

# (op, initiator) -> one layer's steps (caller's, receive thread's); a step is (sending, kind, column
# moved or None).  The pull source answers on its receive thread, right after reading the request.
_PLAN = {
    ("push", True): (((True, PUSH, SRC),), ()),
    ("push", False): ((), ((False, PUSH, DST),)),
    ("pull", True): (((True, REQUEST, None),), ((False, REPLY, DST),)),
    ("pull", False): ((), ((False, REQUEST, None), (True, REPLY, SRC))),
}


RAIL_SOCKBUF = 16 << 20  # bytes per socket when striping over rails and -O sockbuf is not given

class TcpTransport(Transport):
    name = "tcp"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = Caps(memory=("host",), ops=("push", "pull"), one_sided=False, multi_node=True, notifies=True, network=True,
                signals_ready=True, stamps=True, codec_frames="stream",
                unregistered="tcp registers nothing: the kernel copies each send out of the pool")

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
        self.acceptor: Acceptor | None = None
        self.conns: dict[int, Conn] = {}  # rail 0's connection to each peer
        self.rails: dict[int, list[Conn]] = {}  # every rail's, by peer (one entry: no striping)
        # per peer, per lane, every rail's: a pair sending both ways (ctx.duplex) has a lane per direction
        self.lanes: dict[int, list[list[Conn]]] = {}
        self.rail_list: list[tuple[str, str | None]] = []  # (address, interface) of each rail
        self.listeners: list[socket.socket] = []
        self.acceptors: list[Acceptor] = []
        self.bound: list[bool] = []  # per rail: SO_BINDTODEVICE took
        self.splits: Splits | None = None
        self.peer_nbytes: dict[int, int] = {}
        # the receive threads need the GIL for a few microseconds per layer; at the default 5 ms switch
        # interval they wait behind the posting thread instead (restored in close)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(float(ctx.options.get("switch_interval_us", 50)) * 1e-6)

    def register(self, pool) -> bytes:
        """Open the listener; the metadata is JSON: host, addr, port, rank, nbytes."""
        self.pool = pool
        c = self.ctx
        named = c.options.get("addr") or c.options.get("ifname")  # -O beats --nic
        opts = dict(c.options, rails=c.options.get("rails") or (c.nic_rails if c.netdevs and not named else 0))
        self.rail_list = select_rails(c.hostname, opts, c.netdevs or None)
        self.addr, self.ifname = self.rail_list[0]
        if len(self.rail_list) > 1:
            self.splits = Splits(len(self.rail_list))
            # one thread writes the rails in turn: a buffer that holds a rail's share lets each rail drain while
            # the next is written (autotuned ones stall every rail but one); -O sockbuf=N overrides
            self.sockbuf = self.sockbuf or RAIL_SOCKBUF
        for addr, ifname in self.rail_list:
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tune(ls, self.sockbuf)  # accepted sockets inherit the buffer sizes
            self.bound.append(len(self.rail_list) > 1 and bind_device(ls, ifname))
            try:
                ls.bind((addr, 0))
            except OSError as exc:
                ls.close()
                raise TransportError(f"tcp: cannot listen on {addr}: {exc.strerror}") from None
            ls.listen(4096)  # the kernel caps it (somaxconn); the acceptor drains it from now on, a flood included
            self.listeners.append(ls)
            self.acceptors.append(Acceptor(ls, self.ctx.rank, self.ctx.token))  # accepting from now on
        self.listener, self.acceptor = self.listeners[0], self.acceptors[0]
        c, ports = self.ctx, [ls.getsockname()[1] for ls in self.listeners]
        return json.dumps(dict(host=c.hostname, addr=self.addr, port=ports[0], rank=c.rank, nbytes=pool.nbytes,
                               addrs=[a for a, _ in self.rail_list], ports=ports)).encode()

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
            if len(m.get("addrs", [m["addr"]])) != len(self.rail_list):
                raise TransportError(f"tcp: rank {p} has {len(m.get('addrs', [m['addr']]))} rails, rank {me} has "
                                     f"{len(self.rail_list)}: give every rank the same number of NICs")
        deadline, c, n = time.monotonic() + self.timeout, self.ctx, 1 + self.caps.signals_ready
        # a lane per direction when pairs send both ways: each stream then carries one flow's layers in one
        # order, as the receive FIFO pairs them up (a pull both ways on one stream would interleave two)
        lanes = 2 if getattr(c, "duplex", False) else 1
        socks: dict[int, list] = {}
        multi = len(self.rail_list) > 1
        try:  # rail by rail, dials going downwards: a rank takes rail r only after its own dials of every rail
            for r, local in enumerate(self.rail_list):
                for p in sorted(q for q in metas if q < me):
                    m = metas[p]
                    addr, port = (m["addrs"][r], m["ports"][r]) if multi else (m["addr"], m["port"])
                    socks.setdefault(p, []).append([dial(addr, port, p, c.rank, c.token, deadline, self.sockbuf,
                                                         local=local if multi else None) for _ in range(n * lanes)])
            for acc in self.acceptors:
                for p, ss in acc.take({p for p in metas if p > me}, deadline, self.timeout, channels=n * lanes).items():
                    socks.setdefault(p, []).append(ss)
        finally:  # nobody accepts after setup: a later caller is refused by the kernel, not left waiting
            for acc in self.acceptors:
                acc.close()
            self.listener = self.acceptor = None
            self.listeners, self.acceptors = [], []
        for p, rails in socks.items():
            self.lanes[p] = [[] for _ in range(lanes)]
            for ss in rails:
                for s in ss:
                    s.settimeout(None)  # a blocking fd, as the native writev/readv expect
                for lane in range(lanes):
                    data, ctl = ss[lane * n], ss[lane * n + 1] if n > 1 else None
                    conn = Conn(p, data, self.pool.array, self.poll, ctl)
                    conn.fault_close = faults.armed("tcp-close", c.rank)
                    self.lanes[p][lane].append(conn)
            self.rails[p] = self.lanes[p][0]
            self.conns[p] = self.rails[p][0]

    def _lane(self, peer: int, source_here: bool) -> list[Conn]:
        """Per rail, the connection to ``peer`` of the direction the bytes go (lane 0 unless pairs go both
        ways: then lane 0 carries the lower rank's data to the higher, lane 1 the other way)."""
        lanes = self.lanes[peer]
        if len(lanes) == 1:
            return lanes[0]
        src, dst = (self.ctx.rank, peer) if source_here else (peer, self.ctx.rank)
        return lanes[0 if src < dst else 1]

    def _conn(self, peer: int) -> Conn:
        if peer not in self.conns:
            raise TransportError(f"tcp: rank {self.ctx.rank} has no connection to rank {peer}")
        return self.conns[peer]

    def _checked(self, op: str, peer: int, descs: np.ndarray, initiator: bool) -> Conn:
        """The connection to ``peer`` (rail 0 of its lane), once the op and the descriptors (against both pools)
        are valid."""
        if op not in ("push", "pull"):
            raise TransportError(f"tcp: unknown op '{op}'")
        self._conn(peer)
        local, remote = self.pool.nbytes, self.peer_nbytes[peer]
        source_here = (op == "push") == initiator
        check_descs(descs, *((local, remote) if source_here else (remote, local)))
        return self._lane(peer, source_here)[0]

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> Job:
        """push: send this layer from the SRC ranges; pull: request it, receive into the DST ranges."""
        return self.start(self.prepare(op, peer, descs, tag))

    def _striped(self, peer: int, descs: np.ndarray, source_here: bool) -> list[tuple[Conn, np.ndarray]]:
        """Per rail, its connection to ``peer`` and its share of ``descs``."""
        return list(zip(self._lane(peer, source_here), self.splits.of(descs)))

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> tuple:
        """The checks and the headers, ahead of the layer: ``start`` only writes (push) or queues (pull)."""
        plan = _PLAN[(op, True)]
        conn = self._checked(op, peer, descs, True)
        if self.splits is not None:  # one prepared post per rail
            return (None, plan, [(c, d, headers(plan, tag, d)) for c, d in self._striped(peer, descs, op == "push")],
                    op)
        heads = headers(plan, tag, descs)
        if op == "push":  # one write in the caller: Conn.push
            return conn, None, descs, heads[0][0]
        return conn, plan, descs, heads

    def start(self, prepared: tuple) -> Job | Striped:
        conn, plan, descs, heads = prepared
        if conn is None:  # rails: every rail's share posted, each landing on its own connection
            return Striped([c.push(h[0][0], d) if heads == "push" else c.submit(*plan, d, h) for c, d, h in descs])
        return conn.push(heads, descs) if plan is None else conn.submit(*plan, descs, heads)

    @property
    def lib_s(self) -> float:
        """Seconds in the caller's sends, over every connection (base.Transport.lib_s)."""
        return sum(c.lib_s for lanes in self.lanes.values() for rails in lanes for c in rails)

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> Job | Striped:
        """push: receive this layer into the DST ranges; pull: await the request, then send."""
        plan = _PLAN[(op, False)]
        conn = self._checked(op, peer, descs, False)
        if self.splits is not None:
            return Striped([c.submit(*plan, d, headers(plan, tag, d))
                            for c, d in self._striped(peer, descs, op == "pull")])
        return conn.submit(*plan, descs, headers(plan, tag, descs))

    def post_when_ready(self, peer: int, descs: np.ndarray, tag: int = 0) -> Job | Striped:
        """Pull: receive into the DST ranges; the request goes out when ``peer`` signals ``tag``."""
        if not self.caps.signals_ready:
            raise TransportError("tcp: post_when_ready needs -O ready=socket")
        conn = self._checked("pull", peer, descs, True)
        if self.splits is not None:  # each rail's control thread sends its own rail's request
            return Striped([c.when_ready(tag, d) for c, d in self._striped(peer, descs, False)])
        return conn.when_ready(tag, descs)

    def prepare_signal(self, peer: int, tags: list[int]) -> tuple:
        """Pull source: the connections to ``peer`` (one per rail) and the READY headers for ``tags``, packed ahead."""
        if not self.caps.signals_ready:
            raise TransportError("tcp: signal_ready needs -O ready=socket")
        self._conn(peer)
        return self._lane(peer, True), b"".join(HDR.pack(MAGIC, READY, t, 0, 0) for t in tags)

    def start_signal(self, prepared: tuple) -> None:
        """One write of the packed headers on each rail's control connection."""
        conns, signals = prepared
        for conn in conns:
            conn.signal(signals)

    def wait(self, handle: Job | Striped) -> float:
        """Block until the job is done (on the destination: the bytes are in the pool); when it was (rails:
        when the last rail's share was)."""
        if type(handle) is Striped:
            return max(self.wait(j) for j in reversed(handle.jobs))
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
               "poll": self.poll, "ready": self.ready_via, "rails": len(self.rail_list) or 1,
               "rail_addrs": [a for a, _ in self.rail_list], "rail_ifnames": [n or "" for _, n in self.rail_list],
               "rail_bound_to_device": self.bound}
        s = next(iter(self.conns.values())).sock if self.conns else self.listener
        if s is not None and s.fileno() >= 0:
            out["sndbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            out["rcvbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        return out

    def rail_names(self) -> list[str]:
        """Per rail, the NIC it is bound to (its address where the interface is unknown)."""
        return [n or a for a, n in self.rail_list]

    def rail_counters(self) -> dict[int, list[tuple[int, int]]]:
        """Per peer and rail, the kernel's byte counts of its data connection: (sent and acknowledged, received)."""
        out = {}
        for p, lanes in self.lanes.items():  # both lanes of a rail summed: one NIC carries them
            counts = [[tcp_bytes(c.sock) for c in rails] for rails in lanes]
            out[p] = [tuple(sum(x[r][k] for x in counts) for k in (0, 1)) for r in range(len(lanes[0]))]
        return out

    def wire_counts(self) -> dict[int, tuple[int, int]]:
        """Per peer, the kernel's count of the bytes its data connections sent and received so far (tcp_wire.py)."""
        return tcp_wire.counts(self.lanes)

    def close(self) -> None:
        """Stop the threads, close every socket and the listener if setup did not (idempotent)."""
        lanes, self.lanes, self.rails, self.conns = self.lanes, {}, {}, {}
        for c in (c for ls in lanes.values() for cs in ls for c in cs):
            c.close()
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        for acc in self.acceptors:
            acc.close()
        self.listener = self.acceptor = None
        self.listeners, self.acceptors = [], []
