"""Block tables -> descriptor arrays (numpy), coalescing, statistics.

A descriptor is one contiguous copy ``(src_offset, dst_offset, nbytes)``;
arrays are ``int64`` of shape ``(n, 3)`` (see transports/base.py).  Every
function here is vectorized: building or coalescing a layer's descriptors
never loops in Python per block.
"""
from __future__ import annotations

import numpy as np

from .pool import Layout
from .transports.base import DST, LEN, SRC


def request_descs(src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                  nbytes_last: int | None = None, layers=None) -> list[np.ndarray]:
    """Per-layer descriptors moving ``src_blocks`` into ``dst_blocks`` (block by block), all layers at once.

    Rows are ordered block by block, regions inside a block, which is the
    order a serving engine walks its block table.  ``nbytes_last`` shortens
    the final block (a prompt that does not fill its last block).  One numpy
    pass for the whole request: no loop over layers or blocks.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("source and destination block lists differ in length")
    lay = np.arange(src.layers) if layers is None else np.asarray(layers)
    n, r = len(src_blocks), src.regions
    out = np.empty((len(lay), n, r, 3), dtype=np.int64)
    for region in range(r):  # 1 or 2 iterations: regions, not descriptors
        out[:, :, region, SRC] = src.offsets(lay[:, None], region, src_blocks)
        out[:, :, region, DST] = dst.offsets(lay[:, None], region, dst_blocks)
    out[:, :, :, LEN] = src.block_bytes
    if nbytes_last is not None and n:
        out[:, -1, :, LEN] = nbytes_last
    return list(out.reshape(len(lay), n * r, 3))


def layer_descs(src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                layer: int, nbytes_last: int | None = None) -> np.ndarray:
    """request_descs for one layer."""
    return request_descs(src, dst, src_blocks, dst_blocks, nbytes_last, layers=[layer])[0]


def coalesce(descs: np.ndarray) -> np.ndarray:
    """Merge runs adjacent on BOTH sides into single descriptors.

    Rows are first sorted by source offset; a row continues the previous one
    when its source and destination both start where the previous ended.
    The result moves exactly the same bytes to exactly the same places.
    """
    if len(descs) <= 1:
        return descs.copy()
    d = descs[np.argsort(descs[:, SRC], kind="stable")]
    end_s = d[:-1, SRC] + d[:-1, LEN]
    end_d = d[:-1, DST] + d[:-1, LEN]
    starts = np.concatenate(([True], (d[1:, SRC] != end_s) | (d[1:, DST] != end_d)))
    idx = np.flatnonzero(starts)
    out = d[idx].copy()
    out[:, LEN] = np.add.reduceat(d[:, LEN], idx)
    return out


def bulk_descs(src: Layout, dst: Layout, layer: int, nbytes: int) -> np.ndarray:
    """One descriptor per layer: the same payload as one contiguous copy (the bulk ceiling)."""
    s_off, s_len = src.layer_span(layer)
    d_off, d_len = dst.layer_span(layer)
    if nbytes > min(s_len, d_len):
        raise ValueError("bulk payload larger than a layer of the pool")
    return np.array([[s_off, d_off, nbytes]], dtype=np.int64)


def stats(per_layer: list[np.ndarray]) -> dict[str, float]:
    """Descriptor count, payload bytes and mean bytes per descriptor over layers."""
    count = sum(len(d) for d in per_layer)
    payload = int(sum(int(d[:, LEN].sum()) for d in per_layer))
    return {"descriptors": count, "payload_bytes": payload, "mean_desc_bytes": payload / count if count else 0.0}


def byte_map(descs: np.ndarray) -> dict[int, int]:
    """dst byte -> src byte for every byte moved (tests only; small inputs)."""
    out: dict[int, int] = {}
    for s, d, n in descs.tolist():
        for k in range(n):
            out[d + k] = s + k
    return out
