"""Pools of hybrid models (layers.py): the attention layers' blocks, then one state slot per request per linear layer.

The attention plane is a Layout over the full and sliding layers, in the model's order; one block table
addresses both kinds, and a sliding layer moves only its window: the blocks from the one its first token
sits in, entered at that token, so it moves exactly the window's bytes.  The state plane follows the
attention plane: ``linear_layers x nslots`` slots of one layer's state (recurrent + convolution) each; a
request holds slot s in every linear layer, so its state moves as one descriptor per linear layer, whatever
the prompt length.  The check pass verifies these descriptors like every other (memory/verify.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.model import layers as L
from kvbench.model import shapes as M
from kvbench.model.descriptors import DST, LEN, SRC, bulk_descs, coalesce, request_descs
from kvbench.model.layout import Layout


def geometry(case: dict, shape: M.ModelShape, ntok: int) -> dict:
    """case_geometry's numbers for a hybrid model: attention blocks, the window's first block, the state."""
    bs, elem = case["block_size"], M.dtype_bytes(case["dtype"])
    nb = M.num_blocks(ntok, bs)
    row = shape.row_elems * elem if shape.attn_layers else 0
    first, skip = L.window_blocks(shape, ntok, bs)
    sb = L.state_layer_bytes(shape)
    kinds = L.layer_kinds(shape)
    return {"shape": shape, "ntok": ntok, "block_bytes": bs * row, "nblocks": nb, "last_bytes": (ntok - (nb - 1) * bs) * row,
            "full_bytes": shape.attn_layers * shape.regions * nb * bs * row + shape.linear_layers * sb,
            "payload": sum(L.parts(shape, case["dtype"], ntok).values()), "hybrid": True, "kinds": kinds,
            "win_first": first, "win_skip": skip * row, "state_bytes": sb}


@dataclass(frozen=True)
class HybridPool:
    """Where a hybrid model's bytes sit in one pool: ``attn`` (the attention plane), then the state slots."""

    attn: Layout
    state_base: int
    state_bytes: int
    nslots: int  # request states each linear layer holds
    linear_layers: int

    def state_offset(self, lin: int, slot: int) -> int:
        """Byte offset of request slot ``slot``'s state in linear layer ``lin`` (its index among linear layers)."""
        return self.state_base + (lin * self.nslots + slot) * self.state_bytes


def fit(kind: str, g: dict, pool_bytes: int) -> HybridPool:
    """The largest hybrid layout of ``g``'s shape in ``pool_bytes``: as many request states per linear layer as
    whole requests fit, the rest attention blocks."""
    shape = g["shape"]
    A, R, bb, sb, lin = shape.attn_layers, shape.regions, g["block_bytes"], g["state_bytes"], shape.linear_layers
    Layout.fit(kind, max(A, 1), R, max(bb, 1), pool_bytes)  # the layout's own checks (kind against regions)
    nslots = max(1, pool_bytes // max(1, g["full_bytes"])) if lin else 0
    nb = (pool_bytes - lin * nslots * sb) // (A * R * bb) if A and bb else 0
    attn = Layout(kind, A, R, bb, int(max(0, nb)))
    return HybridPool(attn, attn.nbytes, sb, int(nslots), lin)


def _indices(kinds: list[str]) -> list[int]:
    """Each layer's index among the layers of its plane: attention (full, sliding) or state (linear)."""
    out, n = [], {"attn": 0, "state": 0}
    for k in kinds:
        plane = "state" if k == "linear" else "attn"
        out.append(n[plane])
        n[plane] += 1
    return out


def request_layers(hp: HybridPool, g: dict, src_blocks, dst_blocks, slots: tuple[int, int], descs, on: bool,
                   variant: str = "paged") -> list[np.ndarray]:
    """Per model layer: a full layer's blocks, a sliding layer's window, a linear layer's state (one descriptor).

    ``descs`` builds the full layers' rows (request_descs or coalesced_descs, ``on``: coalescing is on);
    ``slots`` are the request's state slots (source, destination).  A reference ``variant`` (bulk, hot,
    chunk-*) makes each attention layer one range from its layer's start; its states keep slot 0 here and
    schemes.offset_bulk moves every range by the request's slot, states included.
    """
    kinds, idx = g["kinds"], _indices(g["kinds"])
    full_a = [a for k, a in zip(kinds, idx) if k == "full"]
    slide_a = [a for k, a in zip(kinds, idx) if k == "sliding"]
    attn: dict[int, np.ndarray] = {}
    if full_a:
        attn.update(zip(full_a, descs(hp.attn, hp.attn, src_blocks, dst_blocks, g["last_bytes"], layers=full_a)))
    if slide_a:
        first, skip, R = g["win_first"], g["win_skip"], hp.attn.regions
        for a, d in zip(slide_a, request_descs(hp.attn, hp.attn, src_blocks[first:], dst_blocks[first:],
                                               g["last_bytes"], layers=slide_a)):
            d = d.copy()
            d[:R, SRC] += skip  # the window's first block, entered at its first token (rows: block by block)
            d[:R, DST] += skip
            d[:R, LEN] -= skip
            attn[a] = coalesce(d) if on else d
    bulk = variant != "paged"
    out = []
    for k, i in zip(kinds, idx):
        if k == "linear":
            s, t = (0, 0) if bulk else slots
            sb = hp.state_bytes
            out.append(np.array([[hp.state_offset(i, s), hp.state_offset(i, t), sb]], dtype=np.int64))
        elif bulk:
            a = 0 if variant == "hot" else i  # hot: every layer is the first attention layer's range
            out.append(bulk_descs(hp.attn, hp.attn, a, int(attn[i][:, LEN].sum())))
        else:
            out.append(np.ascontiguousarray(attn[i]))
    if variant == "hot":  # and every state the first linear layer's
        first = next((d for k, d in zip(kinds, out) if k == "linear"), None)
        out = [first if k == "linear" else d for k, d in zip(kinds, out)]
    return out


def check_bulk(hp: HybridPool, g: dict, layers: list[np.ndarray], hot: bool) -> bool:
    """Do a reference's ranges, moved by their request's slot, stay inside their layer (attention) or their
    linear layer's slots (states)?"""
    for k, i, d in zip(g["kinds"], _indices(g["kinds"]), layers):
        if k == "linear":
            start, span = hp.state_offset(0 if hot else i, 0), hp.nslots * hp.state_bytes
        else:
            start, span = hp.attn.layer_span(0 if hot else i)
        if int((d[:, :2] + d[:, 2:3]).max()) > start + span:
            return False
    return True
