import numpy as np

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
    import pytest

    with pytest.raises(ValueError, match="outside the destination"):
        _native.copy_batch(b, a, np.array([[0, 4000, 200]], dtype=np.int64))
    with pytest.raises(ValueError, match="int64"):
        _native.copy_batch(b, a, np.array([[0, 0, 1]], dtype=np.int32))
