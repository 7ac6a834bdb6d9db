"""verbs: its pure logic (work requests, spreading, signaling, depths, immediate data, GID choice), and the
transport itself against rdma-core's real pyverbs objects on a fake device (tests/fakes/pyverbs_fake.py): two
or three ranks in one process joined by a numpy wire, checked as the harness's check pass checks; the QP's
size against mlx5's work-queue arithmetic, the GPUDirect flush, and the path options (tc, sl, timeout)."""
import os
import sys

import numpy as np
import pytest

from kvbench.memory import pattern, verify
from kvbench.model.descriptors import bulk_descs, request_descs
from kvbench.model.layout import Layout, Pool
from kvbench.transports import options, probe
from kvbench.transports.base import Context, TransportError
from kvbench.transports.verbs.plan import (
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    MAX_SEND_SGE,
    SQ_FLOOR,
    decode_imm,
    depths,
    encode_imm,
    notifications,
    opcodes,
    pick_gid,
    runs,
    segments,
    spread,
    sq_fit,
    work_requests,
    wqe_bytes,
)

# blocks 0-2 go to one contiguous destination run, block 3 elsewhere, blocks 4-5 to a second run
D = np.array([[0, 1000, 100], [500, 1100, 100], [300, 1200, 50], [900, 5000, 10], [40, 7000, 20],
              [80, 7020, 20]], np.int64)


def test_push_writes_one_request_per_destination_run_gathering_the_source_ranges():
    wrs = work_requests(D, "push", max_sge=8, local_base=10_000, remote_base=1 << 40)
    assert [r for r, _ in wrs] == [(1 << 40) + 1000, (1 << 40) + 5000, (1 << 40) + 7000]
    assert [s.tolist() for _, s in wrs] == [[[10_000, 100], [10_500, 100], [10_300, 50]], [[10_900, 10]],
                                            [[10_040, 20], [10_080, 20]]]
    assert sum(int(s[:, 1].sum()) for _, s in wrs) == int(D[:, 2].sum())


def test_a_run_longer_than_max_sge_is_split_and_each_piece_starts_where_the_last_ended():
    wrs = work_requests(D, "push", max_sge=2, local_base=0, remote_base=0)
    assert [(r, len(s)) for r, s in wrs] == [(1000, 2), (1200, 1), (5000, 1), (7000, 2)]
    with pytest.raises(ValueError):
        work_requests(D, "push", max_sge=0, local_base=0, remote_base=0)


def test_pull_reads_one_request_per_source_run_scattering_into_local_ranges():
    d = np.array([[0, 64, 32], [32, 0, 32], [64, 512, 8], [4096, 96, 16]], np.int64)
    wrs = work_requests(d, "pull", max_sge=30, local_base=100, remote_base=1000)
    assert [(r, s.tolist()) for r, s in wrs] == [(1000, [[164, 32], [100, 32], [612, 8]]), (5096, [[196, 16]])]
    assert runs(np.zeros((0, 3), np.int64), 1).tolist() == []


def test_only_a_layers_last_write_carries_the_immediate_notification():
    assert opcodes("push", 3) == [IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM]
    assert opcodes("push", 1) == [IBV_WR_RDMA_WRITE_WITH_IMM] and opcodes("push", 0) == []
    assert opcodes("pull", 2) == [IBV_WR_RDMA_READ] * 2


def test_immediate_data_round_trips_request_and_layer_in_network_byte_order():
    tag = (0xBEEF << 16) | (3 << 12) | 79  # case/iteration, request 3, layer 79, as the harness builds tags
    imm = encode_imm(tag)
    assert imm.to_bytes(4, "little") == tag.to_bytes(4, "big")  # the wire carries it big-endian
    assert decode_imm(imm) == (tag, 3, 79)
    with pytest.raises(ValueError, match="32-bit"):
        encode_imm(1 << 32)


def test_list_says_verbs_and_cuda_ipc_are_unavailable_with_the_reason():
    assert probe("verbs").startswith("no RDMA device")
    assert probe("cuda_ipc").startswith("no CUDA device")
    assert probe("staged") is None


def test_signaling_spreading_and_depths_stay_within_the_queues():
    """Every chain ends in its one signaled request and needs at most ``every`` send-queue entries; groups
    cover a layer's requests in order, one per QP used; the send CQ holds a completion per send-queue entry."""
    assert segments(10, 4) == [(0, 4), (4, 8), (8, 10)] and segments(0, 4) == []
    assert spread(7, 3) == [(0, 2), (2, 4), (4, 7)] and spread(2, 4) == [(0, 1), (1, 2)] and spread(0, 2) == []
    assert notifications(D, send_sge=8, nqps=2) == 2 and notifications(D, send_sge=8, nqps=8) == 3
    d = depths(max_qp_wr=32768, max_cqe=4194303, nqps=6)
    assert d["sq"] == 4096 and d["every"] == 1024 and d["scq"] == 6 * d["sq"] and d["rcq"] == 6 * d["rq"]
    small = depths(max_qp_wr=1024, max_cqe=100, nqps=4)  # the CQ's limit shrinks the queues, not the other way
    assert small["scq"] <= 100 and small["rcq"] <= 100 and small["sq"] == 25 and small["every"] == 6
    tiny = depths(max_qp_wr=64, max_cqe=4194303, nqps=4)  # 64 basic blocks hold 16 WQEs of 4 SGEs (256 B each)
    assert tiny["sq"] == 16 and tiny["rq"] == 64 and tiny["every"] == 4
    assert depths(max_qp_wr=32768, max_cqe=4194303, nqps=1, sq_limit=1024)["sq"] == 1024  # a refused QP's retry


def test_the_send_queue_fits_mlx5s_work_queue_arithmetic():
    """mlx5 sizes an RC WQE as 192 bytes of overhead plus 16 per SGE in 64-byte blocks (704 B for 30 SGEs) and
    counts max_qp_wr in blocks, after rounding the queue up to a power of two: 4096 WQEs of 30 SGEs need 65,536
    blocks of 32,768; the plan's SGEs (a few, not 30) and its send queue stay within them."""
    assert wqe_bytes(30) == 704 and wqe_bytes(MAX_SEND_SGE) == 256 and 4 <= MAX_SEND_SGE <= 8
    assert sq_fit(32768, 30) == 2978 and sq_fit(32768, MAX_SEND_SGE) == 8192
    assert sq_fit(32767, MAX_SEND_SGE) == 4096  # a budget that is no power of two: the one below it
    d = depths(max_qp_wr=32768, max_cqe=4194303, nqps=1)
    assert d["sq"] * wqe_bytes(MAX_SEND_SGE) <= 32768 * 64


def test_the_gid_is_roce_v2_ipv4_mapped_first_unless_named():
    ll, v4 = "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "0000:0000:0000:0000:0000:ffff:0a00:0001"
    table = [(0, ll, 0), (1, ll, 1), (2, v4, 0), (3, v4, 1)]
    assert pick_gid(table, infiniband=False, override=None) == 3
    assert pick_gid(table[:2], infiniband=False, override=None) == 1
    assert pick_gid(table, infiniband=False, override=2) == 2 and pick_gid([], infiniband=True, override=None) == 0
    with pytest.raises(ValueError, match="-O gid="):
        pick_gid([(0, ll, 0), (2, v4, 0)], infiniband=False, override=None)
    assert options.parse(["gid=3"], ["verbs"])["verbs"] == {"gid": 3}


# ----- against real pyverbs objects and a fake device ------------------------------------------------
fake = pytest.importorskip("fakes.pyverbs_fake")
EPOCH, LAYERS, BLOCK = 5, 4, 512


@pytest.fixture
def pv():
    mod, why = fake.load_real()
    if mod is None:
        pytest.skip(why)
    return mod


def make_wire(monkeypatch, n=2, link="roce", **attr):
    devs = [fake.Device(f"mlx5_{r}", link=link, lid=r + 1, gids=fake.roce_gids(r + 1) if link == "roce"
                        else [(f"fe80:0000:0000:0000:0002:c903:0000:{r + 1:04x}", 0)], **attr) for r in range(n)]
    wire = fake.Wire(*devs)
    for name, mod in wire.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return wire


def ranks(nbytes, n=2, pools=None, **opts):
    """n connected VerbsTransports (ranks 0..n-1) with a registered pool each (host pools unless given)."""
    from kvbench.transports.verbs import VerbsTransport

    ts = []
    pools = pools or [Pool(np.zeros(nbytes, np.uint8)) for _ in range(n)]
    for r in range(n):
        ctx = Context(rank=r, world_size=n, hostname="h", run_id="t", options={"device": f"mlx5_{r}", **opts})
        ts.append(VerbsTransport(ctx))
    blobs = [t.register(p) for t, p in zip(ts, pools)]
    for r, t in enumerate(ts):
        t.connect({q: b for q, b in enumerate(blobs) if q != r})
    return ts, pools


def paged(lay: Layout, nblocks: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return request_descs(lay, lay, rng.permutation(lay.nblocks)[:nblocks], rng.permutation(lay.nblocks)[:nblocks])


def check_pass(ts, pools, op, layers, src=0, dst=1, tag0=0x70000):
    """The harness's check pass through the transport's API: the source's layers take a new epoch, the
    destination's ranges are poisoned, the destination copies them aside the moment ``wait`` returns."""
    sp, dp = pools[src].array, pools[dst].array
    pattern.fill(sp, src)
    for d in layers:
        verify.poison(dp, d, src, EPOCH)
        verify.write_epoch(sp, d, src, EPOCH)
    tags = [tag0 | k for k in range(len(layers))]
    if op == "push":
        served = [ts[dst].serve("push", src, d, t) for d, t in zip(layers, tags)]
        hs = [ts[src].start(ts[src].prepare("push", dst, d, t)) for d, t in zip(layers, tags)]
        for h in hs:
            ts[src].wait(h)
        for h in reversed(served):
            ts[dst].wait(h)
    else:
        hs = [ts[dst].start(ts[dst].prepare("pull", src, d, t)) for d, t in zip(layers, tags)]
        for h in reversed(hs):
            ts[dst].wait(h)
    copy, where = verify.snapshot(dp, layers)
    return verify.count_wrong(copy, where, src, 2, EPOCH)


LAY = Layout("layer-major", LAYERS, 2, BLOCK, 64)


@pytest.mark.parametrize("op", ["push", "pull"])
@pytest.mark.parametrize("shape", ["bulk", "paged"])
def test_push_and_pull_bulk_and_paged_end_to_end_over_the_wire(pv, monkeypatch, op, shape):
    """Real SendWR/SGE/QPAttr/AHAttr objects from kvbench's code, a fake device that holds them to the rules,
    bytes moved by the wire: #wrong 0 both ways (READ needs the access flags and rd_atomic set)."""
    wire = make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes)
    layers = [bulk_descs(LAY, LAY, k, LAY.layer_span(k)[1]) for k in range(LAYERS)] if shape == "bulk" \
        else paged(LAY, 40)
    assert check_pass(ts, pools, op, layers) == 0
    assert wire.posted >= LAYERS
    from pyverbs.wr import SendWR

    peer, chains, keep, flush = ts[0 if op == "push" else 1].prepare(op, 1 if op == "push" else 0, layers[0], 1)
    assert not flush  # host pools: no GPUDirect flush
    assert all(type(w) is SendWR for w in keep)  # rdma-core's own objects, not stand-ins


@pytest.mark.parametrize("op", ["push", "pull"])
@pytest.mark.parametrize("lie", ["wrong-block", "early"])
def test_a_wrong_block_or_an_early_completion_through_the_wire_is_caught(pv, monkeypatch, op, lie):
    wire = make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes)
    wire.fault = lie
    assert check_pass(ts, pools, op, paged(LAY, 8)) > 0


def test_work_requests_chain_through_next_wr(pv, monkeypatch):
    """pyverbs chains with the next_wr property (there is no set_next_wr): the fake QP reads the real
    ibv_send_wr structs and follows their next pointers; a layer's chain is one post."""
    wire = make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes)
    layer = paged(LAY, 12)[0]
    prepared = ts[0].prepare("push", 1, layer, 9)
    _, chains, keep, _ = prepared
    assert len(chains) == 1 and len(keep) == len(layer) > 1  # random blocks: one WRITE per block
    got = fake.read_chain(chains[0][1])
    assert [e["opcode"] for e in got] == [IBV_WR_RDMA_WRITE] * (len(layer) - 1) + [IBV_WR_RDMA_WRITE_WITH_IMM]
    assert [e["flags"] for e in got] == [0] * (len(layer) - 1) + [2]  # only the last is signaled
    assert got[-1]["imm"] == encode_imm(9) and got[0]["rkey"] == ts[1].mr.rkey
    before = wire.posted
    ts[0].wait(ts[0].start(prepared))
    assert wire.posted == before + 1


def test_qp_attributes_are_set_per_transition(pv, monkeypatch):
    """INIT: remote WRITE and READ allowed, port, P_Key; RTR: MTU both ports carry, the peer's QP and PSN,
    rd_atomic, RNR timer, a GRH to the peer's RoCE v2 GID; RTS: timeout, retries, our PSN, rd_atomic."""
    wire = make_wire(monkeypatch)
    wire.devices["mlx5_1"].active_mtu = 3  # 1024: the path MTU is the smaller of the two
    ts, _ = ranks(1 << 16)
    q0, q1 = ts[0].qps[1][0], ts[1].qps[0][0]
    s = q0.set
    assert s["qp_access_flags"] == 1 | 2 | 4 and s["port_num"] == 1 and s["pkey_index"] == 0
    assert s["path_mtu"] == 3 and s["dest_qp_num"] == q1.qp_num and s["rq_psn"] == q1.set["sq_psn"]
    assert s["max_dest_rd_atomic"] >= 1 and s["min_rnr_timer"] > 0
    assert q0.ah["is_global"] == 1 and q0.ah["dgid"] == fake.roce_gids(2)[3][0] and q0.ah["sgid_index"] == 3
    assert s["timeout"] == 20 and s["retry_cnt"] == 7 and s["rnr_retry"] == 7 and s["max_rd_atomic"] >= 1
    assert q0.ah["traffic_class"] == 0 and q0.ah["sl"] == 0  # the defaults: -O tc= and -O sl= change them
    assert s["sq_psn"] == q1.set["rq_psn"]
    assert ts[0].info()["gid_index"] == 3 and ts[0].info()["link"] == "RoCE"


def test_gid_option_overrides_and_a_roce_v1_gid_loses_the_packets(pv, monkeypatch):
    make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes, gid=1)  # link-local RoCE v2: routed on this fabric
    assert ts[0].qps[1][0].ah["sgid_index"] == 1 and check_pass(ts, pools, "push", paged(LAY, 4)) == 0
    make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes, gid=0)  # RoCE v1: what index 0 is on mlx5, and why it is not the default
    with pytest.raises(TransportError, match="status 12"):
        check_pass(ts, pools, "push", paged(LAY, 4))


def test_a_roce_port_without_a_v2_gid_says_so_and_an_ib_port_routes_by_lid(pv, monkeypatch):
    wire = make_wire(monkeypatch)
    for d in wire.devices.values():
        d.gids = [(g, t) for g, t in d.gids if t == fake.ROCE_V1]
    with pytest.raises(TransportError, match="no RoCE v2 GID.*-O gid="):
        ranks(1 << 16)
    make_wire(monkeypatch, link="ib")
    ts, pools = ranks(LAY.nbytes)
    assert ts[0].qps[1][0].ah["dlid"] == 2 and ts[0].qps[1][0].ah["is_global"] == 0
    assert check_pass(ts, pools, "pull", paged(LAY, 6)) == 0 and ts[0].info()["link"] == "InfiniBand"


def test_gid_types_come_from_sysfs_where_pyverbs_cannot_query_them(tmp_path, monkeypatch):
    from kvbench.transports.verbs import link

    types_dir = tmp_path / "mlx5_0" / "ports" / "1" / "gid_attrs" / "types"
    types_dir.mkdir(parents=True)
    (types_dir / "0").write_text("IB/RoCE v1\n")
    (types_dir / "1").write_text("RoCE v2\n")
    monkeypatch.setattr(link, "SYSFS", str(tmp_path))
    old = object()  # a Context of rdma-core before ibv_query_gid_type
    assert [link.gid_type(old, "mlx5_0", 1, i) for i in (0, 1, 2)] == [0, 1, 0]


def test_a_paged_request_with_many_descriptors_never_overflows_the_send_queue_or_the_cq(pv, monkeypatch):
    """A small device (send queues of 256 basic blocks: 64 WQEs of 4 SGEs; 128-entry CQs) and a request of
    thousands of work requests: selective signaling and posting only into free entries keep every post and poll
    within the limits (the fake fails a post past the queue with ENOMEM and a poll after a CQ overrun)."""
    make_wire(monkeypatch, max_qp_wr=256, max_cqe=128)
    lay = Layout("layer-major", 8, 2, 256, 512)
    ts, pools = ranks(lay.nbytes)
    layers = paged(lay, 300, seed=3)  # 8 layers x 600 descriptors, every block its own WRITE
    assert ts[0].depth["sq"] == 64 and sum(len(d) for d in layers) == 4800
    assert check_pass(ts, pools, "push", layers) == 0
    assert check_pass(ts, pools, "pull", layers, tag0=0x80000) == 0


def test_qps_option_spreads_a_layers_work_requests_over_several_qps(pv, monkeypatch):
    make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes, qps=3)
    assert len(ts[0].qps[1]) == 3
    assert check_pass(ts, pools, "push", paged(LAY, 20)) == 0
    assert all(q.executed > 0 for q in ts[0].qps[1])  # every QP carried part of each layer
    assert check_pass(ts, pools, "pull", paged(LAY, 20, seed=1), tag0=0x80000) == 0
    assert all(q.executed > 0 for q in ts[1].qps[0])


def once(when, act):
    """A poll hook that acts once, at the first poll where ``when(wire)`` holds: after the destination has
    taken the notification that is not the one it waits for."""
    done = []

    def hook(w):
        if not done and when(w):
            done.append(act())

    return hook


def test_wait_takes_only_its_own_tag(pv, monkeypatch):
    """A notification for another layer is kept for that layer's wait, never taken for ours: the layer we
    wait for is posted only while we wait (another rank acting meanwhile)."""
    wire = make_wire(monkeypatch)
    ts, pools = ranks(LAY.nbytes)
    layers = paged(LAY, 6)
    pattern.fill(pools[0].array, 0)
    for d in layers[:2]:
        verify.poison(pools[1].array, d, 0, EPOCH)
        verify.write_epoch(pools[0].array, d, 0, EPOCH)
    mine, other = ts[1].serve("push", 0, layers[1], 11), ts[1].serve("push", 0, layers[0], 10)
    ts[0].start(ts[0].prepare("push", 1, layers[0], 10))
    wire.on_poll = once(lambda w: w.notified >= 1, lambda: ts[0].start(ts[0].prepare("push", 1, layers[1], 11)))
    ts[1].wait(mine)
    wire.on_poll = None
    copy, where = verify.snapshot(pools[1].array, layers[1:2])
    assert verify.count_wrong(copy, where, 0, 2, EPOCH) == 0
    ts[1].wait(other)  # its notification came first and was kept
    copy, where = verify.snapshot(pools[1].array, layers[:1])
    assert verify.count_wrong(copy, where, 0, 2, EPOCH) == 0


def test_wait_takes_only_its_own_peer(pv, monkeypatch):
    """Two sources push a layer with the same tag to one destination: each wait takes its own peer's."""
    wire = make_wire(monkeypatch, n=3)
    ts, pools = ranks(LAY.nbytes, n=3)
    a, b = paged(LAY, 4, seed=1)[0], paged(LAY, 4, seed=2)[0]
    b = b.copy()
    b[:, 1] = a[:, 1]  # both sources write the same destination ranges: only the right peer's bytes pass
    pattern.fill(pools[0].array, 0)
    pattern.fill(pools[1].array, 1)
    verify.poison(pools[2].array, b, 1, EPOCH)
    verify.write_epoch(pools[1].array, b, 1, EPOCH)
    verify.write_epoch(pools[0].array, a, 0, EPOCH)
    from_1, from_0 = ts[2].serve("push", 1, b, 7), ts[2].serve("push", 0, a, 7)
    ts[0].start(ts[0].prepare("push", 2, a, 7))
    wire.on_poll = once(lambda w: w.notified >= 1, lambda: ts[1].start(ts[1].prepare("push", 2, b, 7)))
    ts[2].wait(from_1)
    wire.on_poll = None
    copy, where = verify.snapshot(pools[2].array, [b])
    assert verify.count_wrong(copy, where, 1, 2, EPOCH) == 0
    ts[2].wait(from_0)


def dmabuf_ranks(monkeypatch, wire, **opts):
    """Two ranks: rank 0's pool host memory, rank 1's device memory exported as a dma-buf (the fake keeps the
    NIC's writes there invisible until a flush); and the fds the export opened."""
    from kvbench.transports.verbs import link

    gpu = np.zeros(LAY.nbytes, np.uint8)  # the device memory the dma-buf exports
    fds = []

    def export(addr, nbytes, dev):
        fd = os.open(os.devnull, os.O_RDONLY)
        fds.append(fd)
        wire.dmabufs[fd] = gpu
        assert addr == int(gpu.ctypes.data) and nbytes == gpu.nbytes and dev == 0
        return fd, 0

    monkeypatch.setattr(link, "dmabuf_fd", export)
    ts, pools = ranks(LAY.nbytes, pools=[Pool(np.zeros(LAY.nbytes, np.uint8)), Pool(gpu, kind="cuda")], **opts)
    return ts, pools, fds


def test_a_dmabuf_pool_registers_with_pyverbs_signature_and_addresses_from_zero(pv, monkeypatch):
    """DmaBufMR(pd, length, access, dmabuf, offset, gpu, gtt): no iova argument; pyverbs registers with
    iova = offset, so the peer addresses the pool from 0 (its rkey's range), not from the device pointer."""
    wire = make_wire(monkeypatch)
    ts, pools, fds = dmabuf_ranks(monkeypatch, wire)
    assert ts[1].reg == "dma-buf" and ts[1].base == 0 and ts[0].remote[1]["addr"] == 0
    with pytest.raises(OSError):
        os.fstat(fds[0])  # the fd is closed once registered: the MR holds the dma-buf
    assert check_pass(ts, pools, "push", paged(LAY, 10)) == 0
    assert check_pass(ts, pools, "pull", paged(LAY, 10, seed=4), src=1, dst=0, tag0=0x80000) == 0


def test_the_fake_device_holds_kvbench_to_the_rules(pv, monkeypatch):
    """The fake's own rules, each as a real device enforces it: send-queue depth (ENOMEM), sq_sig_all's
    default, remote access flags, rd_atomic for READ, CQ overrun, QPInitAttr taking only CQs; and pyverbs'
    QPAttr leaves access flags, rd_atomic and timeout at 0 unless set."""
    from pyverbs.pyverbs_error import PyverbsRDMAError, PyverbsUserError
    from pyverbs.qp import QPAttr, QPCap
    from pyverbs.wr import SGE, SendWR

    from kvbench.transports.verbs import link

    make_wire(monkeypatch)
    from pyverbs.cq import CQ
    from pyverbs.device import Context as VCtx
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPInitAttr

    qa = QPAttr()
    assert qa.qp_access_flags == 0 and qa.max_rd_atomic == 0 and qa.timeout == 0
    pd = PD(VCtx(name="mlx5_0"))
    buf = np.zeros(1 << 12, np.uint8)
    at = int(buf.ctypes.data)
    no_read = MR(pd, 2048, 1 | 2, address=at)  # local and remote write, no remote read
    readable = MR(pd, 2048, 1 | 2 | 4, address=at + 2048)
    cq = CQ(pd.ctx, 4, None, None, 0)
    with pytest.raises(PyverbsUserError):
        QPInitAttr(qp_type=2, scq=object(), rcq=cq, cap=QPCap())
    me = {"mtu": 5, "rd_dest": 0, "ib": False, "gid_index": 3, "lid": 0, "gid": fake.roce_gids(1)[3][0]}

    def pair(rd):
        a, b = (QP(pd, QPInitAttr(qp_type=2, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_send_sge=2)),
                   link.init_attr(1)) for _ in range(2))
        a.to_rts(link.rts_attr(1, {**me, "rd_dest": rd}, {**me, "rd_dest": rd}, b.qp_num, 1, 2, rd))
        b.to_rts(link.rts_attr(1, {**me, "rd_dest": rd}, {**me, "rd_dest": rd}, a.qp_num, 2, 1, rd))
        return a, b

    def wr(op, mr, to):
        w = SendWR(opcode=op, num_sge=1, sg=[SGE(at + 1024, 8, no_read.lkey)])
        w.set_wr_rdma(mr.rkey, to)
        return w

    a, b = pair(0)
    for _ in range(4):
        a.post_send(wr(IBV_WR_RDMA_WRITE, no_read, at))  # sq_sig_all=1 (pyverbs' default): each completes
    with pytest.raises(PyverbsRDMAError, match="Errno: 12"):
        a.post_send(wr(IBV_WR_RDMA_WRITE, no_read, at))  # four entries in use until their completions are polled
    assert cq.poll(4)[0] == 4
    a.post_send(wr(IBV_WR_RDMA_READ, no_read, at))
    assert cq.poll(1)[1][0].status == fake.WC_REM_ACCESS  # the MR allows no remote read
    a, b = pair(0)  # the last pair's QP is in error now: a fresh one
    b.post_send(wr(IBV_WR_RDMA_READ, readable, at + 2048))
    assert cq.poll(1)[1][0].status == fake.WC_REM_INV_REQ  # rd_atomic 0: no READ may be outstanding
    c, d = pair(1)
    c.post_send(wr(IBV_WR_RDMA_READ, readable, at + 2048))
    assert cq.poll(1)[1][0].status == 0
    for _ in range(4):
        c.post_send(wr(IBV_WR_RDMA_WRITE, no_read, at))
        d.post_send(wr(IBV_WR_RDMA_WRITE, no_read, at))  # eight completions for a CQ of four
    with pytest.raises(PyverbsRDMAError, match="overrun"):
        cq.poll(1)


def test_a_dmabuf_covers_whole_pages_and_the_mr_starts_at_the_pools_offset(monkeypatch):
    """The driver exports whole pages only (cuMemGetHandleForAddressRange); a pool that starts inside a page gets
    the pages around it, and its first byte sits at its offset in the dma-buf (pyverbs: iova = offset)."""
    from kvbench.memory import driver
    from kvbench.transports.verbs import link

    asked = []

    def export(ptr, size, dev):
        asked.append((ptr, size, dev))
        return 77

    monkeypatch.setattr(driver, "dmabuf_fd", export)
    assert link.dmabuf_fd(3 * 4096 + 100, 5000, 1) == (77, 100)
    assert asked == [(3 * 4096, 8192, 1)]

    def refuse(ptr, size, dev):
        raise driver.DriverError("cuMemGetHandleForAddressRange", 801)

    monkeypatch.setattr(driver, "dmabuf_fd", refuse)
    assert link.dmabuf_fd(4096, 4096, 0) is None  # then nvidia-peermem, or the one line saying neither is there


def test_the_fake_refuses_the_qp_mlx5_refuses_and_takes_the_transports(pv, monkeypatch):
    """The fake holds a QP to mlx5's arithmetic: 4096 send WRs of 30 SGEs (what verbs asked for before) are
    65,536 basic blocks of 32,768, EINVAL as on a ConnectX; 2048 of them just fit; 31 SGEs pass the device's
    max_sge.  The transport's QPs are made without a retry and hold its plan's depth."""
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QPCap

    make_wire(monkeypatch)
    from pyverbs.cq import CQ
    from pyverbs.device import Context as VCtx
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPInitAttr

    pd = PD(VCtx(name="mlx5_0"))
    cq = CQ(pd.ctx, 16, None, None, 0)

    def qp(wr, sge):
        cap = QPCap(max_send_wr=wr, max_recv_wr=1024, max_send_sge=sge, max_recv_sge=1)
        return QP(pd, QPInitAttr(qp_type=2, scq=cq, rcq=cq, cap=cap))

    with pytest.raises(PyverbsRDMAError, match="Errno: 22"):
        qp(4096, 30)
    assert fake.sq_wqebbs(4096, 30) == 65536 and fake.sq_wqebbs(2048, 30) == 32768
    qp(2048, 30)
    with pytest.raises(PyverbsRDMAError, match="Errno: 22"):
        qp(16, 31)
    ts, pools = ranks(LAY.nbytes, qps=2)
    for q in ts[0].qps[1]:
        assert (q.init.cap.max_send_wr, q.init.cap.max_send_sge) == (4096, MAX_SEND_SGE)
    assert ts[0].info()["note"] == "" and ts[0].depth["sq"] == 4096
    assert check_pass(ts, pools, "push", paged(LAY, 20)) == 0


def test_a_refused_send_queue_is_retried_with_half_the_work_requests_and_said_once(pv, monkeypatch, capsys):
    """A provider whose send-queue budget is smaller than max_qp_wr says (4096 basic blocks of 32768): the QP
    is asked for again with half the work requests until it fits (1024 of 256 B), every QP of the rank has
    that size, the depths and the signaling follow it, so the fake's ENOMEM past the queue never fires on a
    request of thousands of WRITEs, and the note is one line, printed once by rank 0."""
    make_wire(monkeypatch, max_send_wqebb=4096)
    lay = Layout("layer-major", 8, 2, 256, 512)
    ts, pools = ranks(lay.nbytes, qps=2)
    t = ts[0]
    assert t.depth["sq"] == 1024 and t.depth["every"] == 256 and t.info()["sq_depth"] == 1024
    assert all(q.init.cap.max_send_wr == 1024 for q in t.qps[1])
    note = "verbs: mlx5_0 refused a send queue of 4096 work requests of 4 SGEs (EINVAL): its QPs have 1024"
    assert t.info()["note"] == note and ts[1].info()["note"] == note.replace("mlx5_0", "mlx5_1")
    assert capsys.readouterr().err.splitlines() == [f"# {note}"]
    assert check_pass(ts, pools, "push", paged(lay, 300, seed=3)) == 0  # 4800 WRITEs over 2 QPs of 1024
    assert check_pass(ts, pools, "pull", paged(lay, 300, seed=4), tag0=0x80000) == 0
    make_wire(monkeypatch, max_send_wqebb=128)  # not even SQ_FLOOR's WRs fit: one line, no endless halving
    with pytest.raises(TransportError, match=f"mlx5_0 refused an RC QP of {SQ_FLOOR} send work requests") as exc:
        ranks(1 << 16)
    assert "\n" not in str(exc.value)


def test_a_cuda_pools_landing_is_flushed_before_wait_returns(pv, monkeypatch):
    """The NIC's writes into GPU memory are visible only after a read of it through the NIC (the fake holds them
    back until then): the destination of a push, and of a pull, into a CUDA pool reads a byte of its own MR
    on a QP connected to itself before ``wait`` returns, one flush per wait; without it the check finds the
    poison.  A host pool has no flush; a GPU MR asks for relaxed ordering, a host MR does not."""
    wire = make_wire(monkeypatch)
    ts, pools, _ = dmabuf_ranks(monkeypatch, wire)
    assert ts[0].flush_qp is None and ts[1].flush_qp is not None
    assert ts[1].flush_qp.set["dest_qp_num"] == ts[1].flush_qp.qp_num  # loopback, as NCCL's flush QP
    assert ts[1].mr.access & (1 << 20) and not ts[0].mr.access & (1 << 20)  # IBV_ACCESS_RELAXED_ORDERING
    assert ts[1].info()["relaxed_ordering"] and not ts[0].info()["relaxed_ordering"]
    before = wire.flushes
    assert check_pass(ts, pools, "push", paged(LAY, 10)) == 0
    assert wire.flushes - before == LAYERS
    assert check_pass(ts, pools, "pull", paged(LAY, 10, seed=5), src=0, dst=1, tag0=0x80000) == 0
    assert wire.flushes - before == 2 * LAYERS
    monkeypatch.setattr(ts[1], "_flush", lambda: None)  # the transport as it was: no flush
    assert check_pass(ts, pools, "push", paged(LAY, 10, seed=6), tag0=0x90000) > 0


def test_tc_sl_and_timeout_reach_the_qp_attributes(pv, monkeypatch):
    """-O tc= sets the GRH's traffic class and -O sl= the address handle's service level at RTR, -O timeout=
    the ACK timeout at RTS, on every QP (the flush QP too); as parsed from the command line."""
    wire = make_wire(monkeypatch)
    opts = options.parse(["tc=106", "sl=3", "timeout=18"], ["verbs"])["verbs"]
    ts, pools, _ = dmabuf_ranks(monkeypatch, wire, **opts)
    for q in (ts[0].qps[1][0], ts[1].qps[0][0], ts[1].flush_qp):
        assert q.ah["traffic_class"] == 106 and q.ah["sl"] == 3 and q.set["timeout"] == 18
    i = ts[0].info()
    assert (i["traffic_class"], i["service_level"], i["ack_timeout"]) == (106, 3, 18)
    assert check_pass(ts, pools, "push", paged(LAY, 6)) == 0
    make_wire(monkeypatch, link="ib")
    ts, _ = ranks(1 << 16, sl=5)
    assert ts[0].qps[1][0].ah["sl"] == 5 and ts[0].qps[1][0].ah["is_global"] == 0


@pytest.mark.parametrize("item,says", [("tc=300", "the RoCE traffic class is 0-255"),
                                       ("sl=16", "the service level is 0-15"),
                                       ("verbs.timeout=32", "the ACK timeout exponent is 0-31"),
                                       ("tc=-1", "the RoCE traffic class is 0-255")])
def test_tc_sl_and_timeout_out_of_range_are_refused_in_one_line(item, says):
    """Refused at the door (options.parse, which the run's config calls before anything starts), in one line
    that names the option, the value and the range allowed."""
    with pytest.raises(options.OptionError) as exc:
        options.parse([item], ["verbs"])
    key, value = item.removeprefix("verbs.").split("=")
    assert str(exc.value) == f"-O: verbs option {key}={value!r}: {says}"
    assert options.parse(["tc=255", "sl=15", "timeout=0"], ["verbs"])["verbs"] == {"tc": 255, "sl": 15, "timeout": 0}
