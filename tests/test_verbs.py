"""verbs' pure logic: work requests and SGE lists from descriptor arrays, chunking at max_sge, the immediate
data of a layer's last WRITE.  The pyverbs part needs an RDMA device (none here: its probe says so)."""
import numpy as np
import pytest

from kvbench.transports import probe
from kvbench.transports.verbs import (
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    decode_imm,
    encode_imm,
    opcodes,
    runs,
    work_requests,
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
