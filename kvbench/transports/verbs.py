"""verbs: GPUDirect RDMA through pyverbs (rdma-core's Python binding; ``apt-get install python3-pyverbs``).

Written from rdma-core's documented pyverbs API; these machines have no RDMA device (no kernel InfiniBand
support, so no soft-RoCE either), so only the pure logic below has run here (tests/test_verbs.py); the rest is
listed in docs/gpu.md as untested.

* One RC queue pair per peer (``-O qps=N``: N, descriptors dealt round-robin by work request), one completion
  queue; connection data (QP number, PSN, LID, GID, rkey, pool address) goes through the harness.
* The pool is registered once: host memory as a plain MR; CUDA memory through dma-buf (``DmaBufMR``, with the
  fd from cuMemGetHandleForAddressRange) where the driver offers it, else as a plain MR on the device address,
  which works when nvidia-peermem is loaded.  A registration that fails for the locked-memory limit says so.
* Push: RDMA WRITEs; an RDMA WRITE moves a local scatter-gather list into one contiguous remote range, so a
  layer becomes one work request per destination-contiguous run, split at the device's ``max_sge``; the layer's
  last work request is WRITE_WITH_IMM, whose immediate data (the layer's tag) completes a receive the
  destination posted: its notification (``notifies``).  Pull: RDMA READs, source-contiguous runs split at
  ``max_sge_rd``, completion on the reader's CQ.
* Work requests are built in ``prepare`` (while the prefill runs; pyverbs makes one object per work request)
  and posted in ``start`` as one chain, one ``post_send`` per layer.
"""
from __future__ import annotations

import os
import pickle
import struct
import time

import numpy as np

from .base import DST, LEN, SRC, Caps, Transport, TransportError, check_descs, rdma_present

IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ = 0, 1, 4  # enum ibv_wr_opcode


# ----- pure logic (tested here) ----------------------------------------------------------------
def runs(descs: np.ndarray, remote: int) -> np.ndarray:
    """Start index of each run of descriptors whose ``remote`` column continues the previous one's range."""
    if not len(descs):
        return np.zeros(0, np.int64)
    cont = descs[1:, remote] == descs[:-1, remote] + descs[:-1, LEN]
    return np.flatnonzero(np.concatenate(([True], ~cont)))


def work_requests(descs: np.ndarray, op: str, max_sge: int, local_base: int, remote_base: int):
    """A layer's work requests: (remote address, SGE array of (local address, length)) per request.

    push (RDMA WRITE): SGEs gather local SRC ranges into one remote DST run; pull (RDMA READ): SGEs scatter one
    remote SRC run into local DST ranges.  A run longer than ``max_sge`` descriptors becomes several requests.
    Vectorised: the only loop is over work requests, which pyverbs needs as objects anyway."""
    if max_sge < 1:
        raise ValueError("max_sge must be at least 1")
    local, remote = (SRC, DST) if op == "push" else (DST, SRC)
    starts = runs(descs, remote)
    ends = np.append(starts[1:], len(descs))
    # cut every run at max_sge: request boundaries are run starts plus every max_sge-th descriptor within a run
    bounds = np.concatenate([np.arange(s, e, max_sge) for s, e in zip(starts.tolist(), ends.tolist())]) \
        if len(starts) else np.zeros(0, np.int64)
    sges = np.stack([descs[:, local] + local_base, descs[:, LEN]], axis=1)
    out = []
    for i, b in enumerate(bounds.tolist()):
        e = int(bounds[i + 1]) if i + 1 < len(bounds) else len(descs)
        out.append((int(descs[b, remote]) + remote_base, sges[b:e]))
    return out


def encode_imm(tag: int) -> int:
    """Immediate data of a layer's last WRITE: the harness's tag (case and iteration, request << 12, layer),
    32 bits in network byte order as ibv_send_wr.imm_data wants them."""
    if not 0 <= tag < 1 << 32:
        raise ValueError(f"tag {tag} does not fit the 32-bit immediate data")
    return struct.unpack("=I", struct.pack("!I", tag))[0]


def decode_imm(imm: int) -> tuple[int, int, int]:
    """(tag, request, layer) from a completion's immediate data."""
    tag = struct.unpack("!I", struct.pack("=I", imm))[0]
    return tag, (tag >> 12) & 0xF, tag & 0xFFF


def opcodes(op: str, n: int) -> list[int]:
    """Opcodes of a layer's ``n`` work requests: the last WRITE carries the immediate data (the notification)."""
    if op == "pull":
        return [IBV_WR_RDMA_READ] * n
    return [IBV_WR_RDMA_WRITE] * (n - 1) + [IBV_WR_RDMA_WRITE_WITH_IMM] if n else []


def peermem() -> str | None:
    """nvidia-peermem's version when loaded (GPU memory registers as a plain MR), else None."""
    for path in ("/sys/module/nvidia_peermem/version", "/sys/kernel/mm/memory_peers/nv_mem/version"):
        try:
            with open(path) as fh:
                return fh.read().strip() or "loaded"
        except OSError:
            continue
    return None


# ----- pyverbs (needs an RDMA device) ---------------------------------------------------------
class VerbsTransport(Transport):
    name = "verbs"
    caps = Caps(memory=("host", "cuda"), ops=("push", "pull"), one_sided=True, multi_node=True, notifies=True,
                network=True)

    @classmethod
    def probe(cls) -> str | None:
        if not rdma_present():
            return "no RDMA device (/sys/class/infiniband is empty or missing)"
        try:
            import pyverbs.device as d
        except ImportError:
            return "pyverbs is not installed (apt-get install python3-pyverbs; from a venv add " \
                   "/usr/lib/python3/dist-packages to PYTHONPATH)"
        try:
            return None if d.get_device_list() else "no RDMA device (ibv_get_device_list is empty)"
        except Exception as exc:
            return f"no RDMA device ({exc})"

    def __init__(self, ctx):
        super().__init__(ctx)
        from pyverbs.cq import CQ
        from pyverbs.device import Context as VCtx
        from pyverbs.device import get_device_list
        from pyverbs.pd import PD

        name = ctx.options.get("device") or get_device_list()[0].name.decode()
        self.qps_per_peer = int(ctx.options.get("qps", 1))
        self.port = int(ctx.options.get("port", 1))
        self.vctx = VCtx(name=name)
        self.attr = self.vctx.query_device()
        self.pd = PD(self.vctx)
        self.cq = CQ(self.vctx, 4096, None, None, 0)
        self.device_name, self.qps, self.remote = name, {}, {}

    def register(self, pool) -> bytes:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE
        from pyverbs.mr import MR

        access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        self.pool = pool
        try:
            if pool.kind == "cuda":
                self.mr, self.reg = _register_cuda(self.pd, pool, access)
            else:
                self.mr, self.reg = MR(self.pd, pool.nbytes, access, address=pool.addr), "host MR"
        except Exception as exc:
            raise TransportError(f"verbs: registering {pool.nbytes / 2**30:.2f} GiB failed: {exc}{_memlock_hint()}") \
                from None
        return pickle.dumps({"addr": pool.addr, "rkey": self.mr.rkey, "qps": self._make_qps()})

    def _make_qps(self) -> dict:
        from pyverbs.enums import IBV_QPT_RC
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=1024, max_recv_wr=1024, max_send_sge=min(self.attr.max_sge, 30),
                    max_recv_sge=1)
        gid = self.vctx.query_gid(self.port, 0)
        lid = self.vctx.query_port(self.port).lid
        out = {}
        for peer in range(self.ctx.world_size):
            if peer != self.ctx.rank:
                self.qps[peer] = [QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap),
                                     QPAttr(port_num=self.port)) for _ in range(self.qps_per_peer)]
                out[peer] = [(q.qp_num, 0, lid, str(gid)) for q in self.qps[peer]]
        return out

    def connect(self, peers: dict[int, bytes]) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        for peer, blob in peers.items():
            m = pickle.loads(blob)
            self.remote[peer] = m
            for q, (qpn, psn, lid, gid) in zip(self.qps[peer], m["qps"][self.ctx.rank]):
                attr = QPAttr(port_num=self.port)
                attr.dest_qp_num, attr.rq_psn, attr.sq_psn = qpn, psn, 0
                gr = GlobalRoute(dgid=GID(gid), sgid_index=0)
                attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=lid, port_num=self.port)
                q.to_rts(attr)
                self._post_recvs(q, 512)  # WRITE_WITH_IMM consumes a receive at the destination

    def _post_recvs(self, q, n: int) -> None:
        from pyverbs.wr import RecvWR

        for _ in range(n):
            q.post_recv(RecvWR(num_sge=0))

    def prepare(self, op, peer, descs, tag=0):
        from pyverbs.wr import SGE, SendWR

        check_descs(descs, self.pool.nbytes if op == "push" else 1 << 62, 1 << 62 if op == "push" else self.pool.nbytes)
        max_sge = self.attr.max_sge if op == "push" else self.attr.max_sge_rd
        wrs = work_requests(descs, op, max_sge, self.pool.addr, self.remote[peer]["addr"])
        chain = []
        for (raddr, sges), opcode in zip(wrs, opcodes(op, len(wrs))):
            wr = SendWR(opcode=opcode, num_sge=len(sges), sg=[SGE(int(a), int(n), self.mr.lkey) for a, n in sges])
            wr.set_wr_rdma(self.remote[peer]["rkey"], raddr)
            if opcode == IBV_WR_RDMA_WRITE_WITH_IMM:
                wr.imm_data = encode_imm(tag & 0xFFFFFFFF)
            chain.append(wr)
        for a, b in zip(chain, chain[1:]):
            a.set_next_wr(b)
        return peer, chain, len(chain)

    def start(self, prepared):
        peer, chain, n = prepared
        if n:
            self.qps[peer][0].post_send(chain[0])
        return ("init", n)

    def post(self, op, peer, descs, tag=0):
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op, peer, descs, tag=0):
        return ("imm", tag & 0xFFFFFFFF, peer) if op == "push" else None

    def wait(self, handle) -> float | None:
        if handle is None:
            return None
        want = handle[1] if handle[0] == "init" else 1
        while want > 0:
            n, wcs = self.cq.poll(min(want, 64))
            for wc in wcs[:n]:
                if wc.status != 0:
                    raise TransportError(f"verbs: work completion failed with status {wc.status}")
                if handle[0] == "imm":
                    self._post_recvs(self.qps[handle[2]][0], 1)
            want -= n
        return time.perf_counter()

    def info(self) -> dict:
        return {"device": self.device_name, "max_sge": self.attr.max_sge, "max_sge_rd": self.attr.max_sge_rd,
                "registration": getattr(self, "reg", ""), "nvidia_peermem": peermem(), "qps": self.qps_per_peer}

    def close(self) -> None:
        for attr in ("qps", "mr", "cq", "pd", "vctx"):
            obj = getattr(self, attr, None)
            for o in (sum(obj.values(), []) if isinstance(obj, dict) else [obj]):
                if o is not None and hasattr(o, "close"):
                    o.close()


def _register_cuda(pd, pool, access):
    """GPU memory: dma-buf where the driver gives an fd for the range, else a plain MR (nvidia-peermem)."""
    from pyverbs.mr import MR

    fd = _dmabuf_fd(pool.addr, pool.nbytes)
    if fd is not None:
        from pyverbs.mr import DmaBufMR

        try:  # iova = the device address, so remote addresses are the pool's own (docs: iova defaults to offset)
            return DmaBufMR(pd, pool.nbytes, access, fd=fd, offset=0, iova=pool.addr), "dma-buf"
        finally:
            os.close(fd)
    if peermem() is None:
        raise TransportError("verbs: GPU memory needs dma-buf (CUDA 11.7+ driver and kernel 5.12+) or the "
                             "nvidia-peermem module (modprobe nvidia-peermem)")
    return MR(pd, pool.nbytes, access, address=pool.addr), "nvidia-peermem MR"


def _dmabuf_fd(addr: int, nbytes: int) -> int | None:
    """cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) for the pool, or None."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuMemGetHandleForAddressRange", None)
    if fn is None:
        return None
    fd = ctypes.c_int(-1)
    rc = fn(ctypes.byref(fd), ctypes.c_uint64(addr), ctypes.c_size_t(nbytes), ctypes.c_int(1), ctypes.c_ulonglong(0))
    return fd.value if rc == 0 and fd.value >= 0 else None


def _memlock_hint() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" (the locked-memory limit is {soft / 2**20:.0f} MiB: raise it with 'ulimit -l unlimited', or "
            "memlock in /etc/security/limits.conf, or LimitMEMLOCK=infinity for a systemd service)")


