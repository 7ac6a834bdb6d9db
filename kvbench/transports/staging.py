"""staged's pure parts: a layer cut into chunks, each chunk's copy to or from its slot, the jobs its threads pass
along, the inner transport's tags."""
from __future__ import annotations

import queue
import threading

import numpy as np

from kvbench.model.layout import Pool

from .. import memory
from .base import DST, LEN, SRC

EMPTY = object()  # _take: nothing queued (a non-blocking take); None: the queue is closed


def split(descs: np.ndarray, chunk: int) -> list[np.ndarray]:
    """A layer's descriptors cut at every ``chunk`` bytes of payload: per chunk, (src, dst, len, offset in chunk)."""
    if not len(descs):
        return []
    ends = np.cumsum(descs[:, LEN])
    total = int(ends[-1])
    cuts = np.union1d(np.concatenate(([0], ends[:-1])), np.arange(0, total, chunk))  # piece starts
    which = np.searchsorted(ends, cuts, side="right")  # the descriptor holding each piece
    within = cuts - (ends[which] - descs[which, LEN])
    lens = np.diff(np.append(cuts, total))
    pieces = np.stack([descs[which, SRC] + within, descs[which, DST] + within, lens, cuts % chunk], axis=1)
    bounds = np.searchsorted(cuts, np.arange(chunk, total, chunk))
    return np.split(pieces, bounds)


def pieces(descs: np.ndarray, chunk: int, gather: bool) -> list[tuple[np.ndarray, int]]:
    """Per chunk of a layer: its copy between the pool and a slot, as int64 (n, 3) rows in C order (pool -> slot
    when ``gather``, else slot -> pool; slot offsets count from the slot's start, so one array serves every
    slot), and its payload bytes.  Made once per descriptor array (staged caches it with copy.prepared)."""
    out = []
    for ch in split(descs, chunk):
        cols = (ch[:, 0], ch[:, 3], ch[:, 2]) if gather else (ch[:, 3], ch[:, 1], ch[:, 2])
        out.append((np.ascontiguousarray(np.stack(cols, axis=1)), int(ch[:, 2].sum())))
    return out


class _Job:
    __slots__ = ("op", "peer", "chunks", "tag", "done", "error", "at")

    def __init__(self, op, peer, chunks, tag):
        self.op, self.peer, self.chunks, self.tag = op, peer, chunks, tag
        self.done, self.error, self.at = threading.Event(), None, None


def _tag(tag: int, chunk: int) -> int:
    """The inner transport's tag of a layer's chunk (both ends compute the same)."""
    return (tag << 8) | (chunk & 0xFF)


def _tensor(array: np.ndarray):
    import torch

    return torch.from_numpy(array)


def bounce_buffer(inner, nbytes: int, kind: str, pages: str):
    """(the bounce Pool, what keeps its memory alive): the inner transport's own memory where it allocates
    (shared segments, MPI windows), page-locked host memory beside a GPU pool, else page-aligned host memory."""
    buf = inner.alloc(nbytes)
    if buf is not None:
        return Pool(buf.array, "host", buf.release), None
    if kind in ("cuda", "pinned"):
        import torch

        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # page-locked: the GPU's DMA reads it directly
        return Pool(t.numpy(), "pinned"), t
    return Pool(memory.alloc_host(nbytes, pages=pages)), None


class _Slot:
    """A slot of a ring: its part of the bounce buffer and, on a GPU, the events around the copy that last filled
    or emptied it (``busy`` until a thread has waited for them and counted their time)."""

    __slots__ = ("off", "view", "start", "end", "busy", "rows")

    def __init__(self, off: int, view):
        self.off, self.view = off, view
        self.start = self.end = None
        self.busy = False
        self.rows: dict[int, np.ndarray] = {}  # payload bytes -> the inner transport's one-row array, made once


class _Ring:
    """One peer and direction: its slots, the free ones, and the full ones (filled at a source, landed at a
    destination) handed from one thread to the other in order; ``stage`` names its copies."""

    def __init__(self, slots: list[_Slot], src: int, dst: int, stage: str):
        self.slots, self.src, self.dst = slots, src, dst  # src, dst: the ring's offsets at the sending, receiving end
        self.stage = stage
        self.lock = threading.Lock()  # one thread at a time waits for the ring's events: each is counted once
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.full: queue.SimpleQueue = queue.SimpleQueue()
        for s in slots:
            self.free.put(s)

    def wire(self, slot: _Slot, n: int) -> np.ndarray:
        """The inner transport's descriptors for ``n`` bytes of ``slot``: the same array every time, so that its
        per-array caches hit."""
        rows = slot.rows.get(n)
        if rows is None:
            rows = slot.rows[n] = np.array([[self.src + slot.off, self.dst + slot.off, n]], dtype=np.int64)
        return rows


def _take(q: queue.SimpleQueue, block: bool = True):
    """The next item of ``q``; EMPTY when none is there and ``block`` is False; None once the queue is closed
    (left there for whoever takes next)."""
    try:
        item = q.get(block=block)
    except queue.Empty:
        return EMPTY
    if item is None:
        q.put(None)
    return item
