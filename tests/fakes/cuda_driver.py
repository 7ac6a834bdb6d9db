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
* Streams are ordered queues that complete in their own time: a copy is queued, and its bytes move only when
  something waits for its stream (cuStreamSynchronize, cuEventSynchronize on an event recorded after it, a
  stream that cuStreamWaitEvent-s such an event, cuCtxSynchronize).  So a read before that sync sees what was
  there before (the poison), and an event recorded on another stream brackets nothing: each device has one
  clock that only completed work advances (``rate`` bytes/s plus ``overhead`` s per driver call), and an event
  takes its time when its stream reaches it.  Work on the legacy stream (0, 1) waits for every blocking
  stream of its device first (CU_STREAM_DEFAULT semantics) and then completes at once.
* A stream and an event belong to the device of the context current when they were made: cuEventRecord with a
  stream of another device returns CUDA_ERROR_INVALID_HANDLE (400), as the programming guide says of event
  records; memory copies may be issued to any device's stream.  ``launch_kv_copy`` stands for the copy
  kernel (kvbench/memory/copy.py's tiles): a launch on a stream that is not the current device's fails
  (CUDA_ERROR_INVALID_HANDLE), as the guide says of kernel launches.
* ``syncs`` counts the host waits (stream, event, context synchronisations); ``launches`` the kernels.

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

SUCCESS, INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE, NOT_READY = 0, 1, 101, 201, 400, 600
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


class CUevent(int):
    pass


class _Queue:
    """A stream: its device, whether it waits for legacy work (blocking), and its queued work in order."""

    def __init__(self, dev: int, blocking: bool = True):
        self.dev, self.blocking, self.work = dev, blocking, []


class _Event:
    def __init__(self, dev: int):
        self.dev, self.time, self.done = dev, None, True


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
        # the driver is thread-safe: threads that create streams, queue work and wait on events at once (staged's
        # gather, wire and scatter threads) see one consistent set of queues
        self._lock = threading.RLock()
        self.ranges: list[tuple[int, int, object]] = []  # (start, end, keep-alive)
        self.streams: set[int] = set()
        self.calls: list[tuple] = []
        self._ids = itertools.count(0x7000)
        self._fns = {"cuMemcpyAsync": MEMCPY(self._memcpy), "cuMemcpyBatchAsync@13": BATCH13(self._batch13),
                     "cuMemcpyBatchAsync@12": BATCH12(self._batch12)}
        self.queues: dict[int, _Queue] = {}
        self.events: dict[int, _Event] = {}
        self.clock = [0.0] * devices  # each device's time: advanced by completed work only
        self.rate, self.overhead = 100e9, 2e-6  # the fake's device: bytes/s, seconds per driver call
        self.syncs = self.launches = 0
        self.registered: dict[int, int] = {}  # page-locked host ranges: start -> end
        self.batches: list[tuple] = []  # per cuMemcpyBatchAsync: (count, srcAccessOrder, flags)
        for name in ("CUresult", "CUmemcpySrcAccessOrder", "CUmemLocationType", "CUmemRangeHandleType",
                     "CUmemLocation", "CUmemcpyAttributes", "CUstream", "CUevent"):
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

    def _dev(self) -> int:
        return self._ctx() - 0xC000

    def cuStreamCreate(self, flags):  # noqa: N802
        if self._ctx() is None:
            return INVALID_CONTEXT, None
        with self._lock:
            s = next(self._ids)
            self.streams.add(s)
            self.queues[s] = _Queue(self._dev(), blocking=not int(flags) & 1)  # CU_STREAM_NON_BLOCKING = 1
        return SUCCESS, CUstream(s)

    def cuStreamSynchronize(self, stream):  # noqa: N802
        if self._ctx() is None:
            return (INVALID_CONTEXT,)
        if int(stream) not in self.streams and int(stream) not in LEGACY:
            return (INVALID_HANDLE,)
        self.syncs += 1
        if int(stream) in self.queues:
            self._drain(self.queues[int(stream)])
        return (SUCCESS,)

    def cuCtxSynchronize(self):  # noqa: N802
        if self._ctx() is None:
            return (INVALID_CONTEXT,)
        self.syncs += 1
        with self._lock:
            for q in list(self.queues.values()):
                if q.dev == self._dev():
                    self._drain(q)
        return (SUCCESS,)

    # ----- streams as queues, events on the device's clock --------------------------------------
    def _drain(self, q: _Queue, upto=None) -> None:
        """Complete ``q``'s work in order, up to and including ``upto`` (an event), or all of it."""
        with self._lock:
            while q.work:
                item = q.work.pop(0)
                if isinstance(item, _Event):
                    item.time, item.done = self.clock[q.dev], True
                    if item is upto:
                        return
                    continue
                fn, seconds = item
                fn()
                self.clock[q.dev] += seconds

    def _enqueue(self, stream, fn, seconds: float) -> None:
        """Queue work on ``stream``; on the legacy stream, after every blocking stream of the device, at once."""
        with self._lock:
            q = self.queues.get(int(stream or 0))
            if q is None:  # legacy
                dev = self._dev()
                for other in list(self.queues.values()):
                    if other.dev == dev and other.blocking:
                        self._drain(other)
                fn()
                self.clock[dev] += seconds
                return
            q.work.append((fn, seconds))

    def pending(self) -> int:
        """Copies and kernels queued and not yet complete, on every stream."""
        return sum(not isinstance(w, _Event) for q in self.queues.values() for w in q.work)

    def cuEventCreate(self, flags):  # noqa: N802
        if self._ctx() is None:
            return INVALID_CONTEXT, None
        e = next(self._ids)
        self.events[e] = _Event(self._dev())
        return SUCCESS, CUevent(e)

    def cuEventDestroy(self, event):  # noqa: N802
        return (SUCCESS,) if self.events.pop(int(event), None) is not None else (INVALID_HANDLE,)

    def cuEventRecord(self, event, stream):  # noqa: N802
        if self._ctx() is None:
            return (INVALID_CONTEXT,)
        ev, q = self.events.get(int(event)), self.queues.get(int(stream or 0))
        if ev is None or (q is None and int(stream or 0) not in LEGACY):
            return (INVALID_HANDLE,)
        if (q.dev if q is not None else self._dev()) != ev.dev:  # an event and its stream: one device
            return (INVALID_HANDLE,)
        with self._lock:
            if q is None or not q.work:
                ev.time, ev.done = self.clock[ev.dev], True
            else:
                ev.time, ev.done = None, False
                q.work.append(ev)
        return (SUCCESS,)

    def _owner(self, ev: _Event):
        return next((q for q in self.queues.values() if ev in q.work), None)

    def cuEventSynchronize(self, event):  # noqa: N802
        ev = self.events.get(int(event))
        if ev is None:
            return (INVALID_HANDLE,)
        self.syncs += 1
        with self._lock:  # another thread may have completed it meanwhile: then it has no queue left
            if not ev.done and (q := self._owner(ev)) is not None:
                self._drain(q, upto=ev)
        return (SUCCESS,)

    def cuEventQuery(self, event):  # noqa: N802
        ev = self.events.get(int(event))
        return (INVALID_HANDLE,) if ev is None else ((SUCCESS,) if ev.done else (NOT_READY,))

    def cuEventElapsedTime(self, start, end):  # noqa: N802
        a, b = self.events.get(int(start)), self.events.get(int(end))
        if a is None or b is None or a.dev != b.dev:
            return INVALID_HANDLE, None
        if not (a.done and b.done):
            return NOT_READY, None
        return SUCCESS, (b.time - a.time) * 1e3

    def cuStreamWaitEvent(self, stream, event, flags):  # noqa: N802
        """Later work on ``stream`` follows ``event``: the fake completes the event's stream up to it now (an
        order the device may choose)."""
        ev = self.events.get(int(event))
        if ev is None:
            return (INVALID_HANDLE,)
        with self._lock:
            if not ev.done and (q := self._owner(ev)) is not None:
                self._drain(q, upto=ev)
        return (SUCCESS,)

    def launch_kv_copy(self, dst: int, src: int, tiles, stream, dev: int):
        """The copy kernel over ``tiles`` (rows: src offset, dst offset, bytes), queued on ``stream``; refused on a
        stream of another device than the current one."""
        q = self.queues.get(int(stream or 0))
        if self._ctx() is None:
            return INVALID_CONTEXT
        if q is None or q.dev != self._dev() or dev != self._dev():
            return INVALID_HANDLE
        rows = [tuple(int(x) for x in r) for r in tiles]
        for s, d, n in rows:
            if not (self._inside(dst + d, n) and self._inside(src + s, n)):
                return INVALID_VALUE
        self.launches += 1
        self.calls.append(("launch_kv_copy", threading.get_ident(), int(stream), len(rows)))
        nbytes = sum(n for _, _, n in rows)
        self._enqueue(stream, lambda: [ctypes.memmove(dst + d, src + s, n) for s, d, n in rows],
                      self.overhead + nbytes / self.rate)
        return SUCCESS

    def cuGetProcAddress(self, symbol, version, flags):  # noqa: N802
        name = symbol.decode() if isinstance(symbol, bytes) else symbol
        if name == "cuMemcpyBatchAsync":
            if self.version < 12080:
                return 500, 0, 0  # CUDA_ERROR_NOT_FOUND
            name += "@13" if version >= 13000 and self.version >= 13000 else "@12"
        fn = self._fns.get(name)
        return (SUCCESS, ctypes.cast(fn, ctypes.c_void_p).value, 0) if fn else (500, 0, 0)

    def cuMemHostRegister(self, p, size, flags):  # noqa: N802
        """Page-locks a host range (any alignment: the driver rounds to pages); a range registered twice, or one
        overlapping a registered one, is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (712)."""
        if self._ctx() is None:
            return (INVALID_CONTEXT,)
        p, size = int(p), int(size)
        if not size:
            return (INVALID_VALUE,)
        if any(a < p + size and p < b for a, b in self.registered.items()):
            return (712,)
        self.registered[p] = p + size
        return (SUCCESS,)

    def cuMemHostUnregister(self, p):  # noqa: N802
        """713 (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED) for a pointer that is not the start of a registered range."""
        return (SUCCESS,) if self.registered.pop(int(p), None) is not None else (713,)

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
        self._enqueue(stream, lambda: ctypes.memmove(dst, src, n), self.overhead + n / self.rate)
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
        rows = [(d[i], s[i], z[i]) for i in range(count)]
        self.batches.append((count, a.srcAccessOrder, a.flags))
        self._enqueue(stream, lambda: [ctypes.memmove(*r) for r in rows],
                      self.overhead + sum(r[2] for r in rows) / self.rate)
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
