"""Traffic matrices (--scheme matrix, bidir): each pattern measured twice in one launch, every flow alone, one after
another (``isolated``), then all flows at once (``congested``), and the rows that compare the two.

A flow is one (sender, receiver) pair of the matrix (model/matrix.py), moving its cell's tokens.  Per flow and
iteration its time is the later of its two ranks' (every request of the flow); its p50 over the timed iterations
is the flow's time.  Rank 0 derives, as each measurement's rows arrive: ``isolated_s`` and ``congested_s``,
``slowdown`` = congested / isolated, ``fairness`` = min / max GB/s over the flows, and ``receiver_gbps``, the GB/s
into a destination rank over all its flows.
"""
from __future__ import annotations

import itertools

import numpy as np

from kvbench.model import matrix as X
from kvbench.model import shapes as M

_keys = itertools.count()


def flow_case(case: dict, cell: str) -> dict:
    """The case as one flow of the matrix moves it: the cell's tokens (bytes: in whole tokens of its model)."""
    if cell == X.ALL:
        return case
    shape = M.shard(M.get_model(case["model"]), case["tp"], case["pp"])
    dtype = case["dtype"] if case["dtype"] in M.DTYPES else "fp8-e4m3"  # nvfp4: its values' byte per element
    ntok = X.tokens(cell, case["tokens"], M.bytes_per_token(shape, dtype))
    return dict(case, tokens=ntok + case["prefix_hit"])


def largest(case: dict, cells: list[str] | None) -> dict:
    """The case with its largest flow's tokens (sizes the pool)."""
    if not cells:
        return case
    return max((flow_case(case, c) for c in cells), key=lambda c: c["tokens"])


def only(case: dict, entries: list) -> list:
    """A measurement's entries: every one, or (``isolated``) its one flow's; the other ranks then have none."""
    return [e for e in entries if e.pair == case["flow_only"]] if case.get("flow_mode") == "isolated" else entries


def expand(variants: list[dict], npairs: int) -> list[dict]:
    """Per measurement of a case: each flow alone, then all of them (its rows compare the two)."""
    out = []
    for v in variants:
        key = next(_keys)
        out += [dict(v, flow_mode="isolated", flow_only=p, flow_key=key) for p in range(npairs)]
        out.append(dict(v, flow_mode="congested", flow_only=-1, flow_key=key))
    return out


def derive(state: dict, case: dict, rows: list[dict]) -> None:
    """Rank 0, on a measurement's rows of every rank (in place): the flow columns; ``state`` keeps each flow's
    isolated time until its congested measurement comes."""
    timed = [r for r in rows if r.get("row_kind") == "transfer" and r["iter"] >= 0 and r["status"] == "ok"]
    per: dict[int, dict[int, float]] = {}
    nbytes: dict[int, dict[int, int]] = {}
    dst: dict[int, int] = {}
    for r in timed:
        it = per.setdefault(r["pair"], {})
        it[r["iter"]] = max(it.get(r["iter"], 0.0), float(r["seconds"]))
        nbytes.setdefault(r["pair"], {})[r["req"]] = int(r["payload_bytes"])
        if r["role"] in ("decode", "both"):
            dst[r["pair"]] = r["rank"]
    p50 = {p: float(np.median(list(v.values()))) for p, v in per.items()}
    size = {p: sum(v.values()) for p, v in nbytes.items()}
    key = case["flow_key"]
    out: dict[int, dict] = {}
    if case["flow_mode"] == "isolated":
        for p, s in p50.items():
            state[(key, p)] = s
            out[p] = {"isolated_s": s, "receiver_gbps": size[p] / s / 1e9 if s > 0 else np.nan}
    else:
        gbps = {p: size[p] / s / 1e9 if s > 0 else np.nan for p, s in p50.items()}
        fair = min(gbps.values()) / max(gbps.values()) if gbps and max(gbps.values()) > 0 else np.nan
        into: dict[int, list[int]] = {}
        for p, d in dst.items():
            into.setdefault(d, []).append(p)
        for p, s in p50.items():
            iso = state.pop((key, p), np.nan)
            peers = into.get(dst.get(p), [p])
            slowest = max(p50[q] for q in peers)
            out[p] = {"isolated_s": iso, "congested_s": s, "slowdown": s / iso if iso and iso == iso else np.nan,
                      "fairness": fair,
                      "receiver_gbps": sum(size[q] for q in peers) / slowest / 1e9 if slowest > 0 else np.nan}
    for r in rows:
        if r.get("row_kind") == "transfer" and r["pair"] in out:
            r.update(out[r["pair"]])
