"""One-sided UCX, the ucx transport's default (``-O mode=tag``: the two-sided path of ucx.py).

As an engine's UCX backend does (NIXL's, Mooncake's): each rank maps its pool once (``ucp_mem_map``) and hands
its peers the pool's address and packed rkey with its worker address; a peer unpacks the rkey on its endpoint
at connect.  A post is then ONE call into C (kvbench/_ucx.c): a ``ucp_put_nbx`` (push) or ``ucp_get_nbx``
(pull) per descriptor run, straight between the pools (no staging, no pack), and one ``ucp_ep_flush_nbx``;
the initiator's wait progresses the worker until that flush completes, when the bytes are in the destination
pool.  The destination learns nothing from UCX: ``notifies=False``, so the harness sends its own notification
after the initiator's wait (push), and a pull's layer-ready signal is the harness's as well.  No tag message
is sent at all: the context is created with UCX's RMA feature only.

ucxx makes the context, worker and endpoints (its Python API has no memory handle, rkey or put/get: ``_ucx``
calls the same libucp on their handles).  A put or get over a lane that is not truly one-sided needs its
target to progress UCX, which a passive rank here never does: on tcp (UCX's put over a socket) or UCX's
emulation over active messages it would hang, so ``ready`` refuses those lanes in one line (``-O mode=tag``
runs there).  Options: ``tls``, ``err_handling``, ``progress`` and ``spin_us`` as for ``mode=tag``.
"""
from __future__ import annotations

import os
import struct
import time

import numpy as np

from .base import DST, SRC, Caps, Context, Transport, TransportError, Unavailable, check_descs
from .rails import ucx_devices
from .ucx_buffers import ep_info, probe_ucxx, rma_lanes, versions

_META = struct.Struct("<QQQII")  # magic, pool address, pool bytes, worker address bytes, rkey bytes
_MAGIC = 0x4B56424E55435852  # "KVBNUCXR"
_POLL_S = 1e-3  # progress=poll: how long one C call spins before Python looks again (the watchdog, a Ctrl-C)
# lanes whose put/get complete without the target's progress (UCX transport names, as ucp_ep_print_info says)
_PASSIVE = ("self", "cma", "knem", "xpmem", "sysv", "posix", "rc", "dc", "ud", "gga", "cuda_ipc", "rocm_ipc", "ze_ipc")

RMA_CAPS = Caps(memory=("host",), ops=("push", "pull"), one_sided=True, multi_node=True, notifies=False, network=True)


class _Flush:
    """A post's flush request (0 when everything completed inside the call), until ``wait`` sees it done."""

    __slots__ = ("req",)

    def __init__(self, req: int):
        self.req = req


class UcxRmaTransport(Transport):
    """ucp_mem_map'd pools, packed rkeys, put/get per descriptor and a flush per post (``_ucx``)."""

    name = "ucx"
    batches = True  # a serial request's layers go as one post (base.prepare_request): one C call, one flush
    caps = RMA_CAPS
    pins_on_rdma = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._uctx = self._worker = self._pool = self._memh = None
        self._peers: dict[int, tuple] = {}  # rank -> (ucxx endpoint, ep handle, pool address, pool bytes, rkey)
        self._plans: dict = {}  # (id(descs), op, peer) -> (descs, rma arguments)
        self._open: list[_Flush] = []  # flushes posted and not yet seen complete (close cancels them)
        self._lanes: dict[str, dict] = {}
        self._events = str(ctx.options.get("progress", "poll")) == "event"
        self._spin_s = float(ctx.options.get("spin_us", 50)) * 1e-6

    @classmethod
    def probe(cls) -> str | None:
        """ucxx, as the ucx transport's (this module's own C part is checked in ``register``)."""
        return probe_ucxx()

    def register(self, pool) -> bytes:
        """Context (RMA feature) and worker through ucxx; the pool mapped once; address, rkey and worker address."""
        self.require(pool)
        try:
            from kvbench import _ucx
        except ImportError as exc:
            raise Unavailable(f"ucx one-sided needs kvbench._ucx, built by `make install` once ucxx is installed "
                              f"(or `python setup.py build_ext --inplace`); -O mode=tag runs without it ({exc})") from None
        import ucxx._lib.libucxx as api

        self._api, self._c, self._pool = api, _ucx, pool
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, unknown to UCX 1.21
        ucx_devices(self.ctx, "ucx")  # -O rails=N: UCX_NET_DEVICES, before the context (info() shows UCX_ variables)
        cfg = {"TLS": str(self.ctx.options["tls"])} if self.ctx.options.get("tls") else {}
        feats = (api.Feature.RMA,) + ((api.Feature.WAKEUP,) if self._events else ())
        try:
            self._uctx = api.UCXContext(cfg, feature_flags=feats)
            self._worker = api.UCXWorker(self._uctx)
            if self._events:
                self._worker.init_blocking_progress_mode()
            self._memh = _ucx.mem_map(self._uctx.handle, pool.addr, pool.nbytes)
            rkey, addr = _ucx.rkey_pack(self._uctx.handle, self._memh), bytes(self._worker.address)
        except Exception as exc:
            raise TransportError(f"ucx: context, worker or ucp_mem_map of the pool failed: {exc}") from None
        return _META.pack(_MAGIC, pool.addr, pool.nbytes, len(addr), len(rkey)) + addr + rkey

    def register_region(self, pool):
        """--pool-sizes: ucp_mem_map of one more region (unmapped by ``deregister_region``)."""
        return self._c.mem_map(self._uctx.handle, pool.addr, pool.nbytes)

    def deregister_region(self, handle) -> None:
        self._c.mem_unmap(self._uctx.handle, handle)

    def connect(self, peers: dict[int, bytes]) -> None:
        """An endpoint per peer from its worker address, and its pool's rkey unpacked on that endpoint."""
        errh = str(self.ctx.options.get("err_handling", "off")).lower() in ("on", "true", "1")
        for peer, meta in peers.items():
            magic, base, nbytes, na, nr = _META.unpack_from(meta)
            if magic != _MAGIC or len(meta) != _META.size + na + nr:
                raise TransportError(f"ucx: rank {peer}'s connection data is not one-sided ucx's (mode= differs?)")
            addr = self._api.UCXAddress.create_from_buffer(meta[_META.size:_META.size + na])
            try:
                ep = self._worker.create_endpoint_from_worker_address(addr, errh)
                rkey = self._c.rkey_unpack(ep.handle, meta[_META.size + na:])
            except Exception as exc:
                raise TransportError(f"ucx: endpoint or rkey of rank {peer} failed: {exc} "
                                     f"(tls={self._uctx.config.get('TLS')}, err_handling={errh})") from None
            self._peers[peer] = (ep, ep.handle, base, nbytes, rkey)

    def ready(self) -> None:
        """Record the lanes UCX chose; refuse put/get lanes that would need the target's progress."""
        for _ in range(100):
            self._worker.progress()
        self._lanes = {str(p): ep_info(v[1], ()) for p, v in self._peers.items()}
        for p, info in self._lanes.items():
            used = sorted(set(rma_lanes(info)))
            if not used or any(u not in _PASSIVE and u.split("_")[0] not in _PASSIVE for u in used):
                over = ", ".join(used) or "UCX's emulation over active messages (no lane does RMA)"
                raise TransportError(f"ucx: one-sided put/get to rank {p} goes over {over}, which needs the target "
                                     "to progress UCX (kvbench's target is passive): use -O mode=tag")

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """The descriptors checked against both pools and the C call's arguments, once per array (the harness
        never changes one in place): ``start`` is the call alone."""
        key = (id(descs), op, peer)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is descs:
            return hit[1]
        if op not in ("push", "pull"):
            raise TransportError(f"ucx: unknown op {op}")
        try:
            _ep, eph, base, nbytes, rkey = self._peers[peer]
        except KeyError:
            raise TransportError(f"ucx: rank {peer} is not connected") from None
        push = op == "push"
        check_descs(descs, *((self._pool.nbytes, nbytes) if push else (nbytes, self._pool.nbytes)))
        d = np.ascontiguousarray(descs, dtype=np.int64)
        args = (not push, eph, self._pool.addr, self._memh, base, rkey, d, SRC if push else DST, DST if push else SRC)
        if len(self._plans) >= 4096:
            self._plans.clear()
        self._plans[key] = (descs, args)
        return args

    def start(self, prepared):
        """Every descriptor's put/get and the flush: one call."""
        a = time.perf_counter()
        try:
            req = self._c.rma(*prepared)
        except RuntimeError as exc:
            raise TransportError(f"ucx: {exc}") from None
        finally:
            self.lib_s += time.perf_counter() - a  # the library's calls (costs.py)
        if not req:
            return None
        h = _Flush(req)
        self._open.append(h)
        return h

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """push: put every descriptor into the peer's pool; pull: get it from there; then flush."""
        return self.start(self.prepare(op, peer, descs, tag))

    def wait(self, handle) -> None:
        """Progress the worker until the post's flush completed (its bytes are in the destination pool)."""
        if handle is None or not handle.req:
            return
        worker, spin = self._worker.handle, (self._spin_s if self._events else _POLL_S)
        try:
            while not self._c.test(worker, handle.req, spin):
                if self._events:
                    self._worker.progress_worker_event(1)  # sleeps on the event fd until UCX has more (1 ms at most)
        except RuntimeError as exc:
            handle.req = 0
            raise TransportError(f"ucx: {exc}") from None
        handle.req = 0
        if len(self._open) > 64:  # completed handles are dropped lazily
            self._open = [h for h in self._open if h.req]

    def counts(self) -> dict:
        """What this process handed to ucp_put_nbx / ucp_get_nbx so far, and in how many posts."""
        put, get, posts = self._c.counts() if self._pool is not None else (0, 0, 0)
        return {"put_bytes": put, "get_bytes": get, "rma_posts": posts}

    def info(self) -> dict:
        """Versions, the one-sided path, and the lanes and put/get protocols UCX selected per peer."""
        out = {"mode": "rma", "one_sided": "yes: ucp_mem_map once, packed rkeys at connect, ucp_put_nbx/ucp_get_nbx "
               "per descriptor run and one ucp_ep_flush_nbx per post (kvbench._ucx); the harness notifies",
               "scatter_gather": "pool to pool, one put/get per descriptor run (no staging)",
               "progress": "event: spin, then sleep on the worker's event fd" if self._events else "polled in wait()",
               "lanes": self._lanes}
        return out | versions(self._uctx)

    def close(self) -> None:
        """Cancel flushes in flight, drop rkeys and endpoints, unmap the pool (idempotent)."""
        if self._worker is None:
            return
        c, worker = self._c, self._worker
        try:
            for h in self._open:
                if h.req:
                    c.cancel(worker.handle, h.req)
                    h.req = 0
            for ep, _eph, _b, _n, rkey in self._peers.values():
                c.rkey_destroy(rkey)
                ep.close_blocking()
            if self._memh is not None:
                c.mem_unmap(self._uctx.handle, self._memh)
        except Exception:
            pass
        self._open, self._plans, self._peers, self._memh = [], {}, {}, None
        self._worker = self._uctx = None
