"""A fake RDMA device behind pyverbs' own classes, for the verbs tests (no RDMA device here).

What needs a device (Context, PD, MR, DmaBufMR, CQ, CompChannel, QP, QPInitAttr) is faked here, with the
constructor signatures of rdma-core's pyverbs (device.pyx, pd.pyx, mr.pyx, cq.pyx, qp.pyx); everything else
is rdma-core's real pyverbs (Debian's python3-pyverbs): kvbench builds real SendWR, SGE, RecvWR, QPAttr,
QPCap, AHAttr, GlobalRoute and GID objects, and the fake QP reads the real ibv_send_wr structs they fill,
following their ``next`` pointers as the driver does.

A numpy "wire" joins the fake contexts: a posted RDMA WRITE or READ moves the bytes between the MRs' memory
when it executes, in order per QP, and completes on the CQs.  It enforces the rules a real device does and
kvbench depends on:

* the QP's size, with mlx5's arithmetic for an RC send queue (rdma-core providers/mlx5/verbs.c): a WQE is
  sq_overhead() + 16 bytes (a data segment) per ``max_send_sge``, rounded up to 64-byte basic blocks
  (mlx5_calc_send_wqe); sq_overhead() for a QP made by plain ibv_create_qp (no send_ops_flags, so its default
  RC ops, memory-window bind and local invalidate among them) is the largest of ctrl 16 + raddr 16, that plus
  atomic 16, and ctrl 16 + UMR ctrl 48 + mkey context 64 + max(KLM 16, 64) = 192 bytes; the queue is
  ``max_send_wr`` x WQE bytes rounded up to a power of two, and more basic blocks than ``max_send_wqebb`` (the
  provider context's, which the kernel reports as the device's ``max_qp_wr``) fail with EINVAL
  (mlx5_calc_sq_size), as do ``max_send_sge`` past the device's ``max_sge`` and ``max_recv_wr`` past
  ``max_qp_wr``.  Not modelled: max_sq_desc_sz (a WQE's largest size), inline data, other providers;
* queue depths: a post past the send queue's free entries fails with ENOMEM (an entry is free once a
  completion at or after it was polled), past ``max_recv_wr`` too; ``num_sge`` past the QP's or, for a READ,
  the device's limit fails with EINVAL; a CQ that gets more completions than its depth overruns (poll raises);
* GPUDirect: bytes the NIC writes into device memory (a DmaBufMR's: a WRITE landing there, a READ's response
  scattered there) become visible only once the same NIC reads that device memory (an RDMA READ it answers
  from a DmaBufMR: PCIe keeps a read behind the writes before it), as NCCL's flush relies on; until then the
  memory holds its old bytes, though the completion has come (a real GPU's window is short, here it is
  unbounded, so a missing flush always shows);
* signaling: ``sq_sig_all`` (pyverbs' default 1) or IBV_SEND_SIGNALED makes a completion;
* QP state: each transition applies only its fields (qp.pyx's masks); INIT's access flags decide remote
  WRITE/READ into the QP; READ needs max_rd_atomic and the responder's max_dest_rd_atomic; RTR checks the
  MTU, the address (GRH with a known GID on RoCE, the LID on InfiniBand); a RoCE v1 GID at either end, or a
  PSN mismatch, loses the packets: the request fails with retries exceeded;
* keys: lkeys and rkeys with their ranges in the MR's address space (``iova = offset`` for a DmaBufMR) and
  their access flags; an imm WRITE needs a posted receive (rnr_retry 7 waits for one, less fails).

``Wire.fault`` injects a lie: "wrong-block" lands the first WRITE's (or READ's) bytes one length further on;
"early" completes WRITE_WITH_IMM and READs before their bytes land (they land at the next post).
The QP records what its transitions set (``set``, and ``ah`` with the GRH's traffic class and the service
level) and the MR its access flags, for the tests.
"""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import itertools
import subprocess
import sys
import types

import numpy as np

IBV_QPT_RC, IBV_SEND_SIGNALED = 2, 2
WRITE, WRITE_IMM, READ = 0, 1, 4
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_ERR = 0, 1, 2, 3, 6
ACC_LOCAL_WRITE, ACC_REMOTE_WRITE, ACC_REMOTE_READ = 1, 2, 4
WC_OK, WC_LOC_PROT, WC_FLUSH, WC_REM_INV_REQ, WC_REM_ACCESS, WC_RETRY_EXC, WC_RNR_RETRY_EXC = 0, 4, 5, 9, 10, 12, 13
WC_RDMA_WRITE, WC_RDMA_READ, WC_RECV_RDMA_WITH_IMM, WC_WITH_IMM = 1, 2, 129, 2
ENOMEM, EINVAL = 12, 22
WQEBB, DATA_SEG = 64, 16  # MLX5_SEND_WQE_BB, sizeof(struct mlx5_wqe_data_seg)
# _sq_overhead() of an RC QP with the default ops: the largest of RDMA (ctrl + raddr), atomic (+ atomic seg) and
# memory-window bind (ctrl + UMR ctrl + mkey context + max(KLM, 64)): 192
RC_OVERHEAD = max(16 + 16, 16 + 16 + 16, 16 + 48 + 64 + max(16, 64))
ROCE_V1, ROCE_V2 = 0, 1  # IBV_GID_TYPE_SYSFS_*
LINK_IB, LINK_ETH = 1, 2
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
REAL = ("pyverbs.enums", "pyverbs.wr", "pyverbs.addr", "pyverbs.qp", "pyverbs.cq", "pyverbs.pyverbs_error")


def load_real():
    """rdma-core's pyverbs (Debian's python3-pyverbs, in the system python's dist-packages): that package alone
    is loaded into this interpreter, nothing else of dist-packages; (module, None) or (None, why not)."""
    if "pyverbs" not in sys.modules:
        try:
            out = subprocess.run(["dpkg", "-L", "python3-pyverbs"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"dpkg: {exc}"
        init = [p for p in out.stdout.split() if p.endswith("/pyverbs/__init__.py")]
        if out.returncode or not init:
            return None, "python3-pyverbs is not installed (make test installs it as root: apt-get)"
        spec = importlib.util.spec_from_file_location("pyverbs", init[0],
                                                      submodule_search_locations=[init[0].rsplit("/", 1)[0]])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:
            del sys.modules["pyverbs"]
            return None, f"pyverbs does not load: {exc}"
    try:  # the compiled modules are built for the system python: another version cannot load them
        for name in REAL:
            importlib.import_module(name)
    except ImportError as exc:
        return None, f"pyverbs' compiled modules do not load in Python {sys.version.split()[0]}: {exc}"
    return sys.modules["pyverbs"], None


class _Sge(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("length", ctypes.c_uint32), ("lkey", ctypes.c_uint32)]


class _SendWr(ctypes.Structure):  # struct ibv_send_wr (infiniband/verbs.h) up to wr.rdma
    _fields_ = [("wr_id", ctypes.c_uint64), ("next", ctypes.c_void_p), ("sg_list", ctypes.POINTER(_Sge)),
                ("num_sge", ctypes.c_int), ("opcode", ctypes.c_int), ("send_flags", ctypes.c_uint),
                ("imm_data", ctypes.c_uint32), ("remote_addr", ctypes.c_uint64), ("rkey", ctypes.c_uint32)]


_OFFSET: list[int] = []


def _struct_offset() -> int:
    """Where pyverbs' SendWR object keeps its ibv_send_wr: found once from a probe object's wr_id."""
    if not _OFFSET:
        from pyverbs.wr import SGE, SendWR

        probe = SendWR(wr_id=0x5EED_F00D_CAFE_D00D, opcode=READ, num_sge=1, sg=[SGE(1, 2, 3)])
        raw = ctypes.string_at(id(probe), 256)
        off = raw.find((0x5EED_F00D_CAFE_D00D).to_bytes(8, "little"))
        assert off > 0 and _SendWr.from_address(id(probe) + off).opcode == READ
        _OFFSET.append(off)
    return _OFFSET[0]


def read_chain(wr) -> list[dict]:
    """The work requests of a posted chain, read from the real structs as ibv_post_send does."""
    out, p = [], id(wr) + _struct_offset()
    while p:
        s = _SendWr.from_address(p)
        sges = [(s.sg_list[i].addr, s.sg_list[i].length, s.sg_list[i].lkey) for i in range(s.num_sge)]
        out.append({"wr_id": s.wr_id, "opcode": s.opcode, "flags": s.send_flags, "imm": s.imm_data,
                    "raddr": s.remote_addr, "rkey": s.rkey, "sges": sges})
        p = s.next
    return out


def sq_wqebbs(max_send_wr: int, max_send_sge: int) -> int:
    """Basic blocks an mlx5 RC send queue takes (mlx5_calc_send_wqe, then mlx5_calc_sq_size's wqe_cnt)."""
    if not max_send_wr:
        return 0
    wqe = -(-(RC_OVERHEAD + DATA_SEG * max_send_sge) // WQEBB) * WQEBB
    return (1 << (max_send_wr * wqe - 1).bit_length()) // WQEBB  # roundup_pow_of_two(wr x wqe) / MLX5_SEND_WQE_BB


def _err(msg: str, errno: int):
    from pyverbs.pyverbs_error import PyverbsRDMAError

    return PyverbsRDMAError(msg, errno)


class Device:
    """One fake HCA with one port: its attributes (ibv_device_attr's names), LID, GID table, MTU, and the
    provider's send-queue budget in basic blocks (``max_send_wqebb``: what query_device calls ``max_qp_wr``
    unless a test makes them differ, as a provider with other arithmetic would)."""

    def __init__(self, name: str, link: str = "roce", lid: int = 0, gids=None, active_mtu: int = 5,
                 max_send_wqebb: int | None = None, **attr):
        self.name, self.link_layer, self.lid, self.active_mtu = name, LINK_IB if link == "ib" else LINK_ETH, lid, active_mtu
        self.gids = gids if gids is not None else []
        self.attr = types.SimpleNamespace(**{"max_qp_wr": 32768, "max_cqe": 4194303, "max_sge": 30, "max_sge_rd": 30,
                                             "max_qp_rd_atom": 16, "max_qp_init_rd_atom": 16, **attr})
        self.max_send_wqebb = self.attr.max_qp_wr if max_send_wqebb is None else max_send_wqebb


def roce_gids(host: int) -> list[tuple[str, int]]:
    """A RoCE port's GID table as mlx5 fills it: link-local v1, v2, then IPv4-mapped v1, v2."""
    ll = f"fe80:0000:0000:0000:0202:c9ff:fe00:{host:04x}"
    v4 = f"0000:0000:0000:0000:0000:ffff:0a00:{host:04x}"
    return [(ll, ROCE_V1), (ll, ROCE_V2), (v4, ROCE_V1), (v4, ROCE_V2)]


class Wire:
    """The fabric between fake devices: QPs by number, MRs by key, dma-buf fds, the bytes moving."""

    def __init__(self, *devices: Device):
        self.devices = {d.name: d for d in devices}
        self.qps: dict[int, QP] = {}
        self.mrs: dict[int, MR] = {}
        self.dmabufs: dict[int, np.ndarray] = {}  # fd -> the device memory it exports
        self.keys, self.qpns = itertools.count(0x1000, 7), itertools.count(0x40)
        self.fault: str | None = None
        self.late: list = []  # "early": bytes that land after their completion
        self.unflushed: list = []  # (device, view, bytes): written into device memory, not yet visible
        self.flushes = 0  # READs answered from device memory, which made its earlier writes visible
        self.posted = 0  # post_send calls, for the tests
        self.on_poll = None  # ``on_poll(wire)`` runs before each CQ poll: another rank acting meanwhile
        self.notified = 0  # receive completions polled so far
        self.idle = 0  # polls in a row that found nothing with nothing in flight

    def modules(self) -> dict[str, types.ModuleType]:
        """sys.modules entries: the fake device classes beside the real pyverbs ones."""
        from pyverbs import cq as real_cq
        from pyverbs import qp as real_qp

        w = self
        mods = {}
        for name, members in {
            "pyverbs.device": {"Context": Context, "get_device_list": lambda: [types.SimpleNamespace(name=n.encode())
                                                                              for n in w.devices]},
            "pyverbs.pd": {"PD": PD}, "pyverbs.cq": {"CQ": CQ, "CompChannel": CompChannel, "WC": real_cq.WC},
            "pyverbs.mr": {"MR": MR, "DmaBufMR": DmaBufMR},
            "pyverbs.qp": {"QP": QP, "QPInitAttr": QPInitAttr, "QPAttr": real_qp.QPAttr, "QPCap": real_qp.QPCap}}.items():
            m = types.ModuleType(name)
            m.__dict__.update(members)
            mods[name] = m
        _WIRE[:] = [w]
        return mods

    def pump(self) -> None:
        """Execute what the QPs have posted, in order per QP, until nothing more can go."""
        moved = True
        while moved:
            moved = False
            for q in list(self.qps.values()):
                while q.pending and q.state == QPS_RTS:
                    if not q.execute(q.pending[0]):
                        break
                    q.pending.popleft()
                    moved = True

    def land_late(self) -> None:
        for view, data in self.late:
            view[:] = data
        self.late.clear()

    def land_unflushed(self, dev: Device) -> None:
        """``dev`` reads its device memory: what it wrote there before is visible now."""
        self.flushes += 1
        for d, view, data in self.unflushed:
            if d is dev:
                view[:] = data
        self.unflushed = [u for u in self.unflushed if u[0] is not dev]


_WIRE: list[Wire] = []


def _wire() -> Wire:
    return _WIRE[0]


class Context:
    def __init__(self, **kwargs):  # device.pyx: name=, attr=, cmid=, cmd_fd=
        self.dev = _wire().devices.get(kwargs.get("name"))
        if self.dev is None:
            raise _err(f"Failed to open device {kwargs.get('name')}", 19)

    def query_device(self):
        return self.dev.attr

    def query_port(self, port_num: int):
        if port_num != 1:
            raise _err(f"Failed to query port {port_num}", EINVAL)
        d = self.dev
        return types.SimpleNamespace(lid=d.lid, link_layer=d.link_layer, active_mtu=d.active_mtu,
                                     gid_tbl_len=max(1, len(d.gids)), state=4, pkey_tbl_len=1)

    def query_gid(self, port_num: int, index: int):
        from pyverbs.addr import GID

        if not 0 <= index < max(1, len(self.dev.gids)):
            raise _err(f"Failed to query gid {index} of port {port_num}", EINVAL)
        return GID(self.dev.gids[index][0] if self.dev.gids else ZERO_GID)

    def query_gid_type(self, port_num: int, index: int):
        if not 0 <= index < len(self.dev.gids):
            raise _err(f"Failed to query gid type of port {port_num} and gid index {index}", EINVAL)
        return self.dev.gids[index][1]

    def close(self):
        pass


class PD:
    def __init__(self, creator):
        if not isinstance(creator, Context):
            raise TypeError("PD needs a Context")
        self.ctx = creator

    def close(self):
        pass


class CompChannel:
    def __init__(self, context):
        self.ctx = context


class CQ:
    def __init__(self, context, cqe, cq_context=None, channel=None, comp_vector=0):
        if not isinstance(context, Context):
            raise TypeError("Argument 'context' has incorrect type")
        if not 1 <= cqe <= context.dev.attr.max_cqe:
            raise _err("Failed to create a CQ", EINVAL)
        self.cqe, self.queue, self.overrun = cqe, collections.deque(), False

    def push(self, wc, qp=None, frees: int = 0) -> None:
        if len(self.queue) >= self.cqe:  # a real CQ overruns: an async CQ error, its QPs go to error
            self.overrun = True
            return
        self.queue.append((wc, qp, frees))

    def poll(self, num_entries=1):
        w = _wire()
        if w.on_poll is not None:
            w.on_poll(w)
        w.pump()
        if self.overrun:
            raise _err("Failed to poll CQ (CQ overrun: more completions than its depth)", EINVAL)
        out = []
        while self.queue and len(out) < num_entries:
            wc, qp, frees = self.queue.popleft()
            if qp is not None:
                qp.used -= frees  # a polled send completion frees its entry and the unsignaled ones before it
            w.notified += wc.opcode == WC_RECV_RDMA_WITH_IMM
            out.append(wc)
        w.idle = 0 if out or any(q.pending for q in w.qps.values()) else w.idle + 1
        if w.idle > 100_000:  # one process holds every rank: a wait for what nobody posted would spin forever
            raise AssertionError("a poll loop waits for a completion that nothing in flight can make")
        return len(out), out

    def close(self):
        pass


class MR:
    def __init__(self, creator, length=0, access=0, address=None, implicit=False, **kwargs):
        if not isinstance(creator, PD):
            raise TypeError("MR needs a PD")
        if access & ACC_REMOTE_WRITE and not access & ACC_LOCAL_WRITE:
            raise _err("Failed to register a MR (remote write needs local write)", EINVAL)
        if address is None:
            self._own = np.zeros(length, np.uint8)
            address = int(self._own.ctypes.data)
        mem = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address)) if length else np.zeros(0, np.uint8)
        self._setup(creator, length, access, mem, address)

    def _setup(self, pd, length, access, mem, iova):
        w = _wire()
        self.pd, self.length, self.access, self.mem, self.iova = pd, length, access, mem, iova
        self.device = isinstance(self, DmaBufMR)  # device memory: the NIC's writes there wait for a flush
        self.lkey = next(w.keys)
        self.rkey = self.lkey
        w.mrs[self.lkey] = self

    @property
    def buf(self):
        return self.iova

    def view(self, addr: int, n: int):
        """The bytes at [addr, addr + n) of the MR's address space, or None outside it."""
        if addr < self.iova or addr + n > self.iova + self.length:
            return None
        return self.mem[addr - self.iova: addr - self.iova + n]

    def close(self):
        _wire().mrs.pop(self.lkey, None)


class DmaBufMR(MR):
    def __init__(self, pd, length, access, dmabuf=None, offset=0, gpu=0, gtt=0):
        if not isinstance(pd, PD):
            raise TypeError("Argument 'pd' has incorrect type")
        if dmabuf is None:  # pyverbs would allocate a dma-buf from a DRM GPU: there is none
            raise _err("Failed to allocate a DmaBuf (no DRM device)", 19)
        fd = dmabuf.fd if hasattr(dmabuf, "fd") else dmabuf
        mem = _wire().dmabufs.get(fd)
        if mem is None or offset + length > len(mem):
            raise _err(f"Failed to register a dma-buf MR. length: {length}, access flags: {access}", EINVAL)
        # ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd, access): the MR's addresses start at offset
        self._setup(pd, length, access, mem[offset: offset + length], offset)


class QPInitAttr:
    def __init__(self, qp_type=3, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1):
        for cq in (scq, rcq):
            if cq is not None and not isinstance(cq, CQ):
                from pyverbs.pyverbs_error import PyverbsUserError

                raise PyverbsUserError(f"Expected CQ/CQEX, got {type(cq)}")
        self.qp_type, self.send_cq, self.recv_cq, self.cap, self.sq_sig_all = qp_type, scq, rcq, cap, sq_sig_all


# qp.pyx's _get_comp_mask for RC: the fields each transition applies; the others are ignored
FIELDS = {QPS_INIT: ("pkey_index", "port_num", "qp_access_flags"),
          QPS_RTR: ("ah_attr", "path_mtu", "dest_qp_num", "rq_psn", "max_dest_rd_atomic", "min_rnr_timer"),
          QPS_RTS: ("timeout", "retry_cnt", "rnr_retry", "sq_psn", "max_rd_atomic")}


class QP:
    def __init__(self, creator, init_attr, qp_attr=None):
        if not isinstance(creator, PD) or not isinstance(init_attr, QPInitAttr):
            raise TypeError("QP(PD, QPInitAttr, QPAttr)")
        w, dev, cap = _wire(), creator.ctx.dev, init_attr.cap
        if cap.max_send_sge > dev.attr.max_sge or cap.max_recv_wr > dev.attr.max_qp_wr \
                or sq_wqebbs(cap.max_send_wr, cap.max_send_sge) > dev.max_send_wqebb:
            raise _err("Failed to create QP", EINVAL)
        self.pd, self.dev, self.init = creator, dev, init_attr
        self.qp_num, self.state, self.set = next(w.qpns), QPS_RESET, {}
        self.pending, self.rq = collections.deque(), collections.deque()
        self.used = 0  # send-queue entries held until a completion at or after them is polled
        self.unreported = 0  # executed, unsignaled: freed with the next completion
        self.executed = 0  # work requests run, for the tests
        w.qps[self.qp_num] = self
        if qp_attr is not None:
            self.to_init(qp_attr)

    @property
    def qp_state(self):
        return self.state

    def _apply(self, attr, state):
        self.set.update({f: getattr(attr, f) for f in FIELDS[state]})
        self.state = state

    def to_init(self, qp_attr):
        if qp_attr.port_num != 1 or qp_attr.pkey_index != 0:
            raise _err("Failed to modify QP state to init", EINVAL)
        self._apply(qp_attr, QPS_INIT)

    def to_rtr(self, qp_attr):
        if self.state != QPS_INIT:
            self.to_init(qp_attr)
        ah, dev = qp_attr.ah_attr, self.dev
        ok = qp_attr.path_mtu <= dev.active_mtu and qp_attr.max_dest_rd_atomic <= dev.attr.max_qp_rd_atom
        if dev.link_layer == LINK_ETH:  # RoCE: a GRH with our own valid GID, always
            ok = ok and ah.is_global == 1 and ah.sgid_index < len(dev.gids) and dev.gids[ah.sgid_index][0] != ZERO_GID
        else:
            ok = ok and ah.dlid != 0
        if not ok:
            raise _err("Failed to modify QP state to RTR", EINVAL)
        self._apply(qp_attr, QPS_RTR)
        self.ah = {"dgid": ah.dgid, "sgid_index": ah.sgid_index, "dlid": ah.dlid, "is_global": ah.is_global,
                   "traffic_class": ah.traffic_class, "sl": ah.sl}

    def to_rts(self, qp_attr):
        if self.state != QPS_RTR:
            self.to_rtr(qp_attr)
        if qp_attr.max_rd_atomic > self.dev.attr.max_qp_init_rd_atom:
            raise _err("Failed to modify QP state to RTS", EINVAL)
        self._apply(qp_attr, QPS_RTS)

    def post_recv(self, wr, bad_wr=None):
        if self.state == QPS_RESET:
            raise _err("Failed to post recv", EINVAL)
        if len(self.rq) >= self.init.cap.max_recv_wr:
            raise _err("Failed to post recv", ENOMEM)
        self.rq.append(wr.wr_id)
        _wire().pump()

    def post_send(self, wr, bad_wr=None):
        w = _wire()
        w.posted += 1
        w.land_late()
        if self.state not in (QPS_RTS, QPS_ERR):
            raise _err("Failed to post send", EINVAL)
        chain = read_chain(wr)
        for e in chain:
            if len(e["sges"]) > self.init.cap.max_send_sge or (e["opcode"] == READ and len(e["sges"]) > self.dev.attr.max_sge_rd):
                raise _err("Failed to post send", EINVAL)
        if self.used + len(chain) > self.init.cap.max_send_wr:
            raise _err("Failed to post send", ENOMEM)
        self.used += len(chain)
        if self.state == QPS_ERR:  # a QP in error takes posts and flushes them, each with an error completion
            for e in chain:
                self._complete(e, WC_FLUSH, 0, force=True)
            return
        self.pending.extend(chain)
        w.pump()

    # ----- the wire
    def _peer(self):
        """The responder this QP reaches, or None when its packets are lost (address, GID type, PSN)."""
        w, s = _wire(), self.set
        t = w.qps.get(s["dest_qp_num"])
        if t is None or t.state not in (QPS_RTR, QPS_RTS) or t.set.get("dest_qp_num") != self.qp_num:
            return None
        if self.dev.link_layer == LINK_ETH:
            theirs = [ty for g, ty in t.dev.gids if g == self.ah["dgid"]]
            if self.dev.gids[self.ah["sgid_index"]][1] != ROCE_V2 or ROCE_V2 not in theirs:
                return None  # RoCE v1 frames are not routed on this fabric
        elif self.ah["dlid"] != t.dev.lid:
            return None
        if s["path_mtu"] > t.dev.active_mtu or s["sq_psn"] != t.set["rq_psn"]:
            return None
        return t

    def execute(self, e) -> bool:
        """Run one work request; False while it must wait (an imm WRITE with no receive, rnr_retry 7)."""
        from pyverbs.cq import WC

        w, t = _wire(), self._peer()
        nbytes = sum(n for _, n, _ in e["sges"])
        status = WC_RETRY_EXC if t is None else WC_OK
        local, local_mrs = [], []
        for addr, n, lkey in e["sges"]:
            mr = w.mrs.get(lkey)
            v = mr.view(addr, n) if mr is not None and mr.pd is self.pd else None
            if v is None or (e["opcode"] == READ and not mr.access & ACC_LOCAL_WRITE):
                status = status or WC_LOC_PROT
            local.append(v)
            local_mrs.append(mr)
        if not status:
            rmr = w.mrs.get(e["rkey"])
            remote = rmr.view(e["raddr"], nbytes) if rmr is not None and rmr.pd is t.pd else None
            need = ACC_REMOTE_READ if e["opcode"] == READ else ACC_REMOTE_WRITE
            if remote is None or not rmr.access & need or not t.set["qp_access_flags"] & need:
                status = WC_REM_ACCESS
            elif e["opcode"] == READ and (self.set["max_rd_atomic"] < 1 or t.set["max_dest_rd_atomic"] < 1):
                status = WC_REM_INV_REQ
        if not status and e["opcode"] == WRITE_IMM and not t.rq:
            if self.set["rnr_retry"] == 7:
                return False
            status = WC_RNR_RETRY_EXC
        if status:
            self._complete(e, status, nbytes, force=True)
            self.state = QPS_ERR
            for rest in list(self.pending)[1:]:
                self._complete(rest, WC_FLUSH, 0, force=True)
            self.pending = collections.deque([e])
            return True
        if w.fault == "wrong-block":  # the bytes land one length further on (or back) in the remote MR
            w.fault = None
            for shift in (nbytes, -nbytes):
                if rmr.view(e["raddr"] + shift, nbytes) is not None:
                    remote = rmr.view(e["raddr"] + shift, nbytes)
                    break
        late = w.fault == "early" and e["opcode"] in (WRITE_IMM, READ)

        def land(view, data, mr):
            if late:
                w.late.append((view, data.copy()))
            elif mr.device:
                w.unflushed.append((mr.pd.ctx.dev, view, data.copy()))
            else:
                view[:] = data

        if e["opcode"] == READ:
            if rmr.device:
                w.land_unflushed(t.dev)
            data, at = np.array(remote), 0
            for v, mr in zip(local, local_mrs):
                land(v, data[at: at + len(v)], mr)
                at += len(v)
        else:
            data = np.concatenate(local) if local else np.zeros(0, np.uint8)
            land(remote, data, rmr)
        if e["opcode"] == WRITE_IMM:
            t.rq.popleft()
            t.init.recv_cq.push(WC(wr_id=0, status=0, opcode=WC_RECV_RDMA_WITH_IMM, byte_len=nbytes,
                                   qp_num=t.qp_num, imm_data=e["imm"], wc_flags=WC_WITH_IMM))
        self._complete(e, WC_OK, nbytes)
        self.executed += 1
        return True

    def _complete(self, e, status, nbytes, force=False):
        from pyverbs.cq import WC

        self.unreported += 1
        if force or e["flags"] & IBV_SEND_SIGNALED or self.init.sq_sig_all:
            op = WC_RDMA_READ if e["opcode"] == READ else WC_RDMA_WRITE
            self.init.send_cq.push(WC(wr_id=e["wr_id"], status=status, opcode=op, byte_len=nbytes,
                                      qp_num=self.qp_num), self, self.unreported)
            self.unreported = 0

    def close(self):
        _wire().qps.pop(self.qp_num, None)
