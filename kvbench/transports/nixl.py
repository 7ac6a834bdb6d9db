"""NIXL: one-sided WRITE (push) / READ (pull) over its UCX backend, the engine vLLM and Dynamo use.

One agent per rank; the pool is registered once and the agent's metadata
(plus the pool's base address) is what ``register`` returns.  Each post is
one NIXL transfer carrying a notification (the tag) to the peer, so the
target's ``serve``/``wait`` blocks until that notification arrives: for push
that is the destination learning its data landed; for pull it keeps the
passive prefill rank progressing (without a progress thread a passive UCX
worker that is never polled stalls the first transfer) and ends its iteration.

Options (on/off): ``prep`` (on, the default: ``prep_xfer_dlist`` once per
descriptor array, ``make_prepped_xfer`` per post, as serving engines do; off:
``initialize_xfer`` per post), ``progress_thread``, ``telemetry`` (see ``telemetry()``).

--register per-request (``register_request``): an initiator-only rank registers no pool at setup; per request it
registers the request's local blocks (``register_memory``) and prepares the local descriptor list over them,
and after the request's transfers completed releases that list and deregisters (``deregister_memory``), as
nixlbench's ``--reregister_mem`` does.  Peers keep the target pool's registration from setup.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import struct
import time
import weakref
from collections import Counter, OrderedDict, deque

import numpy as np

from .base import DST, LEN, SRC, Caps, Context, Transport, TransportError, Unavailable, check_descs, import_probe
from .rails import ucx_devices
from .registration import pool_once

_HDR = struct.Struct("<4sQQqB")  # magic, pool addr, pool bytes, device id, 1 = VRAM
_MAGIC = b"KVBN"
_CACHE_MAX = 4096  # descriptor arrays remembered (prepared lists hold NIXL memory)
_AGENTS: weakref.WeakSet = weakref.WeakSet()  # transports of this process with a live agent
_SERIAL = itertools.count()  # a new agent name per instance: a peer may still know the last one


def _on(ctx: Context, key: str, default: str = "off") -> bool:
    val = str(ctx.options.get(key, default)).lower()
    if val not in ("on", "off", "true", "false", "1", "0"):
        raise TransportError(f"nixl option {key}='{val}' must be on or off")
    return val in ("on", "true", "1")


class NixlTransport(Transport):
    """NIXL agent per rank; push = WRITE, pull = READ, one notification per post."""

    name = "nixl"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = Caps(memory=("host", "cuda"), ops=("push", "pull"), one_sided=True,
                multi_node=True, notifies=True, network=True)
    pins_on_rdma = True

    @classmethod
    def probe(cls) -> str | None:
        """Why NIXL cannot run here, or None."""
        return import_probe("nixl._api", "install kvbench[nixl] (CPU-only host: pip install --no-deps nixl==1.5.1 "
                            "nixl-cu12==1.5.1, as make install does)",
                            lambda msg: f"nixl import failed: {msg}")  # e.g. "detected CUDA 13 but nixl-cu13 is not installed"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.prep = _on(ctx, "prep", "on")
        self.prog_thread = _on(ctx, "progress_thread")
        self.capture = _on(ctx, "telemetry")
        self.agent = None
        self.reg = None
        self.peers: dict[int, tuple] = {}  # rank -> (agent name, pool addr, pool bytes, devid)
        self.notifs: Counter = Counter()  # (agent name, message) -> arrived, not yet consumed
        self.cache: OrderedDict = OrderedDict()
        self.live: set = set()  # xfer handles posted and not yet waited
        # prep=on: per cached array, one xfer handle re-posted with each post's notification (NIXL allows it
        # once the last post completed), as an engine keeps its transfer requests
        self.xfers: dict = {}  # cache key -> handle
        self.kept: set = set()
        self.once: set = set()  # cache keys posted at least once
        self.tele: deque = deque(maxlen=65536)
        self.env_set = ""
        self.per_req = ctx.register == "per-request"
        self.fresh: dict = {}  # per-request: cache key -> the local list prepared over the request's registration
        self.counts = Counter()  # per-request: registrations and deregistrations made (info())

    # -- setup ---------------------------------------------------------------
    def register(self, pool) -> bytes:
        """Create the agent, register ``pool`` once, return metadata for the peers."""
        if self.agent is not None:
            raise TransportError("nixl: register called twice (one pool per transport)")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise Unavailable(self.probe() or str(exc)) from None
        if "NIXL_LOG_LEVEL" not in os.environ:  # nixl configures its logger at import, at INFO
            logging.getLogger("nixl").setLevel(logging.WARNING)  # per-agent INFO lines clutter tables
        if self.ctx.nic and pool.kind == "cuda" and "UCX_NET_DEVICES" not in os.environ:
            os.environ["UCX_NET_DEVICES"] = f"{self.ctx.nic}:1"  # the RDMA NIC nearest this rank's GPU (placing.py)
            self.env_set = f"UCX_NET_DEVICES={self.ctx.nic}:1"
        if "UCX_MODULES" not in os.environ and not os.path.exists("/sys/class/infiniband"):
            # NIXL's bundled libnl (pulled in by UCX's ib module) segfaults in its exit destructor
            # when NIXL's UCX loads before MPI's; without RDMA devices the ib module is useless anyway
            os.environ["UCX_MODULES"] = "^ib"
            self.env_set = "UCX_MODULES=^ib"
        self.env_set = " ".join(x for x in (self.env_set, ucx_devices(self.ctx, "nixl")) if x)  # -O rails=N
        cfg = nixl_agent_config(enable_prog_thread=self.prog_thread, enable_listen_thread=False,
                                capture_telemetry=self.capture, backends=["UCX"])
        try:
            self.agent = nixl_agent(f"kvb-{self.ctx.run_id}-{self.ctx.rank}-{next(_SERIAL)}", cfg)
        except Exception as exc:
            raise TransportError(f"nixl: agent creation failed: {exc}") from None
        if "UCX" not in self.agent.backends:
            raise TransportError("nixl: the UCX backend plugin is missing from this NIXL build")
        self.seg = "VRAM" if pool.kind == "cuda" else "DRAM"
        # a torch.device has no number protocol (int() is a TypeError): its index is the GPU's ordinal
        self.devid = int(pool.tensor.device.index or 0) if self.seg == "VRAM" else 0
        self.addr, self.nbytes = int(pool.addr), int(pool.nbytes)
        try:
            if pool_once(self.ctx):  # else each request registers its own blocks (register_request)
                self.reg = self.agent.register_memory(
                    np.array([[self.addr, self.nbytes, self.devid]], dtype=np.uint64), self.seg)
        except Exception as exc:
            raise TransportError(f"nixl: registering {self.nbytes} B of {self.seg} failed: {exc}") from None
        _AGENTS.add(self)
        md = self.agent.get_agent_metadata()
        return _HDR.pack(_MAGIC, self.addr, self.nbytes, self.devid, self.seg == "VRAM") + md

    def register_region(self, pool):
        """--pool-sizes: one more region registered with the agent (its memory kind's segment)."""
        devid = int(pool.tensor.device.index or 0) if pool.kind == "cuda" else 0
        try:
            return self.agent.register_memory(np.array([[int(pool.addr), int(pool.nbytes), devid]], dtype=np.uint64),
                                              "VRAM" if pool.kind == "cuda" else "DRAM")
        except Exception as exc:
            raise TransportError(f"nixl: registering {pool.nbytes} B failed: {exc}") from None

    def deregister_region(self, handle) -> None:
        self.agent.deregister_memory(handle)

    def register_request(self, op: str, peer: int, groups: list) -> tuple:
        """--register per-request: the request's local blocks registered, and each array it posts prepared over
        them (a prepared list holds the registration's keys: it cannot outlive it)."""
        got = self.request_regions(op, groups)
        regs = np.empty((len(got), 3), dtype=np.uint64)
        regs[:, 0] = got[:, 0] + self.addr
        regs[:, 1] = got[:, 1]
        regs[:, 2] = self.devid
        try:
            reg = self.agent.register_memory(regs, self.seg)
        except Exception as exc:
            raise TransportError(f"nixl: registering a request's {len(got)} regions failed: {exc}") from None
        self.counts["registered"] += 1
        lists = {}
        try:
            for d in self.request_posts(groups):
                loc = self._entry(op, peer, d)[1]
                if self.prep and len(loc):
                    key = (op, peer, id(d))
                    lists[key] = self.fresh[key] = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, self.seg)
        except Exception:
            self.deregister_request((reg, lists))
            raise
        return reg, lists

    def deregister_request(self, handle: tuple) -> None:
        """Release the request's prepared lists (its transfers were released by their waits), then deregister."""
        reg, lists = handle
        for key, h in lists.items():
            self.fresh.pop(key, None)
            h.release()
        try:
            self.agent.deregister_memory(reg)
        except Exception as exc:
            raise TransportError(f"nixl: deregistering a request's blocks failed: {exc}") from None
        self.counts["deregistered"] += 1

    def connect(self, peers: dict[int, bytes]) -> None:
        """Load each peer's agent metadata (after this we may initiate towards it)."""
        for rank, meta in peers.items():
            magic, addr, nbytes, devid, _vram = _HDR.unpack_from(meta)
            if magic != _MAGIC:
                raise TransportError(f"nixl: rank {rank} sent metadata that is not from this transport")
            try:
                name = self.agent.add_remote_agent(bytes(meta[_HDR.size:]))
            except Exception as exc:
                raise TransportError(f"nixl: loading rank {rank}'s metadata failed: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[rank] = (name, addr, nbytes, devid)

    # -- data path -----------------------------------------------------------
    def _entry(self, op: str, peer: int, descs: np.ndarray):
        """Validated address arrays (and prepared lists) for one descriptor array.

        Keyed on the array's identity: the harness posts the same arrays every
        iteration, and the entry holds a reference so the id cannot be reused.
        The arrays must not be modified in place once posted.
        """
        key = (op, peer, id(descs))
        ent = self.cache.get(key)
        if ent is not None:
            self.cache.move_to_end(key)
            return ent
        name, raddr, rbytes, rdev = self.peers[peer]
        local, remote = (SRC, DST) if op == "push" else (DST, SRC)
        check_descs(descs, *((self.nbytes, rbytes) if op == "push" else (rbytes, self.nbytes)))
        n = len(descs)
        loc = np.empty((n, 3), dtype=np.int64)
        rem = np.empty((n, 3), dtype=np.int64)
        np.add(descs[:, local], self.addr, out=loc[:, 0])
        np.add(descs[:, remote], raddr, out=rem[:, 0])
        loc[:, 1] = rem[:, 1] = descs[:, LEN]
        loc[:, 2], rem[:, 2] = self.devid, rdev
        lh = rh = idx = None
        if self.prep and n:
            # per-request: the local list is prepared over each request's own registration (register_request)
            lh = None if self.per_req else self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, self.seg)
            rh = self.agent.prep_xfer_dlist(name, rem, self.seg)
            idx = np.arange(n, dtype=np.int32)
        ent = (descs, loc, rem, lh, rh, idx)
        self.cache[key] = ent
        if len(self.cache) > _CACHE_MAX:
            old, ent = self.cache.popitem(last=False)
            self.once.discard(old)
            x = self.xfers.pop(old, None)
            if x is not None:
                self.kept.discard(x)
                if x not in self.live:  # else released when its wait ends
                    x.release()
            for h in ent[3:5]:
                if h is not None:
                    h.release()
        return ent

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Start a WRITE (push) or READ (pull) with ``peer``, notifying it with ``tag``."""
        return self.start(self.prepare(op, peer, descs, tag))

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0) -> tuple:
        """Checks and descriptor lists (prepped once per array, kept in an LRU that ``start`` reads:
        a prepared list held here could be evicted and released before it starts)."""
        if op not in self.caps.ops:
            raise TransportError(f"nixl: unknown op '{op}'")
        if peer not in self.peers:
            raise TransportError(f"nixl: rank {peer} was not connected")
        self._entry(op, peer, descs)
        return op, peer, descs, b"kvb%d" % tag

    def start(self, prepared: tuple):
        op, peer, descs, msg = prepared
        _, loc, rem, lh, rh, idx = self._entry(op, peer, descs)
        name = self.peers[peer][0]
        if len(loc) == 0:  # nothing to move, but the target still waits for its notification
            self.agent.send_notif(name, msg)
            return None
        xop = "WRITE" if op == "push" else "READ"
        try:
            if self.prep and self.per_req:  # a new transfer over this request's registration, released by wait
                h = self.agent.make_prepped_xfer(xop, self.fresh[(op, peer, id(descs))], idx, rh, idx, msg)
            elif self.prep:
                key = (op, peer, id(descs))
                h = self.xfers.get(key)
                if h is None or h in self.live:  # not kept yet, or in flight twice (hot)
                    h = self.agent.make_prepped_xfer(xop, lh, idx, rh, idx, msg)
                    if key in self.once and key not in self.xfers:  # kept from an array's second post on
                        self.xfers[key] = h
                        self.kept.add(h)
                    self.once.add(key)  # (a workload posts most of its arrays once: nothing to keep)
            else:
                a = self.agent
                h = a.initialize_xfer(xop, a.get_xfer_descs(loc, self.seg), a.get_xfer_descs(rem, self.seg), name, msg)
            a = time.perf_counter()
            st = self.agent.transfer(h, msg)
            self.lib_s += time.perf_counter() - a
        except Exception as exc:
            raise TransportError(f"nixl: posting {xop} to rank {peer} failed: {exc}") from None
        if st == "ERR":
            self._drop(h)
            raise TransportError(f"nixl: {xop} to rank {peer} failed at post")
        self.live.add(h)
        return h

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Target side: the handle is the notification the initiator will send."""
        if peer not in self.peers:
            raise TransportError(f"nixl: rank {peer} was not connected")
        return (self.peers[peer][0], b"kvb%d" % tag)

    def _drain(self) -> None:
        for name, msgs in self.agent.get_new_notifs().items():
            for m in msgs:
                self.notifs[(name, bytes(m))] += 1

    def _progress_others(self) -> None:
        # several agents in one process (in-process tests): without a progress thread, the
        # agent on the other end only advances when polled, and nobody else polls it here
        for t in list(_AGENTS):
            if t is not self and t.agent is not None:
                t._drain()

    def wait(self, handle) -> None:
        """Initiator: until the transfer completes. Target: until its notification arrives."""
        if handle is None:
            return
        a = self.agent
        if isinstance(handle, tuple):
            notifs, others = self.notifs, len(_AGENTS) > 1
            while notifs[handle] == 0:
                self._drain()
                if others:
                    self._progress_others()
            notifs[handle] -= 1
            if not notifs[handle]:
                del notifs[handle]  # tags are per request: keep the counter small
            return
        check, others = a.check_xfer_state, len(_AGENTS) > 1
        try:
            st = check(handle)
            while st == "PROC":
                if others:
                    self._progress_others()
                st = check(handle)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError
            st = f"{type(exc).__name__}: {exc}"
        self.live.discard(handle)
        if st != "DONE":
            with contextlib.suppress(Exception):
                self._drop(handle)
            raise TransportError(f"nixl: transfer failed ({st})")
        if self.capture:
            t = a.get_xfer_telemetry(handle)
            self.tele.append({"post_us": t.postDuration, "xfer_us": t.xferDuration,
                              "bytes": t.totalBytes, "descs": t.descCount})
        if handle not in self.kept:  # kept handles are posted again
            handle.release()

    def _drop(self, h) -> None:
        """Release a handle that failed, and forget it if it was kept for re-posting."""
        if h in self.kept:
            self.kept.discard(h)
            self.xfers = {k: v for k, v in self.xfers.items() if v is not h}
        h.release()

    # -- facts and teardown --------------------------------------------------
    def telemetry(self) -> list[dict]:
        """NIXL's per-transfer telemetry since the last call (needs option telemetry=on).

        Each entry: post_us (time inside post), xfer_us (post to completion, as
        NIXL saw it), bytes, descs (descriptors after NIXL merged adjacent ones).
        """
        out = list(self.tele)
        self.tele.clear()
        return out

    def info(self) -> dict:
        """Library version and the options in force."""
        from importlib.metadata import version

        out = {"nixl": version("nixl"), "backend": "UCX", "prep": "on" if self.prep else "off",
               "progress_thread": "on" if self.prog_thread else "off",
               "telemetry": "on" if self.capture else "off", "env_set": self.env_set}
        if self.per_req:
            out["per_request"] = dict(self.counts, pool_registered=self.reg is not None)
        return out

    def close(self) -> None:
        """Release transfers, prepared lists, peers and the registration (idempotent)."""
        a, self.agent = self.agent, None
        if a is None:
            return
        _AGENTS.discard(self)
        # best effort: an active transfer that cannot be cancelled is freed with the agent
        steps = [h.release for h in self.live | self.kept]
        steps += [h.release for ent in self.cache.values() for h in ent[3:5] if h is not None]
        steps += [h.release for h in self.fresh.values()]
        steps += [lambda n=name: a.remove_remote_agent(n) for name, *_ in self.peers.values()]
        if self.reg is not None:
            steps.append(lambda: a.deregister_memory(self.reg))
        for step in steps:
            with contextlib.suppress(Exception):
                step()
        self.live.clear()
        self.kept.clear()
        self.xfers.clear()
        self.once.clear()
        self.cache.clear()
        self.fresh.clear()
        self.peers.clear()
        self.reg = None
