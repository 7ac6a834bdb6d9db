"""One workload case as both of its loops see it: the fixed facts of the case (LoadCase), named, not a dict.

Built once per case by LoadHarness.measure (load.py) and read by the prefill
rank's loop there and the decode rank's loop (load_decode.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.model.descriptors import coalesce, request_descs
from kvbench.model.layout import Layout

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
    t0: float = 0.0  # perf_counter at the end of the case's first barrier: the workload's clock starts there
    clk: Callable[[], float] = None  # seconds since t0

    def descs(self, src_ids, dst_ids, ntok: int) -> list[np.ndarray]:
        """A request's descriptor arrays, one per layer, from its source and destination blocks."""
        last = (ntok - (len(src_ids) - 1) * self.case["block_size"]) * self.g["shape"].row_elems * self.elem
        out = request_descs(self.lay, self.lay, src_ids, dst_ids, last)
        return [coalesce(d) for d in out] if self.case["coalesce"] == "on" else out
