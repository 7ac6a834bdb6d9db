"""The check pass: an epoch in the source pattern, poison that can never pass, a snapshot at completion.

The check pass is one more transfer after the timed iterations, made so that
every way of lying is caught deterministically:

* each layer's source ranges get this pass's *epoch* of the fill pattern at the
  moment the layer becomes final (not before), so a read of a layer before it is
  final, or a stale copy, holds the wrong epoch; an epoch is keyed content
  (keyed.py), so no transport can write a byte it did not carry;
* the destination ranges are poisoned with the bitwise complement of what they
  must hold, so a poisoned element can never equal its expected value, for any
  dtype (a fixed poison byte equals the pattern by chance: 1 in 256 fp8 elements);
* the destination copies its ranges aside the moment it believes the transfer
  complete, before any further synchronisation with the source, and verifies the
  copy: bytes that land a moment later (a completion reported early) are wrong.

Not on a timed path: the loops here run once per case.
"""
from __future__ import annotations

import numpy as np

from kvbench import memory
from kvbench.memory import keyed
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.model.layout import block_array

_CHUNK = 1 << 24  # bytes per vectorised step: bounds the index arrays a step builds


def expected(rank: int, offset: int, nbytes: int, epoch: int) -> np.ndarray:
    """What ``rank``'s pool holds at [offset, offset + nbytes) in ``epoch``."""
    return expected_ranges(rank, np.array([[offset, 0, nbytes]], np.int64), epoch)


def _steps(descs: np.ndarray):
    """Slices of ``descs`` of about _CHUNK bytes each (a range larger than that is a step of its own): the loop
    runs once per step, never once per descriptor."""
    ends = np.cumsum(descs[:, LEN])
    i = 0
    while i < len(descs):
        base = int(ends[i - 1]) if i else 0
        j = max(i + 1, int(np.searchsorted(ends, base + _CHUNK, side="right")))
        yield slice(i, j)
        i = j


def _back_to_back(lens: np.ndarray) -> np.ndarray:
    """Where each range starts when the ranges are laid end to end."""
    return np.cumsum(lens) - lens


def expected_ranges(rank: int, descs: np.ndarray, epoch: int) -> np.ndarray:
    """What ``rank``'s pool holds at the SRC ranges of ``descs`` in ``epoch``, back to back (vectorised: the
    words of every range at once, then the bytes of unaligned ranges picked out); keyed content: one C call."""
    out = np.empty(int(descs[:, LEN].sum()), np.uint8)
    if memory.pattern.CONTENTS is None:
        keyed.ranges(out, descs, rank, epoch)
        return out
    for sl in _steps(descs):
        d = descs[sl]
        s, n = d[:, SRC], d[:, LEN]
        w0 = s // 4
        nw = -(-(s + n) // 4) - w0
        idx = np.repeat(w0 - _back_to_back(nw), nw) + np.arange(int(nw.sum()), dtype=np.int64)
        b = memory.epoch_words_at(rank, idx, epoch).view(np.uint8)
        lead = s - w0 * 4
        o = int(_back_to_back(descs[:, LEN])[sl.start]) if sl.start else 0
        if not (lead.any() or (n % 4).any()):  # every range whole words: they are the bytes
            out[o : o + len(b)] = b
        else:
            pos = np.repeat(_back_to_back(nw) * 4 + lead - _back_to_back(n), n) + np.arange(int(n.sum()))
            out[o : o + len(pos)] = b[pos]
    return out


class Expected:
    """What ranges must hold, epoch after epoch (the check of every timed iteration): each epoch's keyed content
    computed when asked (one C call over the ranges)."""

    def __init__(self, rank: int, descs: np.ndarray):
        self.rank, self.descs = rank, np.ascontiguousarray(descs)

    def at(self, epoch: int) -> np.ndarray:
        return expected_ranges(self.rank, self.descs, epoch)


def scatter(pool: np.ndarray, data: np.ndarray, descs: np.ndarray, col: int) -> None:
    """pool[column ``col``'s ranges] = data, laid back to back, in one native call."""
    from kvbench import _native  # a compiled extension: the check needs it, importing this module must not

    moved = np.empty_like(descs)
    moved[:, SRC] = _back_to_back(descs[:, LEN])
    moved[:, DST] = descs[:, col]
    moved[:, LEN] = descs[:, LEN]
    _native.copy_batch(pool, data, np.ascontiguousarray(moved))


def write_epoch(pool: np.ndarray, descs: np.ndarray, rank: int, epoch: int) -> None:
    """Source: this layer is final now; its ranges take ``epoch``'s pattern."""
    if len(descs) and memory.pattern.CONTENTS is None:
        keyed.ranges(pool, descs, rank, epoch, place=SRC)
    elif len(descs):
        scatter(pool, expected_ranges(rank, descs, epoch), descs, SRC)


def poison(pool: np.ndarray, descs: np.ndarray, src_rank: int, epoch: int) -> None:
    """Destination: every byte of the ranges becomes the complement of what it must hold."""
    if len(descs) and memory.pattern.CONTENTS is None:
        keyed.ranges(pool, descs, src_rank, epoch, place=DST, flip=True)
    elif len(descs):
        scatter(pool, np.invert(expected_ranges(src_rank, descs, epoch)), descs, DST)


def snapshot(pool: np.ndarray, layers: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Destination, at completion: its ranges copied aside in one native call, the last range first; (copy,
    descriptors of the copy)."""
    from kvbench import _native

    descs = np.concatenate(layers) if layers else np.zeros((0, 3), np.int64)
    moved = np.empty_like(descs)
    moved[:, SRC] = descs[:, DST]  # read from the pool ...
    moved[:, LEN] = descs[:, LEN]
    moved[:, DST] = _back_to_back(descs[:, LEN])  # ... into the copy, back to back
    copy = np.empty(int(descs[:, LEN].sum()), dtype=np.uint8)
    # the last range first: a transfer still under way when its completion was reported (written in order, as
    # copies and streams are) has not reached its end yet, however soon after the completion the copy starts
    _native.copy_batch(copy, pool, np.ascontiguousarray(moved[::-1]))
    where = descs.copy()
    where[:, DST] = moved[:, DST]
    return copy, where


_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def count_diff(a: np.ndarray, b: np.ndarray, lens: np.ndarray, elem_bytes: int) -> int:
    """Elements of ``elem_bytes`` that differ between the bytes ``a`` and ``b``, ranges of ``lens`` laid back to
    back; a range that is not a whole number of elements counts bytes."""
    whole = lens % elem_bytes == 0
    if whole.all() and elem_bytes in _VIEW:  # compared as elements: no per-byte mask
        return int(np.count_nonzero(a.view(_VIEW[elem_bytes]) != b.view(_VIEW[elem_bytes])))
    diff = a != b
    if whole.all():
        return int(diff.reshape(-1, elem_bytes).any(axis=1).sum())
    per = np.repeat(whole, lens)
    return int(diff[per].reshape(-1, elem_bytes).any(axis=1).sum()) + int(diff[~per].sum())


def count_wrong(copy: np.ndarray, descs: np.ndarray, src_rank: int, elem_bytes: int, epoch: int) -> int:
    """Elements of ``elem_bytes`` in the copy that differ from the source's pattern in ``epoch``."""
    if not len(descs):
        return 0
    lens = descs[:, LEN]
    exp = expected_ranges(src_rank, descs, epoch)
    if np.array_equal(descs[:, DST], _back_to_back(lens)):  # a snapshot's copy: the ranges back to back
        got = copy[: len(exp)]
    else:
        got, _ = snapshot(copy, [descs])
    return count_diff(exp, got, lens, elem_bytes)


def guard_zones(ranges: np.ndarray, size: int, width: int = 4096) -> np.ndarray:
    """Descriptors (SRC = DST = offset, LEN) of the bytes around ``ranges`` (offset, length rows) in a pool of
    ``size`` bytes: up to ``width`` bytes on each side of every run of ranges, within the gaps between them,
    plus the pool's first and last ``width`` bytes where no range covers them (canaries at its edges).  A
    write outside a transfer's ranges lands in one of them if it touches a neighbour (vectorised)."""
    if not len(ranges):
        return np.zeros((0, 3), np.int64)
    order = np.argsort(ranges[:, 0], kind="stable")
    lo, hi = ranges[order, 0], ranges[order, 0] + ranges[order, 1]
    reach = np.maximum.accumulate(hi)
    new = np.concatenate([[True], lo[1:] > reach[:-1]])  # a run starts where no earlier range reaches
    first = np.flatnonzero(new)
    starts, ends = lo[first], np.concatenate([reach[first[1:] - 1], reach[-1:]])
    gap_lo = np.concatenate([[0], ends])  # the gaps before, between and after the runs
    gap_hi = np.concatenate([starts, [size]])
    keep = gap_hi > gap_lo
    gap_lo, gap_hi = gap_lo[keep], gap_hi[keep]
    width = int(width)
    a_lo, a_hi = gap_lo, np.minimum(gap_hi, gap_lo + width)  # each gap's first bytes (after a run)
    b_lo, b_hi = np.maximum(gap_lo, gap_hi - width), gap_hi  # and its last bytes (before the next)
    merged = a_hi >= b_lo  # a narrow gap: one zone, the whole gap
    z_lo = np.concatenate([a_lo, b_lo[~merged]])
    z_hi = np.concatenate([np.where(merged, b_hi, a_hi), b_hi[~merged]])
    zones = np.stack([z_lo, z_lo, z_hi - z_lo], axis=1).astype(np.int64)
    return zones[np.argsort(z_lo, kind="stable")]


def layer_is_right(pool: np.ndarray, lay, layer: int, src_ids, dst_ids, last: int, src_rank: int) -> bool:
    """Whether one layer of a landed request holds exactly the source rank's fill pattern (all regions).

    The pattern is memory.fill's (memory.pattern_at), checked a whole layer at a time.
    """
    got = block_array(pool, lay, np.uint32)[layer][:, dst_ids]  # (regions, blocks, words)
    base = np.stack([lay.offsets(layer, r, src_ids) // 4 for r in range(lay.regions)])
    exp = memory.pattern_at(src_rank, base[..., None] + np.arange(lay.block_bytes // 4))
    lw = last // 4
    return bool(np.array_equal(got[:, :-1], exp[:, :-1]) and np.array_equal(got[:, -1, :lw], exp[:, -1, :lw]))
