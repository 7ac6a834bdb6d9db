"""One workload case as both of its loops see it: the fixed facts of the case (LoadCase), named, not a dict.

Built once per case by LoadHarness.measure (load.py) and read by the prefill
rank's loop there and the decode rank's loop (load_decode.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.harness.checkpass import epoch_of
from kvbench.harness.requests import pool_allocator
from kvbench.memory.verify import Expected
from kvbench.model.ageing import TraceRequests
from kvbench.model.descriptors import coalesce, request_descs
from kvbench.model.layout import BlockAllocator, Layout, parse_alloc

SLOTS = 4  # source-side request slots: a prefill rank's pool holds this many of its largest request
POLL_S = 0.0  # idle loops yield the core but keep polling (as MPI waits do): wake-up latency is ms under load
NAN = float("nan")


@dataclass
class LoadCase:
    case: dict  # the suite's case (block_size, op, overlap, handshake, alloc, coalesce, ...)
    g: dict  # its geometry (case_geometry): shape, block bytes
    t: Any  # the transport
    cap: int  # decode pool capacity in blocks
    plans: dict  # prefill rank -> its requests' arrivals, tokens, blocks and prefill seconds (LoadHarness.workload)
    srcs: list[int]  # prefill ranks
    dests: dict[int, list[int]]  # prefill rank -> its decode ranks (requests go round-robin over them)
    lay: Layout
    pool: np.ndarray  # this rank's pool, as bytes
    elem: int  # bytes per element of the dtype
    n: int  # requests per prefill rank
    bpt: int  # KV bytes per token
    seed: int
    no: int = 0  # the case's number: with a request's id, its epoch under ``-c all``
    t0: float = 0.0  # perf_counter at the end of the case's first barrier: the workload's clock starts there
    clk: Callable[[], float] = None  # seconds since t0
    pats: dict = field(default_factory=dict)  # -c all: prefill rank -> SlotPatterns of its slots (primed)
    dalloc: BlockAllocator | None = None  # this decode rank's allocator, built before the clock (decode_allocator)
    aged_by: TraceRequests | None = None  # aged:<N> under a trace: its requests age the pool (None: drawn ones)

    def slots(self, rank: int) -> list:
        """Prefill rank ``rank``'s request slots (SLOTS x its largest request; None where the pool is too small):
        seeded, so its decode ranks know them too."""
        nb = int(self.plans[rank]["nblocks"].max())
        alloc = BlockAllocator(self.lay.nblocks, seed=self.seed * 7919 + rank * 2)
        spec = "contiguous" if parse_alloc(self.case["alloc"])[0] == "aged" else self.case["alloc"]  # decode's ages
        return [alloc.allocate(nb, spec) for _ in range(SLOTS)]

    def decode_allocator(self, rank: int) -> BlockAllocator:
        """Decode rank ``rank``'s allocator of ``cap`` blocks (``aged:<N>``: its free list aged, which takes a
        while: built before the workload's clock starts)."""
        return pool_allocator(self.cap, self.seed * 7919 + rank * 2 + 1, self.case, "dst", self.aged_by)

    def prime(self, ranks) -> None:
        """-c all: the slot patterns of ``ranks`` computed now, before the workload's clock runs."""
        for s in ranks:
            self.pats[s] = SlotPatterns(s, self.lay)
            for ids in self.slots(s):
                if ids is not None:
                    self.pats[s].layers(ids, self.lay.block_bytes, 0)

    def epoch(self, rid: int) -> int:
        """The pattern's epoch of request ``rid`` (ids are unique over the prefill ranks): under ``-c all`` its
        source layers take it when final, so its bytes differ from every other request's, in any block."""
        return epoch_of(self.no, rid)

    def last(self, nblocks: int, ntok: int) -> int:
        """Bytes of a request's last block (a prompt need not fill it)."""
        return (ntok - (nblocks - 1) * self.case["block_size"]) * self.g["shape"].row_elems * self.elem

    def descs(self, src_ids, dst_ids, ntok: int) -> list[np.ndarray]:
        """A request's descriptor arrays, one per layer, from its source and destination blocks."""
        out = request_descs(self.lay, self.lay, src_ids, dst_ids, self.last(len(src_ids), ntok))
        return [coalesce(d) for d in out] if self.case["coalesce"] == "on" else out


class SlotPatterns:
    """What a prefill rank's request slots hold in any epoch (``-c all``): each slot's epoch-0 pattern computed
    once (verify.Expected: later epochs are one XOR), a request's bytes cut from it.  A request's source blocks
    are a prefix of its slot's, so the slot is known by its first block."""

    def __init__(self, rank: int, lay: Layout):
        self.rank, self.lay, self.slots = rank, lay, {}

    def layers(self, src_ids: np.ndarray, last: int, epoch: int) -> np.ndarray:
        """(layers, bytes): row i is layer i's bytes of the request, back to back in its descriptors' order."""
        lay, nb = self.lay, len(src_ids)
        have = self.slots.get(int(src_ids[0]))
        if have is None or have[0] < nb:
            have = self.slots[int(src_ids[0])] = (nb, Expected(self.rank, np.concatenate(
                request_descs(lay, lay, src_ids, src_ids))))
        a = have[1].at(epoch).reshape(lay.layers, have[0], lay.regions, lay.block_bytes)
        return np.concatenate([a[:, : nb - 1].reshape(lay.layers, -1), a[:, nb - 1, :, :last].reshape(lay.layers, -1)],
                              axis=1)
