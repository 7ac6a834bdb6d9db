"""verbs' pure logic: work requests from descriptor arrays, how they spread over QPs and which are signaled,
queue depths, the immediate data, the GID to use.  No pyverbs here: tests/test_verbs.py runs all of it.

Queue depths stay within the provider's work-queue budget (mlx5's arithmetic: wqe_bytes, sq_fit)."""
from __future__ import annotations

import struct

import numpy as np

from kvbench.model.descriptors import DST, LEN, SRC

IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ = 0, 1, 4  # enum ibv_wr_opcode
IBV_SEND_SIGNALED = 2  # enum ibv_send_flags
IBV_LINK_LAYER_INFINIBAND = 1  # enum ibv_port_attr.link_layer (0: unspecified, IB too)
GID_ROCE_V2 = 1  # ibv_query_gid_type's IBV_GID_TYPE_SYSFS_ROCE_V2; sysfs writes it "RoCE v2"
SQ_DEPTH, RQ_DEPTH, SQ_FLOOR = 4096, 1024, 64  # SQ_FLOOR: the smallest send queue a refused QP is retried with
# 4 SGEs: a WRITE gathers up to four source ranges into one destination run, and its WQE stays four 64-byte basic
# blocks (wqe_bytes), so a send queue of SQ_DEPTH fits in half of mlx5's budget (NCCL asks for 1)
MAX_SEND_SGE = 4
WQEBB = 64  # mlx5's send basic block (MLX5_SEND_WQE_BB): the unit of its work-queue budget
# mlx5's sq_overhead() for an RC QP made by plain ibv_create_qp: its default send ops include memory-window bind,
# whose ctrl (16) + UMR ctrl (48) + mkey context (64) + 64 outweigh ctrl + raddr + atomic (48)
RC_WQE_OVERHEAD = 192
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def runs(descs: np.ndarray, remote: int) -> np.ndarray:
    """Start index of each run of descriptors whose ``remote`` column continues the previous one's range."""
    if not len(descs):
        return np.zeros(0, np.int64)
    cont = descs[1:, remote] == descs[:-1, remote] + descs[:-1, LEN]
    return np.flatnonzero(np.concatenate(([True], ~cont)))


def bounds(descs: np.ndarray, op: str, max_sge: int) -> np.ndarray:
    """Index of each work request's first descriptor: a run of remote-contiguous descriptors (DST for a push's
    WRITE, SRC for a pull's READ), cut every ``max_sge`` descriptors."""
    if max_sge < 1:
        raise ValueError("max_sge must be at least 1")
    starts = runs(descs, DST if op == "push" else SRC)
    if not len(starts):
        return np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(descs))
    pieces = -(-(ends - starts) // max_sge)  # requests per run
    first = np.repeat(starts, pieces)
    within = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    return first + within * max_sge


def work_requests(descs: np.ndarray, op: str, max_sge: int, local_base: int, remote_base: int):
    """A layer's work requests: (remote address, SGE array of (local address, length)) per request.

    push (RDMA WRITE): SGEs gather local SRC ranges into one remote DST run; pull (RDMA READ): SGEs scatter one
    remote SRC run into local DST ranges.  A run longer than ``max_sge`` descriptors becomes several requests.
    Vectorised: the only loop is over work requests, which pyverbs needs as objects anyway."""
    local, remote = (SRC, DST) if op == "push" else (DST, SRC)
    b = bounds(descs, op, max_sge)
    sges = np.stack([descs[:, local] + local_base, descs[:, LEN]], axis=1)
    ends = np.append(b[1:], len(descs)).tolist()
    return [(int(descs[s, remote]) + remote_base, sges[s:e]) for s, e in zip(b.tolist(), ends)]


def spread(n: int, nqps: int) -> list[tuple[int, int]]:
    """A layer's ``n`` work requests dealt to QPs as contiguous groups, (start, end) per QP used: one QP keeps
    its group in order, so its last WRITE_WITH_IMM lands after the group's other WRITEs."""
    m = min(n, max(1, nqps))
    cut = [n * j // m for j in range(m + 1)] if m else [0]
    return list(zip(cut[:-1], cut[1:]))


def notifications(descs: np.ndarray, send_sge: int, nqps: int) -> int:
    """WRITE_WITH_IMM completions a push destination waits for: one per QP the initiator's layer used
    (``send_sge`` and ``nqps`` are the initiator's)."""
    return len(spread(len(bounds(descs, "push", send_sge)), nqps))


def segments(n: int, every: int) -> list[tuple[int, int]]:
    """A QP's group of ``n`` work requests cut into chains posted one by one: each ends in its one signaled
    request, so every ``every``-th and the group's last are signaled (selective signaling) and a chain never
    needs more of the send queue than ``every`` entries."""
    cut = list(range(0, n, max(1, every))) + [n]
    return list(zip(cut[:-1], cut[1:])) if n else []


def wqe_bytes(max_send_sge: int) -> int:
    """An RC send WQE's size as mlx5 lays it out (rdma-core providers/mlx5/verbs.c, mlx5_calc_send_wqe): the
    transport's overhead plus a 16-byte data segment per SGE, in whole basic blocks."""
    return -(-(RC_WQE_OVERHEAD + 16 * max_send_sge) // WQEBB) * WQEBB


def sq_fit(max_qp_wr: int, max_send_sge: int) -> int:
    """The most work requests a send queue may ask for: mlx5 rounds ``max_send_wr`` x WQE bytes up to a power of
    two and refuses more basic blocks than ``max_qp_wr`` (which it counts in blocks, not WQEs; mlx5_calc_sq_size),
    so the queue's bytes stay within the largest power of two of blocks at most ``max_qp_wr``."""
    budget = 1 << (max(1, max_qp_wr).bit_length() - 1)
    return max(1, budget * WQEBB // wqe_bytes(max_send_sge))


def depths(max_qp_wr: int, max_cqe: int, nqps: int, send_sge: int = MAX_SEND_SGE,
           sq_limit: int = SQ_DEPTH) -> dict[str, int]:
    """Queue depths: a send queue of ``sq`` entries per QP, a signaled request every ``every``, a send CQ that
    holds a completion for every send-queue entry of every QP (a completion is only ever outstanding while its
    request holds an entry), a receive CQ that holds one for every posted receive; all within the device's
    limits, the send queue within the provider's budget for WQEs of ``send_sge`` SGEs (sq_fit) and
    ``sq_limit`` (what a refused QP was retried with)."""
    nqps = max(1, nqps)
    sq = max(1, min(sq_fit(max_qp_wr, send_sge), sq_limit, SQ_DEPTH, max_cqe // nqps))
    rq = max(1, min(max_qp_wr, RQ_DEPTH, max_cqe // nqps))
    return {"sq": sq, "rq": rq, "every": max(1, sq // 4), "scq": sq * nqps, "rcq": rq * nqps}


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
    """Opcodes of a QP's ``n`` work requests of a layer: the last WRITE carries the immediate data."""
    if op == "pull":
        return [IBV_WR_RDMA_READ] * n
    return [IBV_WR_RDMA_WRITE] * (n - 1) + [IBV_WR_RDMA_WRITE_WITH_IMM] if n else []


def pick_gid(table: list[tuple[int, str, int]], infiniband: bool, override: int | None) -> int:
    """The GID index to use: ``override`` (-O gid=), else 0 on an InfiniBand port (routed by LID), else the
    first RoCE v2 GID, IPv4-mapped first (link-local v6 GIDs are not routed); ``table`` holds (index, GID,
    type) per entry.  ValueError when a RoCE port has no RoCE v2 GID."""
    if override is not None:
        return override
    if infiniband:
        return 0
    v2 = [(i, g) for i, g, t in table if t == GID_ROCE_V2 and g != ZERO_GID]
    for i, g in v2:
        if g.startswith(IPV4_MAPPED):
            return i
    if v2:
        return v2[0][0]
    raise ValueError("no RoCE v2 GID on this port (its GIDs are RoCE v1 or empty): name one with -O gid=<index>")


def peermem() -> str | None:
    """nvidia-peermem's version when loaded (GPU memory registers as a plain MR), else None."""
    for path in ("/sys/module/nvidia_peermem/version", "/sys/kernel/mm/memory_peers/nv_mem/version"):
        try:
            with open(path) as fh:
                return fh.read().strip() or "loaded"
        except OSError:
            continue
    return None
