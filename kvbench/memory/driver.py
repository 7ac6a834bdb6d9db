"""The one door to the CUDA driver: NVIDIA's cuda-bindings (``cuda.bindings.driver``), a context per thread,
a real stream per thread, and the raw entry points the copy engines call once per descriptor array.

The rules kept here are the driver's, not ours: a fresh thread has no current context (driver calls return
CUDA_ERROR_INVALID_CONTEXT, 201) until it binds one, so every thread that calls the driver first calls
``ensure_context``; ``cuMemcpyBatchAsync`` refuses the legacy NULL stream, so copies go on ``stream()``, a stream
created here (blocking: ordered after the legacy stream's work, as torch's default-stream writes are); a dma-buf
handle covers whole pages.  Typed calls go through the bindings; the two calls made per descriptor array
(cuMemcpyAsync from C, one per row; cuMemcpyBatchAsync with the rows' arrays) take the driver's entry point by
``cuGetProcAddress`` for the ABI of the driver's CUDA version, because the typed binding wants a Python object
per copy.  tests/fakes/cuda_driver.py stands in for the bindings where no GPU is.
"""
from __future__ import annotations

import ctypes
import threading

SUCCESS = 0
INVALID_CONTEXT = 201
PAGE = 4096  # cuMemGetHandleForAddressRange: a dma-buf covers whole host pages
_API = None  # the bindings module (tests put their fake here)
_lock = threading.Lock()


class _State:
    """What this process learnt about the driver: it does not come or go within a process."""

    def __init__(self):
        self.reason: list = []  # reason()'s answer, once asked
        self.primary: dict[int, object] = {}  # device -> its retained primary context
        self.local = threading.local()  # per thread: the bound device, its copy streams
        self.batch = None  # batch_fn()'s answer
        self.memcpy = 0  # cuMemcpyAsync's address


_state = _State()


class DriverError(RuntimeError):
    """A driver call failed (one line: the call and its CUresult)."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed with CUresult {code}")
        self.code = code


def api():
    """``cuda.bindings.driver`` (or the tests' fake); DriverError when it cannot be imported."""
    global _API
    if _API is None:
        try:
            from cuda.bindings import driver as d
        except ImportError:
            raise DriverError("import cuda.bindings (pip install cuda-bindings, or 'kvbench[gpu]')", -1) from None
        _API = d
    return _API


def call(what: str, res):
    """The values after a bindings call's CUresult; DriverError when it is not success."""
    rc, *out = res if isinstance(res, tuple) else (res,)
    if int(rc) != SUCCESS:
        raise DriverError(what, int(rc))
    return out[0] if len(out) == 1 else tuple(out)


def reason() -> str | None:
    """Why the driver cannot be called here (one line), or None."""
    got = _state.reason
    if not got:
        try:
            if _API is None:
                ctypes.CDLL("libcuda.so.1")  # the bindings load it too, with a longer story when it is missing
            call("cuInit", api().cuInit(0))
            got.append(None)
        except OSError:
            got.append("no CUDA driver (libcuda.so.1 does not load)")
        except DriverError as exc:
            got.append(str(exc))
    return got[0]


def reset() -> None:
    """Forget what was learnt about the driver (tests: after putting a fake in ``_API``)."""
    global _state
    _state = _State()


def version() -> int:
    """The driver's CUDA version as 1000 * major + 10 * minor."""
    return int(call("cuDriverGetVersion", api().cuDriverGetVersion()))


def device_count() -> int:
    """GPUs this process sees; 0 where no driver is."""
    if reason() is not None:
        return 0
    return int(call("cuDeviceGetCount", api().cuDeviceGetCount()))


def ensure_context(dev: int) -> None:
    """Bind ``dev``'s primary context (the one torch and cupy use) to the calling thread, once per thread."""
    st = _state
    if getattr(st.local, "dev", None) == dev:
        return
    d = api()
    with _lock:
        if dev not in st.primary:
            call("cuInit", d.cuInit(0))
            st.primary[dev] = call("cuDevicePrimaryCtxRetain",
                                   d.cuDevicePrimaryCtxRetain(call("cuDeviceGet", d.cuDeviceGet(dev))))
    call("cuCtxSetCurrent", d.cuCtxSetCurrent(st.primary[dev]))
    st.local.dev = dev


def stream(dev: int) -> int:
    """This thread's copy stream on ``dev`` (created once): never the legacy NULL stream."""
    streams = _state.local.__dict__.setdefault("streams", {})
    ensure_context(dev)
    if dev not in streams:
        streams[dev] = call("cuStreamCreate", api().cuStreamCreate(0))  # 0: blocking, ordered after legacy work
    return int(streams[dev])


def synchronize(handle: int) -> None:
    d = api()
    call("cuStreamSynchronize", d.cuStreamSynchronize(d.CUstream(handle)))


def host_register(ptr: int, nbytes: int, dev: int) -> None:
    """Page-lock ``nbytes`` of host memory already mapped at ``ptr`` for every context (portable): the copy engines
    then read it by DMA, and its pages stay the mapping's own (huge pages where --pages asked for them), which a
    pinned allocation from torch's caching host allocator (rounded up to a power of two) would not be."""
    ensure_context(dev)
    call("cuMemHostRegister", api().cuMemHostRegister(ptr, nbytes, 1))  # 1: CU_MEMHOSTREGISTER_PORTABLE


def host_unregister(ptr: int) -> None:
    call("cuMemHostUnregister", api().cuMemHostUnregister(ptr))


# ----- events: the device's own clock, on the stream that carries the work ------------------------
def event(dev: int):
    """A timing event on ``dev`` (an event and the stream it is recorded on must share a device)."""
    ensure_context(dev)
    return call("cuEventCreate", api().cuEventCreate(0))  # 0: CU_EVENT_DEFAULT, timing enabled


def record(ev, handle: int) -> None:
    """``ev`` completes when the work queued on stream ``handle`` before it has."""
    d = api()
    call("cuEventRecord", d.cuEventRecord(ev, d.CUstream(handle)))


def event_synchronize(ev) -> None:
    call("cuEventSynchronize", api().cuEventSynchronize(ev))


def wait_event(handle: int, ev) -> None:
    """Work queued on stream ``handle`` after this waits for ``ev`` (no host wait)."""
    d = api()
    call("cuStreamWaitEvent", d.cuStreamWaitEvent(d.CUstream(handle), ev, 0))


def elapsed(start, end) -> float:
    """Seconds of device time between two completed events (the driver answers in milliseconds)."""
    d = api()
    fn = getattr(d, "cuEventElapsedTime", None) or d.cuEventElapsedTime_v2
    return float(call("cuEventElapsedTime", fn(start, end))) / 1e3


def destroy(ev) -> None:
    call("cuEventDestroy", api().cuEventDestroy(ev))


def entry(name: str, cuda_version: int) -> int:
    """The driver's entry point of ``name`` with the ABI of ``cuda_version`` (cuGetProcAddress), as an address."""
    return int(call(f"cuGetProcAddress({name})", api().cuGetProcAddress(name.encode(), cuda_version, 0))[0])


def pci_bus_id(dev: int) -> str:
    """``dev``'s PCI address as sysfs names it (domain:bus:device.function, lower case)."""
    d = api()
    bus = call("cuDeviceGetPCIBusId", d.cuDeviceGetPCIBusId(32, call("cuDeviceGet", d.cuDeviceGet(dev))))
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).strip("\x00").lower()


def dmabuf_fd(ptr: int, size: int, dev: int) -> int:
    """A dma-buf file descriptor for ``size`` bytes of device memory at ``ptr`` (both page-aligned: the driver
    refuses other ranges with CUDA_ERROR_INVALID_VALUE, so refuse them here with the reason)."""
    if ptr % PAGE or size % PAGE:
        raise DriverError(f"cuMemGetHandleForAddressRange(0x{ptr:x}, {size}): address and size must be multiples of "
                          f"{PAGE} bytes", 1)
    ensure_context(dev)
    d = api()
    kind = d.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    return int(call("cuMemGetHandleForAddressRange", d.cuMemGetHandleForAddressRange(ptr, size, kind, 0)))


def memcpy_attributes(src_dev: int | None, dst_dev: int | None, any_order: bool = False, overlap: bool = False):
    """One CUmemcpyAttributes for a whole batch: the source read in stream order (or in ANY order, where the
    source is stable while the copy runs), each side's location (a device, or the host), and the flag that asks
    the driver to prefer overlap with compute."""
    d = api()
    a = d.CUmemcpyAttributes()
    order = d.CUmemcpySrcAccessOrder
    a.srcAccessOrder = order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY if any_order else order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    for hint, dev in (("srcLocHint", src_dev), ("dstLocHint", dst_dev)):
        loc = d.CUmemLocation()
        loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST if dev is None else \
            d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = 0 if dev is None else dev
        setattr(a, hint, loc)
    a.flags = 1 if overlap else 0  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    return a


def batch_fn():
    """(ctypes function of cuMemcpyBatchAsync for this driver's ABI, has failIdx), or (None, reason).  CUDA 12.8
    and 12.9 take a failIdx pointer before the stream; CUDA 13 removed it (8 arguments)."""
    if _state.batch is None:
        _state.batch = _batch_fn()
    return _state.batch


def _batch_fn():
    why = reason()
    if why:
        return None, why
    ver = version()
    if ver < 12080:
        return None, f"cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one is {ver // 1000}.{ver % 1000 // 10})"
    fail_idx = ver < 13000
    try:
        addr = entry("cuMemcpyBatchAsync", 13000 if not fail_idx else 12080)
    except DriverError as exc:
        return None, str(exc)
    P, S = ctypes.c_void_p, ctypes.c_size_t
    args = [P, P, P, S, P, P, S] + ([P] if fail_idx else []) + [P]
    return ctypes.CFUNCTYPE(ctypes.c_int, *args)(addr), fail_idx


def memcpy_async_addr() -> int:
    """The address of cuMemcpyAsync (called from C once per descriptor: kvbench._native.call_copies)."""
    if not _state.memcpy:
        _state.memcpy = entry("cuMemcpyAsync", 12000)
    return _state.memcpy
