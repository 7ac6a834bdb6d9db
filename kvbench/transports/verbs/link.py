"""verbs' setup against the device: the GID to route by, the QP attributes of each state transition, the
pool's registration (host MR, dma-buf MR, nvidia-peermem MR).  pyverbs is imported inside the functions: it
is optional, and these run only where an RDMA device exists (tests: a fake device, tests/fakes/)."""
from __future__ import annotations

import os

from kvbench.memory import driver
from kvbench.transports.base import TransportError

from .plan import IBV_LINK_LAYER_INFINIBAND, peermem, pick_gid

SYSFS = "/sys/class/infiniband"
RNR_TIMER, RETRIES, RD_ATOMIC, HOP_LIMIT = 12, 7, 16, 64  # rdma-core's tests and NCCL use these
# ACK timeout 4.096 us x 2^20 per retry, NCCL_IB_TIMEOUT's default: a shorter one gives up on a congested fabric
# (retries exceeded) where the packets were only late
TIMEOUT = 20


def gid_type(vctx, device: str, port: int, index: int) -> int:
    """A GID's type: pyverbs' query where it has one, else sysfs (1: RoCE v2, as IBV_GID_TYPE_SYSFS_ROCE_V2)."""
    try:
        return int(vctx.query_gid_type(port, index))
    except AttributeError:  # rdma-core before ibv_query_gid_type
        pass
    try:
        with open(f"{SYSFS}/{device}/ports/{port}/gid_attrs/types/{index}") as fh:
            return 1 if "v2" in fh.read() else 0
    except OSError:
        return 0


def local_port(vctx, device: str, port: int, gid_opt: int | None) -> dict:
    """What a peer needs of this port to address it: LID, GID (index and value), MTU, link layer."""
    pa = vctx.query_port(port)
    ib = pa.link_layer in (0, IBV_LINK_LAYER_INFINIBAND)
    table = []
    if gid_opt is None and not ib:
        for i in range(pa.gid_tbl_len):
            try:
                table.append((i, str(vctx.query_gid(port, i)), gid_type(vctx, device, port, i)))
            except Exception:  # an empty or unreadable entry: not one to route by
                continue
    try:
        index = pick_gid(table, ib, gid_opt)
    except ValueError as exc:
        raise TransportError(f"verbs: {device} port {port}: {exc}") from None
    if index >= pa.gid_tbl_len:
        raise TransportError(f"verbs: -O gid={index} is past {device} port {port}'s {pa.gid_tbl_len} GIDs")
    return {"lid": pa.lid, "gid": str(vctx.query_gid(port, index)), "gid_index": index, "mtu": pa.active_mtu,
            "ib": ib}


def init_attr(port: int):
    """RESET -> INIT (pyverbs applies it when the QP is made): the port, P_Key 0, and remote WRITE and READ
    allowed into this QP's memory, which an RDMA WRITE or READ from the peer needs besides the MR's flags."""
    from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE
    from pyverbs.qp import QPAttr

    a = QPAttr(port_num=port)
    a.pkey_index = 0
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
    return a


def rts_attr(port: int, me: dict, peer: dict, qpn: int, my_psn: int, peer_psn: int, rd_atomic: int,
             tc: int = 0, sl: int = 0, timeout: int = TIMEOUT):
    """INIT -> RTR -> RTS in one QPAttr (pyverbs' to_rts applies the RTR fields, then the RTS ones).
    RTR: the path MTU both ports carry, the peer's QP and PSN, READs it may have in flight at us, the RNR
    timer, and its address (GID and GRH on RoCE, LID on InfiniBand) with the service level ``sl`` and, in the
    GRH, the traffic class ``tc`` (-O sl=, -O tc=: what a fabric's lossless class is selected by).  RTS: our
    PSN, ACK timeout (-O timeout=) and retries, and READs we may have in flight at it (``rd_atomic``, within what
    it accepts).  A QP connected to itself (the GPUDirect flush's) passes ``me`` as ``peer``."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    a = QPAttr(port_num=port, path_mtu=min(me["mtu"], peer["mtu"]))
    a.dest_qp_num, a.rq_psn, a.sq_psn = qpn, peer_psn, my_psn
    a.max_dest_rd_atomic, a.max_rd_atomic = me["rd_dest"], min(rd_atomic, peer["rd_dest"])
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = RNR_TIMER, timeout, RETRIES, RETRIES
    if me["ib"]:
        a.ah_attr = AHAttr(dlid=peer["lid"], port_num=port, is_global=0, sl=sl)
    else:
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=me["gid_index"], hop_limit=HOP_LIMIT, traffic_class=tc)
        a.ah_attr = AHAttr(gr=gr, is_global=1, port_num=port, sl=sl)
    return a


def relaxed_ordering() -> int:
    """IBV_ACCESS_RELAXED_ORDERING, or 0 where this pyverbs predates it.  It is an optional access flag
    (IBV_ACCESS_OPTIONAL_RANGE): libibverbs drops it where the kernel takes no optional flags and a driver that
    cannot relax PCIe ordering ignores it, so it never costs the registration; it changes no completion
    semantics (ibv_reg_mr(3)), and kvbench reads bytes only after a completion (and, on GPU, the flush)."""
    from pyverbs import enums

    return int(getattr(enums, "IBV_ACCESS_RELAXED_ORDERING", 0))


def register(pd, pool, access, gpu: int = 0) -> tuple[object, str, int]:
    """(MR, what kind, the address of the pool's first byte in the MR's address space).  Device memory asks for
    relaxed ordering, as NCCL's GPU MRs do: the NIC's writes into GPU memory need not keep PCIe order."""
    from pyverbs.mr import MR

    if pool.kind != "cuda":
        return MR(pd, pool.nbytes, access, address=pool.addr), "host MR", pool.addr
    access |= relaxed_ordering()
    got = dmabuf_fd(pool.addr, pool.nbytes, gpu)
    if got is not None:
        from pyverbs.mr import DmaBufMR

        fd, offset = got
        try:  # pyverbs registers with iova = offset: the MR's addresses start at the pool's offset in the dma-buf
            return DmaBufMR(pd, pool.nbytes, access, dmabuf=fd, offset=offset), "dma-buf", offset
        finally:
            os.close(fd)
    if peermem() is None:
        raise TransportError("verbs: GPU memory needs dma-buf (CUDA 11.7+ driver and kernel 5.12+) or the "
                             "nvidia-peermem module (modprobe nvidia-peermem)")
    return MR(pd, pool.nbytes, access, address=pool.addr), "nvidia-peermem MR", pool.addr


def dmabuf_fd(addr: int, nbytes: int, gpu: int) -> tuple[int, int] | None:
    """(a dma-buf fd over the whole pages that hold the pool, the pool's offset in it), through the driver's one
    door (memory/driver.py); None where the driver cannot export one (then nvidia-peermem is the way)."""
    start = addr - addr % driver.PAGE
    end = -(-(addr + nbytes) // driver.PAGE) * driver.PAGE
    try:
        return driver.dmabuf_fd(start, end - start, gpu), addr - start
    except driver.DriverError:
        return None


def memlock_hint() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" (the locked-memory limit is {soft / 2**20:.0f} MiB: raise it with 'ulimit -l unlimited', or "
            "memlock in /etc/security/limits.conf, or LimitMEMLOCK=infinity for a systemd service)")
