"""Pools of scaled formats (formats.py): values, block scales and tensor scales in planes of their own.

Engines keep a quantized cache's scales beside its values, indexed by the same
block table: a block id names a block of values *and* its block of scales.  The
pool is cut into three planes, each a Layout of its own (values, then block
scales, then one tensor-scale row per layer), all with the same block count, so
one block table addresses all of them.  A request's layer then moves, per
block and region, its values and its scales (two descriptors where a plain
dtype has one), and per layer its tensor scales (one more).

A model with a sparse-attention indexer (DeepSeek-V3.2) keeps the indexer's key
cache the same way, in a plane of its own after the others: per layer a second
region with its own bytes per token (a block of it is not a block of the
latent), addressed by the same block table, one more descriptor per block.
Packed formats (fp8-ds-mla: scales inside each row) have no scale plane.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.model import shapes as M
from kvbench.model.descriptors import bulk_descs, in_last_layer, page_descs
from kvbench.model.formats import Format
from kvbench.model.layout import Layout


@dataclass(frozen=True)
class Plane(Layout):
    """A Layout that starts ``base`` bytes into the pool."""

    base: int = 0

    def offsets(self, layer, region, blocks):
        return self.base + super().offsets(layer, region, blocks)

    def layer_span(self, layer):
        off, n = super().layer_span(layer)
        return self.base + off, n


def scaled(case: dict, shape: M.ModelShape | None = None) -> bool:
    """Whether a case's pool is cut into planes: a format with scales or a packed row, or (``shape``) a model
    with an indexer cache beside its latent."""
    return (case["dtype"] in ("nvfp4", "fp8-ds-mla") or case.get("scales", "none") != "none"
            or (shape is not None and shape.indexer_bytes > 0))


def geometry(case: dict, shape: M.ModelShape, ntok: int) -> dict:
    """case_geometry's numbers for a scaled format: value blocks, scale blocks, tensor scales, payload."""
    fmt = Format(case["dtype"], case.get("scales", "none"))
    bs = case["block_size"]
    nb = M.num_blocks(ntok, bs)
    vbt, sbt, tsb = fmt.value_bytes_token(shape), fmt.block_scale_bytes_token(shape), fmt.tensor_scale_bytes
    tail = ntok - (nb - 1) * bs
    L, R, ib = shape.layers, shape.regions, shape.indexer_bytes
    return {"shape": shape, "ntok": ntok, "block_bytes": bs * vbt, "nblocks": nb, "last_bytes": tail * vbt,
            "scale_block_bytes": bs * sbt, "scale_last_bytes": tail * sbt, "tensor_bytes": R * tsb,
            "index_block_bytes": bs * ib, "index_last_bytes": tail * ib,
            "full_bytes": L * R * nb * bs * (vbt + sbt) + L * nb * bs * ib + L * R * tsb,
            "payload": sum(fmt.parts(shape, ntok).values()), "elem": 1, "fmt": fmt}


def fit(kind: str, g: dict, nbytes: int) -> tuple[Plane, Plane | None, int | None, Plane | None]:
    """The planes of a pool of ``nbytes``: (values, block scales or None, tensor-scale base or None, indexer
    keys or None)."""
    shape = g["shape"]
    L, R, ibb = shape.layers, shape.regions, g["index_block_bytes"]
    Layout.fit(kind, L, R, g["block_bytes"], nbytes)  # the layout's own checks (kind against regions)
    tensor = L * g["tensor_bytes"]
    per = L * R * (g["block_bytes"] + g["scale_block_bytes"]) + L * ibb
    nb = max(0, (nbytes - tensor) // per)
    values = Plane(kind, L, R, g["block_bytes"], nb, 0)
    scales = Plane(kind, L, R, g["scale_block_bytes"], nb, values.nbytes) if g["scale_block_bytes"] else None
    end = values.nbytes + (scales.nbytes if scales else 0)
    index = Plane(kind, L, 1, ibb, nb, end) if ibb else None  # one region per layer, whatever the layout's
    end += index.nbytes if index else 0
    return values, scales, end if g["tensor_bytes"] else None, index


def request_layers(planes, g: dict, src_blocks, dst_blocks, descs, bulk: bool, whole: bool = False,
                   coalesce: bool = False) -> list[np.ndarray]:
    """Per layer: the values' descriptors, then the block scales', the indexer keys', the tensor scales' one.
    ``whole`` (cross-layer pages posted at once): each plane's whole pages (``coalesce``: adjacent ones merged),
    every row in the last layer's array (descriptors.in_last_layer); a bulk reference moves the tokens' bytes."""
    values, scales, tbase, index = planes
    parts = ([(values, g["last_bytes"])] + ([(scales, g["scale_last_bytes"])] if scales else [])
             + ([(index, g["index_last_bytes"])] if index else []))
    per_plane = []
    for plane, last in parts:
        if whole and not bulk:
            per_plane.append(in_last_layer(page_descs(plane, plane, src_blocks, dst_blocks, coalesce), plane.layers))
            continue
        lay = descs(plane, plane, src_blocks, dst_blocks, last)
        if bulk:  # a reference: each plane's bytes of the layer as one contiguous copy
            lay = [bulk_descs(plane, plane, k, int(d[:, 2].sum())) for k, d in enumerate(lay)]
        per_plane.append(lay)
    out = []
    for k in range(g["shape"].layers):
        rows = [p[k] for p in per_plane]
        if tbase is not None:
            off = tbase + k * g["tensor_bytes"]
            rows.append(np.array([[off, off, g["tensor_bytes"]]], dtype=np.int64))
        out.append(np.ascontiguousarray(np.concatenate(rows)))
    return in_last_layer(np.concatenate(out), len(out)) if whole and not bulk else out
