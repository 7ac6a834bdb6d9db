"""The fill pattern of a pool and its verification.

The fill pattern is a pure function of (source rank, byte offset in the
source pool), so a destination can recompute, for every element it received,
the value it must hold.  Because a pool offset determines (layer, region,
block, offset-in-block) through the layout, the pattern identifies exactly
which source element belongs where; a block copied to the wrong place, a
stale block, a torn write or a byte from the wrong rank all count as wrong.
"""
from __future__ import annotations

import numpy as np

POISON = 0xA5

_MUL = np.uint32(2654435761)  # Knuth's multiplicative hash constant
CONTENTS = None  # values.Realistic / values.Dump in force (None: the check pattern); set by use()


def use(contents) -> None:
    """Make ``contents`` (memory/values.py) what fill, expected and verify compute; None: the check pattern."""
    global CONTENTS
    CONTENTS = contents
_RANK = np.uint32(0x9E3779B9)


def pattern_at(rank: int, words: np.ndarray) -> np.ndarray:
    """The fill pattern of ``rank``'s pool at 32-bit word indices ``words`` (any shape)."""
    w = np.asarray(words).astype(np.uint32)  # a copy: indices wrap like the pool's own words
    w *= _MUL
    w ^= np.uint32((rank + 1) * int(_RANK) & 0xFFFFFFFF)
    return w


def pattern_words(rank: int, word_start: int, nwords: int) -> np.ndarray:
    """The fill pattern of ``rank``'s pool for 32-bit words [start, start+n)."""
    if CONTENTS is not None:
        return CONTENTS.words(rank, word_start, nwords)
    return pattern_at(rank, np.arange(word_start, word_start + nwords, dtype=np.uint32))


def epoch_words(rank: int, word_start: int, nwords: int, epoch: int, mix) -> np.ndarray:
    """Words of ``epoch``: the check pattern XOR ``mix``; other contents draw new values (their statistics kept)."""
    if CONTENTS is not None:
        return CONTENTS.words(rank, word_start, nwords, epoch)
    words = pattern_words(rank, word_start, nwords)
    if epoch:
        words ^= mix
    return words


def epoch_words_at(rank: int, widx: np.ndarray, epoch: int, mix) -> np.ndarray:
    """``epoch_words`` at any 32-bit word indices (int64): the check's vectorised path over many ranges."""
    if CONTENTS is not None:
        return CONTENTS.at(rank, widx, epoch)
    words = pattern_at(rank, widx)
    if epoch:
        words ^= mix
    return words


def fill(array: np.ndarray, rank: int, chunk: int = 1 << 26) -> None:
    """Write ``rank``'s pattern over the whole pool (also pre-faults it)."""
    words = array[: array.nbytes // 4 * 4].view(np.uint32)
    for start in range(0, len(words), chunk // 4):
        n = min(chunk // 4, len(words) - start)
        words[start : start + n] = pattern_words(rank, start, n)
    tail = array.nbytes % 4
    if tail:
        array[-tail:] = POISON


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
