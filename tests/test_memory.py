import os

import numpy as np
import pytest

from kvbench import _native, memory


def test_pool_is_page_aligned():
    a = memory.alloc_host(10_000)
    assert a.__array_interface__["data"][0] % memory.PAGE == 0
    assert a.nbytes == 10_000


def test_fill_is_rank_specific_and_verifies():
    src = memory.alloc_host(1 << 16)
    memory.fill(src, rank=3)
    other = memory.alloc_host(1 << 16)
    memory.fill(other, rank=4)
    assert not np.array_equal(src, other)
    assert np.array_equal(src[100:300], memory.expected_bytes(3, 100, 200))


def test_count_wrong_counts_elements_and_catches_one_byte():
    src = memory.alloc_host(1 << 16)
    dst = memory.alloc_host(1 << 16)
    memory.fill(src, rank=0)
    descs = np.array([[0, 4096, 1024], [8192, 0, 512]], dtype=np.int64)
    memory.poison(dst, descs, 1)
    assert memory.count_wrong(dst, descs, 0, 2) == 768  # everything poisoned: 1536 B of fp16
    _native.copy_batch(dst, src, descs)
    assert memory.count_wrong(dst, descs, 0, 2) == 0
    dst[4096 + 7] ^= 1
    assert memory.count_wrong(dst, descs, 0, 2) == 1
    assert memory.count_wrong(dst, descs, 1, 2) > 0  # data from the wrong rank is caught


def test_native_copy_batch_bounds_checked():
    a = memory.alloc_host(4096)
    b = memory.alloc_host(4096)
    with pytest.raises(ValueError, match="outside the destination"):
        _native.copy_batch(b, a, np.array([[0, 4000, 200]], dtype=np.int64))
    with pytest.raises(ValueError, match="int64"):
        _native.copy_batch(b, a, np.array([[0, 0, 1]], dtype=np.int32))


def test_native_unlike_flags_each_range_holding_another_byte():
    # the workload's grant check: granted blocks must still hold poison; one byte anywhere in a range flags it
    pool = np.full(64 * 4096 + 100, memory.POISON, np.uint8)
    d = np.zeros((65, 3), np.int64)
    d[:64, 1], d[:, 2] = np.arange(64) * 4096, 4096
    d[64] = [0, 64 * 4096, 100]  # a short last range, past the 4 KiB reference
    flags = np.zeros(65, np.uint8)
    assert _native.unlike(pool, d, 1, memory.POISON, flags) == 0 and not flags.any()
    for at in (5 * 4096, 7 * 4096 + 4095, 64 * 4096 + 99):  # a range's first byte, its last, the short one's last
        pool[at] ^= 1
    assert _native.unlike(pool, d, 1, memory.POISON, flags) == 3 and np.flatnonzero(flags).tolist() == [5, 7, 64]
    assert _native.unlike(pool, d[:5], 1, memory.POISON) == 0  # ranges end where they say
    with pytest.raises(ValueError, match="one byte per row"):
        _native.unlike(pool, d, 1, memory.POISON, np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="outside the pool"):
        _native.unlike(pool, np.array([[0, len(pool) - 10, 11]], np.int64), 1, memory.POISON)


# ----- page sizes ---------------------------------------------------------------------------------------------
THP_OFF = memory.thp_mode() in (None, "never")
THP_WHY = f"transparent huge pages are {memory.thp_mode() or 'not built'} here (enabled: madvise or always needed)"


def test_unknown_page_kind_is_refused():
    with pytest.raises(ValueError, match="4k, thp, huge"):
        memory.alloc_host(4096, pages="2m")


def test_4k_pool_reports_no_huge_pages():
    a = memory.alloc_host(8 << 20, pages="4k")
    rep = memory.page_report(a)
    assert rep["bytes"] == 8 << 20 and rep["kernel_page_size"] == memory.PAGE
    assert rep["huge_share"] < 0.01 and rep["huge_bytes"] < 64 << 10  # MADV_NOHUGEPAGE: 4 KiB even under 'always'
    assert memory.page_summary(rep) == "4 KiB pages"


@pytest.mark.skipif(THP_OFF, reason=THP_WHY)
def test_thp_pool_is_aligned_and_backed_by_huge_pages():
    a = memory.alloc_host((16 << 20) + 12344, pages="thp")
    assert a.__array_interface__["data"][0] % memory.thp_size() == 0 and a.nbytes == (16 << 20) + 12344
    rep = memory.page_report(a)
    assert rep["huge_share"] > 0, rep  # the kernel may leave part on 4 KiB pages when memory is fragmented
    assert rep["thp_eligible"] is not False
    memory.fill(a, 5)  # the pattern does not depend on the pages
    assert np.array_equal(a[-300:], memory.expected_bytes(5, a.nbytes - 300, 300))


def test_page_report_of_a_slice_counts_only_its_own_bytes():
    a = memory.alloc_host(4 << 20)
    rep = memory.page_report(a[memory.PAGE : 2 * memory.PAGE])
    assert rep["bytes"] == memory.PAGE and 0 <= rep["huge_bytes"] <= memory.PAGE


def _overcommit() -> int:
    try:
        with open("/proc/sys/vm/nr_overcommit_hugepages") as fh:
            return int(fh.read())
    except OSError:
        return 0


def test_huge_pool_when_the_kernel_has_pages():
    hp = memory.hugepage_size()
    if memory.hugepages_free_bytes() < 2 * hp:
        pytest.skip(f"HugePages_Free is {memory.hugepages_free_bytes() // hp} (sysctl vm.nr_hugepages=N reserves)")
    a = memory.alloc_host(hp + 1, pages="huge")
    rep = memory.page_report(a)
    assert rep["kernel_page_size"] == hp and rep["huge_share"] == 1.0
    assert memory.page_summary(rep) == f"hugetlb {hp >> 10} KiB"


def test_huge_pool_larger_than_the_kernels_pool_is_a_clear_error():
    if _overcommit():
        pytest.skip("vm.nr_overcommit_hugepages > 0: the kernel may grow its pool instead of failing")
    hp = memory.hugepage_size()
    need = memory.hugepages_free_bytes() // hp + 3
    with pytest.raises(memory.PagesError) as e:
        memory.alloc_host(need * hp, pages="huge")
    line = str(e.value)
    assert "\n" not in line and f"needs {need} huge pages" in line
    assert "HugePages_Free" in line and "HugePages_Total" in line
    assert "sysctl vm.nr_hugepages=" in line and "/proc/sys/vm/nr_hugepages" in line and "hugepages=" in line


def test_huge_error_names_the_pages_to_reserve(monkeypatch):
    from kvbench.memory import host

    mi = {"HugePages_Total": 4, "HugePages_Free": 1, "HugePages_Rsvd": 0, "Hugepagesize": 2 << 20}
    monkeypatch.setattr(host, "meminfo", lambda: mi)
    monkeypatch.setattr(host.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(12, "Cannot allocate memory")))
    with pytest.raises(memory.PagesError, match=r"needs 3 huge pages of 2048 KiB .* HugePages_Free 1 of "
                                                r"HugePages_Total 4 .*vm.nr_hugepages=6"):
        memory.alloc_host(5 << 20, pages="huge")
    assert memory.hugepages_free_bytes() == 2 << 20


# ----- pools transports allocate ------------------------------------------------------------------------------
def _shm_pair(pages: str):
    from kvbench.model.layout import Pool
    from kvbench.transports.base import Context
    from kvbench.transports.shm import ShmTransport

    ts = [ShmTransport(Context(r, 2, "h", f"pages{os.getpid()}", pages=pages)) for r in (0, 1)]
    pools = []
    for t in ts:
        b = t.alloc(8 << 20)
        pools.append(Pool(b.array, "host", b.release))
    metas = [t.register(p) for t, p in zip(ts, pools)]
    ts[0].connect({1: metas[1]})
    ts[1].connect({0: metas[0]})
    for t in ts:
        t.ready()
    return ts, pools


@pytest.mark.parametrize("pages", memory.PAGE_KINDS)
def test_shm_segment_says_what_pages_it_got(pages):
    from kvbench.job import cleanup

    ts, pools = _shm_pair(pages)
    try:
        rep = ts[0].pages(pools[0])
        policy = memory.tmpfs_huge(cleanup.SHM_DIR)
        assert rep["tmpfs_huge"] == policy and rep["bytes"] == 8 << 20 and set(rep["peer_huge_share"]) == {1}
        if pages == "huge":  # hugetlb does not live on tmpfs: the page size is the segment's own, and it says so
            assert rep["applied"] == "own" and "hugetlb" in rep["note"]
        else:
            assert rep["applied"] == pages
        if pages != "thp" and policy in (None, "never", "advise"):  # (huge=always: fallocate takes huge pages)
            assert rep["huge_share"] == 0 and rep["peer_huge_share"][1] == 0
        if pages == "thp":  # aligned mappings and MADV_COLLAPSE: huge pages even on a huge=never mount (6.1+)
            assert rep["huge_share"] > 0 and rep["peer_huge_share"][1] > 0 or "MADV_COLLAPSE refused" in rep["note"]
        a, b = pools[0].array, ts[1].peers[0]  # one segment, two mappings
        a[-5:] = 7
        assert np.array_equal(b[-5:], a[-5:])
    finally:
        for t, p in zip(ts, pools):
            t.close()
            p.release()
