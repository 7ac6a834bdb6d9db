import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.descriptors import bulk_descs, byte_map, coalesce, layer_descs, stats
from kvbench.pool import BlockAllocator, Layout

LAYOUT_KINDS = ["layer-major", "block-major", "mla"]


def make_layout(kind, layers=3, block_bytes=8, nblocks=24):
    return Layout(kind, layers, 1 if kind == "mla" else 2, block_bytes, nblocks)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(LAYOUT_KINDS), n=st.integers(1, 12), seed=st.integers(0, 2**16),
       spec=st.sampled_from(["random", "contiguous", "fragmented:3", "fragmented:1"]), last=st.integers(1, 8))
def test_coalesced_and_uncoalesced_move_same_bytes_to_same_places(kind, n, seed, spec, last):
    lay = make_layout(kind)
    src = BlockAllocator(lay.nblocks, seed).allocate(n, spec)
    dst = BlockAllocator(lay.nblocks, seed + 1).allocate(n, spec)
    for layer in range(lay.layers):
        d = layer_descs(lay, lay, src, dst, layer, nbytes_last=last)
        c = coalesce(d)
        assert byte_map(d) == byte_map(c)
        assert int(c[:, 2].sum()) == int(d[:, 2].sum())
        assert len(c) <= len(d)
        # no two coalesced rows could have been merged further
        o = c[np.argsort(c[:, 0])]
        assert not np.any((o[1:, 0] == o[:-1, 0] + o[:-1, 2]) & (o[1:, 1] == o[:-1, 1] + o[:-1, 2]))


@pytest.mark.parametrize("kind,expected", [("layer-major", 2), ("mla", 1), ("block-major", 1)])
def test_contiguous_allocation_coalesces_to_one_descriptor_per_region_per_layer(kind, expected):
    lay = make_layout(kind, layers=4, block_bytes=64, nblocks=32)
    src = BlockAllocator(lay.nblocks, 1).allocate(10, "contiguous")
    dst = BlockAllocator(lay.nblocks, 2).allocate(10, "contiguous")
    for layer in range(lay.layers):
        d = layer_descs(lay, lay, src, dst, layer)
        assert len(d) == 10 * lay.regions
        c = coalesce(d)
        # block-major keeps K and V of a block adjacent, so a layer is one run
        assert len(c) == expected
        assert int(c[:, 2].sum()) == 10 * lay.regions * 64


def test_random_allocation_mostly_does_not_coalesce():
    lay = make_layout("layer-major", layers=1, block_bytes=64, nblocks=4096)
    src = BlockAllocator(lay.nblocks, 1).allocate(64, "random")
    dst = BlockAllocator(lay.nblocks, 2).allocate(64, "random")
    assert len(coalesce(layer_descs(lay, lay, src, dst, 0))) > 120


def test_fragmented_runs_coalesce_to_runs():
    lay = make_layout("mla", layers=1, block_bytes=64, nblocks=4096)
    # same seed on both sides: identical runs, so each 4-block run coalesces into one descriptor
    src = BlockAllocator(lay.nblocks, 5).allocate(64, "fragmented:4")
    dst = BlockAllocator(lay.nblocks, 5).allocate(64, "fragmented:4")
    assert len(coalesce(layer_descs(lay, lay, src, dst, 0))) == 16


def test_layer_descs_exact_offsets_layer_major():
    lay = Layout("layer-major", 2, 2, 100, 10)
    d = layer_descs(lay, lay, np.array([3, 7]), np.array([1, 2]), layer=1)
    # layer 1 K region starts at (1*2+0)*10*100 = 2000, V at 3000
    assert d.tolist() == [[2300, 2100, 100], [3300, 3100, 100], [2700, 2200, 100], [3700, 3200, 100]]


def test_layer_descs_exact_offsets_block_major():
    lay = Layout("block-major", 2, 2, 100, 10)
    d = layer_descs(lay, lay, np.array([3]), np.array([1]), layer=1)
    assert d.tolist() == [[(10 + 3) * 200, (10 + 1) * 200, 100], [(10 + 3) * 200 + 100, (10 + 1) * 200 + 100, 100]]


def test_bulk_and_stats():
    lay = Layout("layer-major", 2, 2, 100, 10)
    b = bulk_descs(lay, lay, 1, 400)
    assert b.tolist() == [[2000, 2000, 400]]
    s = stats([b, b])
    assert s == {"descriptors": 2, "payload_bytes": 800, "mean_desc_bytes": 400.0}
    with pytest.raises(ValueError):
        bulk_descs(lay, lay, 0, 10**6)


def test_allocator_is_reproducible_and_exhausts():
    a, b = BlockAllocator(100, 42), BlockAllocator(100, 42)
    assert a.allocate(30, "random").tolist() == b.allocate(30, "random").tolist()
    assert a.allocate(70, "random") is not None
    assert a.allocate(1, "random") is None  # full: the caller decides (back-pressure)
    c = BlockAllocator(10, 0)
    assert c.allocate(4, "contiguous").tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="fragmented:<run>"):
        c.allocate(1, "striped")


@pytest.mark.parametrize("n", [1, 2, 8, 9, 40])
def test_check_descs_refuses_ranges_outside_either_pool(n):
    from kvbench.transports.base import TransportError, check_descs

    good = np.array([[i * 100, i * 100, 100] for i in range(n)], dtype=np.int64)
    check_descs(good, n * 100, n * 100)  # exactly fits both pools
    for limit, what in (((n * 100 - 1, n * 100), "source"), ((n * 100, n * 100 - 1), "destination")):
        with pytest.raises(TransportError, match=f"past the end of the {what} pool"):
            check_descs(good, *limit)
    bad = good.copy()
    bad[-1, 2] = 0
    with pytest.raises(TransportError, match="non-positive length"):
        check_descs(bad, n * 100, n * 100)
    bad = good.copy()
    bad[0, 1] = -1
    with pytest.raises(TransportError, match="negative offset"):
        check_descs(bad, n * 100, n * 100)
