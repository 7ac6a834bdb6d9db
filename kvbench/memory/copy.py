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
           RawKernel: a CTA per descriptor, 16-byte vectors); without   descriptors' common divisor, one index_select
           cupy, torch's index copy (a few launches)                    and one index_copy_): the SMs' role
batch      the driver's batched memcpy, ``cuMemcpyBatchAsync`` (CUDA    the native batched copy
           12.8+; unavailable with the reason on older drivers)
=========  ==========================================================  =========================================

Buffers are 1-D uint8 torch tensors or numpy arrays.  Host buffers go through the native copy by pointer
(a torch index copy is much slower on a CPU: docs/pitfalls.md#torch-cpu-copies).
"""
from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import numpy as np

from kvbench import _native

ENGINES = ("memcpy", "kernel", "batch")
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


@lru_cache(maxsize=1)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@lru_cache(maxsize=1)
def _batch_fn():
    """(ctypes function, has failIdx) of the driver's batched memcpy, or (None, reason)."""
    lib = _libcuda()
    if lib is None:
        return None, "no CUDA driver (libcuda.so.1 does not load)"
    ver = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(ver))
    if ver.value < 12080:
        return None, f"cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one is {ver.value // 1000}." \
                     f"{ver.value % 1000 // 10})"
    for name, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):  # 13.x, then 12.8
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn, fail_idx
    return None, "the driver exports no cuMemcpyBatchAsync"


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def probe(engine: str, device: str = "cpu") -> str | None:
    """Why ``engine`` cannot copy on ``device`` ("cpu" or "cuda") here, or None."""
    if engine not in ENGINES:
        return f"copy engine '{engine}' is not one of: {', '.join(ENGINES)}"
    if device != "cuda":
        return None
    if _libcuda() is None:
        return "no CUDA driver (libcuda.so.1 does not load)"
    if engine == "batch":
        fn, why = _batch_fn()
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


def _stream(stream) -> int:
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


def _memcpy_cuda(dst, src, descs, stream) -> None:
    lib = _libcuda()
    fn = ctypes.cast(lib.cuMemcpyAsync, ctypes.c_void_p).value
    rc, row = _native.call_copies(fn, _ptr(dst), _ptr(src), descs, _stream(stream))
    if rc:
        raise CopyError(f"cuMemcpyAsync failed with CUresult {rc} at descriptor {row}")


@lru_cache(maxsize=1)
def _kernel():
    import cupy

    return cupy.RawKernel(_KERNEL, "kv_copy")


def _kernel_cuda(dst, src, descs, stream) -> None:
    try:
        import cupy
    except ImportError:  # the same role with torch's indexing kernels: a few launches instead of one
        return index_copy(dst, src, descs)
    st = cupy.cuda.ExternalStream(_stream(stream))
    with st:
        d = cupy.asarray(descs)  # the descriptor array on the device, in stream order before the launch
        _kernel()((len(descs),), (256,), (cupy.uint64(_ptr(dst)), cupy.uint64(_ptr(src)), d, np.int32(len(descs))))
    return None


def _batch_cuda(dst, src, descs, stream) -> None:
    fn, fail_idx = _batch_fn()
    if fn is None:
        raise CopyError(f"copy batch: {fail_idx}")
    n = len(descs)
    dsts = (descs[:, 1] + _ptr(dst)).astype(np.uint64)
    srcs = (descs[:, 0] + _ptr(src)).astype(np.uint64)
    sizes = descs[:, 2].astype(np.uint64)
    attr = _MemcpyAttributes(1, _MemLocation(1, 0), _MemLocation(1, 0), 0)  # stream order; device hints
    idx = (ctypes.c_size_t * 1)(0)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    args = [p(dsts), p(srcs), p(sizes), ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1)]
    failed = ctypes.c_size_t(0)
    if fail_idx:
        args.append(ctypes.byref(failed))
    rc = fn(*args, ctypes.c_void_p(_stream(stream)))
    if rc:
        raise CopyError(f"cuMemcpyBatchAsync failed with CUresult {rc}" + (f" at copy {failed.value}" if fail_idx else ""))


def copy(engine: str, dst, src, descs: np.ndarray, stream=None) -> None:
    """``dst[D:D+L] = src[S:S+L]`` for every row with ``engine``; on a CUDA buffer asynchronous on ``stream``
    (default: torch's current stream): call ``sync`` before reading the bytes on the host."""
    check(descs, _nbytes(src), _nbytes(dst))
    if not len(descs):
        return
    if _is_cuda(dst) or _is_cuda(src):
        {"memcpy": _memcpy_cuda, "kernel": _kernel_cuda, "batch": _batch_cuda}[engine](dst, src, descs, stream)
    elif engine == "kernel":
        index_copy(dst, src, descs)
    else:

        _native.copy_batch(_host_view(dst), _host_view(src), descs)


def sync(*bufs, stream=None) -> None:
    """Wait for the copies queued on ``stream`` when any of ``bufs`` is on a CUDA device."""
    if any(_is_cuda(b) for b in bufs):
        import torch

        if stream is None:
            torch.cuda.current_stream().synchronize()
        else:
            stream.synchronize()


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 B/s); nan for a zero time."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan
