"""The fill pattern of a pool and its verification.

The fill is keyed content (memory/keyed.py): a function of (source rank, byte offset in the source pool,
epoch) under a key drawn from the run's secret, so a destination can recompute, for every element it received,
the value it must hold, and no transport can.  Because a pool offset determines (layer, region, block,
offset-in-block) through the layout, the pattern identifies exactly which source element belongs where; a
block copied to the wrong place, a stale block, a torn write or a byte from the wrong rank all count as wrong.
"""
from __future__ import annotations

import numpy as np

from . import keyed

POISON = 0xA5

CONTENTS = None  # values.Realistic / values.Dump in force (None: the check pattern); set by use()


def use(contents) -> None:
    """Make ``contents`` (memory/values.py) what fill, expected and verify compute; None: the check pattern."""
    global CONTENTS
    CONTENTS = contents


def pattern_at(rank: int, words: np.ndarray, epoch: int = 0) -> np.ndarray:
    """The check pattern of ``rank``'s pool at 32-bit word indices ``words`` (any shape) in ``epoch``."""
    return keyed.words_at(rank, words, epoch)


def _run(rank: int, word_start: int, nwords: int, epoch: int) -> np.ndarray:
    """The check pattern's words [start, start+n) in ``epoch``: one range, one C call."""
    out = np.empty(nwords, np.uint32)
    keyed.ranges(out.view(np.uint8), np.array([[4 * word_start, 0, 4 * nwords]], np.int64), rank, epoch)
    return out


def pattern_words(rank: int, word_start: int, nwords: int) -> np.ndarray:
    """The fill pattern of ``rank``'s pool for 32-bit words [start, start+n)."""
    if CONTENTS is not None:
        return CONTENTS.words(rank, word_start, nwords)
    return _run(rank, word_start, nwords, 0)


def epoch_words(rank: int, word_start: int, nwords: int, epoch: int) -> np.ndarray:
    """Words of ``epoch``: the check pattern under the epoch's key; other contents draw new values (their
    statistics kept)."""
    if CONTENTS is not None:
        return CONTENTS.words(rank, word_start, nwords, epoch)
    return _run(rank, word_start, nwords, epoch)


def epoch_words_at(rank: int, widx: np.ndarray, epoch: int) -> np.ndarray:
    """``epoch_words`` at any 32-bit word indices (int64): the check's vectorised path over many ranges."""
    if CONTENTS is not None:
        return CONTENTS.at(rank, widx, epoch)
    return pattern_at(rank, widx, epoch)


def fill(array: np.ndarray, rank: int, chunk: int = 1 << 26) -> None:
    """Write ``rank``'s pattern over the whole pool (also pre-faults it); the bytes after the last whole word
    POISON, as on a device."""
    whole = array.nbytes // 4 * 4
    if CONTENTS is None:
        keyed.ranges(array, np.array([[0, 0, whole]], np.int64), rank, 0, place=0)
    else:
        words = array[:whole].view(np.uint32)
        for start in range(0, len(words), chunk // 4):
            n = min(chunk // 4, len(words) - start)
            words[start : start + n] = pattern_words(rank, start, n)
    if array.nbytes % 4:
        array[whole:] = POISON


def expected_bytes(rank: int, offset: int, nbytes: int) -> np.ndarray:
    """The bytes ``rank``'s pool holds at [offset, offset+nbytes) after ``fill``."""
    w0 = offset // 4
    w1 = -(-(offset + nbytes) // 4)
    words = pattern_words(rank, w0, w1 - w0).view(np.uint8)
    lead = offset - w0 * 4
    return words[lead : lead + nbytes]


def poison(array: np.ndarray, descs: np.ndarray, col: int) -> None:
    """Overwrite the ranges named by column ``col`` of ``descs`` with POISON."""
    for off, n in zip(descs[:, col].tolist(), descs[:, 2].tolist()):
        array[off : off + n] = POISON


def count_wrong(dst: np.ndarray, descs: np.ndarray, src_rank: int, elem_bytes: int) -> int:
    """Count elements of ``elem_bytes`` in the destination ranges that differ from
    what the source rank's pattern holds at the matching source ranges.

    Not on a timed path: called once per case, after timing.
    """
    wrong = 0
    for s, d, n in descs.tolist():
        exp = expected_bytes(src_rank, s, n)
        got = dst[d : d + n]
        diff = exp != got
        if diff.any():
            if n % elem_bytes == 0:
                wrong += int(diff.reshape(-1, elem_bytes).any(axis=1).sum())
            else:
                wrong += int(diff.sum())
    return wrong
