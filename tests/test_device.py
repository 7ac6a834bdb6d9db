"""The device layer on torch CPU tensors: pools, the fill pattern and the check computed with torch ops, held to
the bytes of the host code (memory/pattern.py, verify.py); the copy engines on descriptor arrays."""
import ctypes

import numpy as np
import pytest
from helpers.asserts import device_matches_host

torch = pytest.importorskip("torch")

from kvbench import _native, memory  # noqa: E402
from kvbench.memory import copy as C  # noqa: E402
from kvbench.memory import device as D  # noqa: E402
from kvbench.memory import driver, verify  # noqa: E402

# source ranges (upper half) apart from destination ranges (lower half): one buffer plays both in these tests
DESCS = np.array([[500000, 8192, 1000], [505003, 100, 777], [570001, 300000, 4096], [631072, 40960, 32768]], np.int64)


def pools(n=(1 << 20) + 3, rank=3):
    host = memory.alloc_host(n)
    memory.fill(host, rank)
    dev = D.alloc(n, "torch-cpu")
    D.fill(dev.tensor, rank)
    return host, dev


def test_torch_cpu_pool_is_page_aligned_and_filled_like_a_host_pool():
    host, dev = pools()
    assert dev.addr % memory.PAGE == 0 and dev.nbytes == host.nbytes
    assert np.array_equal(host, dev.array)  # the tensor's fill, seen through its numpy view
    assert dev.array[-3:].tolist() == [memory.POISON] * 3


def test_the_check_on_the_device_matches_verify_byte_for_byte_and_catches_a_flipped_byte():
    host, dev = pools()
    a, t = host.copy(), dev.tensor.clone()
    device_matches_host(a, t, DESCS, 3, 7, writer=5)
    ca, wa = verify.snapshot(a, [DESCS[:2], DESCS[2:]])
    ct, wt = D.snapshot(t, [DESCS[:2], DESCS[2:]])
    assert np.array_equal(ca, ct.numpy()) and np.array_equal(wa, wt)
    # poisoned ranges: every element is wrong (fp16: 2-byte elements; 777 B is counted per byte)
    want = 1000 // 2 + 777 + 4096 // 2 + 32768 // 2
    assert verify.count_wrong(ca, wa, 3, 2, 7) == D.count_wrong(ct, wt, 3, 2, 7) == want
    # the destination gets what the source holds in epoch 7: nothing wrong, then one flipped byte
    good = np.concatenate([verify.expected(3, s, n, 7) for s, _, n in DESCS.tolist()])
    copy = torch.from_numpy(good.copy())
    assert D.count_wrong(copy, wt, 3, 2, 7) == 0
    copy[5000] ^= 0x01
    assert D.count_wrong(copy, wt, 3, 2, 7) == 1 == verify.count_wrong(copy.numpy(), wa, 3, 2, 7)


def test_cuda_and_pinned_say_why_they_are_unavailable_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert D.probe("cuda") == "no CUDA device (no CUDA driver: libcuda.so.1 does not load)"
    assert D.probe("pinned").startswith("page-locked host memory needs a CUDA device (no CUDA driver")
    assert D.probe("torch-cpu") is None and D.probe("host") is None
    with pytest.raises(D.DeviceMemoryError, match="--memory cuda: no CUDA device"):
        D.alloc(4096, "cuda")


def test_a_pool_larger_than_free_memory_is_refused_before_allocating_with_the_numbers():
    with pytest.raises(D.DeviceMemoryError) as e:
        D.alloc(1 << 50, "torch-cpu")
    msg = str(e.value)
    assert "a pool of 1048576.00 GiB does not fit: host memory has" in msg and "GiB free of" in msg
    assert "\n" not in msg


def blocks(n=300, bb=32768, pool=64 << 20, seed=0):
    rng = np.random.default_rng(seed)
    nb = pool // bb - 1
    d = np.stack([rng.permutation(nb)[:n] * bb, rng.permutation(nb)[:n] * bb, np.full(n, bb)], 1).astype(np.int64)
    d[-1, 2] = 1000  # a request's short last block
    d[0] = [nb * bb + 3, nb * bb + 7, 11]  # unaligned offsets and length, in the spare block
    return d


@pytest.mark.parametrize("engine", C.ENGINES)
def test_every_copy_engine_moves_exactly_the_described_bytes(engine):
    src = D.alloc(64 << 20, "torch-cpu")
    D.fill(src.tensor, 1)
    dst = D.alloc(64 << 20, "torch-cpu")
    d = blocks()
    C.copy(engine, dst.tensor, src.tensor, d)
    C.sync(dst.tensor)
    moved = np.zeros(dst.nbytes, bool)
    for s, t, n in d.tolist():
        assert np.array_equal(dst.array[t : t + n], src.array[s : s + n])
        moved[t : t + n] = True
    assert not dst.array[~moved].any()  # nothing else was written
    with pytest.raises(C.CopyError, match="outside"):
        C.copy(engine, dst.tensor, src.tensor, np.array([[64 << 20, 0, 1]], np.int64))


def test_the_per_descriptor_driver_loop_calls_the_function_once_per_row_and_stops_at_an_error():
    """_native.call_copies is how memcpy runs one cuMemcpyAsync per descriptor on a GPU; here a function of the
    same signature (a ctypes callback) stands in for the driver."""
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    d = np.array([[0, 100, 10], [50, 0, 20], [200, 3000, 5], [0, 0, 1]], np.int64)
    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    def fake(dp, sp, n, stream):
        calls.append(stream)
        ctypes.memmove(dp, sp, n)
        return 0 if len(calls) < 3 else 700  # the third call fails (CUDA_ERROR_ILLEGAL_ADDRESS)

    fn = ctypes.cast(fake, ctypes.c_void_p).value
    assert _native.call_copies(fn, dst.ctypes.data, src.ctypes.data, d, 42) == (700, 2)
    assert calls == [42, 42, 42]
    assert np.array_equal(dst[100:110], src[0:10]) and np.array_equal(dst[0:20], src[50:70])


def test_device_engines_say_why_they_cannot_run_without_a_driver():
    if driver.reason() is None:
        pytest.skip("a CUDA driver is present")
    for e in C.ENGINES:
        assert C.probe(e, "cuda") == "no CUDA driver (libcuda.so.1 does not load)"
        assert C.probe(e, "cpu") is None
    assert C.probe("dma", "cpu").startswith("copy engine 'dma' is not one of")
