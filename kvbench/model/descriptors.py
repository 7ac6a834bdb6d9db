"""Block tables -> descriptor arrays (numpy), coalescing, statistics.

A descriptor is one contiguous copy ``(src_offset, dst_offset, nbytes)``;
arrays are ``int64`` of shape ``(n, 3)`` whose columns are ``SRC, DST, LEN``.  Every
function here is vectorized: building or coalescing a layer's descriptors
never loops in Python per block.
"""
from __future__ import annotations

import numpy as np

from kvbench.model.layout import LAYOUTS, Layout

SRC, DST, LEN = 0, 1, 2  # the columns of a descriptor array


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
    This is the general path (any rows); ``coalesced_descs`` gets the same
    result for a whole request from its block tables, without this sort.
    """
    if len(descs) <= 1:
        return descs.copy()
    return _merge_sorted(descs[np.argsort(descs[:, SRC], kind="stable")])


def _merge_sorted(d: np.ndarray) -> np.ndarray:
    """coalesce's merge step over rows already in stable source-offset order (at least one row)."""
    end_s = d[:-1, SRC] + d[:-1, LEN]
    end_d = d[:-1, DST] + d[:-1, LEN]
    starts = np.concatenate(([True], (d[1:, SRC] != end_s) | (d[1:, DST] != end_d)))
    idx = np.flatnonzero(starts)
    out = d[idx].copy()
    out[:, LEN] = np.add.reduceat(d[:, LEN], idx)
    return out


def coalesced_descs(src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                    nbytes_last: int | None = None, layers=None) -> list[np.ndarray]:
    """``[coalesce(d) for d in request_descs(...)]``, identical row for row, from the block tables.

    Engines coalesce on block tables: the order ``coalesce`` sorts a layer's
    rows into follows from the source block ids alone, so one argsort of the
    request's block ids (not of its descriptors) gives it, once per request:

    * ``layer-major`` and ``mla``: region by region, blocks by source id
      (each region's blocks lie in their own span of the layer);
    * ``block-major`` and ``cross-layer``: blocks by source id, regions inside a block.

    Runs are then found once, on layer 0's rows in that order (a row joins
    the previous one when both its source and destination start where the
    previous ended: consecutive block ids on both sides, full blocks; for
    layer-major a run can cross from one region into the next, for
    block-major from a block's K into its V and on into the next block).
    Every layout places layer ``l`` at a constant offset from layer 0 on each
    side, so other layers are layer 0's runs shifted: no work per layer
    beyond one add.  Falls back to ``coalesce`` per layer where that order
    does not follow from the ids: layer-major/mla source ids outside
    ``[0, nblocks)``, block-major repeated source ids, or another layout kind.
    """
    base = _layer0_coalesced(src, dst, src_blocks, dst_blocks, nbytes_last)
    if base is None:
        return [coalesce(d) for d in request_descs(src, dst, src_blocks, dst_blocks, nbytes_last, layers)]
    return _shift_layers(base, src, dst, layers)


def _shift_layers(base: np.ndarray, src: Layout, dst: Layout, layers=None) -> list[np.ndarray]:
    """Layer 0's rows moved to each layer: one add for all layers."""
    lay = np.arange(src.layers) if layers is None else np.asarray(layers, dtype=np.int64)
    out = np.empty((len(lay),) + base.shape, dtype=np.int64)
    out[:] = base
    # column by column: a broadcast add over the last axis of 3 is slower
    out[:, :, SRC] += (src.offsets(lay, 0, 0) - src.offsets(0, 0, 0))[:, None]
    out[:, :, DST] += (dst.offsets(lay, 0, 0) - dst.offsets(0, 0, 0))[:, None]
    return list(out)


def _layer0_coalesced(src: Layout, dst: Layout, src_blocks, dst_blocks, nbytes_last) -> np.ndarray | None:
    """Layer 0's coalesced rows from the block tables, or None where coalescing must sort descriptors."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    if len(s) != len(d):
        raise ValueError("source and destination block lists differ in length")
    n, r = len(s), src.regions
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    if src.kind not in LAYOUTS or dst.kind not in LAYOUTS or src.block_bytes <= 0 or r < 1:
        return None
    order = np.argsort(s, kind="stable")
    ss, ds = s[order], d[order]
    if src.kind in ("block-major", "cross-layer"):  # a block's regions adjacent: rows sort block by block
        if n > 1 and not np.all(np.diff(ss)):
            return None  # repeated ids: coalesce's stable sort interleaves their K and V rows
        shape, axis = (n, r), 1  # rows: blocks by source id, regions inside a block
    else:
        if ss[0] < 0 or ss[-1] >= src.nblocks:
            return None  # out of range: regions could overlap, the order would not follow from the ids
        shape, axis = (r, n), 0  # rows: region by region, blocks by source id
    length = np.full(n, src.block_bytes, dtype=np.int64)
    if nbytes_last is not None:
        length[-1] = nbytes_last  # the request's last block, wherever it sorts
    rows = np.empty(shape + (3,), dtype=np.int64)
    for region in range(r):  # 1 or 2 iterations: regions, not descriptors
        at = (slice(None), region) if axis == 1 else (region, slice(None))
        rows[at + (SRC,)] = src.offsets(0, region, ss)
        rows[at + (DST,)] = dst.offsets(0, region, ds)
        rows[at + (LEN,)] = length[order]
    return _merge_sorted(rows.reshape(n * r, 3))


def page_descs(src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray,
               coalesce: bool = False) -> np.ndarray:
    """A ``cross-layer`` request moved page by page: one descriptor per block holding every layer and region
    (``coalesce``: blocks adjacent on both sides merged, in source-id order, as ``coalesce`` orders rows).

    The last block moves whole even when the prompt does not fill it: a page is the engines' unit of transfer,
    and its layers' unfilled tails lie between its filled bytes.  One numpy pass, no loop per block."""
    if src.kind != "cross-layer" or dst.kind != "cross-layer":
        raise ValueError("whole pages need layout 'cross-layer' on both sides")
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    if len(s) != len(d):
        raise ValueError("source and destination block lists differ in length")
    out = np.empty((len(s), 3), dtype=np.int64)
    out[:, SRC], out[:, DST], out[:, LEN] = src.offsets(0, 0, s), dst.offsets(0, 0, d), src.page_bytes
    if not coalesce or len(out) <= 1:
        return out
    return _merge_sorted(out[np.argsort(s, kind="stable")])


def in_last_layer(rows: np.ndarray, layers: int) -> list[np.ndarray]:
    """A request whose rows are final only with its last layer (whole pages) as per-layer arrays: every row in
    the last layer's, the others empty (the harness posts no empty array)."""
    empty = np.empty((0, 3), dtype=np.int64)
    return [empty] * (layers - 1) + [np.ascontiguousarray(rows, dtype=np.int64)]


def bulk_descs(src: Layout, dst: Layout, layer: int, nbytes: int) -> np.ndarray:
    """One descriptor per layer: the same payload as one contiguous copy (the bulk ceiling)."""
    s_off, s_len = src.layer_span(layer)
    d_off, d_len = dst.layer_span(layer)
    if nbytes > min(s_len, d_len):
        raise ValueError("bulk payload larger than a layer of the pool")
    return np.array([[s_off, d_off, nbytes]], dtype=np.int64)


CHUNKS = {"chunk-64K": 64 << 10, "chunk-256K": 256 << 10, "chunk-1M": 1 << 20, "chunk-4M": 4 << 20}


def chunked(d: np.ndarray, size: int) -> np.ndarray:
    """One contiguous range (a bulk layer's descriptor) as back-to-back descriptors of ``size`` bytes."""
    s, t, n = (int(x) for x in d[0])
    starts = np.arange(0, n, size, dtype=np.int64)
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, SRC], out[:, DST] = s + starts, t + starts
    out[:, LEN] = np.minimum(size, n - starts)
    return out


def regions(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Byte ranges ``[start, start + len)`` merged where they overlap or touch, sorted: an ``(n, 2)`` int64 array of
    (start, length).  What a per-request registration pins: each contiguous run of a request's blocks once."""
    if len(starts) == 0:
        return np.empty((0, 2), dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s = np.asarray(starts, dtype=np.int64)[order]
    reach = np.maximum.accumulate(s + np.asarray(lens, dtype=np.int64)[order])
    first = np.flatnonzero(np.r_[True, s[1:] > reach[:-1]])  # a range that starts past everything before it
    last = np.r_[first[1:] - 1, len(s) - 1]
    return np.stack([s[first], reach[last] - s[first]], axis=1)


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
