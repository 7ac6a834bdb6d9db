"""staged's pure parts: a layer cut into chunks, each chunk's copy to or from its slot, the jobs its threads pass
along, the inner transport's tags."""
from __future__ import annotations

import threading

import numpy as np

from kvbench.model.layout import Pool

from .. import memory
from .base import DST, LEN, SRC


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
