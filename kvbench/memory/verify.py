"""The check pass: an epoch in the source pattern, poison that can never pass, a snapshot at completion.

The check pass is one more transfer after the timed iterations, made so that
every way of lying is caught deterministically:

* each layer's source ranges get this pass's *epoch* of the fill pattern at the
  moment the layer becomes final (not before), so a read of a layer before it is
  final, or a stale copy, holds the wrong epoch;
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
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.model.layout import block_array


def _mix(epoch: int) -> np.uint32:
    """The word XOR-ed into every pattern word for ``epoch`` (epoch 0: the plain fill pattern)."""
    return np.uint32((epoch * 0x85EBCA6B) & 0xFFFFFFFF)


def expected(rank: int, offset: int, nbytes: int, epoch: int) -> np.ndarray:
    """What ``rank``'s pool holds at [offset, offset + nbytes) in ``epoch``."""
    w0, w1 = offset // 4, -(-(offset + nbytes) // 4)
    words = memory.epoch_words(rank, w0, w1 - w0, epoch, _mix(epoch))
    lead = offset - w0 * 4
    return words.view(np.uint8)[lead : lead + nbytes]


def write_epoch(pool: np.ndarray, descs: np.ndarray, rank: int, epoch: int) -> None:
    """Source: this layer is final now; its ranges take ``epoch``'s pattern."""
    for s, _, n in descs.tolist():
        pool[s : s + n] = expected(rank, s, n, epoch)


def poison(pool: np.ndarray, descs: np.ndarray, src_rank: int, epoch: int) -> None:
    """Destination: every byte of the ranges becomes the complement of what it must hold."""
    for s, d, n in descs.tolist():
        np.invert(expected(src_rank, s, n, epoch), out=pool[d : d + n])


def snapshot(pool: np.ndarray, layers: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Destination, at completion: its ranges copied aside in one native call; (copy, descriptors of the copy)."""
    from kvbench import _native  # a compiled extension: the check needs it, importing this module must not

    descs = np.concatenate(layers) if layers else np.zeros((0, 3), np.int64)
    moved = np.empty_like(descs)
    moved[:, SRC] = descs[:, DST]  # read from the pool ...
    moved[:, LEN] = descs[:, LEN]
    moved[:, DST] = np.cumsum(descs[:, LEN]) - descs[:, LEN]  # ... into the copy, back to back
    copy = np.empty(int(descs[:, LEN].sum()), dtype=np.uint8)
    _native.copy_batch(copy, pool, np.ascontiguousarray(moved))
    where = descs.copy()
    where[:, DST] = moved[:, DST]
    return copy, where


def count_wrong(copy: np.ndarray, descs: np.ndarray, src_rank: int, elem_bytes: int, epoch: int) -> int:
    """Elements of ``elem_bytes`` in the copy that differ from the source's pattern in ``epoch``."""
    wrong = 0
    for s, d, n in descs.tolist():
        diff = expected(src_rank, s, n, epoch) != copy[d : d + n]
        if diff.any():
            wrong += int(diff.reshape(-1, elem_bytes).any(axis=1).sum()) if n % elem_bytes == 0 else int(diff.sum())
    return wrong


def layer_is_right(pool: np.ndarray, lay, layer: int, src_ids, dst_ids, last: int, src_rank: int) -> bool:
    """Whether one layer of a landed request holds exactly the source rank's fill pattern (all regions).

    The pattern is memory.fill's (memory.pattern_at), checked a whole layer at a time.
    """
    got = block_array(pool, lay, np.uint32)[layer][:, dst_ids]  # (regions, blocks, words)
    base = np.stack([lay.offsets(layer, r, src_ids) // 4 for r in range(lay.regions)])
    exp = memory.pattern_at(src_rank, base[..., None] + np.arange(lay.block_bytes // 4))
    lw = last // 4
    return bool(np.array_equal(got[:, :-1], exp[:, :-1]) and np.array_equal(got[:, -1, :lw], exp[:, -1, :lw]))
