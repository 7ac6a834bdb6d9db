"""Two-sided UCX through ucxx (``-O mode=tag``): tag send/receive between worker-address endpoints.

The ucx transport is one-sided by default: ``UcxTransport(ctx)`` builds ucx_rma.py's transport (registered
pools, packed rkeys, put/get per descriptor and a flush) unless ``-O mode=tag`` asks for this class, the
two-sided path (ucxx's Python API has no put/get: the tag API is all it offers).  push: the source sends,
the destination receives; pull: the destination sends a small request and the
source answers with the data (one more round trip, as in any two-sided pull).

A serial request's layers are one post (base.prepare_request): one header
(a push sends it in ``prepare``: it says what the request is, known before its
layers are final), then its ranges pool to pool when each layer is one range (bulk), else one
packed message.  Scatter-gather: ucxx has no iov datatype, and ``tag_send_multi`` / one
``tag_send`` per block cost a Python object and a message per block, so a layer
of n > 1 descriptors is packed into page-aligned staging with one
``copy_batch`` (GIL released), sent as ONE tag message and unpacked likewise:
one extra memcpy per side, which measured faster than either alternative (docs/evidence.md).
One descriptor goes pool to pool.  A packed push's staging is capped
(``staging_mib``, default 1024): one that would exceed it is packed when
started, after the oldest started push frees a buffer; idle buffers beyond
the cap are dropped.  Receive staging and a pull source's answer hold what is
in flight, uncapped: a receive that waited for a buffer could wait on a send
its peer starts only after the barrier.
UCX tags hold (sender rank, kind, per-direction sequence) and each layer
carries a checked header (magic, kvbench tag, bytes, descriptors), so a
mixed-up stream raises.  Progress is made in ``wait`` (no asyncio, no
thread): with ``progress=event`` (default ``poll``: spin, as ucx_perftest does) a wait spins on ``progress`` for ``spin_us`` (default 50)
and then sleeps on the worker's event fd until UCX has more (ucxx's ``progress_worker_event``: one C
call, GIL released), then spins again: completions that follow each other closely are caught at
once, and a rank whose part is waiting on its peer leaves the CPU to it; ``progress=poll`` spins.  ``import ucxx`` must precede mpi4py's MPI init in the process
(docs/pitfalls.md#ucx-first; ``kvbench.job.comm.preload`` does it).  Options: ``tls``
(UCX_TLS, e.g. ``sm``, ``tcp``), ``err_handling`` (off; on excludes shared
memory), ``staging_mib``, ``progress``, ``spin_us``.  ``info()["lanes"]`` is what UCX really selected.
"""
from __future__ import annotations

import os
import time

import numpy as np

from .base import DST, LEN, SRC, Caps, Context, Transport, TransportError
from .rails import ucx_devices
from .ucx_buffers import UcxBuffers, ep_info, probe_ucxx, versions
from .ucx_rma import RMA_CAPS, UcxRmaTransport

_MAGIC = 0x4B56424E55435831  # "KVBNUCX1"
_PUSH_HDR, _PUSH_DATA, _PULL_REQ, _PULL_DATA = 1, 2, 3, 4
_PUSH_PART, _PULL_PART = 5, 6  # a request's layers of one range each: one message per range, under one header


def _tag(sender: int, kind: int, seq: int) -> int:
    return (sender << 44) | (kind << 40) | (seq & ((1 << 40) - 1))


class _Handle:
    """Outstanding UCX requests, the buffers they use, and what to do when they finish."""

    __slots__ = ("reqs", "keep", "then", "stage", "sends")

    def __init__(self, reqs, keep, then=None, stage=None, sends=False):
        self.reqs, self.keep, self.then, self.stage = reqs, keep, then, stage
        self.sends = sends  # a packed push: it completes without this rank doing more (UcxBuffers._staging)


TAG_CAPS = Caps(memory=("host",), ops=("push", "pull"), one_sided=False, multi_node=True, notifies=True, network=True,
                unregistered="ucx mode=tag registers nothing: UCX registers a send's buffer on first use (in the first "
                "transfer)")


class UcxTransport(UcxBuffers, Transport):
    """ucxx worker per rank; one tag message per layer (plus a header), polled progress (``-O mode=tag``)."""

    name = "ucx"
    batches = True  # a serial request's layers go as one post (base.prepare_request)
    caps = RMA_CAPS  # the registry's class answers for the default mode; an instance of this class says TAG_CAPS
    pins_on_rdma = True

    def __new__(cls, ctx):
        # the default mode on transport "ucx" is one-sided (as mpi's __new__ picks sendrecv); a subclass stays tag
        if cls is UcxTransport and ctx.options.get("mode", "rma") != "tag":
            return UcxRmaTransport(ctx)  # not a UcxTransport: built (and initialised) here
        return super().__new__(cls)

    @classmethod
    def probe(cls) -> str | None:
        """Why ucxx cannot run here, or None (ucx_buffers.probe_ucxx)."""
        return probe_ucxx()

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.caps = TAG_CAPS
        self._worker = self._uctx = self._pool = None
        self._eps: dict[int, object] = {}
        self._seq: dict[tuple, int] = {}
        self._free: list[np.ndarray] = []  # staging buffers not in use
        self._free_bytes = 0  # their bytes
        self._staged: list[_Handle] = []  # handles holding staging, oldest first
        self._reactive: list[_Handle] = []  # pull-serve handles that must answer a request
        self._in_use = 0
        self._cap = int(float(ctx.options.get("staging_mib", 1024)) * (1 << 20))
        self._lanes: dict[str, dict] = {}
        self._parts: dict = {}  # (id(descs), column[, "rows"]) -> (descs, its ucxx views or its pack rows)
        self._events = str(ctx.options.get("progress", "poll")) == "event"
        self._spin_s = float(ctx.options.get("spin_us", 50)) * 1e-6

    def register(self, pool) -> bytes:
        """Create the UCX context and worker; return this worker's address."""
        self.require(pool)
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array

        self._api, self._Array, self._pool = api, Array, pool
        # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows: one warning per rank otherwise
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        ucx_devices(self.ctx, "ucx")  # -O rails=N: UCX_NET_DEVICES, before the context (info() shows UCX_ variables)
        cfg = {"TLS": str(self.ctx.options["tls"])} if self.ctx.options.get("tls") else {}
        try:
            self._uctx = api.UCXContext(cfg, feature_flags=(api.Feature.TAG,) + ((api.Feature.WAKEUP,) if self._events else ()))
            self._worker = api.UCXWorker(self._uctx)
            if self._events:
                self._worker.init_blocking_progress_mode()
            return bytes(self._worker.address)
        except Exception as exc:
            raise TransportError(f"ucx: context/worker creation failed: {exc}") from None

    def connect(self, peers: dict[int, bytes]) -> None:
        """One endpoint per peer, from the peer's worker address."""
        errh = str(self.ctx.options.get("err_handling", "off")).lower() in ("on", "true", "1")
        for peer, meta in peers.items():
            addr = self._api.UCXAddress.create_from_buffer(meta)
            try:
                self._eps[peer] = self._worker.create_endpoint_from_worker_address(addr, errh)
            except Exception as exc:  # e.g. err_handling=on with tls=sm: no shm transport supports it
                raise TransportError(f"ucx: endpoint to rank {peer} failed: {exc} "
                                     f"(tls={self._uctx.config.get('TLS')}, err_handling={errh})") from None

    def ready(self) -> None:
        """Record the lanes and tag protocols UCX chose for each endpoint."""
        for _ in range(100):
            self._worker.progress()
        self._lanes = {str(p): ep_info(ep.handle) for p, ep in self._eps.items()}

    def _part_tags(self, sender: int, kind: int, seq: int, n: int) -> list:
        """The UCX tags of a bulk request's ``n`` range messages (built ahead: a Python object each)."""
        tag, base = self._api.UCXXTag, _tag(sender, kind, seq << 12)
        return [tag(base | i) for i in range(n)]

    def _send_parts(self, peer: int, views: list, tags: list) -> list:
        ep = self._eps[peer]
        a = time.perf_counter()
        reqs = [ep.tag_send(v, t) for v, t in zip(views, tags)]
        self.lib_s += time.perf_counter() - a  # the library's calls (costs.py)
        return reqs

    def _recv_parts(self, peer: int, seq: int, descs: np.ndarray, kind: int) -> list:
        recv = self._worker.tag_recv
        return [recv(v, t) for v, t in zip(self._views(descs, DST), self._part_tags(peer, kind, seq, len(descs)))]

    def _whole(self, descs: np.ndarray) -> bool:
        """A request's layers joined, one range each (bulk): one message per range, one header."""
        return 1 < len(descs) == self.layers_in(descs) <= 4096  # the range's index takes a tag's low 12 bits

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Every post takes its sequence number here, in the order the target serves them.  A push sends its
        header here (what the request is: known before its layers are final).  A bulk request (its layers
        joined, one range each) is built ahead: its header, views and tags; a pull also posts its receives
        here (the destination's own buffers: the data then never arrives unexpected), so that ``start`` only
        sends.  A packed post reserves its staging here (a packed pull also posts its receive into it); a
        packed push packs in ``start``, when its layers are final."""
        if op not in ("push", "pull"):
            raise TransportError(f"ucx: unknown op {op}")
        seq, me, hdr = self._next(op, "post", peer), self.ctx.rank, _header(tag, descs)
        # a push's header describes the request, not its bytes: it goes here, once the post is built, off the
        # timed path (one message fewer after the layers are final); the target checks it when the data landed
        if not self._whole(descs):  # its staging reserved here (a started post may free one), its header built
            if op == "push":  # packed in start, once the layers are final
                area = self._push_area(descs)
                return "packed push", peer, hdr, self._send(peer, hdr, _tag(me, _PUSH_HDR, seq)), seq, *area, descs
            data, stage, unpack = self._recv_area(descs)
            return "packed pull", peer, hdr, seq, self._recv(data, _tag(peer, _PULL_DATA, seq)), data, stage, unpack
        if op == "push":
            views, tags = self._views(descs, SRC), self._part_tags(me, _PUSH_PART, seq, len(descs))
            return "push", peer, hdr, views, tags, [self._send(peer, hdr, _tag(me, _PUSH_HDR, seq))]
        parts = self._recv_parts(peer, seq, descs, _PULL_PART)
        return "pull", peer, hdr, [self._Array(hdr)], [self._api.UCXXTag(_tag(me, _PULL_REQ, seq))], parts

    def start(self, prepared):
        """Send what ``prepare`` built (a bulk pull: its request; its receives are posted)."""
        if prepared[0] == "packed push":  # the pack, then the data (its header went in prepare)
            _, peer, hdr, hreq, seq, data, stage, rows, descs = prepared
            if data is None:  # over the staging cap when prepared: staging once the oldest started send frees one
                data, stage, rows = self._pack_area(descs, may_wait=True)
            self._pack_now(stage, rows)
            reqs = [hreq, self._send(peer, data, _tag(self.ctx.rank, _PUSH_DATA, seq))]
            return self._track(_Handle(reqs, (hdr, data), stage=stage, sends=True))
        if prepared[0] == "packed pull":  # its request (its receive is posted)
            _, peer, hdr, seq, recv, data, stage, unpack = prepared
            reqs = [self._send(peer, hdr, _tag(self.ctx.rank, _PULL_REQ, seq)), recv]
            return self._track(_Handle(reqs, (hdr, data), then=unpack, stage=stage))
        kind, peer, hdr, msgs, tags, posted = prepared
        sent = self._send_parts(peer, msgs, tags)
        # the last posted first (_advance looks at it first): a push's header went before its parts, a pull's
        # receives were posted before its request
        reqs = posted + sent if kind == "push" else sent + posted
        return self._track(_Handle(reqs, (hdr,)))

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """push: send header + data; pull: send a request, receive the data.  A bulk request (its layers
        joined, one range each) goes pool to pool, a message per range under one header; other layers are
        packed into staging (``prepare``)."""
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """push: receive header + data and scatter; pull: answer the peer's request when it comes."""
        want = _header(tag, descs)  # what the peer's header must say
        if self._whole(descs):
            seq, hdr = self._next(op, "serve", peer), np.zeros(4, np.uint64)
            if op == "push":
                reqs = [self._recv(hdr, _tag(peer, _PUSH_HDR, seq))] + self._recv_parts(peer, seq, descs, _PUSH_PART)
                return self._track(_Handle(reqs, (hdr,), then=lambda h: _check(hdr, want, "push header")))

            views, tags = self._views(descs, SRC), self._part_tags(self.ctx.rank, _PULL_PART, seq, len(descs))

            def answer_parts(h):
                _check(hdr, want, "pull request")
                h.reqs = self._send_parts(peer, views, tags)

            h = _Handle([self._recv(hdr, _tag(peer, _PULL_REQ, seq))], (hdr,), then=answer_parts)
            self._reactive.append(h)
            return h
        if op == "push":
            seq, hdr = self._next(op, "serve", peer), np.zeros(4, np.uint64)
            data, stage, unpack = self._recv_area(descs)

            def then(h):
                _check(hdr, want, "push header")
                unpack(h)

            reqs = [self._recv(hdr, _tag(peer, _PUSH_HDR, seq)), self._recv(data, _tag(peer, _PUSH_DATA, seq))]
            return self._track(_Handle(reqs, (hdr, data), then=then, stage=stage))
        if op == "pull":
            seq, req = self._next(op, "serve", peer), np.zeros(4, np.uint64)

            def answer(h):
                _check(req, want, "pull request")
                data, h.stage = self._pack(descs, may_wait=False)  # the requester's receive waits for it: no cap
                h.keep, h.reqs = (data,), [self._send(peer, data, _tag(self.ctx.rank, _PULL_DATA, seq))]

            h = _Handle([self._recv(req, _tag(peer, _PULL_REQ, seq))], (req,), then=answer)
            self._reactive.append(h)
            return h
        raise TransportError(f"ucx: unknown op {op}")

    def wait(self, handle) -> None:
        """Progress the worker until ``handle`` is done, answering pending pull requests meanwhile."""
        if handle is None:
            return
        while not self._advance(handle):
            self._step(handle)
            for h in self._reactive:
                self._advance(h)
            self._reactive = [h for h in self._reactive if h.reqs != ()]

    def _step(self, handle: _Handle) -> None:
        """Advance the worker: spin (poll: once; event: for ``spin_s`` or until ``handle``'s last request
        completed), then with events one call that sleeps on the event fd (at most 1 ms) until UCX has more."""
        progress = self._worker.progress
        progress()
        if not self._events:
            return
        last, until, now = handle.reqs[-1], time.perf_counter() + self._spin_s, time.perf_counter
        while not last.completed:
            if now() >= until:
                self._worker.progress_worker_event(1)
                return
            progress()

    def _advance(self, h: _Handle) -> bool:
        if h.reqs == ():
            return True
        if not all(r.completed for r in reversed(h.reqs)):  # the last posted first: one look while it runs
            return False
        try:
            for r in h.reqs:
                r.check_error()
        except Exception as exc:
            raise TransportError(f"ucx: request failed: {exc}") from None
        h.reqs, then, h.then = [], h.then, None
        if then is not None:
            then(h)  # may post more requests (the pull answer)
            if h.reqs:
                self._track(h)
                return False
        h.reqs, h.keep = (), None
        if h.stage is not None:
            self._release(h.stage)
            h.stage = None
        return True

    def _next(self, op: str, side: str, peer: int) -> int:
        self._seq[op, side, peer] = seq = self._seq.get((op, side, peer), -1) + 1
        return seq

    def _send(self, peer, arr, tag):
        a = time.perf_counter()
        req = self._eps[peer].tag_send(self._Array(arr), self._api.UCXXTag(tag))
        self.lib_s += time.perf_counter() - a  # the library's call (costs.py)
        return req

    def _recv(self, arr, tag):
        return self._worker.tag_recv(self._Array(arr), self._api.UCXXTag(tag))

    def info(self) -> dict:
        """Versions, one-sidedness, and the UCX lanes/protocols actually selected per peer."""
        out = {"mode": "tag", "one_sided": "no: -O mode=tag (the default, rma, is ucp_put_nbx/ucp_get_nbx)",
               "scatter_gather": "pack/unpack via staging (copy_batch), one tag message per layer",
               "progress": "event: progress, then sleep on the worker's event fd" if self._events
               else "polled in wait()", "lanes": self._lanes}
        return out | versions(self._uctx)

    def close(self) -> None:
        """Cancel what is in flight, close endpoints, drop the worker and context (idempotent)."""
        if self._worker is None:
            return
        try:
            self._worker.cancel_inflight_requests()
            for ep in self._eps.values():
                ep.close_blocking()
        except Exception:
            pass
        self._eps.clear()
        self._reactive, self._staged, self._free, self._free_bytes = [], [], [], 0
        self._parts.clear()
        self._worker = self._uctx = None


def _header(tag: int, descs: np.ndarray) -> np.ndarray:
    return np.array([_MAGIC, tag & ((1 << 64) - 1), int(descs[:, LEN].sum()), len(descs)], np.uint64)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """``got`` must be the header ``want`` (built ahead, when the receive was posted)."""
    if got.tobytes() != want.tobytes():
        raise TransportError(f"ucx: {what} mismatch (stream mixed up): got {got.tolist()}, expected {want.tolist()}")
