"""Rails: one request striped across several NICs, each rail carrying an equal share of its bytes.

* ``split(descs, n)``: the descriptor array cut into ``n`` arrays whose bytes differ by at most one; a
  descriptor that straddles a cut is split into two (numpy cumsum and searchsorted, no step per descriptor).
  The rails' arrays, concatenated in order, move exactly the bytes of ``descs`` to the same places.
* ``Splits``: the split of each array a transport is handed, cached by its identity (the harness posts the
  same arrays every iteration), with per rail its bytes and descriptors.
* ``Striped``: the handle of a request posted on several rails; it lands when its last rail lands.
"""
from __future__ import annotations

import numpy as np

from kvbench.model.descriptors import DST, LEN, SRC


def split(descs: np.ndarray, n: int) -> list[np.ndarray]:
    """``descs`` as ``n`` arrays of consecutive byte ranges; rail r carries bytes [r*T//n, (r+1)*T//n) of the
    request's T bytes in descriptor order."""
    if n < 1:
        raise ValueError(f"rails: {n} rails (need 1 or more)")
    descs = np.asarray(descs, dtype=np.int64).reshape(-1, 3)
    if n == 1:
        return [descs]
    lens = descs[:, LEN]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if len(ends) else 0
    starts = ends - lens
    cuts = (total * np.arange(n + 1, dtype=np.int64)) // n  # byte positions of the rails' edges
    # per rail the first descriptor ending after its start and the first ending at or after its end
    first = np.searchsorted(ends, cuts[:-1], side="right")
    last = np.searchsorted(ends, cuts[1:], side="left")
    out = []
    for r in range(n):  # one step per rail, never per descriptor
        lo, hi = int(cuts[r]), int(cuts[r + 1])
        if hi <= lo:
            out.append(np.empty((0, 3), dtype=np.int64))
            continue
        i, j = int(first[r]), int(last[r])
        part = descs[i : j + 1].copy()
        s = np.maximum(starts[i : j + 1], lo)
        skip = s - starts[i : j + 1]  # bytes of a descriptor before the rail's start
        part[:, SRC] += skip
        part[:, DST] += skip
        part[:, LEN] = np.minimum(ends[i : j + 1], hi) - s
        part = part[part[:, LEN] > 0]  # zero-length descriptors carry nothing on any rail
        out.append(np.ascontiguousarray(part))
    return out


class Splits:
    """Per descriptor array a transport is handed, its rails' arrays, bytes and descriptors (cached by the
    array's identity; the cache holds the array, so its id stays its own)."""

    def __init__(self, n: int):
        self.n = n
        self._cache: dict[int, tuple] = {}

    def of(self, descs: np.ndarray) -> list[np.ndarray]:
        hit = self._cache.get(id(descs))
        if hit is None or hit[0] is not descs:
            if len(self._cache) >= 4096:
                self._cache.clear()
            parts = split(descs, self.n)
            hit = self._cache[id(descs)] = (descs, parts)
        return hit[1]


def shares(layers: list[np.ndarray], n: int) -> tuple[list[int], list[int]]:
    """Per rail, the bytes and descriptors of a request whose layers are posted one array each (untimed:
    the rows' rail columns)."""
    nbytes, ndescs = [0] * n, [0] * n
    for d in layers:
        for r, part in enumerate(split(d, n)):
            nbytes[r] += int(part[:, LEN].sum())
            ndescs[r] += len(part)
    return nbytes, ndescs


class Striped:
    """A request posted on several rails: done when every rail's job is."""

    __slots__ = ("jobs",)

    def __init__(self, jobs: list):
        self.jobs = jobs
