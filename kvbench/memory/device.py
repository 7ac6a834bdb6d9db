"""Device pools: the memory kinds ``torch-cpu``, ``pinned`` and ``cuda`` as torch tensors, filled and verified
on the device.

* ``torch-cpu``: a page-aligned, pre-faulted host mapping (memory.alloc_host) seen as a CPU tensor: the device
  layer's code on a machine without a GPU (tests, a user checking a setup).  Its bytes are host memory, so
  copies may also take the native batched copy by pointer (a torch index copy is much slower:
  docs/pitfalls.md#torch-cpu-copies).
* ``pinned``: page-locked host memory (cudaHostAlloc through torch); needs a CUDA build and a GPU.
* ``cuda``: one device allocation per rank, a uint8 tensor; refused before allocating when it exceeds the
  device's free memory.

Fill and check follow memory/pattern.py and verify.py to the bit (the same 32-bit words of (rank, word
index), the same epoch mix, poison = the complement of what must land), computed with torch ops where the
pool lives, so a multi-GB device pool is never copied to the host to be filled or checked; in pieces, so the
temporaries stay within an eighth of the pool and 1 GiB (``budget``), and the snapshot of a request's bytes is
taken to host memory.  Not on a timed path.
"""
from __future__ import annotations

import numpy as np

from kvbench.memory import verify
from kvbench.model.layout import Pool

from . import driver, host, pattern
from .pattern import POISON

KINDS = ("host", "torch-cpu", "pinned", "cuda")
DEVICE_KINDS = KINDS[1:]
_CHUNK = 1 << 22  # words per fill step: bounds the int64 temporaries at 32 MiB


class DeviceMemoryError(RuntimeError):
    """A pool that cannot be had on this device (one line, with the numbers)."""


def _torch():
    import torch  # lazily: only device memory kinds need it

    return torch


def probe(kind: str) -> str | None:
    """Why memory ``kind`` cannot be had here (one line), or None."""
    if kind not in KINDS:
        return f"memory '{kind}' is not one of: {', '.join(KINDS)}"
    if kind == "host":
        return None
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # without importing it: torch takes seconds to import
        return "torch is not installed (pip install 'kvbench[gpu]', or torch==2.13.0 for the CPU build)"
    if kind == "torch-cpu":
        return None
    why = driver_reason()
    if why:
        return f"{'page-locked host memory needs a CUDA device' if kind == 'pinned' else 'no CUDA device'} ({why})"
    torch = _torch()
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        what = "page-locked host memory needs a CUDA device" if kind == "pinned" else "no CUDA device"
        return f"{what} ({build}; torch.cuda.is_available() is False)"
    return None


def driver_reason() -> str | None:
    """Why no CUDA driver is usable here (a GPU is there when libcuda.so.1 loads: docs/pitfalls.md#detect-hardware), or None."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver: libcuda.so.1 does not load"
    return None


class DevicePool(Pool):
    """A pool held by a torch tensor; ``array`` is its numpy view where the bytes are host memory (else None)."""

    def __init__(self, tensor, kind: str, keep=None):
        self.tensor, self.kind, self._keep = tensor, kind, keep  # keep: the host mapping under a torch-cpu tensor
        self.nbytes = int(tensor.numel())
        self.addr = int(tensor.data_ptr())
        self.array = tensor.numpy() if tensor.device.type == "cpu" else None
        self._release = None
        self.own_pages = False

    @property
    def device(self):
        return self.tensor.device

    def release(self) -> None:
        rel, self._release = self._release, None
        if rel is not None:  # page-locked: unlocked before its mapping goes
            rel()
        self.tensor = self.array = self._keep = None


_BOUND: int | None = None  # the GPU bind() made current (the harness's placement)


def bind(gpu: int) -> None:
    """Make ``gpu`` this process's current device (torch, cupy and the driver's calls from this thread)."""
    global _BOUND
    _torch().cuda.set_device(gpu)
    driver.ensure_context(gpu)
    _BOUND = gpu


def local_device() -> int:
    """This rank's GPU: the one placement bound, else its rank on the node (MPICH, Open MPI, Slurm) modulo the
    GPUs it sees."""
    import os

    if _BOUND is not None:
        return _BOUND
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]) % max(1, _torch().cuda.device_count())
    return _torch().cuda.current_device()


def free_bytes(kind: str, device: int = 0) -> tuple[int, int]:
    """(free, total) bytes where a pool of ``kind`` would live."""
    if kind == "cuda":
        free, total = _torch().cuda.mem_get_info(device)
        return int(free), int(total)
    mi = host.meminfo()
    return host.available_bytes(), mi.get("MemTotal", 0)


def check_fits(nbytes: int, kind: str, device: int = 0) -> None:
    """Refuse, before allocating, a pool larger than the free memory it would take (DeviceMemoryError)."""
    free, total = free_bytes(kind, device)
    if nbytes > free:
        where = f"cuda:{device}" if kind == "cuda" else "host memory"
        raise DeviceMemoryError(f"--memory {kind}: a pool of {nbytes / 2**30:.2f} GiB does not fit: {where} has "
                                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB (lower --pool-factor or "
                                f"--tokens)")


def alloc(nbytes: int, kind: str, pages: str = "4k", device: int | None = None) -> DevicePool:
    """A pool of ``kind`` (one of DEVICE_KINDS), pre-faulted, not yet filled."""
    why = probe(kind)
    if why:
        raise DeviceMemoryError(f"--memory {kind}: {why}")
    torch = _torch()
    dev = local_device() if device is None and kind == "cuda" else (device or 0)
    check_fits(nbytes, kind, dev)
    if kind == "torch-cpu":
        arr = host.alloc_host(nbytes, pages=pages)  # page-aligned (docs/pitfalls.md#page-align), pre-faulted
        return DevicePool(torch.from_numpy(arr), kind, keep=arr)
    if kind == "pinned":  # the pool's own page-aligned mapping, page-locked in place (driver.host_register)
        arr = host.alloc_host(nbytes, pages=pages)
        driver.host_register(int(arr.ctypes.data), nbytes, dev)
        pool = DevicePool(torch.from_numpy(arr), kind, keep=arr)
        pool._release = lambda p=int(arr.ctypes.data): driver.host_unregister(p)
        return pool
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    t.zero_()  # pre-fault (host) / first-touch mapping (device) before any timing
    return DevicePool(t, kind)


from .words import (  # noqa: E402, F401  (the word path and the budget: memory/words.py; budget is device's API)
    _PER_ELEM,
    _PER_WORD,
    _by_words,
    _word_pieces,
    _words,
    budget,
    pieces,
    step,
)


def fill(tensor, rank: int) -> None:
    """pattern.fill on a uint8 tensor: ``rank``'s words over the whole pool, the tail bytes POISON."""
    torch = _torch()
    n = int(tensor.numel()) // 4
    words = tensor[: n * 4].view(torch.int32)
    chunk = min(_CHUNK, step(int(tensor.numel())))
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        if pattern.CONTENTS is not None:  # --fill realistic / file: drawn on the host, a piece at a time
            words[start : start + k] = torch.from_numpy(pattern.pattern_words(rank, start, k).view(np.int32)).to(
                tensor.device)
            continue
        idx = torch.arange(start, start + k, dtype=torch.int64, device=tensor.device)
        words[start : start + k] = _words(torch, idx, rank)
    if tensor.numel() % 4:
        tensor[n * 4 :] = POISON



def count_now(tensor, descs: np.ndarray, src_rank: int, elem_bytes: int, epoch: int):
    """Wrong elements of ``descs``' destination ranges as the pool holds them now, compared in place on its device
    per 32-bit word: a 0-d int64 tensor there (the caller's read is the one wait).  Ranges off the word path
    (unaligned, other contents) are counted from a snapshot, as count_wrong does."""
    torch = _torch()
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    if not len(descs):
        return total
    if not _by_words(descs, elem_bytes):
        return total.add_(count_wrong(*snapshot(tensor, [descs]), src_rank, elem_bytes, epoch))
    for words, src_w, dst_w in _word_pieces(tensor, descs):
        total.add_(_elements(torch, words.index_select(0, dst_w).bitwise_xor_(_words(torch, src_w, src_rank, epoch)),
                             elem_bytes))
    return total


def _elements(torch, diff, elem_bytes: int):
    """Elements of ``elem_bytes`` with a nonzero bit in ``diff`` (int32 words, elements back to back)."""
    bad = diff.view({1: torch.uint8, 2: torch.int16}.get(elem_bytes, torch.int32)) != 0
    group = max(1, elem_bytes // 4)
    return (bad.view(-1, group).any(dim=1) if group > 1 else bad).sum()


def gather(tensor, descs: np.ndarray):
    """The bytes of ``descs``' destination ranges as they are now, back to back: int32 words on the pool's device
    (the word path), else a host snapshot (uint8)."""
    torch = _torch()
    if not len(descs) or not _by_words(descs, 1):
        return snapshot(tensor, [descs])[0]
    return torch.cat([words.index_select(0, dst_w) for words, _, dst_w in _word_pieces(tensor, descs)])


def count_changed(before, after, lens: np.ndarray, elem_bytes: int):
    """Elements that differ between two gathers of the same ranges (a 0-d tensor for device words)."""
    torch = _torch()
    if before.dtype == torch.int32 and 4 % elem_bytes == 0:
        return _elements(torch, torch.bitwise_xor(before, after), elem_bytes)
    return verify.count_diff(_to_numpy(before), _to_numpy(after), lens, elem_bytes)


def _to_numpy(x) -> np.ndarray:
    x = x if isinstance(x, np.ndarray) else x.cpu().numpy()
    return x.view(np.uint8)


def write_epoch(tensor, descs: np.ndarray, rank: int, epoch: int) -> None:
    """verify.write_epoch: the source's ranges take ``epoch``'s pattern (per word where it can, in pieces)."""
    torch = _torch()
    if _by_words(descs):
        for words, src_w, _ in _word_pieces(tensor, descs):
            words.index_copy_(0, src_w.long(), _words(torch, src_w, rank, epoch))
        return
    for d in pieces(descs, step(int(tensor.numel())) // 2):
        tensor[_positions(torch, d, 0, tensor.device)] = expected(torch, rank, d, epoch, tensor.device)


def poison(tensor, descs: np.ndarray, src_rank: int, epoch: int) -> None:
    """verify.poison: every destination byte becomes the complement of what it must hold."""
    torch = _torch()
    if _by_words(descs):
        for words, src_w, dst_w in _word_pieces(tensor, descs):
            words.index_copy_(0, dst_w.long(), _words(torch, src_w, src_rank, epoch).bitwise_not_())
        return
    for d in pieces(descs, step(int(tensor.numel())) // 2):
        tensor[_positions(torch, d, 1, tensor.device)] = ~expected(torch, src_rank, d, epoch, tensor.device)


def _positions(torch, descs: np.ndarray, col: int, device):
    """Byte positions of column ``col``'s ranges, back to back (one index per byte of one piece)."""
    lens = descs[:, 2]
    starts = descs[:, col] - (np.cumsum(lens) - lens)
    rep = torch.repeat_interleave(torch.as_tensor(starts, device=device), torch.as_tensor(lens, device=device))
    return rep + torch.arange(int(lens.sum()), dtype=torch.int64, device=device)


def expected(torch, rank: int, descs: np.ndarray, epoch: int, device):
    """What ``rank``'s pool holds at the SRC ranges of ``descs`` (one piece) in ``epoch``, back to back, as uint8."""
    if pattern.CONTENTS is not None:  # values other than the check pattern: verify.py's, moved to the device
        return torch.from_numpy(verify.expected_ranges(rank, descs, epoch)).to(device)
    pos = _positions(torch, descs, 0, device)
    w = _words(torch, pos >> 2, rank, epoch)
    return ((w >> ((pos & 3) * 8).to(torch.int32)) & 0xFF).to(torch.uint8)


def snapshot(tensor, layers: list[np.ndarray]):
    """verify.snapshot: the destination ranges gathered aside at once; (copy, descriptors of the copy).  The copy
    is host memory (a CPU tensor), gathered on the device in bounded pieces: a request's bytes again on the
    device would take more than the check's share of it."""
    torch = _torch()
    descs = np.concatenate(layers) if layers else np.zeros((0, 3), np.int64)
    where = descs.copy()
    where[:, 1] = np.cumsum(descs[:, 2]) - descs[:, 2]
    copy = torch.empty(int(descs[:, 2].sum()), dtype=torch.uint8)
    at = 0
    for d in pieces(descs, step(int(tensor.numel())) // 2):
        n = int(d[:, 2].sum())
        copy[at : at + n] = tensor[_positions(torch, d, 1, tensor.device)].cpu()
        at += n
    return copy, where


def count_wrong(copy, descs: np.ndarray, src_rank: int, elem_bytes: int, epoch: int) -> int:
    """verify.count_wrong: elements of ``elem_bytes`` that differ (bytes, in a range not a whole number of them);
    in pieces of whole elements, so the temporaries stay bounded."""
    torch = _torch()
    wrong = 0
    whole = descs[:, 2] % elem_bytes == 0
    limit = max(elem_bytes, step(int(copy.numel())) // 2 // elem_bytes * elem_bytes)
    dev = _check_device(torch, copy)
    for sel, per_elem in ((whole, True), (~whole, False)):
        for d in pieces(descs[sel], limit):
            slab, d = _slab(copy, d, dev)
            got = slab[_positions(torch, d, 1, dev)]
            diff = got != expected(torch, src_rank, d, epoch, dev)
            wrong += int(diff.view(-1, elem_bytes).any(dim=1).sum()) if per_elem else int(diff.sum())
    return wrong


def _check_device(torch, copy):
    """Where a host copy of device bytes is compared: the rank's GPU when CUDA is up (the pattern's per-byte
    arithmetic runs a hundred times faster there than on the host), else where the copy is."""
    if copy.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return copy.device


def _slab(copy, d: np.ndarray, dev):
    """(the bytes of ``copy`` that piece ``d``'s destination ranges span, on ``dev``; ``d`` relative to them):
    one contiguous copy per piece instead of a host-side gather of every byte."""
    lo = int(d[:, 1].min())
    hi = int((d[:, 1] + d[:, 2]).max())
    d = d.copy()
    d[:, 1] -= lo
    return copy[lo:hi].to(dev, non_blocking=False), d


def on_device(pool) -> bool:
    """The pool's bytes are not host memory (a CUDA tensor): the check runs there, with torch.
    KVBENCH_CHECK_ON_DEVICE=1 (tests) sends CPU-tensor pools the same way, so that path runs without a GPU."""
    import os

    forced = os.environ.get("KVBENCH_CHECK_ON_DEVICE") == "1"
    return isinstance(pool, DevicePool) and (pool.array is None or forced)


def buf(pool):
    """The object the check reads and writes: a CUDA pool's tensor, else the host bytes' numpy array."""
    return pool.tensor if on_device(pool) else pool.array


def checker(pool):
    """The module whose poison/write_epoch/snapshot/count_wrong fit ``pool``: this one for CUDA pools, verify.py
    for host bytes (torch-cpu and pinned pools are host memory: numpy checks them faster than torch's
    byte indexing on a CPU; tests/test_device.py holds the two to the same bytes)."""
    import sys

    return sys.modules[__name__] if on_device(pool) else verify


def sync(pool) -> None:
    """Wait for the device's queued work on ``pool`` (a no-op on the host)."""
    if isinstance(pool, DevicePool) and pool.tensor is not None and pool.tensor.device.type == "cuda":
        _torch().cuda.synchronize(pool.tensor.device)
