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
    """The kernel engine's tiles go to the device once per prepared request, not on every post (cupy path)."""
    cuda_driver.install(monkeypatch)
    monkeypatch.delattr(cuda_driver.FakeDriver, "launch_kv_copy")  # the cupy path, with cupy faked below
    uploads, grids = [], []

    class Kernel:
        def __call__(self, grid, block, args):
            dst, src, d, n = args
            grids.append(grid)
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
    fake = cuda_driver.FakeDriver()
    src, dst = fake.alloc(1 << 20), fake.alloc(1 << 20)
    src.t.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    descs = np.array([[0, 4096, 1000], [8192, 0, 4096], [100000, 300000, 200000]], np.int64)
    for _ in range(3):
        C.copy("kernel", dst, src, descs)
    _expect(src, dst, descs)
    assert len(uploads) == 1
    assert grids == [(2 + 7,)] * 3  # 200000 bytes are 7 tiles of at most 32 KiB: 7 CTAs, not 1


def test_the_kernel_spreads_a_large_descriptor_over_many_ctas():
    """One CTA per descriptor copied a 16 MiB bulk descriptor with 256 threads; tiles of TILE bytes spread it."""
    descs = np.array([[0, 1 << 24, 1 << 24], [1 << 25, 5, 100]], np.int64)
    t = C.tiles(descs)
    assert len(t) == (1 << 24) // C.TILE + 1 and t[:, 2].max() <= C.TILE
    assert int(t[:, 2].sum()) == int(descs[:, 2].sum())
    assert (t[1:-1, 0] - t[:-2, 0] == C.TILE).all() and (t[:-1, 1] - t[:-1, 0] == (1 << 24)).all()
    assert t.flags["C_CONTIGUOUS"] and t.dtype == np.int64


@pytest.mark.parametrize("engine", ["memcpy", "kernel", "batch"])
def test_copied_bytes_are_there_only_after_their_stream_syncs(monkeypatch, engine):
    """The fake's streams complete in their own time: a read before the copy stream's sync sees the old bytes."""
    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    C.copy(engine, dst, src, descs)
    assert fake.pending() >= 1 and not dst.t.any()  # queued, not done
    C.sync(dst)
    assert fake.pending() == 0
    _expect(src, dst, descs)


def test_events_on_another_stream_bracket_nothing(monkeypatch):
    """Timing copies with events on a stream that does not carry them measures nothing (0 s of device time);
    C.Timer on the copy stream measures the copies (the fake's clock: bytes / rate + a call's overhead)."""
    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    driver.ensure_context(0)
    other = int(fake.cuStreamCreate(0)[1])
    wrong = C.Timer(0, stream=other)
    wrong.start()
    C.copy("memcpy", dst, src, descs)
    assert wrong.stop() == 0.0
    right = C.Timer(0)
    right.start()
    C.copy("memcpy", dst, src, descs)
    s = right.stop()
    n = int(descs[:, 2].sum())
    assert s == pytest.approx(3 * fake.overhead + n / fake.rate) and s > 0
    assert not fake.pending()  # the stop event's sync completed the copies before it


def test_a_copy_goes_on_the_initiators_device_not_the_peer_buffers(monkeypatch):
    """Two GPUs: a kernel push from device 0 into device 1's buffer launches on device 0's stream (a launch on a
    stream of another device fails, as CUDA's guide says); memcpy and batch keep device 0 bound to the thread."""
    fake = cuda_driver.install(monkeypatch, devices=2)
    n = 1 << 16
    src, dst = fake.alloc(n, dev=0), fake.alloc(n, dev=1)
    src.t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    descs = np.array([[0, 4096, 1000], [8192, 0, 4096]], np.int64)
    for engine in ("kernel", "memcpy", "batch"):
        dst.t.zero_()
        C.copy(engine, dst, src, descs, device=0)
        assert driver._state.local.dev == 0
        C.sync(dst, device=0)
        _expect(src, dst, descs)
    launches = [c for c in fake.calls if c[0] == "launch_kv_copy"]
    assert launches and all(fake.queues[c[2]].dev == 0 for c in launches)
    # the rule the fake holds: device 1's buffer as the initiator on device 0's stream is refused
    with pytest.raises(C.CopyError, match="launch failed"):
        C.copy("kernel", dst, src, descs, stream=driver.stream(0), device=1)


def test_batch_variants_set_the_drivers_flags_and_build_once(monkeypatch):
    fake = cuda_driver.install(monkeypatch)
    src, dst, descs = _pair(fake)
    for engine in ("batch", "batch-overlap", "batch-any", "batch"):
        C.copy(engine, dst, src, descs)
    C.sync(dst)
    _expect(src, dst, descs)
    assert fake.batches == [(3, 1, 0), (3, 1, 1), (3, 3, 0), (3, 1, 0)]  # (count, srcAccessOrder, flags)
    made = {k for k in C._prepared[id(descs)][1] if k[0] == "batch"}
    assert len(made) == 3  # one set of arrays and attributes per engine, reused by the second "batch"


def test_auto_takes_the_kernel_between_gpus_and_batch_across_pcie():
    assert C.default("cuda_ipc", "cuda")[0] == "kernel" and "nccl#1932" in C.default("cuda_ipc", "cuda")[1]
    assert C.default("staged", "cuda")[0] == "batch" and "host <-> device" in C.default("staged", "cuda")[1]
    assert C.default("shm", "host")[0] == "batch"


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
                 "cuCtxSetCurrent", "cuStreamCreate", "cuStreamSynchronize", "cuGetProcAddress", "cuEventCreate",
                 "cuEventRecord", "cuEventSynchronize", "cuEventElapsedTime", "cuStreamWaitEvent", "cuEventDestroy",
                 "cuMemHostRegister", "cuMemHostUnregister",
                 "cuDeviceGetPCIBusId", "cuMemGetHandleForAddressRange", "CUmemcpyAttributes", "CUmemLocation",
                 "CUstream", "CUmemcpySrcAccessOrder", "CUmemLocationType", "CUmemRangeHandleType"):
        assert hasattr(real, name), name
    a = real.CUmemcpyAttributes()
    assert {"srcAccessOrder", "srcLocHint", "dstLocHint", "flags"} <= set(dir(a)) and a.getPtr()
    assert int(real.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) == 1
    assert int(real.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY) == 3
    assert int(real.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE) == 1
    assert int(real.CUresult.CUDA_ERROR_INVALID_CONTEXT) == driver.INVALID_CONTEXT


def test_the_batch_attributes_build_with_the_real_bindings(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(driver, "_API", real)
    a = driver.memcpy_attributes(0, None)
    assert int(a.srcAccessOrder) == 1 and int(a.srcLocHint.type) == 1 and int(a.dstLocHint.type) == 2
    b = driver.memcpy_attributes(0, 0, any_order=True, overlap=True)
    assert int(b.srcAccessOrder) == 3 and int(b.flags) == 1


def test_pinned_pools_page_lock_their_own_mapping_and_unlock_it_on_release(monkeypatch):
    """--memory pinned: the pool's own page-aligned mapping (so --pages applies), registered in place with the
    driver, not torch's caching host allocator (which rounds each allocation up to a power of two)."""
    from kvbench.memory import device

    fake = cuda_driver.install(monkeypatch)
    monkeypatch.setattr(device, "probe", lambda kind: None)
    n = 3 << 20  # not a power of two: the registered range is the pool, not a rounded block
    pool = device.alloc(n, "pinned")
    assert pool.addr % 4096 == 0 and fake.registered == {pool.addr: pool.addr + n}
    assert pool.tensor.device.type == "cpu" and pool.array is not None and pool.array.nbytes == n
    pool.release()
    assert fake.registered == {}
    with pytest.raises(driver.DriverError, match="713"):
        driver.host_unregister(pool.addr or 4096)  # the fake holds the driver's rule: only a registered start


def test_copy_auto_resolves_per_case_and_the_preamble_says_why():
    """--copy auto (the default): the case's engine follows the pair of memories its transport copies between."""
    from kvbench.config import suite as S
    from kvbench.memory.copy import preamble_lines as copy_lines

    s = S.validate({"name": "t", "axes": {"transport": ["cuda_ipc", "staged", "tcp"], "memory": ["cuda", "host"]}})
    got = {(c["transport"], c["memory"]): c["copy"] for c in S.expand(s)}
    assert got[("cuda_ipc", "cuda")] == "kernel" and got[("staged", "cuda")] == "batch"
    assert got[("tcp", "host")] == "batch"
    lines = copy_lines(s)
    assert "# copy auto: cuda_ipc on cuda pools -> kernel (device to device" in lines[0]
    assert any(x.startswith("# copy auto: staged on cuda pools -> batch (host <-> device") for x in lines)
    fixed = S.validate({"name": "t", "axes": {"transport": ["cuda_ipc"], "memory": ["cuda"], "copy": ["memcpy"]}})
    assert [c["copy"] for c in S.expand(fixed)] == ["memcpy"] and copy_lines(fixed) == []
