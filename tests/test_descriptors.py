import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.model.descriptors import (
    _layer0_coalesced,
    bulk_descs,
    byte_map,
    coalesce,
    coalesced_descs,
    layer_descs,
    request_descs,
    stats,
)
from kvbench.model.layout import BlockAllocator, Layout

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


def reference_coalesced(src, dst, sb, db, last=None, layers=None):
    """Today's path, the reference: build every layer's rows, then sort and merge each layer."""
    return [coalesce(d) for d in request_descs(src, dst, sb, db, last, layers)]


def assert_same(fast, ref):
    assert len(fast) == len(ref)
    for f, r in zip(fast, ref):
        assert f.dtype == r.dtype == np.int64 and f.shape == r.shape
        assert f.tobytes() == r.tobytes()  # byte for byte: same rows, same order


ALLOCS = ["random", "contiguous", "fragmented:1", "fragmented:2", "fragmented:3", "fragmented:8"]


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(LAYOUT_KINDS), dst_kind=st.sampled_from(LAYOUT_KINDS + [None]),
       layers=st.integers(1, 4), block_bytes=st.sampled_from([1, 8, 64, 4096, 32768]),
       nblocks=st.integers(1, 40), dst_extra=st.integers(0, 5), frac=st.floats(0, 1), seed=st.integers(0, 2**16),
       spec=st.sampled_from(ALLOCS), dst_spec=st.sampled_from(ALLOCS + [None]),
       last=st.one_of(st.none(), st.integers(1, 40000)), sub=st.booleans())
def test_block_table_coalescing_matches_sorting_coalesce(kind, dst_kind, layers, block_bytes, nblocks, dst_extra,
                                                         frac, seed, spec, dst_spec, last, sub):
    regions = 1 if kind == "mla" else 2
    src = Layout(kind, layers, regions, block_bytes, nblocks)
    # same layout on both sides (as plan() uses), or another kind / pool size on the destination
    dst = src if dst_kind is None else Layout(dst_kind, layers, regions, block_bytes, nblocks + dst_extra)
    n = max(1, round(frac * nblocks))  # 1 .. the whole pool (a full pool lets a run cross from K into V)
    sb = BlockAllocator(src.nblocks, seed).allocate(n, spec)
    db = BlockAllocator(dst.nblocks, seed + 1).allocate(n, dst_spec or spec)
    if sb is None or db is None:  # fragmented:<run> may not find enough whole runs
        return
    if last is not None:
        last = min(last, block_bytes)  # a partial (or full) last block, as plan() passes it
    lay = [layers - 1, 0] if sub else None
    fast = coalesced_descs(src, dst, sb, db, last, lay)
    assert_same(fast, reference_coalesced(src, dst, sb, db, last, lay))
    # allocator block tables always take the block-table path, never the fallback
    assert _layer0_coalesced(src, dst, sb, db, last) is not None


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(LAYOUT_KINDS), dst_kind=st.sampled_from(LAYOUT_KINDS), block_bytes=st.integers(1, 16),
       data=st.data(), last=st.one_of(st.none(), st.integers(0, 40)))
def test_any_block_tables_match_sorting_coalesce(kind, dst_kind, block_bytes, data, last):
    # arbitrary ids: repeats, ids past the pool, runs in any order, lengths that are not the block size;
    # where the order would not follow from the ids, coalesced_descs falls back to coalesce
    src = Layout(kind, 3, 1 if kind == "mla" else 2, block_bytes, 6)
    dst = Layout(dst_kind, 3, src.regions, block_bytes, 5)
    n = data.draw(st.integers(0, 14))
    sb = np.array(data.draw(st.lists(st.integers(-1, 7), min_size=n, max_size=n)), dtype=np.int64)
    db = np.array(data.draw(st.lists(st.integers(-1, 7), min_size=n, max_size=n)), dtype=np.int64)
    assert_same(coalesced_descs(src, dst, sb, db, last), reference_coalesced(src, dst, sb, db, last))


@pytest.mark.parametrize("kind,expected", [("layer-major", 1), ("mla", 1), ("block-major", 1)])
def test_whole_pool_contiguous_runs_across_regions(kind, expected):
    lay = make_layout(kind, layers=3, block_bytes=16, nblocks=10)
    ids = np.arange(10)
    fast = coalesced_descs(lay, lay, ids, ids)
    assert_same(fast, reference_coalesced(lay, lay, ids, ids))
    # layer-major: the last K block ends where the first V block starts, on both sides
    assert [len(d) for d in fast] == [expected] * 3
    assert [d.tolist() for d in fast] == [[[i * 320, i * 320, 320]] for i in range(3)] if kind != "mla" else True


def test_out_of_order_neighbours_merge_like_the_sort():
    # request order 5, 3, 4 -> 12, 10, 11: adjacent after sorting by source, so one run per region
    lay = make_layout("layer-major", layers=2, block_bytes=8, nblocks=24)
    sb, db = np.array([5, 3, 4]), np.array([12, 10, 11])
    fast = coalesced_descs(lay, lay, sb, db, 5)
    assert_same(fast, reference_coalesced(lay, lay, sb, db, 5))
    # the partial last block (4, last in request order) ends its run: K [3, 4 short] + [5], V the same
    assert fast[0].tolist() == [[24, 80, 13], [40, 96, 8], [216, 272, 13], [232, 288, 8]]


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


@pytest.mark.launches
def test_descriptor_benchmark_runs_and_both_paths_agree():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "descriptors.py"), "--tokens", "1000", "-r", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical outputs, old and new: yes" in r.stdout
    assert sum(1 for ln in r.stdout.splitlines() if ln.split()[2:3] in (["old"], ["new"])) == 10
