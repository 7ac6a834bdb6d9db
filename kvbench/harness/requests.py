"""What a case's requests are, before anything is timed: their geometry, the pool that holds them, and the
plan of their blocks and descriptors (the control plane).
"""
from __future__ import annotations

import numpy as np

from kvbench import memory
from kvbench.harness import tprequests
from kvbench.harness.flows import flow_case, largest
from kvbench.harness.state import Session
from kvbench.model import hybridpool, planes
from kvbench.model import shapes as M
from kvbench.model.ageing import TraceRequests, aged_order, trace_aged_order
from kvbench.model.descriptors import (
    CHUNKS,
    LEN,
    bulk_descs,
    chunked,
    coalesced_descs,
    in_last_layer,
    page_descs,
    request_descs,
)
from kvbench.model.layout import BlockAllocator, Layout, parse_alloc
from kvbench.model.matrix import ALL
from kvbench.model.schemes import Entry, offset_bulk
from kvbench.model.tpmap import case_pair
from kvbench.transports.base import TransportError


def case_geometry(case: dict) -> dict:
    """Shape numbers of a case: blocks, block bytes, payload (pure arithmetic)."""
    if tp := case_pair(case["tp"]):  # --tp P:D: each side's own heads (tprequests.py)
        return tprequests.geometry(case, tp)
    shape = M.shard(M.get_model(case["model"]), case["tp"], case["pp"])
    ntok = M.transferred_tokens(case["tokens"], case["prefix_hit"])
    if planes.scaled(case, shape):  # values, block scales, indexer keys, tensor scales in planes of their own
        return planes.geometry(case, shape, ntok)
    if shape.hybrid:  # sliding windows and linear states beside the attention blocks
        return hybridpool.geometry(case, shape, ntok)
    bs = case["block_size"]
    bb = M.block_bytes(shape, bs, case["dtype"])
    nb = M.num_blocks(ntok, bs)
    last = (ntok - (nb - 1) * bs) * shape.row_elems * M.dtype_bytes(case["dtype"])
    return {"shape": shape, "ntok": ntok, "block_bytes": bb, "nblocks": nb, "last_bytes": last,
            "full_bytes": shape.layers * shape.regions * nb * bb,
            "payload": M.bytes_per_token(shape, case["dtype"]) * ntok}


def layer_bytes(case: dict, cells: list[str] | None = None) -> int:
    """The largest layer a case moves (a matrix: its largest flow's; the preflight's)."""
    g = case_geometry(largest(case, cells))
    return g["payload"] // g["shape"].layers


def pool_bytes(cases: list[dict], factor: float, entries: int = 1) -> int:
    """One pool size for a transport's cases: ``factor`` x the requests one rank holds at once.

    ``entries`` is the number of pairs the busiest rank belongs to; each case
    multiplies it by its own ``inflight``.
    """
    need = max(case_geometry(c)["full_bytes"] * c.get("inflight", 1) for c in cases) * entries
    return -(-int(need * factor) // memory.PAGE) * memory.PAGE


def pool_allocator(nblocks: int, seed: int, case: dict, side: str,
                   trace: TraceRequests | None = None) -> BlockAllocator:
    """A rank's allocator for one side of a case: ``aged:<N>`` ages the decode side's (``dst``) free list first
    (untimed: the control plane), by ``trace``'s requests under a trace's replay, else by drawn ones seeded by
    ``seed``; every other allocator starts fresh."""
    alloc = BlockAllocator(nblocks, seed=seed)
    kind, n = parse_alloc(case["alloc"])
    if kind == "aged" and side == "dst" and case.get("variant", "paged") == "paged":
        bs = case["block_size"]
        alloc.age(aged_order(nblocks, bs, n, seed) if trace is None else trace_aged_order(nblocks, bs, n, trace))
    return alloc


def plan(comm, rank: int, seed: int, case: dict, g: dict, s: Session) -> list[Entry]:
    """Control plane (untimed): decode reserves its blocks, prefill picks its own; both learn both (``seed``: the
    case's own, from the run's seed and the case number)."""
    if "tp_map" in g:  # --tp P:D: a pair per piece of the map
        return tprequests.plan(comm, rank, seed, case, g, s, pool_allocator)
    fmt = planes.fit(case["layout"], g, s.nbytes) if "fmt" in g else None
    hyb = hybridpool.fit(case["layout"], g, s.nbytes) if "hybrid" in g else None
    lay = fmt[0] if fmt else hyb.attn if hyb else Layout.fit(case["layout"], g["shape"].layers, g["shape"].regions,
                                                             g["block_bytes"], s.nbytes)
    bulk = case["variant"] != "paged"  # a reference: contiguous blocks, one range per layer to start from
    # cross-layer pages posted at once: whole pages, the last one too (bulk references move the tokens' bytes,
    # one reference per payload for every layout: harness/loop.py variants)
    whole = lay.kind == "cross-layer" and case.get("overlap", "serial") == "serial"
    # a matrix's flows move their own tokens (harness/flows.py); every other scheme's pairs the case's
    geo = [case_geometry(flow_case(case, c)) if c != ALL else g for c in s.cells] if s.cells else [g] * len(s.pairs)
    # a rank that sends and receives (bidir, a matrix) takes both sides' blocks from one allocator: disjoint
    both = any(src == rank for src, _ in s.pairs) and any(dst == rank for _, dst in s.pairs)
    # flows of several sizes: bulk slices a layer by the largest flow's bytes, so none overlaps the next
    stride = max(x["full_bytes"] // x["shape"].layers for x in geo) if s.cells else None
    aged = parse_alloc(case["alloc"])[0] == "aged"  # the decode pool aged, the prefill's fresh: its runs are decode's
    allocs: dict[str, BlockAllocator] = {}
    mine, slots = {}, {}
    for i, (src, dst) in enumerate(s.pairs):
        for req in range(case["inflight"]):
            for side, r in (("src", src), ("dst", dst)):
                if r != rank:
                    continue
                pool_side = "both" if both else side  # a rank on both sides ages its one pool as decode's
                if pool_side not in allocs:
                    allocs[pool_side] = pool_allocator(lay.nblocks, seed * 7919 + r * 2 + (side == "dst"), case,
                                                       "dst" if both else side)
                spec = "contiguous" if bulk or (aged and side == "src") else case["alloc"]
                ids = allocs[pool_side].allocate(geo[i]["nblocks"], spec)
                if ids is None:
                    raise TransportError(f"pool of {lay.nblocks} blocks per layer cannot hold the requests "
                                         f"in flight; raise --pool-factor")
                mine[(i, req, side)] = ids
                slots[(i, req, side)] = sum(1 for key in slots if both or key[2] == side)
    blocks, allslots = tprequests.gathered(comm, mine, slots, s.local)
    entries = []
    for i, (src, dst) in enumerate(s.pairs):
        if rank not in (src, dst):
            continue
        g, ntok = geo[i], (geo[i]["ntok"] + case["prefix_hit"] if s.cells else 0)
        for req in range(case["inflight"]):
            layers = []
            descs = coalesced_descs if case["coalesce"] == "on" else request_descs  # bulk only sums lengths
            if fmt:  # scale planes beside the values: their own descriptors
                entries.append(Entry(i, req, src, dst, planes.request_layers(
                    fmt, g, blocks[(i, req, "src")], blocks[(i, req, "dst")], descs, bulk, whole, case["coalesce"] == "on"),
                    blocks[(i, req, "dst")], ntok))
                continue
            if hyb:  # each layer by its kind: blocks, a window, or one state slot
                entries.append(Entry(i, req, src, dst, hybrid_layers(hyb, case, g, blocks, allslots, (i, req), descs),
                                     blocks[(i, req, "dst")]))
                continue
            ids = blocks[(i, req, "src")], blocks[(i, req, "dst")]
            if whole and not bulk:
                per_layer = in_last_layer(page_descs(lay, lay, *ids, case["coalesce"] == "on"), lay.layers)
            else:
                per_layer = descs(lay, lay, *ids, g["last_bytes"])
            for layer, d in enumerate(per_layer):
                if bulk:
                    d = bulk_descs(lay, lay, layer, int(d[:, LEN].sum()))
                layers.append(np.ascontiguousarray(d))
            if bulk:  # requests sharing a pool get disjoint slices of each layer
                if case["variant"] == "hot":  # every layer is layer 0's range: the same buffer, cache-hot
                    layers = [layers[0]] * len(layers)
                layers = offset_bulk(layers, allslots[(i, req, "src")], allslots[(i, req, "dst")], stride)
                for j, d in enumerate(layers):
                    start, span = lay.layer_span(0 if case["variant"] == "hot" else j)
                    if int((d[:, :2] + d[:, 2:3]).max()) > start + span:
                        raise TransportError("bulk requests in flight do not fit a layer; raise --pool-factor")
                if case["variant"] in CHUNKS:
                    layers = [chunked(d, CHUNKS[case["variant"]]) for d in layers]
            entries.append(Entry(i, req, src, dst, layers, blocks[(i, req, "dst")], ntok))
    return entries


def hybrid_layers(hyb, case: dict, g: dict, blocks: dict, allslots: dict, key: tuple, descs) -> list[np.ndarray]:
    """A hybrid model's request, layer by layer (hybridpool.py); a reference's ranges moved to the request's slot."""
    slots = (allslots[key + ("src",)], allslots[key + ("dst",)])
    if hyb.linear_layers and max(slots) >= hyb.nslots:
        raise TransportError(f"pool holds {hyb.nslots} request states per linear layer, fewer than the requests "
                             "in flight; raise --pool-factor")
    layers = hybridpool.request_layers(hyb, g, blocks[key + ("src",)], blocks[key + ("dst",)], slots, descs,
                                       case["coalesce"] == "on", case["variant"])
    if case["variant"] == "paged":
        return layers
    layers = offset_bulk(layers, *slots)
    if not hybridpool.check_bulk(hyb, g, layers, case["variant"] == "hot"):
        raise TransportError("bulk requests in flight do not fit a layer; raise --pool-factor")
    return [chunked(d, CHUNKS[case["variant"]]) for d in layers] if case["variant"] in CHUNKS else layers


def case_label(no: int, case: dict) -> str:
    """How the one-line failure message names a case."""
    what = "bulk" if case.get("variant") == "bulk" else f"{case['alloc']} {case['block_size']}-token blocks"
    return f"case {no} ({case['transport']} {case['op']} {case['model']} {case['tokens']} tokens, {what})"
