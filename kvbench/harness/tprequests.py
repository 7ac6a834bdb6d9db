"""A case run at ``--tp P:D``: prefill ranks 0..P-1 hold P's heads, decode ranks P..P+D-1 D's, and each pair is
one piece of the TP map (model/tpmap.py): the heads one decode rank takes from one prefill rank.

Each side's pool holds its own layout (a prefill rank's blocks hold its heads, a decode rank's its own), fitted
in the one pool size every rank shares.  A rank's request has one set of blocks however many pieces it sends or
receives: the pieces of a gather (TP 4 -> 2) land in the same decode blocks, each at its own heads, and the slices
of a split (TP 2 -> 4) leave the same prefill blocks.  A reference (bulk, ceiling, hot) moves each piece's bytes
as one range per layer, in slots of its own.
"""
from __future__ import annotations

import numpy as np

from kvbench.model import shapes as M
from kvbench.model import tpmap as T
from kvbench.model.descriptors import CHUNKS, chunked, coalesce
from kvbench.model.layout import Layout, parse_alloc
from kvbench.model.schemes import Entry, make_pairs, offset_bulk
from kvbench.transports.base import TransportError


def pairs(case: dict) -> list[tuple[int, int]] | None:
    """The case's (prefill rank, decode rank) pairs, one per piece; None for one TP degree (the scheme's)."""
    tp = T.case_pair(case["tp"])
    if tp is None:
        return None
    return T.rank_pairs(T.tp_map(M.shard(M.get_model(case["model"]), 1, case["pp"]), 1, case["block_size"],
                                 case["dtype"], case["layout"], case["head_layout"], tp))


def session_tp(case: dict):
    """What splits a transport's cases into sessions beyond registering.session_key: a P:D case's pairs are its
    own (its TP), one TP degree's are the run's (None: never a split)."""
    return case["tp"] if isinstance(case["tp"], str) else None


def pair_sets(cases: list[dict], scheme: str, world: int, matrix=None) -> list[list[tuple[int, int]]]:
    """Every set of pairs a run's cases take: their TP maps' at P:D, else the scheme's alone (SchemeError)."""
    tps = {c["tp"]: pairs(c) for c in cases if isinstance(c["tp"], str)}
    return list(tps.values()) or [make_pairs(scheme, world, matrix)]


def geometry(case: dict, tp: T.TPPair) -> dict:
    """case_geometry at P:D: the decode side's shape and block bytes, the prefill side's beside them, pools sized
    by the larger side's blocks, the payload of the decode rank that receives the most, and the map."""
    whole = M.get_model(case["model"])
    src, dst = M.shard(whole, tp.prefill, case["pp"]), M.shard(whole, tp.decode, case["pp"])
    ntok = M.transferred_tokens(case["tokens"], case["prefix_hit"])
    bs, dt = case["block_size"], case["dtype"]
    tmap = T.tp_map(M.shard(whole, 1, case["pp"]), ntok, bs, dt, case["layout"], case["head_layout"], tp)
    sbb, dbb = M.block_bytes(src, bs, dt), M.block_bytes(dst, bs, dt)
    nb = M.num_blocks(ntok, bs)
    per = [sum(q.nbytes for q in tmap.of(d)) for d in range(tp.decode)]
    return {"shape": dst, "ntok": ntok, "block_bytes": dbb, "src_block_bytes": sbb, "nblocks": nb,
            "last_bytes": (ntok - (nb - 1) * bs) * dst.row_elems * M.dtype_bytes(dt),
            "full_bytes": dst.layers * dst.regions * nb * max(sbb, dbb), "payload": max(per), "tp_map": tmap}


def plan(comm, rank: int, seed: int, case: dict, g: dict, s, allocator) -> list[Entry]:
    """requests.plan at P:D (``allocator``: requests.pool_allocator); the same control plane: each rank reserves
    its blocks, all learn all."""
    if s.local:
        raise TransportError(f"--tp {case['tp']} moves heads between ranks: a transport of one rank has none")
    tmap, shape = g["tp_map"], g["shape"]
    lays = {side: Layout.fit(case["layout"], shape.layers, shape.regions, g[key], s.nbytes)
            for side, key in (("src", "src_block_bytes"), ("dst", "block_bytes"))}
    bulk = case["variant"] != "paged"
    aged = parse_alloc(case["alloc"])[0] == "aged"
    allocs, mine, slots = {}, {}, {}
    for i, (src, dst) in enumerate(s.pairs):
        for req in range(case["inflight"]):
            for side, r in (("src", src), ("dst", dst)):
                key = key_of(i, req, side, r, bulk)
                if r != rank or key in mine:
                    continue
                if side not in allocs:
                    allocs[side] = allocator(lays[side].nblocks, seed * 7919 + r * 2 + (side == "dst"), case, side)
                spec = "contiguous" if bulk or (aged and side == "src") else case["alloc"]
                ids = allocs[side].allocate(g["nblocks"], spec)
                if ids is None:
                    raise TransportError(f"pool of {lays[side].nblocks} blocks per layer cannot hold the requests "
                                         "in flight; raise --pool-factor")
                slots[key] = sum(1 for k in mine if k[2] == side)
                mine[key] = ids
    blocks, allslots = gathered(comm, mine, slots)
    entries = []
    for i, (src, dst) in enumerate(s.pairs):
        if rank not in (src, dst):
            continue
        piece = tmap.pieces[i]
        for req in range(case["inflight"]):
            sk, dk = key_of(i, req, "src", src, bulk), key_of(i, req, "dst", dst, bulk)
            layers = T.piece_descs(piece, tmap, lays["src"], lays["dst"], blocks[sk], blocks[dk])
            if bulk:
                layers = bulk_layers(case, lays, piece.nbytes // shape.layers, shape.layers, allslots[sk],
                                     allslots[dk])
            elif case["coalesce"] == "on":
                layers = [coalesce(d) for d in layers]
            entries.append(Entry(i, req, src, dst, [np.ascontiguousarray(d) for d in layers], blocks[dk]))
    return entries


def key_of(pair: int, req: int, side: str, rank: int, bulk: bool) -> tuple:
    """A request's blocks on one side: a paged request's are its rank's, whichever pieces it sends or receives; a
    reference's are its pair's (a slot of its own)."""
    return (pair if bulk else ("rank", rank), req, side)


def bulk_layers(case: dict, lays: dict, nbytes: int, layers: int, src_slot: int, dst_slot: int) -> list[np.ndarray]:
    """A piece's reference: its bytes of each layer as one range on each side, shifted to its slots."""
    hot = case["variant"] == "hot"  # every layer is layer 0's range: the same buffer, cache-hot
    out = []
    for j in range(layers):
        s0, s_len = lays["src"].layer_span(0 if hot else j)
        d0, d_len = lays["dst"].layer_span(0 if hot else j)
        if (src_slot + 1) * nbytes > s_len or (dst_slot + 1) * nbytes > d_len:
            raise TransportError("bulk requests in flight do not fit a layer; raise --pool-factor")
        out.append(np.array([[s0, d0, nbytes]], dtype=np.int64))
    out = offset_bulk(out, src_slot, dst_slot)
    return [chunked(d, CHUNKS[case["variant"]]) for d in out] if case["variant"] in CHUNKS else out


def gathered(comm, mine: dict, slots: dict, local: bool = False) -> tuple[dict, dict]:
    """Every rank's block ids and slots, merged (``local``: this rank's alone, no other rank takes part)."""
    blocks, allslots = {}, {}
    for part, sl in ([(mine, slots)] if local else comm.allgather((mine, slots))):
        blocks.update(part)
        allslots.update(sl)
    return blocks, allslots
