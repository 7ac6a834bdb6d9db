"""Copy engines on descriptor arrays (the ``copy`` axis): ``memcpy``, ``kernel``, ``batch``.

Each engine copies ``dst[D : D+L] = src[S : S+L]`` for every row (S, D, L) of an int64 ``(n, 3)`` array, in
one call from Python (no Python loop per descriptor):

=========  ==========================================================  =========================================
engine     on a CUDA device (stream-ordered, asynchronous)              on host memory (torch-cpu, pinned, host)
=========  ==========================================================  =========================================
memcpy     one ``cuMemcpyAsync`` per descriptor, the loop in C          the native batched copy (one memcpy per
           (kvbench._native.call_copies): the copy engines, with a      row in C): the host has no per-call
           driver call per descriptor                                   driver cost to model
kernel     one gather/scatter kernel launch for all descriptors (cupy   torch's vectorized index copy (rows of the
           RawKernel: a CTA per tile of at most TILE bytes, so a        descriptors' common divisor, one index_select
           large descriptor is copied by many CTAs; 16-byte vectors);   and one index_copy_): the SMs' role
           without cupy, torch's index copy (a few launches)
batch      the driver's batched memcpy, ``cuMemcpyBatchAsync`` (CUDA    the native batched copy
           12.8+; unavailable with the reason on older drivers), on a
           real stream (it refuses the legacy NULL stream);
           ``batch-overlap`` asks the driver to prefer overlap with
           compute (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE),
           ``batch-any`` lets it read the source in any order (the
           source is stable while the copy runs)
=========  ==========================================================  =========================================

``auto`` (the default) is resolved per case by the pair of memories a transport copies between (``default``):
device to device (cuda_ipc, one GPU or two) takes ``kernel``, host <-> device (staged's bounce buffers) ``batch``.
The device of a copy is the initiator's, the device of the stream it goes on, never the peer buffer's: a kernel
launched on a stream of another device fails.

Buffers are 1-D uint8 torch tensors or numpy arrays.  Host buffers go through the native copy by pointer
(a torch index copy is much slower on a CPU: docs/pitfalls.md#torch-cpu-copies).
"""
from __future__ import annotations

import ctypes
import math
import weakref
from functools import lru_cache

import numpy as np

from kvbench import _native

from . import driver

ENGINES = ("memcpy", "kernel", "batch", "batch-overlap", "batch-any")
AUTO = "auto"
TILE = 32 << 10  # bytes per CTA of the copy kernel: a 16 MiB descriptor is 512 CTAs, a 32 KiB block one
DEVICE_TO_DEVICE = ("cuda_ipc",)  # transports whose copies go between two device pools
_KERNEL = r"""
extern "C" __global__ void kv_copy(unsigned char *dst, const unsigned char *src, const long long *d, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    long long s = d[3 * i], o = d[3 * i + 1], len = d[3 * i + 2];
    const unsigned char *sp = src + s;
    unsigned char *dp = dst + o;
    long long k0 = 0;
    if ((((unsigned long long)sp | (unsigned long long)dp) & 15) == 0) {  /* 16-byte vectors where aligned */
        long long nv = len >> 4;
        for (long long k = threadIdx.x; k < nv; k += blockDim.x) ((uint4 *)dp)[k] = ((const uint4 *)sp)[k];
        k0 = nv << 4;
    }
    for (long long k = k0 + threadIdx.x; k < len; k += blockDim.x) dp[k] = sp[k];
}
"""


class CopyError(RuntimeError):
    """A copy engine failed or cannot run here (one line)."""


def _is_cuda(buf) -> bool:
    return getattr(getattr(buf, "device", None), "type", "cpu") == "cuda"


def _host_view(buf) -> np.ndarray:
    """The numpy view of host bytes (a numpy array, or a CPU tensor's memory)."""
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


def _ptr(buf) -> int:
    return int(buf.__array_interface__["data"][0]) if isinstance(buf, np.ndarray) else int(buf.data_ptr())


def _nbytes(buf) -> int:
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else int(buf.numel())


def default(transport: str, memory: str) -> tuple[str, str]:
    """The engine ``auto`` means for ``transport`` on ``memory`` pools, and why, in words."""
    if memory == "cuda" and transport in DEVICE_TO_DEVICE:
        return "kernel", ("device to device: one gather launch over many CTAs (cuMemcpyBatchAsync costs "
                          "microseconds per entry between two places on one GPU: NVIDIA/nccl#1932)")
    if memory == "cuda":
        return "batch", "host <-> device: the driver's batched copy feeds the copy engines (as vLLM's offload does)"
    return "batch", "host bytes: every engine is the native batched copy"


def preamble_lines(suite) -> list[str]:
    """Where --copy auto chose an engine for device pools: which, for which transport, and why."""
    if AUTO not in suite.axes.copy:
        return []
    pairs = sorted({(t, m) for t in suite.axes.transport for m in suite.axes.memory if m == "cuda"})
    return [f"# copy auto: {t} on {m} pools -> {e} ({why})" for t, m in pairs for e, why in [default(t, m)]]


def probe(engine: str, device: str = "cpu") -> str | None:
    """Why ``engine`` cannot copy on ``device`` ("cpu" or "cuda") here, or None."""
    if engine not in ENGINES:
        return f"copy engine '{engine}' is not one of: {', '.join(ENGINES)}"
    if device != "cuda":
        return None
    why = driver.reason()
    if why:
        return why
    if engine.startswith("batch"):
        fn, why = driver.batch_fn()
        return None if fn is not None else why
    return None


def check(descs: np.ndarray, src_nbytes: int, dst_nbytes: int) -> None:
    """Every row inside both buffers (device addresses are not checked in C)."""
    if descs.dtype != np.int64 or descs.ndim != 2 or descs.shape[1] != 3:
        raise CopyError(f"descriptors must be int64 (n, 3), got {descs.dtype} {descs.shape}")
    if len(descs) and ((descs < 0).any() or (descs[:, 0] + descs[:, 2]).max() > src_nbytes
                       or (descs[:, 1] + descs[:, 2]).max() > dst_nbytes):
        raise CopyError("a descriptor lies outside the source or destination buffer")


def index_copy(dst, src, descs: np.ndarray) -> None:
    """torch's vectorized index copy: each descriptor as rows of g bytes (g: the largest power of two, up to
    64 KiB, dividing its offsets and length), one index_select and one index_copy_ per distinct g (one or two
    in a KV layer: full blocks and a short last one)."""
    import torch

    if not len(descs):
        return
    g = np.gcd.reduce(descs, axis=1)
    g = np.minimum(np.where(g > 0, g & -g, 1), 1 << 16)
    s = torch.as_tensor(src) if isinstance(src, np.ndarray) else src
    d = torch.as_tensor(dst) if isinstance(dst, np.ndarray) else dst
    for gv in np.unique(g).tolist():
        part = descs[g == gv]
        rows = part[:, 2] // gv
        first = np.cumsum(rows) - rows
        k = torch.arange(int(rows.sum()), device=d.device)
        reps = torch.as_tensor(rows, device=d.device)
        at_src = torch.repeat_interleave(torch.as_tensor(part[:, 0] // gv - first, device=d.device), reps) + k
        at_dst = torch.repeat_interleave(torch.as_tensor(part[:, 1] // gv - first, device=d.device), reps) + k
        sv = s[: _nbytes(s) // gv * gv].view(-1, gv)
        dv = d[: _nbytes(d) // gv * gv].view(-1, gv)
        dv.index_copy_(0, at_dst, sv.index_select(0, at_src))


def _dev(buf) -> int | None:
    """The CUDA device index of a buffer, None for host bytes."""
    return (buf.device.index or 0) if _is_cuda(buf) else None


def _stream(stream, dev: int) -> int:
    """The stream handle a copy goes on: the caller's, or this thread's copy stream (driver.stream) in place of
    none or the legacy NULL stream (cuMemcpyBatchAsync refuses it).  Binds ``dev``'s context to the thread."""
    driver.ensure_context(dev)  # a fresh thread (staged's) has no current context: driver calls would fail (201)
    handle = _handle(stream)
    return handle if handle not in LEGACY else driver.stream(dev)


LEGACY = (0, 1)  # the NULL stream and CU_STREAM_LEGACY: one stream, which cuMemcpyBatchAsync refuses


def _handle(stream) -> int:
    """A stream's driver handle (a torch or cupy stream's ``cuda_stream``, or the integer itself; None is 0)."""
    return int(getattr(stream, "cuda_stream", stream) or 0) if stream is not None else 0


def stream_device(stream) -> int | None:
    """The device a stream object belongs to (a torch stream's ``device``), or None when it does not say."""
    d = getattr(stream, "device", None)
    if d is None:
        return None
    return int(d.index or 0) if hasattr(d, "index") else int(d)


def _memcpy_cuda(dst, src, descs, stream, dev) -> None:
    rc, row = _native.call_copies(driver.memcpy_async_addr(), _ptr(dst), _ptr(src), descs, _stream(stream, dev))
    if rc:
        raise CopyError(f"cuMemcpyAsync failed with CUresult {rc} at descriptor {row}")


@lru_cache(maxsize=1)
def _kernel():
    import cupy

    return cupy.RawKernel(_KERNEL, "kv_copy")


_prepared: dict[int, tuple] = {}  # id(descriptor array) -> (a weak reference to it, {key: what was made of it})


def prepared(descs: np.ndarray, key, make):
    """What ``make()`` builds from ``descs`` for ``key``, built once per array (the harness builds a request's
    arrays once and never changes one in place), so a post builds and uploads nothing inside the timed window."""
    k = id(descs)
    ref, per = _prepared.get(k, (None, None))
    if ref is None or ref() is not descs:  # numpy arrays are unhashable: by identity, forgotten when freed
        ref, per = weakref.ref(descs), {}
        _prepared[k] = (ref, per)
        weakref.finalize(descs, _prepared.pop, k, None)
    if key not in per:
        per[key] = make()
    return per[key]


def split_rows(descs: np.ndarray, limit: int) -> np.ndarray:
    """``descs`` with every row longer than ``limit`` cut at multiples of ``limit`` from its start, in order."""
    n = np.maximum(1, -(-descs[:, 2] // limit))
    rows = np.repeat(descs, n, axis=0)
    k = (np.arange(len(rows)) - np.repeat(np.cumsum(n) - n, n)) * limit
    rows[:, 0] += k
    rows[:, 1] += k
    rows[:, 2] = np.minimum(rows[:, 2] - k, limit)
    return rows


def tiles(descs: np.ndarray) -> np.ndarray:
    """The copy kernel's work: one row (src, dst, bytes) per CTA, each at most TILE bytes, C order."""
    return np.ascontiguousarray(split_rows(descs, TILE))


def device_descs(cupy, descs: np.ndarray, dev: int):
    """``descs``' tiles on device ``dev``, made and uploaded once per array."""
    return prepared(descs, ("tiles", dev), lambda: cupy.asarray(tiles(descs)))  # C order: the kernel reads d[3 * i]


def _launch_cupy(dst: int, src: int, descs: np.ndarray, handle: int, dev: int) -> None:
    import cupy

    with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(handle):
        d = device_descs(cupy, descs, dev)
        n = int(d.shape[0])
        _kernel()((n,), (256,), (cupy.uint64(dst), cupy.uint64(src), d, np.int32(n)))


def _kernel_cuda(dst, src, descs, stream, dev) -> None:
    handle = _stream(stream, dev)
    fake = getattr(driver.api(), "launch_kv_copy", None)  # tests/fakes/cuda_driver.py: the kernel's rules, no GPU
    if fake is not None:
        rc = fake(_ptr(dst), _ptr(src), prepared(descs, "tiles", lambda: tiles(descs)), handle, dev)
        if rc:
            raise CopyError(f"copy kernel: launch failed with CUresult {rc} (device {dev}, stream 0x{handle:x})")
        return None
    try:
        import cupy  # noqa: F401
    except ImportError:  # the same role with torch's indexing kernels: a few launches instead of one
        if not (_is_cuda(dst) and _is_cuda(src)):
            raise CopyError("copy kernel: between host and device memory it needs cupy (pip install cupy-cuda13x; "
                            "cupy-cuda12x for CUDA 12)") from None
        return index_copy(dst, src, descs)
    _launch_cupy(_ptr(dst), _ptr(src), descs, handle, dev)
    return None


def _batch_args(descs: np.ndarray, dst, src, engine: str) -> tuple:
    """cuMemcpyBatchAsync's arrays and attributes for ``descs`` between these buffers (made once per array)."""
    dsts = (descs[:, 1] + _ptr(dst)).astype(np.uint64)
    srcs = (descs[:, 0] + _ptr(src)).astype(np.uint64)
    sizes = descs[:, 2].astype(np.uint64)
    attr = driver.memcpy_attributes(_dev(src), _dev(dst), any_order=engine == "batch-any",
                                    overlap=engine == "batch-overlap")
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    idx = (ctypes.c_size_t * 1)(0)
    args = [p(dsts), p(srcs), p(sizes), len(descs), ctypes.c_void_p(attr.getPtr()), ctypes.cast(idx, ctypes.c_void_p), 1]
    return args, (dsts, srcs, sizes, attr, idx)  # the second: what keeps the arrays alive


def _batch_cuda(dst, src, descs, stream, dev, engine="batch") -> None:
    fn, fail_idx = driver.batch_fn()
    if fn is None:
        raise CopyError(f"copy {engine}: {fail_idx}")
    args, _ = prepared(descs, ("batch", _ptr(dst), _ptr(src), engine), lambda: _batch_args(descs, dst, src, engine))
    handle = _stream(stream, dev)
    failed = ctypes.c_size_t(0)
    extra = [ctypes.cast(ctypes.byref(failed), ctypes.c_void_p)] if fail_idx else []
    rc = fn(*args, *extra, ctypes.c_void_p(handle))
    if rc:
        raise CopyError(f"cuMemcpyBatchAsync failed with CUresult {rc}" + (f" at copy {failed.value}" if fail_idx else ""))


def copy(engine: str, dst, src, descs: np.ndarray, stream=None, device: int | None = None) -> None:
    """``dst[D:D+L] = src[S:S+L]`` for every row with ``engine``; on a CUDA buffer asynchronous on ``stream``
    (default: this thread's copy stream, driver.stream; never the legacy NULL stream): call ``sync`` before
    reading the bytes on the host.  ``device``: the initiator's GPU (default: ``stream``'s, else the source's
    when it is device memory, else the destination's): a peer's buffer never decides it."""
    check(descs, _nbytes(src), _nbytes(dst))
    if not len(descs):
        return
    if _is_cuda(dst) or _is_cuda(src):
        dev = device if device is not None else stream_device(stream)
        if dev is None:
            dev = _dev(src) if _is_cuda(src) else _dev(dst)
        if engine.startswith("batch"):
            return _batch_cuda(dst, src, descs, stream, dev, engine)
        {"memcpy": _memcpy_cuda, "kernel": _kernel_cuda}[engine](dst, src, descs, stream, dev)
    elif engine == "kernel":
        index_copy(dst, src, descs)
    else:

        _native.copy_batch(_host_view(dst), _host_view(src), descs)


def sync(*bufs, stream=None, device: int | None = None) -> None:
    """Wait for the copies queued on ``stream`` (default: this thread's copy stream on ``device``, else on the
    first CUDA buffer's device) when any of ``bufs`` is on a CUDA device."""
    cuda = [b for b in bufs if _is_cuda(b)]
    if not cuda:
        return
    if _handle(stream) not in LEGACY:
        return stream.synchronize() if hasattr(stream, "synchronize") else driver.synchronize(_handle(stream))
    driver.synchronize(_stream(None, device if device is not None else _dev(cuda[0])))


class Timer:
    """Device time of the work queued on one stream between ``start`` and ``stop``: two events recorded on that
    stream (the stream that carries the copies, never another one: two streams do not order each other)."""

    def __init__(self, dev: int, stream=None):
        self.dev = dev
        self.handle = _stream(stream, dev)
        self.a, self.b = driver.event(dev), driver.event(dev)

    def start(self) -> None:
        driver.record(self.a, self.handle)

    def stop(self) -> float:
        """Seconds of device time since ``start``, after waiting for the stream to reach the stop event."""
        driver.record(self.b, self.handle)
        driver.event_synchronize(self.b)
        return driver.elapsed(self.a, self.b)

    def close(self) -> None:
        driver.destroy(self.a)
        driver.destroy(self.b)


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 B/s); nan for a zero time."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan
