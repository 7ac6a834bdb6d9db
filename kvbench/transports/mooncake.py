"""Mooncake transfer engine: one-sided batch WRITE (push) / READ (pull), P2P handshake.

No metadata server: each engine is initialised with ``P2PHANDSHAKE`` and its
session id (``host:rpc_port``) plus the pool's base address is what
``register`` returns.  Each post is one ``batch_transfer_async_write``/``read``
per chunk of at most ``batch`` descriptors (default 2048: larger batches fail
on tcp with "queue-full" at the engine's default queue caps,
docs/pitfalls.md#engine-listeners; see below); ``wait`` blocks in
``get_batch_transfer_status`` (GIL released).

Notification (option ``notify``).  Mooncake's Python API only attaches
notifications to its *synchronous* batch call, so once a push's batches
complete the initiator sends the tag (8 bytes) on a TCP socket per pair and
the destination's ``serve``/``wait`` sleeps in ``recv`` on it (``socket``, the
default).  It must sleep, not spin: on tcp the engine's own threads move the
bytes, and a destination busy-polling for the harness's MPI message takes
their CPU and the bandwidth drops (docs/evidence.md).
``notify=mpi`` leaves it to the harness's MPI message.  For the same reason a rank whose part of
an iteration is done (a pull's source: the engine's threads serve the reads) sleeps in the barrier
after it (``idle_sleeps``), as the tool's target sits idle.  The socket binds
``host`` and is closed once the peers are connected; a peer must present the
run's token, as in the tcp transport.

Protocol (option ``protocol``, default rdma when /sys/class/infiniband exists,
else tcp).  Mooncake's ``initialize(..., protocol, ...)`` does NOT choose the
transport: it installs RDMA whenever it discovers an HCA and TCP otherwise
(unless MC_FORCE_TCP is set), silently.  So ``tcp`` sets MC_FORCE_TCP=1, and the
protocol really in use is derived the way the engine decides (its topology's
HCA list and MC_FORCE_TCP); ``rdma`` requested with TCP in use is an error,
never a mislabelled row.  Both of its listeners (handshake RPC and the TCP
data port) bind all interfaces even when ``host`` is 127.0.0.1.
Options: ``protocol``, ``host`` (address peers reach; default ``kvbench.transports.sockets``'
choice: ``addr``/``ifname`` options, KVBENCH_SOCKET_IFNAME, else the host
name's route), ``device`` (HCA filter, e.g. ``mlx5_0,mlx5_1``), ``batch``.
The tcp lanes' queue caps (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER,
MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER) default to 65535 here, as serving
deployments set them: at the engine's defaults a few thousand outstanding
descriptors per peer fail with "queue-full".
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections import Counter

import numpy as np

from kvbench.transports.sockets import (
    accept_peers,
    dial,
    recv_exact,
    select_addr,  # NCCL-style -O addr= / ifname= / KVBENCH_SOCKET_IFNAME, as tcp
)

from .base import DST, LEN, SRC, Caps, Context, Transport, TransportError, check_descs, import_probe, rdma_present
from .quiet import engine_stderr
from .registration import pool_once

_TAG = struct.Struct("<Q")
_MASK = (1 << 64) - 1


class MooncakeTransport(Transport):
    """One TransferEngine per rank; push = batch WRITE, pull = batch READ."""

    name = "mooncake"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    idle_sleeps = True  # its own threads serve a pull's reads: the source sleeps once its part is done
    caps = Caps(memory=("host",), ops=("push", "pull"), one_sided=True,
                multi_node=True, notifies=True, network=True)

    @classmethod
    def memory_needs(cls, nbytes, options):
        pins = options.get("protocol") == "rdma" or (options.get("protocol") is None and rdma_present())
        return {"locked": nbytes} if pins else {}  # an RDMA registration pins the pool

    @classmethod
    def probe(cls) -> str | None:
        """Why Mooncake cannot run here, or None."""
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO log is a screen per engine
        return import_probe("mooncake.engine",
                            "install kvbench[mooncake] (mooncake-transfer-engine-non-cuda on hosts without CUDA)",
                            lambda msg: f"{msg}; apt-get install libibverbs1" if "libibverbs" in msg
                            else f"mooncake import failed: {msg}", ImportError)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._te = self._pool = None
        self._peers: dict[int, tuple[str, int, int]] = {}  # rank -> (session, addr, nbytes)
        self._info: dict = {}
        self._batch = int(ctx.options.get("batch", 2048))
        if not 1 <= self._batch <= 65535:
            raise TransportError(f"mooncake option batch={self._batch} must be 1..65535")
        self._notify = str(ctx.options.get("notify", "socket"))
        if self._notify not in ("socket", "mpi"):
            raise TransportError(f"mooncake option notify={self._notify} must be socket or mpi")
        if self._notify == "mpi":
            self.caps = Caps(**{**self.caps.__dict__, "notifies": False})
        self._listener = None
        self._socks: dict[int, socket.socket] = {}
        self._seen: dict[int, Counter] = {}  # tags that arrived before anybody waited for them
        self._cache: dict = {}  # (op, peer, id(descs)) -> (descs, local addresses, remote addresses, lengths)
        self._pool_reg = False  # the pool was registered at setup (not on an initiator under --register per-request)
        self.counts = Counter()  # per-request: registrations and deregistrations made (info())

    def register(self, pool) -> bytes:
        """Start the engine (P2P handshake), register the pool once, return session id + base."""
        self.require(pool)
        from mooncake.engine import TransferEngine

        opts = self.ctx.options
        want = str(opts.get("protocol") or ("rdma" if os.path.exists("/sys/class/infiniband") else "tcp"))
        if want not in ("tcp", "rdma"):
            raise TransportError(f"mooncake option protocol={want} must be tcp or rdma")
        if want == "rdma" and os.environ.get("MC_FORCE_TCP"):
            raise TransportError("rdma requested but MC_FORCE_TCP is set in the environment")
        # Its tcp lanes reject ("queue-full") more than ~2-4k queued descriptors per peer by default;
        # a request posts all layers before waiting, so raise the caps as serving deployments do.
        for var in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
            os.environ.setdefault(var, "65535")
        host = str(opts.get("host") or select_addr(self.ctx.hostname, opts)[0])
        device = str(opts.get("device", ""))
        saved = os.environ.get("MC_FORCE_TCP")
        if want == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"  # else an HCA, if present, is used regardless
        forced = bool(os.environ.get("MC_FORCE_TCP")) and not os.environ.get("MC_FORCE_HCA")
        with engine_stderr() as log:  # its glog start-up lines go to the sidecar, not the run's stderr
            try:
                self._te = te = TransferEngine()
                rc = te.initialize(host, "P2PHANDSHAKE", want, device)
            finally:  # read at initialisation only: do not leak it into later engines of this process
                if saved is None:
                    os.environ.pop("MC_FORCE_TCP", None)
            used = self._protocol_in_use(te, device, forced) if rc == 0 else ""
        if rc != 0:
            said = f" (it said: {log.last()})" if log.last() else ""
            raise TransportError(f"mooncake: initialize({host}, P2PHANDSHAKE, {want}) failed{said}")
        if want == "rdma" and used != "rdma":
            raise TransportError("rdma requested but mooncake fell back to tcp (no RDMA device found)")
        if pool_once(self.ctx):  # else each request registers its own blocks (register_request)
            if te.register_memory(pool.addr, pool.nbytes) != 0:
                raise TransportError(f"mooncake: register_memory of {pool.nbytes} bytes failed")
            self._pool_reg = True
        self._pool = pool
        session = f"{host}:{te.get_rpc_port()}"
        port = 0
        if self._notify == "socket":
            self._listener = socket.create_server((host, 0), backlog=max(16, 2 * self.ctx.world_size))
            port = self._listener.getsockname()[1]
        self._info = {"protocol": used, "requested": want, "session": session, "batch": self._batch,
                      "notify": self._notify + (f" (listened on {host}:{port} during setup)" if port else " (harness)"),
                      "listeners": "handshake RPC and tcp data port bind all interfaces (0.0.0.0)",
                      "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
                      "MC_FORCE_TCP": forced, "engine_log": log.text[-4000:]}
        return json.dumps({"session": session, "addr": pool.addr, "nbytes": pool.nbytes,
                           "host": host, "notify_port": port}).encode()

    @staticmethod
    def _protocol_in_use(te, device: str, forced_tcp: bool) -> str:
        # The engine installs rdma iff topology discovery finds an HCA and MC_FORCE_TCP was unset;
        # get_local_topology re-runs that same discovery: {"cpu:0": [[preferred HCAs], [others]]}.
        topo = json.loads(te.get_local_topology(device))
        hcas = any(h for lists in topo.values() for lst in lists for h in lst)
        return "rdma" if hcas and not forced_tcp else "tcp"

    def register_region(self, pool):
        """--pool-sizes: one more region registered with the engine."""
        if self._te.register_memory(pool.addr, pool.nbytes) != 0:
            raise TransportError(f"mooncake: register_memory of {pool.nbytes} bytes failed")
        return pool.addr

    def deregister_region(self, handle) -> None:
        self._te.unregister_memory(handle)

    def register_request(self, op: str, peer: int, groups: list) -> list[int]:
        """--register per-request: the request's local blocks registered with the engine, one call."""
        got = self.request_regions(op, groups)
        addrs = (got[:, 0] + self._pool.addr).tolist()
        if self._te.batch_register_memory(addrs, got[:, 1].tolist()) != 0:
            raise TransportError(f"mooncake: batch_register_memory of a request's {len(addrs)} regions failed")
        self.counts["registered"] += 1
        return addrs

    def deregister_request(self, handle: list[int]) -> None:
        if self._te.batch_unregister_memory(handle) != 0:
            raise TransportError(f"mooncake: batch_unregister_memory of a request's {len(handle)} regions failed")
        self.counts["deregistered"] += 1

    def connect(self, peers: dict[int, bytes]) -> None:
        """Remember each peer's session and pool (the engine opens segments on first use) and open
        the notification sockets: the higher rank dials, the lower accepts (dials never wait); then
        close the notification listener."""
        metas = {peer: json.loads(meta) for peer, meta in peers.items()}
        for peer, m in metas.items():
            self._peers[peer] = (m["session"], int(m["addr"]), int(m["nbytes"]))
        if self._listener is None:
            return
        me, tok, deadline = self.ctx.rank, self.ctx.token, time.monotonic() + 60
        for peer in sorted(p for p in metas if p < me):
            m = metas[peer]
            self._add(peer, dial(m["host"], m["notify_port"], peer, me, tok, deadline, what="mooncake"))
        try:
            for rank, (s,) in accept_peers(self._listener, {p for p in metas if p > me}, me, tok, deadline, 60,
                                           what="mooncake").items():
                self._add(rank, s)
        finally:  # nobody accepts after setup: a later caller is refused by the kernel
            self._listener.close()
            self._listener = None

    def _add(self, peer: int, s: socket.socket) -> None:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer], self._seen[peer] = s, Counter()

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Submit the layer as batches of <= ``batch`` descriptors; returns their batch ids (and whom to notify)."""
        session, raddr, rbytes = self._peers[peer]
        if op not in ("push", "pull"):
            raise TransportError(f"mooncake: unknown op {op}")
        submit = self._te.batch_transfer_async_write if op == "push" else self._te.batch_transfer_async_read
        loc, rem, lens = self._lists(op, peer, descs, raddr, rbytes)
        ids = []
        for i in range(0, len(lens), self._batch):
            j = i + self._batch
            a = time.perf_counter()
            bid = submit(session, loc[i:j], rem[i:j], lens[i:j])
            self.lib_s += time.perf_counter() - a
            if bid == 0:
                if ids:  # do not leave submitted batches behind unreaped
                    self._te.get_batch_transfer_status(ids)
                raise TransportError(f"mooncake: {op} batch submission to {session} failed")
            ids.append(bid)
        return [ids, peer if op == "push" and self.caps.notifies else None, tag]  # peer: whom to notify

    def _lists(self, op: str, peer: int, descs: np.ndarray, raddr: int, rbytes: int) -> tuple:
        """Checked address and length lists of a descriptor array, built once per array (the harness reuses
        its arrays every iteration and never changes them in place; the cache holds them, so ids stay theirs)."""
        key = (op, peer, id(descs))
        hit = self._cache.get(key)
        if hit is not None and len(hit[0]) == len(descs):
            return hit[1:]
        if op == "push":
            check_descs(descs, self._pool.nbytes, rbytes)
            local, remote = descs[:, SRC], descs[:, DST]
        else:
            check_descs(descs, rbytes, self._pool.nbytes)
            local, remote = descs[:, DST], descs[:, SRC]
        if len(self._cache) >= 4096:
            self._cache.clear()
        # the binding takes list[int]; .tolist() converts in C (no Python loop per descriptor)
        hit = self._cache[key] = (descs, (local + self._pool.addr).tolist(), (remote + raddr).tolist(),
                                  descs[:, LEN].tolist())
        return hit[1:]

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Push: the destination's handle is the notification to come. Pull: nothing to wait for."""
        if op == "push" and self.caps.notifies:
            if peer not in self._socks:
                raise TransportError(f"mooncake: rank {peer} was not connected")
            return (peer, tag & _MASK)
        return None

    def wait(self, handle) -> None:
        """Initiator: until its batches completed, then notify (push). Destination: until notified."""
        if handle is None:
            return
        if isinstance(handle, tuple):  # one thread waits per rank (the load harness: its waiter thread)
            peer, tag = handle
            seen = self._seen[peer]
            try:
                while not seen[tag]:
                    seen[_TAG.unpack(recv_exact(self._socks[peer], _TAG.size))[0]] += 1
            except (OSError, ConnectionError) as exc:
                raise TransportError(f"mooncake: notification from rank {peer} lost: {exc}") from None
            seen[tag] -= 1
            if not seen[tag]:
                del seen[tag]
            return
        (ids, peer, tag), handle[:] = handle, [[], None, 0]  # ids are freed once reaped: never ask twice
        if ids and self._te.get_batch_transfer_status(ids) != 0:
            raise TransportError("mooncake: transfer failed or timed out")
        if peer is not None:
            try:
                self._socks[peer].sendall(_TAG.pack(tag & _MASK))
            except OSError as exc:
                raise TransportError(f"mooncake: notifying rank {peer} failed: {exc}") from None

    def info(self) -> dict:
        """Protocol really used (not merely requested), session, listener note, version."""
        from importlib.metadata import PackageNotFoundError, version

        out = dict(self._info)
        if self.ctx.register == "per-request":
            out["per_request"] = dict(self.counts, pool_registered=self._pool_reg)
        for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
            try:
                out["version"] = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                pass
        return out

    def close(self) -> None:
        """Close the notification sockets, unregister the pool and drop the engine (idempotent)."""
        for s in [*self._socks.values(), *([self._listener] if self._listener else [])]:
            s.close()
        self._socks.clear()
        self._listener = None
        te, self._te = self._te, None
        if te is None:
            return
        if self._pool is not None and self._pool_reg:
            try:
                te.unregister_memory(self._pool.addr)
            except Exception:
                pass
        del te
