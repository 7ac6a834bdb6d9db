"""A fake of the part of ``cuda.bindings.driver`` kvbench calls, enforcing the documented rules kvbench relies on.

* A fresh thread has no current context: every call but cuInit, cuDriverGetVersion, cuDeviceGet(Count),
  cuDevicePrimaryCtxRetain and cuGetProcAddress returns CUDA_ERROR_INVALID_CONTEXT (201) until the thread binds
  one with cuCtxSetCurrent.
* cuMemcpyBatchAsync refuses the legacy NULL stream (0, and CU_STREAM_LEGACY, 1), attrsIdxs[0] != 0 and a
  srcAccessOrder outside STREAM..ANY with CUDA_ERROR_INVALID_VALUE (1); its ABI is the one asked for by
  cuGetProcAddress (CUDA 13: 8 arguments; 12.8: a failIdx pointer before the stream).
* cuMemGetHandleForAddressRange needs a page-aligned address and size.
* Copies touch only memory handed out by ``alloc`` (CPU tensors standing for device memory) or registered as
  host memory (``host``): bytes really move (ctypes.memmove), so a check after them means something.

``install(target)`` puts it in place of the bindings for kvbench.memory.driver: ``target`` is a pytest
monkeypatch (undone after the test) or None (for a process of its own, e.g. a rehearsal of gpu-check).
``cuda_tensor(t, dev)`` wraps a CPU tensor as a buffer kvbench's copy engines take for CUDA memory.
"""
from __future__ import annotations

import ctypes
import enum
import itertools
import os
import threading

SUCCESS, INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE = 0, 1, 101, 201, 400
LEGACY = (0, 1)  # the NULL stream and CU_STREAM_LEGACY: the same legacy default stream


def _enum(name: str, prefix: str, **members: int) -> type[enum.IntEnum]:
    """An IntEnum as the bindings spell it: class ``name``, each member ``prefix`` + its key."""
    return enum.IntEnum(name, {prefix + k: v for k, v in members.items()})


CUresult = _enum("CUresult", "CUDA_", SUCCESS=SUCCESS, ERROR_INVALID_VALUE=INVALID_VALUE,
                 ERROR_INVALID_CONTEXT=INVALID_CONTEXT)
CUmemcpySrcAccessOrder = _enum("CUmemcpySrcAccessOrder", "CU_MEMCPY_SRC_ACCESS_ORDER_", INVALID=0, STREAM=1,
                               DURING_API_CALL=2, ANY=3)
CUmemLocationType = _enum("CUmemLocationType", "CU_MEM_LOCATION_TYPE_", INVALID=0, DEVICE=1, HOST=2)
CUmemRangeHandleType = _enum("CUmemRangeHandleType", "CU_MEM_RANGE_HANDLE_TYPE_", DMA_BUF_FD=1)


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """The C layout (24 bytes), as the bindings' struct of the same name; getPtr() is its address."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", CUmemLocation), ("dstLocHint", CUmemLocation),
                ("flags", ctypes.c_uint)]

    def getPtr(self) -> int:  # noqa: N802 (the bindings' name)
        return ctypes.addressof(self)


class CUstream(int):
    pass


MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
_P, _S = ctypes.c_void_p, ctypes.c_size_t
BATCH13 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _S, _P, _P, _S, _P)
BATCH12 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _S, _P, _P, _S, _P, _P)


class FakeDriver:
    """One process's driver: ``devices`` GPUs of CUDA ``version``; ``calls`` logs (name, thread id, args)."""

    def __init__(self, devices: int = 1, version: int = 13000, bus_ids: list[str] | None = None):
        self.devices, self.version = devices, version
        self.bus_ids = bus_ids or [f"0000:{0x1b + i:02x}:00.0" for i in range(devices)]
        self.tls = threading.local()
        self.ranges: list[tuple[int, int, object]] = []  # (start, end, keep-alive)
        self.streams: set[int] = set()
        self.calls: list[tuple] = []
        self._ids = itertools.count(0x7000)
        self._fns = {"cuMemcpyAsync": MEMCPY(self._memcpy), "cuMemcpyBatchAsync@13": BATCH13(self._batch13),
                     "cuMemcpyBatchAsync@12": BATCH12(self._batch12)}
        for name in ("CUresult", "CUmemcpySrcAccessOrder", "CUmemLocationType", "CUmemRangeHandleType",
                     "CUmemLocation", "CUmemcpyAttributes", "CUstream"):
            setattr(self, name, globals()[name])

    # ----- memory: CPU tensors stand for device allocations -----------------------------------
    def alloc(self, nbytes: int, dev: int = 0):
        """A zeroed buffer on fake device ``dev``: a CPU tensor whose ``device`` says cuda:dev."""
        import torch

        t = torch.zeros(nbytes, dtype=torch.uint8)
        self.host(t)
        return cuda_tensor(t, dev)

    def host(self, t) -> None:
        """Memory copies may touch (host buffers of a host<->device copy)."""
        p = int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.__array_interface__["data"][0])
        self.ranges.append((p, p + int(t.nbytes), t))

    def _inside(self, p: int, n: int) -> bool:
        return not self.ranges or any(a <= p and p + n <= b for a, b, _ in self.ranges)

    # ----- contexts ---------------------------------------------------------------------------
    def _ctx(self) -> int | None:
        return getattr(self.tls, "ctx", None)

    def cuInit(self, flags):  # noqa: N802
        return (SUCCESS,)

    def cuDriverGetVersion(self):  # noqa: N802
        return SUCCESS, self.version

    def cuDeviceGetCount(self):  # noqa: N802
        return SUCCESS, self.devices

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return (SUCCESS, int(ordinal)) if 0 <= int(ordinal) < self.devices else (INVALID_DEVICE, None)

    def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
        return SUCCESS, 0xC000 + int(dev)

    def cuCtxSetCurrent(self, ctx):  # noqa: N802
        self.tls.ctx = int(ctx) or None
        return (SUCCESS,)

    def cuCtxGetCurrent(self):  # noqa: N802
        return SUCCESS, self._ctx() or 0

    def cuDeviceGetPCIBusId(self, length, dev):  # noqa: N802
        return SUCCESS, self.bus_ids[int(dev)].upper().encode()

    def cuStreamCreate(self, flags):  # noqa: N802
        if self._ctx() is None:
            return INVALID_CONTEXT, None
        s = next(self._ids)
        self.streams.add(s)
        return SUCCESS, CUstream(s)

    def cuStreamSynchronize(self, stream):  # noqa: N802
        if self._ctx() is None:
            return (INVALID_CONTEXT,)
        return (SUCCESS,) if int(stream) in self.streams or int(stream) in LEGACY else (INVALID_HANDLE,)

    def cuGetProcAddress(self, symbol, version, flags):  # noqa: N802
        name = symbol.decode() if isinstance(symbol, bytes) else symbol
        if name == "cuMemcpyBatchAsync":
            if self.version < 12080:
                return 500, 0, 0  # CUDA_ERROR_NOT_FOUND
            name += "@13" if version >= 13000 and self.version >= 13000 else "@12"
        fn = self._fns.get(name)
        return (SUCCESS, ctypes.cast(fn, ctypes.c_void_p).value, 0) if fn else (500, 0, 0)

    def cuMemGetHandleForAddressRange(self, dptr, size, kind, flags):  # noqa: N802
        if self._ctx() is None:
            return INVALID_CONTEXT, None
        if int(dptr) % 4096 or int(size) % 4096 or not self._inside(int(dptr), int(size)):
            return INVALID_VALUE, None
        return SUCCESS, os.open(os.devnull, os.O_RDONLY)

    # ----- the raw entry points ---------------------------------------------------------------
    def _memcpy(self, dst, src, n, stream):
        self.calls.append(("cuMemcpyAsync", threading.get_ident(), stream))
        if self._ctx() is None:
            return INVALID_CONTEXT
        if not (self._inside(dst, n) and self._inside(src, n)):
            return INVALID_VALUE
        ctypes.memmove(dst, src, n)
        return SUCCESS

    def _batch(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):
        self.calls.append(("cuMemcpyBatchAsync", threading.get_ident(), stream))
        if self._ctx() is None:
            return INVALID_CONTEXT
        if (stream or 0) in LEGACY or not count or not nattrs or not attrs:
            return INVALID_VALUE
        if ctypes.cast(idxs, ctypes.POINTER(ctypes.c_size_t))[0] != 0:
            return INVALID_VALUE
        a = CUmemcpyAttributes.from_address(attrs)
        if not 1 <= a.srcAccessOrder <= 3:
            return INVALID_VALUE
        u64 = ctypes.POINTER(ctypes.c_uint64)
        d, s, z = (ctypes.cast(x, u64) for x in (dsts, srcs, sizes))
        for i in range(count):  # a fake: a Python loop here stands for the driver's work
            if not (self._inside(d[i], z[i]) and self._inside(s[i], z[i])):
                return INVALID_VALUE
        for i in range(count):
            ctypes.memmove(d[i], s[i], z[i])
        return SUCCESS

    def _batch13(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):
        return self._batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream)

    def _batch12(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, fail_idx, stream):
        return self._batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream)


class _CudaTensor:
    """A CPU tensor seen as CUDA memory by kvbench's copy engines (device type, index, pointer, size)."""

    def __init__(self, t, dev: int):
        import torch

        self.t, self.device = t, torch.device("cuda", dev)

    def data_ptr(self) -> int:
        return int(self.t.data_ptr())

    def numel(self) -> int:
        return int(self.t.numel())

    def numpy(self):
        return self.t.numpy()


def cuda_tensor(t, dev: int = 0) -> _CudaTensor:
    return _CudaTensor(t, dev)


def install(target=None, **kw) -> FakeDriver:
    """Put a FakeDriver in place of cuda.bindings for kvbench.memory.driver (and forget what it learnt)."""
    from kvbench.memory import driver

    fake = FakeDriver(**kw)
    if target is not None:  # both undone after the test: the next one learns about its own driver
        target.setattr(driver, "_API", fake)
        target.setattr(driver, "_state", driver._State())
    else:
        driver._API = fake
        driver.reset()
    return fake
