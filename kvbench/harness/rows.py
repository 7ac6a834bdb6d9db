"""A case's result rows: the case keys every row carries, one row per (entry, iteration) and the check's row,
gathered to rank 0's sink.

``Rows`` is mixed into the harness (it reads ``comm``, ``rank``, ``opts``,
``case_no`` and ``sink``) so that subclasses such as the workload harness
build their rows through the same ``base_row`` and ``deliver``.
"""
from __future__ import annotations

import numpy as np

from kvbench.codecs.path import codec_columns, lossy_columns
from kvbench.harness import carriage, flows, pathcheck, placing, railrows, setuprows, wirerows
from kvbench.harness.requests import case_geometry
from kvbench.harness.state import Record
from kvbench.job import faults
from kvbench.model.descriptors import CHUNKS
from kvbench.model.schemes import control_bytes
from kvbench.results import costs
from kvbench.results.schema import FABRIC_DEFAULTS

nan = float("nan")


class Rows:
    """Building and delivering rows (a mixin of ``Harness``)."""

    def base_row(self, case: dict, g: dict | None = None, no: int | None = None) -> dict:
        bulk = case.get("variant", "paged") != "paged"
        return {
            "case": self.case_no if no is None else no, "variant": case.get("variant", "paged"), "transport": case["transport"],
            "op": case["op"], "memory": case.get("memory", "host"), "copy": case.get("copy", "batch"),
            "prefill": case.get("prefill", "clock"), "model": case["model"], "tokens": case["tokens"],
            "prefix_hit": case["prefix_hit"], "block_size": 0 if bulk else case["block_size"],
            "block_bytes": CHUNKS.get(case.get("variant"), 0) if bulk or g is None else g["block_bytes"],
            "layout": case["layout"],
            "allocation": case["variant"] if bulk else case["alloc"], "coalesce": "bulk" if bulk else case["coalesce"],
            "dtype": case["dtype"], "codec": case.get("codec", "none"), "fill": self.opts.fill,
            "scales": case.get("scales", "none"),
            "overlap": case["overlap"], "scheme": case["scheme"],
            "handshake": case["handshake"], "prefill_ms_set": case["prefill_ms_set"], "workload": case["workload"],
            "layers": (g or case_geometry(case))["shape"].layers,
            "tp": case["tp"], "pp": case["pp"], "world_size": self.comm.size, "inflight": case["inflight"],
            "register": case.get("register", "once"),
            "pages": self.opts.pages, "cache": self.opts.cache, "cache_bytes": 0,
            "gpu": -1, "nic": "", "same_gpu": False,  # placement (placing.columns) in a measured row
            # why its timed iterations ended (calibrate.py sets it on the case; schema 5)
            "ci_stop": case.get("ci_stop", "fixed"), "ci_target_pct": self.opts.target_ci or float("nan"),
            "row_kind": "transfer", "phase": "", "peer": -1, "region_bytes": nan,  # setup rows: setuprows.py
            **dict(FABRIC_DEFAULTS, flow_mode=case.get("flow_mode", "")),  # rails (railrows.py), flows (flows.py)
            **carriage.DEFAULTS,  # a timed row's carrier columns (schema 7): carriage.py
            **wirerows.DEFAULTS,  # a timed row's counted wire bytes (schema 8): wirerows.py
            **pathcheck.DEFAULTS,  # what carried the case's bytes, every row of a measured case (schema 9)
        }

    def emit(self, case, g, entries, rec: list[Record], nwrong, no: int, clock: dict, rules: list[str], codec=None,
             errors=None, stages=None, cost=None, took=None, cache=None, every=None, bounds=None, first=None,
             rails=None, carry=None, wire=None) -> None:
        """A case's rows on this rank: one per (entry, timed iteration) and the check pass's; ``every`` (-c all):
        per timed iteration the wrong elements per entry, each timed row's ``nwrong``; ``bounds``: (this rank's
        wake-up bound, per entry (GB/s bound, kind)) from harness/bounds.py; ``first``: per entry, its first
        transfer's seconds (setuprows.py); ``rails``: per entry its rail columns (railrows.py); ``carry``: this
        rank's carrier columns of the timed rows (carriage.py); ``wire``: per timed iteration the transport's counted
        bytes per peer (wirerows.py)."""
        rows, bases = [], []
        path = {k: v for k, v in (carry or {}).items() if k in pathcheck.DEFAULTS}  # the case's, on all its rows
        counted = wirerows.per_entry(wire, entries, self.rank)
        wake_bound, wake_p99, per_entry = bounds or (nan, nan, {})
        prefill_s = float(case["prefill_ms"]) / 1e3
        for k, e in enumerate(entries):
            role = "both" if e.src == e.dst else ("prefill" if e.src == self.rank else "decode")
            base = dict(self.base_row(case, g, no), rank=self.rank, role=role, pair=e.pair, req=e.req,
                        payload_bytes=e.payload, wire_bytes=e.payload + control_bytes(e, case["handshake"]),
                        descriptors=e.descriptors, status="ok", reason="", prefill_s=prefill_s,
                        queue_s=nan, arrival_s=nan, completion=rules[k], wake_bound_s=wake_bound, wake_p99_s=wake_p99,
                        bound_gbps=bound_at(per_entry.get(k, (nan, ""))[0], None), bound_kind=per_entry.get(k, (nan, ""))[1],
                        **placing.columns(getattr(self, "placement", None), self.rank, case, e.src, e.dst),
                        **(rails or {}).get(k, railrows.EMPTY),
                        **({"tokens": e.tokens} if e.tokens else {}),
                        **({"flow": f"{e.src}->{e.dst}"} if case.get("flow_mode") else {}), **path)
            bases.append(base)
            # a destination's times move onto its source's clock: + (its barrier exit - the source's)
            skews, err, off = clock[e.src] if e.dst == self.rank else (None, nan, nan)
            for it, r in enumerate(rec):
                skew = float(skews[it]) if skews is not None else 0.0
                rows.append(dict(base, **stage_columns(stages[it] if stages else None),
                                 iter=it, round=r.round, seconds=r.done[k] + skew, harness_seconds=r.harness_s,
                                 nwrong=every[it][k] if every else None, handshake_s=r.handshake_s if e.src == self.rank else nan,
                                 exposed_s=nan if r.exposed[k] is None else r.exposed[k] + skew,
                                 skew_s=skew if skews is not None else nan, clock_err_s=err, clock_offset_s=off,
                                 **codec_columns(codec, it, e, case), **costs.row(cost, it, k),
                                 **real_prefill_s(took, it, e.src),
                                 cache_bytes=0 if cache is None or not cache[1][it] else cache[0][k],
                                 bound_gbps=bound_at(per_entry.get(k, (nan, ""))[0], it), **(carry or {}),
                                 wire_counted_bytes=wirerows.at(counted, k, it)))
            if nwrong is not None:
                rows.append(dict(base, iter=-1, round=-1, seconds=nan, harness_seconds=nan, handshake_s=nan, exposed_s=nan,
                                 nwrong=nwrong[k] if role != "prefill" else 0, skew_s=nan, clock_err_s=nan,
                                 clock_offset_s=nan, **lossy_columns((errors or {}).get(k))))
        self.deliver(rows + setuprows.first_rows(lambda k: bases[k], first)
                     + [dict(r, **path) for r in self.take_setup(no, case.get("ci_stop", "fixed"))], case=case)

    def emit_skipped(self, case: dict, reason: str) -> None:
        self.case_no += 1
        row = dict(self.base_row(dict(case, variant="paged")), rank=self.rank, role="", pair=-1, req=0, iter=-1,
                   seconds=float("nan"), harness_seconds=float("nan"),
                   payload_bytes=case_geometry(case)["payload"], wire_bytes=0, descriptors=0,
                   status="skipped", reason=reason, nwrong=None, prefill_s=float("nan"), handshake_s=float("nan"),
                   exposed_s=float("nan"), queue_s=float("nan"), arrival_s=float("nan"), skew_s=float("nan"),
                   clock_err_s=float("nan"), clock_offset_s=float("nan"), completion="",
                   carrier_evidence="skipped: nothing moved (the reason column says why)")
        self.deliver([row] if self.rank == 0 else [])

    def take_setup(self, no: int, ci_stop: str = "fixed") -> list[dict]:
        """This rank's transport's setup rows, once, under case ``no`` (the first case delivered after them) and
        its ``ci_stop``, as every row of a case."""
        rows, self.setup_rows = [dict(r, case=no, ci_stop=ci_stop) for r in getattr(self, "setup_rows", [])], []
        return rows

    def deliver(self, rows: list[dict], setup: bool = False, case: dict | None = None) -> None:
        """Gather the rows to rank 0's sink (a matrix's measurement: with its flow columns, flows.derive)."""
        # with the rows, this rank's engine words behind their carrier_proto (pathcheck.py): the sidecar's
        everything = self.comm.gather((rows, self.take_raw() if hasattr(self, "take_raw") else {}))
        if self.rank and not setup:  # rank 0 writes them now (its own point is inside the write: results/store.py)
            faults.at("table-write", self.rank, self.case_no)
        if self.rank == 0:
            flat = [r for part, _ in everything for r in part]
            raw = self.extra_meta.setdefault("carrier_raw", {}) if hasattr(self, "extra_meta") else {}
            for rank, (_, words) in enumerate(everything):
                for no, w in words.items():
                    raw.setdefault(str(no), {})[str(rank)] = w
            if case is not None and case.get("flow_mode"):
                flows.derive(self.flow_state, case, flat)
            if self.sink:
                self.sink(flat)


def real_prefill_s(took: list | None, it: int, src: int) -> dict:
    """A real prefill's measured seconds (on the source, sent to its destinations) as the row's prefill_s."""
    return {"prefill_s": took[it][src]} if took and src in took[it] else {}


def stage_columns(stages: dict | None) -> dict:
    """A row's per-stage seconds (staged: gather, wire, scatter on this rank in this iteration; else empty)."""
    nan = float("nan")
    stages = stages or {}
    return {f"{k}_s": float(stages.get(k, nan)) for k in ("gather", "wire", "scatter")}


def bound_at(bound, it: int | None) -> float:
    """A row's GB/s bound: the copy beside its timed iteration ``it`` (a list per iteration), their median for
    the check pass's row (``it`` None), or the one value a link's rate gives every iteration."""
    if not isinstance(bound, list):
        return bound
    if it is None:
        return float(np.median(bound)) if bound else float("nan")
    return bound[it] if it < len(bound) else float("nan")
