"""The CUDA driver door (kvbench/memory/driver.py) and the copy engines' CUDA paths, held to the driver's rules by
tests/fakes/cuda_driver.py: batched copies refuse the legacy NULL stream, a fresh thread has no context, dma-buf
handles cover whole pages.  The fake's memory is CPU tensors, so the bytes really move."""
import os
import sys
import threading
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fakes import cuda_driver  # noqa: E402

from kvbench.memory import copy as C  # noqa: E402
from kvbench.memory import driver  # noqa: E402


def _pair(fake, n=1 << 16):
    src, dst = fake.alloc(n), fake.alloc(n)
    src.t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    descs = np.array([[0, 4096, 1000], [8192, 0, 4096], [20000, 30000, 333]], np.int64)
    return src, dst, descs


def _expect(src, dst, descs):
    s, d = src.t.numpy(), dst.t.numpy()
    for a, b, n in descs:
        assert (d[b:b + n] == s[a:a + n]).all()


@pytest.mark.parametrize("version", [13000, 12080])
def test_batch_copy_never_hands_the_driver_the_legacy_stream(monkeypatch, version):
    """copy=batch with no stream (and with torch's default stream, handle 0) goes on a created stream."""
    fake = cuda_driver.install(monkeypatch, version=version)
    src, dst, descs = _pair(fake)
    C.copy("batch", dst, src, descs)
    C.copy("batch", dst, src, descs, stream=types.SimpleNamespace(cuda_stream=0))
    C.sync(dst)
    _expect(src, dst, descs)
    streams = [s for name, _, s in fake.calls if name == "cuMemcpyBatchAsync"]
    assert len(streams) == 2 and all(s not in (None, 0, 1) for s in streams)


def test_the_fake_refuses_the_legacy_stream_as_the_driver_does(monkeypatch):
    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    driver.ensure_context(0)
    fn, _ = driver.batch_fn()
    P = lambda a: a.ctypes.data  # noqa: E731
    d, s, z = (descs[:, 1] + dst.data_ptr()).astype(np.uint64), (descs[:, 0] + src.data_ptr()).astype(np.uint64), \
        descs[:, 2].astype(np.uint64)
    attr, idx = driver.memcpy_attributes(0, 0), np.zeros(1, np.uint64)
    assert fn(P(d), P(s), P(z), 3, attr.getPtr(), P(idx), 1, None) == 1  # CUDA_ERROR_INVALID_VALUE


@pytest.mark.parametrize("engine", ["memcpy", "batch"])
def test_a_fresh_thread_binds_the_context_before_its_driver_calls(monkeypatch, engine):
    """staged's worker threads copy from threads of their own: each binds the primary context first (no 201)."""
    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    errors = []

    def work():
        try:
            C.copy(engine, dst, src, descs)
            C.sync(dst)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errors, errors
    _expect(src, dst, descs)


def test_a_fresh_thread_without_a_context_gets_201_from_the_fake(monkeypatch):
    fake = cuda_driver.install(monkeypatch)
    out = []
    th = threading.Thread(target=lambda: out.append(fake.cuStreamCreate(0)[0]))
    th.start()
    th.join()
    assert out == [201]


def test_staged_threads_copy_through_the_driver_with_a_context(monkeypatch):
    """StagedTransport._copy, the gather/scatter its worker threads run, on (fake) CUDA memory from a new thread."""
    from kvbench.transports.staged import StagedTransport

    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    t = StagedTransport.__new__(StagedTransport)
    t.engine, t.dev, t.btensor = "batch", src, dst
    errors = []
    th = threading.Thread(target=lambda: _catch(errors, t._copy, descs, True))
    th.start()
    th.join()
    assert not errors, errors
    _expect(src, dst, descs)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


def test_dmabuf_handles_need_whole_pages(monkeypatch):
    fake = cuda_driver.install(monkeypatch)
    buf = fake.alloc(1 << 16)
    base = buf.data_ptr() + (-buf.data_ptr()) % 4096
    with pytest.raises(driver.DriverError, match="multiples of 4096"):
        driver.dmabuf_fd(base + 512, 4096, 0)
    fd = driver.dmabuf_fd(base, 8192, 0)
    assert fd >= 0
    os.close(fd)  # the fake opens a real descriptor, as the driver does


def test_kernel_engine_uploads_descriptors_once_per_array(monkeypatch):
    """The kernel engine's descriptor array goes to the device once per prepared request, not on every post."""
    fake = cuda_driver.install(monkeypatch)
    uploads = []

    class Kernel:
        def __call__(self, grid, block, args):
            dst, src, d, n = args
            for s, o, ln in np.asarray(d)[: int(n)]:
                import ctypes

                ctypes.memmove(int(dst) + int(o), int(src) + int(s), int(ln))

    class Ctx:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cupy = types.SimpleNamespace(asarray=lambda a: uploads.append(a) or np.array(a), uint64=int, RawKernel=None,
                                 cuda=types.SimpleNamespace(Device=Ctx, ExternalStream=Ctx))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(C, "_kernel", lambda: Kernel())
    src, dst, descs = _pair(fake)
    for _ in range(3):
        C.copy("kernel", dst, src, descs)
    _expect(src, dst, descs)
    assert len(uploads) == 1


def test_device_count_and_pci_bus_id_through_the_door(monkeypatch):
    cuda_driver.install(monkeypatch, devices=2, bus_ids=["0000:1b:00.0", "0000:9A:00.0"])
    assert driver.device_count() == 2
    assert driver.pci_bus_id(1) == "0000:9a:00.0"


def test_no_driver_here_is_one_line():
    if driver.reason() is None:
        pytest.skip("a CUDA driver is present")
    assert driver.reason() == "no CUDA driver (libcuda.so.1 does not load)"
    assert driver.device_count() == 0


def test_the_names_the_door_calls_exist_in_the_real_bindings():
    """driver.py against NVIDIA's cuda-bindings (installed here without a GPU): every call and type it uses."""
    real = pytest.importorskip("cuda.bindings.driver")
    for name in ("cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                 "cuCtxSetCurrent", "cuStreamCreate", "cuStreamSynchronize", "cuGetProcAddress",
                 "cuDeviceGetPCIBusId", "cuMemGetHandleForAddressRange", "CUmemcpyAttributes", "CUmemLocation",
                 "CUstream", "CUmemcpySrcAccessOrder", "CUmemLocationType", "CUmemRangeHandleType"):
        assert hasattr(real, name), name
    a = real.CUmemcpyAttributes()
    assert {"srcAccessOrder", "srcLocHint", "dstLocHint", "flags"} <= set(dir(a)) and a.getPtr()
    assert int(real.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) == 1
    assert int(real.CUresult.CUDA_ERROR_INVALID_CONTEXT) == driver.INVALID_CONTEXT


def test_the_batch_attributes_build_with_the_real_bindings(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(driver, "_API", real)
    a = driver.memcpy_attributes(0, None)
    assert int(a.srcAccessOrder) == 1 and int(a.srcLocHint.type) == 1 and int(a.dstLocHint.type) == 2
