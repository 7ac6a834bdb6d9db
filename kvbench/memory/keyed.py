"""Keyed pool contents: what no transport can predict.

A pool's bytes are Philox4x32-10 (a counter-based generator) of (16-byte block, rank) under a 64-bit content
key; each epoch's key is derived from a secret the run draws on rank 0 and shares over MPI, never through a
transport.  So a transport that carries part of a range cannot write the rest (the fill is not a public
function any more), and a path that compresses or deduplicates finds nothing to gain: what a row times is what
the wire carried.

Three implementations of the same bits: C on the host (kvbench/_keyed.c, the one the harness calls), torch on a
device (``words``), and ``block`` here in pure Python, the reference the tests hold both to.
"""
from __future__ import annotations

import numpy as np

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
SALT = 0x6B766263  # the counter's fourth word (content)
SALT_KEY = 0x6B65790A  # the counter's fourth word when a key is derived
_M32 = 0xFFFFFFFF
SECRET = 0  # set per run by secret(); 0 in a process that never ran one (in-process tests: reproducible)


def secret(value: int) -> None:
    """The run's secret (64 bits, drawn on rank 0 and broadcast): every key derives from it."""
    global SECRET
    SECRET = int(value) & ((1 << 64) - 1)


def block(c: tuple[int, int, int, int], k0: int, k1: int) -> tuple[int, int, int, int]:
    """Philox4x32-10 of counter ``c`` under key (k0, k1): the reference (pure Python, one block)."""
    c0, c1, c2, c3 = c
    for _ in range(10):
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + W0) & _M32, (k1 + W1) & _M32
    return c0, c1, c2, c3


def key(rank: int, epoch: int) -> tuple[int, int]:
    """The content key of ``rank``'s pool in ``epoch`` (0: the fill), from the run's secret."""
    out = block((epoch & _M32, (epoch >> 32) & _M32, rank & _M32, SALT_KEY), SECRET & _M32, SECRET >> 32)
    return out[0], out[1]


def reference(rank: int, epoch: int, offset: int, nbytes: int) -> np.ndarray:
    """The bytes [offset, offset + nbytes) of ``rank``'s pool in ``epoch``, block by block in Python (tests)."""
    k0, k1 = key(rank, epoch)
    b0, b1 = offset // 16, -(-(offset + nbytes) // 16)
    words = np.array([block((b & _M32, b >> 32, rank, SALT), k0, k1) for b in range(b0, b1)], np.uint32)
    return words.reshape(-1).view(np.uint8)[offset - 16 * b0: offset - 16 * b0 + nbytes]


def ranges(out: np.ndarray, descs: np.ndarray, rank: int, epoch: int, place: int = -1, flip: bool = False) -> None:
    """``out`` takes the content of ``descs``' SRC ranges of ``rank``'s pool in ``epoch``: back to back (place
    -1) or at column ``place`` of each row; complemented with ``flip``.  One C call, the GIL released."""
    from kvbench import _keyed  # a compiled extension: imported where it is needed

    _keyed.ranges(out, np.ascontiguousarray(descs, dtype=np.int64), *key(rank, epoch), rank & _M32, place, int(flip))


def words_at(rank: int, widx: np.ndarray, epoch: int = 0) -> np.ndarray:
    """The 32-bit words at word indices ``widx`` (any shape) of ``rank``'s pool in ``epoch``."""
    w = np.asarray(widx, dtype=np.int64).reshape(-1) * 4
    out = np.empty(len(w) * 4, np.uint8)
    if len(w):
        ranges(out, np.stack([w, np.zeros_like(w), np.full_like(w, 4)], axis=1), rank, epoch)
    return out.view(np.uint32).reshape(np.shape(widx))


# ----- on a device, with torch ops (memory/words.py) --------------------------------------------------------
def words(torch, idx, rank: int, epoch: int):
    """The words at int64 word indices ``idx`` (a tensor) of ``rank``'s pool in ``epoch``, as int32 with the same
    bits, computed where ``idx`` lives.  int64 products of two 32-bit values wrap modulo 2^64 (two's
    complement), so their high and low halves are exact."""
    k0, k1 = key(rank, epoch)
    blk = idx.to(torch.int64) >> 2
    c0, c1 = blk & _M32, (blk >> 32) & _M32
    c2 = torch.full_like(blk, rank & _M32)
    c3 = torch.full_like(blk, SALT)
    for _ in range(10):
        p0, p1 = c0 * M0, c2 * M1
        c0, c1, c2, c3 = ((p1 >> 32) & _M32) ^ c1 ^ k0, p1 & _M32, ((p0 >> 32) & _M32) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + W0) & _M32, (k1 + W1) & _M32
    lane = (idx.to(torch.int64) & 3).unsqueeze(-1)
    w = torch.stack([c0, c1, c2, c3], dim=-1).gather(-1, lane).squeeze(-1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
