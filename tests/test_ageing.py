"""An aged decode pool (--alloc aged:N, model/ageing.py): the free queue's exact order after hand-made requests,
its invariants under any requests, the allocator that hands it out, a real run from it, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.asserts import assert_nothing_written, assert_one_line
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.model import ageing as A
from kvbench.model.layout import BlockAllocator, parse_alloc
from kvbench.report import plots
from kvbench.report.stats import load_run


def _age(nblocks, reqs, block_size=1):
    """reqs: (arrival s, input tokens, output tokens); 1 s per output token, so a request lives output seconds."""
    a, i, o = (np.array(x) for x in zip(*reqs))
    log = []
    return A.age(nblocks, block_size, a, i, o, tpot_s=1.0, log=log).tolist(), [(r, ids.tolist(), s) for r, ids, s in log]


def test_three_requests_leave_the_free_queue_in_vllm_order():
    # 6 blocks of 1 token. r0 takes 0,1 (ends at 1); r1 takes 2,3,4 (ends at 1.5); at 1.2 r0 has finished and
    # given 1,0 back to the tail (last block first): r2 takes the head, 5 then 1, 0 (ends at 3.2)
    queue, log = _age(6, [(0.0, 1, 1), (0.5, 2, 1), (1.2, 1, 2)])
    assert log == [(0, [0, 1], 1), (1, [2, 3, 4], 1), (0, [0, 1], -1), (2, [5, 1, 0], 1),
                   (1, [2, 3, 4], -1), (2, [5, 1, 0], -1)]
    assert queue == [4, 3, 2, 0, 1, 5]


def test_a_request_that_does_not_fit_waits_for_the_next_to_finish():
    # r2 needs 4 blocks at 1.2 when 3 are free: it is admitted when r1 ends (1.5) and takes 5,1,0 then 4
    queue, log = _age(6, [(0.0, 1, 1), (0.5, 2, 1), (1.2, 2, 2)])
    assert log[3:] == [(1, [2, 3, 4], -1), (2, [5, 1, 0, 4], 1), (2, [5, 1, 0, 4], -1)]
    assert queue == [3, 2, 4, 0, 1, 5]


def test_tokens_round_up_to_blocks_and_a_request_larger_than_the_pool_takes_all_of_it():
    assert A.footprint(np.array([1, 16, 17, 1000]), np.array([0, 0, 0, 0]), 16, 8).tolist() == [1, 1, 2, 8]
    queue, log = _age(4, [(0.0, 3, 9), (0.0, 1, 0)], block_size=2)  # 12 tokens = 6 blocks of a 4-block pool
    assert log == [(0, [0, 1, 2, 3], 1), (0, [0, 1, 2, 3], -1), (1, [3], 1), (1, [3], -1)]
    assert queue == [2, 1, 0, 3]


@settings(max_examples=150, deadline=None)
@given(nblocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 16]),
       reqs=st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.integers(0, 100), st.integers(0, 20)),
                     max_size=40))
def test_ageing_never_hands_out_a_block_twice_and_loses_none(nblocks, block_size, reqs):
    reqs = sorted(reqs)  # arrivals in order
    a, i, o = (np.array(x, dtype=float if k == 0 else np.int64).reshape(-1) for k, x in
               enumerate(zip(*reqs) if reqs else ([], [], [])))
    log = []
    queue = A.age(nblocks, block_size, a, i, o, tpot_s=0.1, log=log)
    held = np.zeros(nblocks, dtype=bool)
    owner = {}
    for r, ids, sign in log:
        if sign > 0:
            assert not held[ids].any() and len(set(ids.tolist())) == len(ids)  # never granted while held
            held[ids] = True
            owner[r] = ids
        else:
            assert np.array_equal(owner.pop(r), ids) and held[ids].all()  # a request gives back what it took
            held[ids] = False
    assert not owner and not held.any()
    assert sorted(queue.tolist()) == list(range(nblocks))  # every block free again, once
    assert sum(1 for e in log if e[2] > 0) == len(reqs)


def test_drawn_requests_are_seeded_and_the_aged_order_is_a_permutation():
    a1, i1, o1 = A.drawn_requests(500, 256, 16, seed=7)
    a2, i2, o2 = A.drawn_requests(500, 256, 16, seed=7)
    assert np.array_equal(a1, a2) and np.array_equal(i1, i2) and np.array_equal(o1, o2)
    assert (np.diff(a1) >= 0).all() and i1.min() >= 1 and o1.min() >= 1 and i1.max() <= 256 * 16
    fresh, old = A.aged_order(256, 16, 0, 7), A.aged_order(256, 16, 2000, 7)
    assert fresh.tolist() == list(range(256)) and sorted(old.tolist()) == list(range(256))
    # the head of a queue 2,000 requests old is in runs far shorter than a fresh pool's one run
    runs = 1 + int((np.diff(old[:128]) != 1).sum())
    assert runs > 16, runs


def test_the_allocator_hands_out_the_aged_queue_and_takes_blocks_back_at_its_tail():
    alloc = BlockAllocator(6).age(np.array([4, 3, 2, 0, 1, 5]))
    assert alloc.allocate(4, "aged:9").tolist() == [4, 3, 2, 0] and alloc.nfree == 2
    assert alloc.allocate(3, "aged:9") is None  # not enough free: back-pressure, nothing taken
    alloc.release(np.array([4, 3]))
    assert alloc.nfree == 4 and alloc.allocate(4, "aged:9").tolist() == [1, 5, 3, 4]
    with pytest.raises(ValueError, match="not aged"):
        BlockAllocator(6).allocate(2, "aged:9")
    with pytest.raises(ValueError, match="was aged"):
        BlockAllocator(6).age(np.arange(6)).allocate(2, "random")
    with pytest.raises(ValueError, match="whole, unused pool"):
        BlockAllocator(6).age(np.arange(5))


@pytest.mark.parametrize("spec", ["aged:", "aged:-1", "aged:abc", "aged:1.5", "aged", "aged:2000000"])
def test_parse_alloc_refuses_a_bad_age(spec):
    with pytest.raises(ValueError, match="alloc 'aged"):
        parse_alloc(spec)


def test_parse_alloc_reads_an_age():
    assert parse_alloc("aged:0") == ("aged", 0) and parse_alloc("aged:10000") == ("aged", 10000)


@pytest.mark.parametrize("spec", ["aged:", "aged:-1", "aged:abc"])
def test_a_bad_age_is_one_line_and_writes_nothing(kvrun, tmp_path, spec):
    r = kvrun(["-t", "shm", "--tokens", "64", "-n", "2", "-w", "0", "--alloc", spec])
    assert_one_line(r, f"alloc '{spec}'", "aged:<N>")
    assert_nothing_written(tmp_path)


def test_a_real_run_from_an_aged_pool_is_checked_and_has_more_descriptors_than_a_fresh_one(kvrun):
    # 16-token blocks, coalescing on: a fresh contiguous pool moves one descriptor per layer and region, random
    # one per block; the aged pool's blocks come in short runs, so it lands in between, and every byte is right
    r = kvrun(["-t", "shm", "--op", "push", "--tokens", "1024", "-b", "16", "--layers", "2", "--kv-heads", "2",
               "--head-dim", "64", "--alloc", "contiguous,random,aged:1000", "--coalesce", "on",
               "--variants", "bulk,paged", "-n", "2", "-w", "0", "--rounds", "1", "--progress", "off"], timeout=180)
    assert r.code == 0, r.out[-3000:] + r.err[-3000:]
    assert r.meta()["total_wrong"] == 0
    df = r.transfers()
    paged = df[(df["variant"] == "paged") & (df["iter"] >= 0)]
    descs = paged.groupby("allocation")["descriptors"].max().to_dict()
    assert (paged.groupby("allocation")["descriptors"].nunique() == 1).all()
    layers_regions = 2 * 2
    per_block = layers_regions * 1024 // 16  # one descriptor per block per region per layer: none adjacent
    assert descs["contiguous"] == layers_regions and descs["random"] <= per_block
    assert layers_regions < descs["aged:1000"] <= per_block, descs
    checked = df[(df["variant"] == "paged") & (df["iter"] == -1)]
    assert len(checked) and (checked["nwrong"].fillna(0) == 0).all()
    # the report draws GB/s against age from these rows (ages 0 and 1000)
    st_ = load_run(r.results).st
    (cap, fig), = plots.bandwidth_vs_age(st_[st_["kind"] == "bandwidth"])
    assert fig is not None and "pool's age" in cap
    ax = fig.axes[0]
    assert sorted(set(x for ln in ax.lines for x in ln.get_xdata())) == [0, 1000]
    plots._plt().close(fig)
    fresh = st_[(st_["kind"] == "bandwidth") & ~st_["allocation"].str.startswith("aged")]
    assert list(plots.bandwidth_vs_age(fresh)) == []  # no aged pool in the run: no plot, no line
