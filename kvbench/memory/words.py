"""The device pattern and check per 32-bit word (memory/device.py's word path): the pattern's words with torch
ops, the budget that sizes a piece, and the pieces' word indices, with a constant number of launches per piece
and no wait for the device."""
from __future__ import annotations

import numpy as np

from . import keyed, pattern
from .copy import split_rows


def _torch():
    import torch  # lazily: only device memory kinds need it

    return torch


# ----- the pattern, on the device ---------------------------------------------------------------
def _words(torch, idx, rank: int, epoch: int = 0):
    """pattern.pattern_at(rank, idx, epoch) as int32 (the same bits), for int64 word indices: the keyed content
    (keyed.py) computed where ``idx`` lives."""
    return keyed.words(torch, idx, rank, epoch)


# Extra memory the fill and the check may take where the pool lives, at most: an eighth of the pool, 1 GiB at
# most.  Per element of a step the temporaries (int64 positions, the keyed generator's int64 lanes, int32 words) take
# under _PER_ELEM bytes, so a step handles budget / _PER_ELEM elements (words for the fill, bytes for the check).
_BUDGET_MAX = 1 << 30
_PER_ELEM = 256


def budget(pool_bytes: int) -> int:
    """Bytes of temporaries the fill and the check of a pool of ``pool_bytes`` may hold at once."""
    return min(max(pool_bytes // 8, 1), _BUDGET_MAX)


def step(pool_bytes: int) -> int:
    """Elements per step (a multiple of 64, so a cut range keeps whole elements of every dtype)."""
    return max(64, budget(pool_bytes) // _PER_ELEM // 64 * 64)


def pieces(descs: np.ndarray, limit: int) -> list[np.ndarray]:
    """``descs`` cut into groups of rows of at most 2 * ``limit`` bytes in all, a row longer than ``limit`` cut at
    multiples of ``limit`` from its start; the rows keep their order (so a copy back to back keeps its layout)."""
    if not len(descs):
        return []
    rows = split_rows(descs, limit)
    group = (np.cumsum(rows[:, 2]) - 1) // limit
    return np.split(rows, np.flatnonzero(np.diff(group)) + 1)


# ----- the check per 32-bit word, in place where the pool lives --------------------------------------------------
# Per word of a piece the temporaries are two indices, the row map, the words read, the generator's lanes and a flag: under _PER_WORD
# bytes, so a piece takes budget / _PER_WORD words.  The launches per piece are a constant (two small uploads of
# the piece's descriptors, the index build, one gather, the pattern, a compare, a sum), and nothing waits for the
# device until the caller reads the count.
_PER_WORD = 256


def _by_words(descs: np.ndarray, elem: int = 4) -> bool:
    """The word path applies: the check pattern, every offset and length a whole number of 32-bit words, and an
    element either inside a word or a whole number of words that every range holds whole."""
    return (pattern.CONTENTS is None and not (descs % 4).any()
            and (4 % elem == 0 or (64 % elem == 0 and not (descs[:, 2] % elem).any())))


def _word_index(torch, d: np.ndarray, device, wide: bool):
    """(source word, destination word) indices of piece ``d``'s ranges, back to back, built on ``device``."""
    w = d // 4
    lens = w[:, 2]
    first = np.cumsum(lens) - lens
    dt = torch.int64 if wide else torch.int32
    delta = torch.as_tensor(np.stack([w[:, 0] - first, w[:, 1] - first]).astype(np.int64), device=device).to(dt)
    n = int(lens.sum())
    row = torch.repeat_interleave(torch.arange(len(w), device=device), torch.as_tensor(lens, device=device),
                                  output_size=n)  # output_size given: no wait for the device
    k = torch.arange(n, dtype=dt, device=device)
    return delta[0].index_select(0, row).add_(k), delta[1].index_select(0, row).add_(k)


def _word_pieces(tensor, descs: np.ndarray):
    """Per piece of ``descs`` (sized from the pool's budget): (the pool's int32 words, source and destination word
    indices)."""
    torch = _torch()
    nbytes = int(tensor.numel())
    words = tensor[: nbytes // 4 * 4].view(torch.int32)
    limit = max(64, budget(nbytes) // _PER_WORD * 4 // 64 * 64)
    for d in pieces(descs, limit):
        yield (words,) + _word_index(torch, d, tensor.device, nbytes >= 1 << 33)


