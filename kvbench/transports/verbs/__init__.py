"""verbs: GPUDirect RDMA through pyverbs (rdma-core's Python binding; ``apt-get install python3-pyverbs``).

These machines have no RDMA device, so the tests hold it to rdma-core's real pyverbs objects (work requests,
QP attributes, addresses) and to a fake device written from rdma-core's sources (tests/fakes/pyverbs_fake.py),
with a numpy wire between two of them; docs/gpu.md lists what has not run on hardware.

* ``-O qps=N`` RC queue pairs per peer: a layer's work requests are dealt to them in contiguous groups, each
  group's last WRITE carrying the immediate data, so the destination waits for one notification per QP used.
* Connection data (QP numbers, PSNs, LID, GID, MTU, rkey, the pool's address in its MR) goes through the
  harness.  The GID is the port's RoCE v2 one (IPv4-mapped first; ``-O gid=`` names another; InfiniBand
  ports route by LID).  QP attributes are set per transition (link.py).
* The pool is registered once: host memory as a plain MR; CUDA memory through dma-buf (``DmaBufMR``, whose
  addresses start at 0) where the driver offers it, else a plain MR on the device address (nvidia-peermem).
* Push: RDMA WRITEs, one per destination-contiguous run, split at the QP's SGE limit; the last WRITE of each
  QP's group is WRITE_WITH_IMM, whose immediate data (the layer's tag) completes a receive at the
  destination, matched to its tag and peer.  Pull: RDMA READs of source-contiguous runs.
* Queues never overflow: only every k-th request and each group's last are signaled, chains are posted once
  the send queue has room for them, and each CQ holds every completion that can be outstanding (plan.depths).
* The QPs fit the provider's work-queue budget: few SGEs per WRITE and a send queue sized by mlx5's arithmetic
  (plan.sq_fit); a QP refused with EINVAL is asked for again with half the work requests, the depths follow,
  and info()'s ``note`` says so (rank 0 prints it once).
* A CUDA pool's landing is flushed before ``wait`` returns on its destination (a push's or a pull's): an RDMA
  READ of one byte of the pool's own MR on a QP connected to itself, as NCCL's ncclIbIflush does, since the
  NIC's writes into GPU memory may still be on their way when their completion arrives; host pools skip it.
* ``-O tc=`` (RoCE traffic class, in the GRH) and ``-O sl=`` (service level) select a fabric's class;
  ``-O timeout=`` is the ACK timeout exponent (default 20, NCCL's); GPU MRs ask for relaxed ordering.
"""
from __future__ import annotations

import collections
import errno
import itertools
import os
import pickle
import sys
import time

from kvbench.transports.base import Caps, Transport, TransportError, check_descs, rdma_present

from . import link
from .plan import (
    IBV_SEND_SIGNALED,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    MAX_SEND_SGE,
    SQ_DEPTH,
    SQ_FLOOR,
    decode_imm,
    depths,
    encode_imm,
    notifications,
    opcodes,
    peermem,
    segments,
    spread,
    work_requests,
)

__all__ = ["VerbsTransport"]
IBV_WC_RECV_RDMA_WITH_IMM = 129  # enum ibv_wc_opcode


class _Wait:
    """A posted request's signaled completions still to come, and whether its landing needs a GPUDirect flush
    (a pull into a CUDA pool)."""

    __slots__ = ("left", "flush")

    def __init__(self, left: int, flush: bool = False):
        self.left, self.flush = left, flush


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

        name = ctx.options.get("device") or ctx.nic or get_device_list()[0].name.decode()  # nic: nearest its GPU
        self.qps_per_peer = int(ctx.options.get("qps", 1))
        self.port = int(ctx.options.get("port", 1))
        self.path = {"tc": int(ctx.options.get("tc", 0)), "sl": int(ctx.options.get("sl", 0)),
                     "timeout": int(ctx.options.get("timeout", link.TIMEOUT))}
        gid = ctx.options.get("gid")
        self.vctx = VCtx(name=name)
        self.attr = self.vctx.query_device()
        self.pd = PD(self.vctx)
        self.send_sge = min(self.attr.max_sge, MAX_SEND_SGE)
        self.read_sge = min(self.attr.max_sge_rd, self.send_sge)
        self.depth = self._depths()
        self.planned = self.depth["sq"]
        self.scq = CQ(self.vctx, self.depth["scq"], None, None, 0)  # sends: our WRITEs' and READs' completions
        self.rcq = CQ(self.vctx, self.depth["rcq"], None, None, 0)  # receives: peers' WRITE_WITH_IMM
        self.note = ""  # what setup had to give up (a smaller send queue), for info()
        self.flush_qp = self.flush_wr = None  # a CUDA pool's GPUDirect flush (connect)
        self.me = link.local_port(self.vctx, name, self.port, None if gid is None else int(gid))
        self.me["rd_dest"] = min(self.attr.max_qp_rd_atom, link.RD_ATOMIC)
        self.device_name, self.qps, self.remote = name, {}, {}
        self.psn: dict[int, list[int]] = {}
        self.by_qpn: dict[int, tuple[int, object]] = {}  # our QP number -> (peer, QP)
        self.sq_used: dict[int, int] = {}  # send-queue entries in use per QP number
        self.sq_marks: dict[int, collections.deque] = {}  # entries each outstanding signaled request frees
        self.cq_out = 0  # signaled completions outstanding on the send CQ
        self.waits: dict[int, _Wait] = {}  # wr_id -> the request it completes
        self.arrived: collections.Counter = collections.Counter()  # (peer, tag) -> notifications not yet taken
        self.serial = itertools.count(1)

    def _depths(self, sq_limit: int = SQ_DEPTH) -> dict[str, int]:
        nqps = (self.ctx.world_size - 1) * self.qps_per_peer
        return depths(self.attr.max_qp_wr, self.attr.max_cqe, nqps, self.send_sge, sq_limit)

    def register(self, pool) -> bytes:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE

        access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        self.pool = pool
        try:
            self.mr, self.reg, self.base = link.register(self.pd, pool, access, max(self.ctx.gpu, 0))
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"verbs: registering {pool.nbytes / 2**30:.2f} GiB failed: {exc}"
                                 f"{link.memlock_hint()}") from None
        return pickle.dumps({**self.me, "addr": self.base, "rkey": self.mr.rkey, "qps": self._make_qps(),
                             "send_sge": self.send_sge, "nqps": self.qps_per_peer})

    def _new_qp(self, send_wr: int, recv_wr: int, send_sge: int):
        """An RC QP, still in RESET.  sq_sig_all=0: only the requests we flag signaled complete (pyverbs' default
        signals every one)."""
        from pyverbs.enums import IBV_QPT_RC
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=send_sge, max_recv_sge=1)
        return QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0))

    def _to_init(self, q):
        """RESET -> INIT apart from the creation, so that only the creation's EINVAL reads as "too big"."""
        q.to_init(link.init_attr(self.port))
        self.sq_used[q.qp_num], self.sq_marks[q.qp_num] = 0, collections.deque()
        return q

    def _sized_qp(self):
        """A data QP of the plan's depths; where the provider refuses its size (EINVAL: a work-queue budget other
        than plan.sq_fit's arithmetic), again with half the send queue down to SQ_FLOOR, and the depths follow so
        that no chain is posted past the queue the QP really has."""
        from pyverbs.pyverbs_error import PyverbsRDMAError

        while True:
            try:
                q = self._new_qp(self.depth["sq"], self.depth["rq"], self.send_sge)
                break
            except PyverbsRDMAError as exc:
                if getattr(exc, "error_code", None) != errno.EINVAL or self.depth["sq"] // 2 < SQ_FLOOR:
                    raise TransportError(f"verbs: {self.device_name} refused an RC QP of {self.depth['sq']} send "
                                         f"work requests of {self.send_sge} SGEs: {exc}") from None
                self.depth = self._depths(self.depth["sq"] // 2)
        if self.depth["sq"] < self.planned:
            first = not self.note
            self.note = (f"verbs: {self.device_name} refused a send queue of {self.planned} work requests of "
                         f"{self.send_sge} SGEs (EINVAL): its QPs have {self.depth['sq']}")
            if first and self.ctx.rank == 0:
                print(f"# {self.note}", file=sys.stderr, flush=True)
        return self._to_init(q)

    def _make_qps(self) -> dict:
        out = {}
        for peer in range(self.ctx.world_size):
            if peer == self.ctx.rank:
                continue
            self.qps[peer] = [self._sized_qp() for _ in range(self.qps_per_peer)]
            self.psn[peer] = [int.from_bytes(os.urandom(3), "little") for _ in self.qps[peer]]
            for q in self.qps[peer]:
                self.by_qpn[q.qp_num] = (peer, q)
            out[peer] = [(q.qp_num, psn) for q, psn in zip(self.qps[peer], self.psn[peer])]
        return out

    def _make_flush(self) -> None:
        """The GPUDirect flush of a CUDA pool, as NCCL's (ncclIbIflush): a QP connected to itself, and a signaled
        RDMA READ of the pool's first byte into a host byte of our own.  The NIC's read of GPU memory comes after
        its writes there (PCIe keeps a read behind earlier writes on its path), so its completion means they
        landed."""
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE
        from pyverbs.mr import MR
        from pyverbs.wr import SGE, SendWR

        q = self._to_init(self._new_qp(1, 0, 1))
        psn = int.from_bytes(os.urandom(3), "little")
        rd = min(self.attr.max_qp_init_rd_atom, link.RD_ATOMIC)
        q.to_rts(link.rts_attr(self.port, self.me, self.me, q.qp_num, psn, psn, rd, **self.path))
        self.flush_mr = MR(self.pd, 64, IBV_ACCESS_LOCAL_WRITE)
        wr = SendWR(opcode=IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(self.flush_mr.buf, 1, self.flush_mr.lkey)],
                    send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(self.mr.rkey, self.base)
        self.flush_qp, self.flush_wr = q, wr

    def connect(self, peers: dict[int, bytes]) -> None:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE
        from pyverbs.mr import MR
        from pyverbs.wr import SGE, RecvWR

        # a receive for WRITE_WITH_IMM moves no data, but pyverbs before rdma-core 57 refuses a RecvWR with no
        # SGE: one SGE on a small buffer of our own, and the one RecvWR reposted (posting copies it)
        self.sink = MR(self.pd, 64, IBV_ACCESS_LOCAL_WRITE)
        self.recv = RecvWR(num_sge=1, sg=[SGE(self.sink.buf, 64, self.sink.lkey)])
        rd = min(self.attr.max_qp_init_rd_atom, link.RD_ATOMIC)
        for peer, blob in peers.items():
            m = pickle.loads(blob)
            self.remote[peer] = m
            if m["ib"] != self.me["ib"]:
                raise TransportError(f"verbs: rank {peer}'s port is {'InfiniBand' if m['ib'] else 'RoCE'}, "
                                     f"this rank's is {'InfiniBand' if self.me['ib'] else 'RoCE'}")
            for q, psn, (qpn, their_psn) in zip(self.qps[peer], self.psn[peer], m["qps"][self.ctx.rank]):
                q.to_rts(link.rts_attr(self.port, self.me, m, qpn, psn, their_psn, rd, **self.path))
                for _ in range(self.depth["rq"]):  # WRITE_WITH_IMM consumes a receive at the destination
                    q.post_recv(self.recv)
        if self.pool.kind == "cuda":
            self._make_flush()

    def prepare(self, op, peer, descs, tag=0):
        from pyverbs.wr import SGE, SendWR

        check_descs(descs, self.pool.nbytes if op == "push" else 1 << 62, 1 << 62 if op == "push" else self.pool.nbytes)
        wrs = work_requests(descs, op, self.send_sge if op == "push" else self.read_sge, self.base,
                            self.remote[peer]["addr"])
        rkey, lkey, imm = self.remote[peer]["rkey"], self.mr.lkey, encode_imm(tag & 0xFFFFFFFF)
        keep, chains = [], []  # pyverbs' next_wr holds a pointer, not a reference: the prepared post keeps them
        for qi, (a, b) in enumerate(spread(len(wrs), self.qps_per_peer)):
            ops = opcodes(op, b - a)
            for s, e in segments(b - a, self.depth["every"]):
                seg = []
                for i in range(s, e):
                    raddr, sges = wrs[a + i]
                    wr = SendWR(opcode=ops[i], num_sge=len(sges), sg=[SGE(int(x), int(n), lkey) for x, n in sges],
                                send_flags=IBV_SEND_SIGNALED if i == e - 1 else 0)
                    wr.set_wr_rdma(rkey, raddr)
                    if ops[i] == IBV_WR_RDMA_WRITE_WITH_IMM:
                        wr.imm_data = imm
                    if seg:
                        seg[-1].next_wr = wr
                    seg.append(wr)
                keep += seg
                chains.append((qi, seg[0], seg[-1], len(seg)))
        return peer, chains, keep, op == "pull" and self.flush_qp is not None

    def start(self, prepared):
        peer, chains, _, flush = prepared
        w = _Wait(len(chains), flush)
        if not chains:
            return w
        serial = next(self.serial)
        self.waits[serial] = w
        for qi, head, last, n in chains:
            last.wr_id = serial
            self._post(self.qps[peer][qi], head, n, self.depth["sq"])
        return w

    def _post(self, q, head, n: int, room: int) -> None:
        """Post a chain of ``n`` requests once the QP's send queue (``room`` entries) and the send CQ can take
        it: posting past either fails or overruns."""
        qpn = q.qp_num
        while self.sq_used[qpn] + n > room or self.cq_out >= self.depth["scq"]:
            self._progress()
        q.post_send(head)
        self.sq_used[qpn] += n
        self.sq_marks[qpn].append(n)
        self.cq_out += 1

    def _flush(self) -> None:
        """Read a byte of our CUDA pool through the NIC and wait for it (_make_flush): the bytes the NIC wrote
        there before are visible once it completes."""
        w = _Wait(1)
        serial = next(self.serial)
        self.waits[serial] = w
        self.flush_wr.wr_id = serial
        self._post(self.flush_qp, self.flush_wr, 1, 1)
        while w.left > 0:
            self._progress()

    def post(self, op, peer, descs, tag=0):
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op, peer, descs, tag=0):
        if op != "push":
            return None
        m = self.remote[peer]
        return ("imm", peer, tag & 0xFFFFFFFF, notifications(descs, m["send_sge"], m["nqps"]))

    def _progress(self) -> None:
        """Poll both CQs once: a send completion frees its send-queue entries and counts toward its request; a
        receive completion counts for its (peer, tag), and its receive is posted again."""
        n, wcs = self.scq.poll(64)
        for wc in wcs[:n]:
            if wc.status != 0:
                raise TransportError(f"verbs: work completion failed with status {wc.status} (QP {wc.qp_num})")
            self.sq_used[wc.qp_num] -= self.sq_marks[wc.qp_num].popleft()
            self.cq_out -= 1
            w = self.waits.get(wc.wr_id)
            if w is not None:
                w.left -= 1
                if not w.left:
                    del self.waits[wc.wr_id]
        n, wcs = self.rcq.poll(64)
        for wc in wcs[:n]:
            if wc.status != 0:
                raise TransportError(f"verbs: receive completion failed with status {wc.status} (QP {wc.qp_num})")
            peer, q = self.by_qpn[wc.qp_num]
            if wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM:
                self.arrived[(peer, decode_imm(wc.imm_data)[0])] += 1
            q.post_recv(self.recv)

    def wait(self, handle) -> float | None:
        if handle is None:
            return None
        if isinstance(handle, _Wait):
            while handle.left > 0:
                self._progress()
            if handle.flush:
                self._flush()
        else:  # a push's destination: the notifications of its tag, from its peer, one per QP the layer used
            _, peer, tag, want = handle
            key = (peer, tag)
            while self.arrived[key] < want:
                self._progress()
            self.arrived[key] -= want
            if not self.arrived[key]:
                del self.arrived[key]
            if self.flush_qp is not None:
                self._flush()
        return time.perf_counter()

    def info(self) -> dict:
        return {"device": self.device_name, "max_sge": self.attr.max_sge, "max_sge_rd": self.attr.max_sge_rd,
                "registration": getattr(self, "reg", ""), "nvidia_peermem": peermem(), "qps": self.qps_per_peer,
                "gid_index": self.me["gid_index"], "link": "InfiniBand" if self.me["ib"] else "RoCE",
                "sq_depth": self.depth["sq"], "send_sge": self.send_sge, "signal_every": self.depth["every"],
                "traffic_class": self.path["tc"], "service_level": self.path["sl"],
                "ack_timeout": self.path["timeout"],
                "relaxed_ordering": bool(getattr(self, "pool", None) is not None and self.pool.kind == "cuda"
                                         and link.relaxed_ordering()),
                "gpu_flush": "RDMA READ, loopback QP" if self.flush_qp is not None else "",
                "note": self.note}

    def close(self) -> None:
        for attr in ("qps", "flush_qp", "mr", "flush_mr", "sink", "scq", "rcq", "pd", "vctx"):
            obj = getattr(self, attr, None)
            for o in (sum(obj.values(), []) if isinstance(obj, dict) else [obj]):
                if o is not None and hasattr(o, "close"):
                    o.close()
            if isinstance(obj, dict):
                obj.clear()
