"""A landing time bounded from two sides: a row that beats physics is SUSPECT, not noise.

Two bounds, each measured or read in the run itself (the harness measures, harness/bounds.py; this module
holds the arithmetic and reads the kernel's link rates):

* the wake-up bound: a transport's landing stamp may precede the moment the harness's wait returned by at
  most the time a thread takes to wake another on this machine.  Each rank measures that at each
  transport's setup (a thread stamps and sets an event, the waiter notes its return; ``wake_bound`` of the
  samples, plus a GIL switch interval).  A row's ``stamp_lead_s`` is its wait's return minus the later of the stamp and the wait's
  start (a stamp before the wait began claims nothing the wait could contradict), or, where the stamp falls inside
  the destination's own post call, that call's return minus the stamp (a transport that copies in its post lands
  its last byte as the call ends).  A request is judged on its iterations, not their median (a lie leads in
  nearly all of them, a waiter a loaded machine woke late only in some): beyond the wake-up bound in each, or
  in more than half of them (both of two) by a quarter of that iteration's own time, 0.5 ms and the p99 wake-up
  measured beside the case at least, it is no wake-up (honest leads are tens of us; a loaded machine's, its p99) but a
  stamp well before the landing, at any size that leaves 0.5 ms.  A transport that does not stamp has an
  infinite wake-up bound (any stamp it returns is judged by the share alone); ranks that outnumber their CPUs
  have none (NaN: nothing is judged);
* the path bound: a row's GB/s may not exceed what its path can carry (at p50, and where the destination
  posted the request itself, from its post to the landing: ``measures``).  A pair on one host moves bytes
  through memory: the bound is the harness's own copy of the same descriptors beside each timed iteration
  (``_native.copy_batch``, the better of two, outside the transport and its timed window).  A pair across hosts goes through a
  NIC: the bound is the link rate the kernel reports for the transport's interface
  (/sys/class/net/IF/speed), or, where the transport does not say which NIC it used, the sum over every
  NIC and RDMA port of the host.  Device memory, or a link without a reported rate, has no bound ("none").

A case is SUSPECT when its median is beyond a bound by more than its spread (and, for the path bound, a
noise margin: its GB/s from its p50 plus the bound on its clock correction, the slowest the transfer can have
been, each iteration against the bound measured beside it): the one line names the case, the bound and the
margin (``suspects``, ``line``).  Beyond the copies beside its iterations but not beyond the best copy of the same
bytes the rank made in the run, a case is NOISY: load can make that, and the line says how to get a verdict (``noisy``).
"""
from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

import numpy as np

from kvbench.results import machine

if TYPE_CHECKING:  # every rank measures its bounds; only rank 0 judges rows (frames come from the caller)
    import pandas as pd

COLUMNS = ["stamp_lead_s", "wake_bound_s", "bound_gbps", "bound_kind", "window_s"]  # rows, schema 5 (store.py)
WAKE_PCT = 99  # the percentile of the wake-up samples the bound starts from
WAKE_FACTOR = 3.0  # ... times this: a loaded machine wakes threads later in some phases than in others
WAKE_FLOOR_S = 5e-3  # ... plus this: scheduler time slices the measurement may have missed (a busy machine)
COPY_MARGIN = 0.25  # a row may beat the harness's best copy by this much (plus its spread) before it is a lie
# a landing stamp whose median lead over its wait's return is this share of the request's own time, and at least
# LEAD_FLOOR_S and the rank's p99 wake-up beside it (wake_p99), is no wake-up: honest leads are wake-ups (tens of
# us, ~2% of a 1 ms request beside two busy loops on 2 cores), a stamp halfway to the landing leads by the whole
# reported time
LEAD_SHARE, LEAD_FLOOR_S = 0.25, 5e-4
NAN = float("nan")


def wake_bound(samples, switch_s: float | None = None) -> float:
    """Seconds a landing stamp may precede the wait's return, from wake-up samples (seconds) on this rank, plus
    one GIL switch interval (``sys.getswitchinterval()`` unless given): a transport's thread that stamps in C
    takes the GIL back before it wakes the waiter, and a thread holding it lets go only that often."""
    switch = sys.getswitchinterval() if switch_s is None else switch_s
    return WAKE_FACTOR * wake_p99(samples) + switch + WAKE_FLOOR_S  # NaN without samples


def wake_p99(samples) -> float:
    """The WAKE_PCT percentile of wake-up samples (seconds; NaN without any): how late this rank's threads woke
    while its bound was measured, a loaded machine's milliseconds included."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    return float(np.percentile(s, WAKE_PCT)) if len(s) else NAN


def copy_gbps(nbytes: int, best_s: float) -> float:
    """GB/s (10^9 B/s) of the harness's best copy of ``nbytes``."""
    return nbytes / best_s / 1e9 if best_s > 0 else NAN


def link_gbps(speed_mbps: float | None) -> float | None:
    """A NIC's link rate in GB/s (10^9 B/s) from the kernel's Mb/s; None without one."""
    return speed_mbps * 1e6 / 8 / 1e9 if speed_mbps and speed_mbps > 0 else None


def rdma_gbps(rate: str | None) -> float | None:
    """An RDMA port's rate ('400 Gb/sec (4X NDR)') in GB/s; None when unreadable."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(m.group(1)) / 8 if m else None


def _speed(root: str, ifname: str) -> float | None:
    return link_gbps(machine.nic_speed_mbps(ifname, root))


def network_bound(ifname: str | None = None, root: str = "/sys") -> tuple[float, str]:
    """(GB/s, kind) of a path across hosts: the link rate of ``ifname`` (the interface the transport used),
    else the sum over the host's NICs and RDMA ports (the most any path out of it can carry)."""
    if ifname and ifname != "lo" and (g := _speed(root, ifname)) is not None:
        return g, f"link {ifname}"
    total, names = 0.0, []
    net = os.path.join(root, "class", "net")
    for n in sorted(os.listdir(net)) if os.path.isdir(net) else []:
        if n != "lo" and (g := _speed(root, n)) is not None:
            total, names = total + g, names + [n]
    for port, rate in machine.rdma_rates(root).items():
        if g := rdma_gbps(rate):
            total, names = total + g, names + [port]
    if not names:
        return NAN, "none (no NIC reports a link rate)"
    return total, "links " + "+".join(names)


def spread(x: pd.Series) -> float:
    """Half the interquartile range of ``x``, relative to its median (0 with fewer than 2 values)."""
    x = x.dropna()
    if len(x) < 2:
        return 0.0
    q25, q50, q75 = np.percentile(x, [25, 50, 75])
    return float((q75 - q25) / 2 / q50) if q50 > 0 else 0.0


def lower_median(x) -> float:
    """The largest value that more than half of ``x`` reach: all of two, two of three, five of eight."""
    return float(np.sort(np.asarray(x, dtype=np.float64))[(len(x) + 1) // 2 - 1])


def verdicts(df: pd.DataFrame | None, st: pd.DataFrame | None) -> list[dict]:
    """Per case beyond a bound: {case, key, what, value, bound, margin_pct, spread_pct, verdict}.

    ``df``: the rows; ``st``: their case statistics (store.case_stats: gbps and the keys).  A case's spread is
    half the interquartile range of its per-iteration values, relative to their median."""
    if df is None or st is None or not {"stamp_lead_s", "wake_bound_s", "bound_gbps"} <= set(df.columns):
        return []  # an older schema: nothing measured to judge against
    out = []
    timed = df[(df["status"] == "ok") & (df["iter"] >= 0)]
    keys = st.set_index("case")
    # the landing stamp of each (case, rank, pair, request) this rank received, in most of its iterations (a stamp
    # that lies leads in nearly all of them, a waiter a loaded machine woke late only in some: with two iterations,
    # both), against its rank's wake-up bound (in every iteration) and a share of that iteration's own time (a source's stamp of its own send is no landing, and never the pair's
    # time; where ranks outnumber the CPUs no bound is measured, and nothing is judged)
    lead = timed[timed["stamp_lead_s"].notna() & timed["wake_bound_s"].notna() & (timed["role"] != "prefill")]
    for (case, rank, pair, req), g in lead.groupby(["case", "rank", "pair", "req"]):
        if case not in keys.index or len(g) < 2:  # one iteration cannot tell a lie from a waiter woken late once
            continue
        leads, bound = g["stamp_lead_s"].to_numpy(float), float(g["wake_bound_s"].max())
        sp, least = spread(g["stamp_lead_s"]), float(leads.min())
        at = dict(case=int(case), key=key(keys.loc[case]), spread_pct=100 * sp, rank=int(rank), pair=int(pair),
                  req=int(req))
        own = g["seconds"].to_numpy(float) if "seconds" in g else np.full(len(g), NAN)  # each iteration's own time
        # a lead no longer than the wake-ups this rank measured beside the case (p99) is one of them: on a loaded
        # machine those reach milliseconds, and an honest waiter late by one in most iterations is no lie
        p99 = float(g["wake_p99_s"].max()) if "wake_p99_s" in g else NAN  # (schema 11)
        floor = float(np.fmax(LEAD_FLOOR_S, p99))  # (NaN: the floor alone)
        ratio = leads / np.maximum(floor, LEAD_SHARE * own)
        if np.isfinite(bound) and least > bound * (1 + sp):
            out.append(at | dict(what="wake", value=least, bound=bound, margin_pct=100 * (least / bound - 1)))
        elif np.isfinite(ratio).all() and lower_median(ratio) > 1:
            k = int(np.argsort(ratio, kind="stable")[(len(ratio) + 1) // 2 - 1])  # the majority's nearest to honest
            out.append(at | dict(what="lead", value=float(leads[k]), own=float(own[k]), floor=floor,
                                 bound=float(leads[k] / ratio[k]), margin_pct=100 * float(ratio[k] - 1)))
    # GB/s: each iteration against the bound measured beside it (the harness's copy next to it, or a link's rate)
    # hot re-sends one cache-resident buffer by design (it beats the ceiling too): no copy of memory bounds it
    judged = timed[timed["bound_gbps"].notna() & (timed["variant"] != "hot")]
    # the best copy of the same bytes this rank made anywhere in the run: a case's few iterations can all sit in
    # a slow phase of a shared machine, the machine's own best copy of those bytes cannot be beaten honestly
    run_best = judged.groupby(["rank", "payload_bytes"])["bound_gbps"].max() if "payload_bytes" in judged else None
    for case, g in judged.groupby("case"):
        if case not in keys.index:
            continue
        r = keys.loc[case]
        kind = str(g.loc[g["bound_gbps"].idxmin(), "bound_kind"])
        # each timed iteration's bound: the better of its destination's copy and its source's (harness/bounds.py)
        per = g.groupby(["pair", "req", "iter"])["bound_gbps"].max()
        best = float(per.max())
        if run_best is not None and kind == "memory copy":
            best = max(best, *(float(run_best.get((k, b), NAN)) for k, b in
                               g[["rank", "payload_bytes"]].drop_duplicates().itertuples(index=False)))
        ms = measures(r, timed[timed["case"] == case], per)
        for measure, gbps, ratio, sp in ms:
            if ratio > 1 + COPY_MARGIN + sp:
                # beyond the copy beside it, but its fastest iterations not beyond the best copy of these bytes
                # in the run: load on a shared machine can make that, so it is said (noisy) and not called a lie
                clear = max(m[1] for m in ms) > best * (1 + COPY_MARGIN)
                out.append(dict(case=int(case), key=key(r), what=kind, value=gbps, bound=float(per.median()),
                                best=best, measure=measure, margin_pct=100 * (ratio - 1), spread_pct=100 * sp,
                                verdict="SUSPECT" if clear else "NOISY"))
                break
    return out


def split(judged: list[dict]) -> tuple[list[dict], list[dict]]:
    """(SUSPECT, NOISY) of verdicts: a verdict without a word of its own (the wake-up, wire.py's) is SUSPECT."""
    return ([v for v in judged if v.get("verdict", "SUSPECT") == "SUSPECT"],
            [v for v in judged if v.get("verdict") == "NOISY"])


def suspects(df: pd.DataFrame | None, st: pd.DataFrame | None) -> list[dict]:
    """The cases ``verdicts`` calls SUSPECT (the run's status and exit code rest on these)."""
    return split(verdicts(df, st))[0]


def noisy(df: pd.DataFrame | None, st: pd.DataFrame | None) -> list[dict]:
    """The cases beyond the copy beside their iterations but within the run's best copy of their bytes: no verdict."""
    return split(verdicts(df, st))[1]


def measures(r, rows: pd.DataFrame, per: pd.Series) -> list[tuple[str, float, float, float]]:
    """A case's GB/s as the path bound judges it: (what, GB/s, its median ratio to the bound of each iteration,
    that ratio's spread); ``per``: the bound per (pair, request, iteration).

    Its headline at p50 plus the bound on its clock correction (the slowest it can have been: the destination's
    clock is matched within clock_err_s of its source's); where a destination posted the request itself, from its
    post to the landing (on one clock): no barrier or notification in it, so a loaded machine's wake-ups, which
    slow every iteration, do not hide a time that beats the copy; and its fast iterations (the upper quartile):
    a transport that copies slower than the harness (a peer's pages) hid a halved time at the median, while one
    iteration that moved nothing (a skip, which only -c all sees) does not move it."""
    err = float(rows["clock_err_s"].max()) if "clock_err_s" in rows and rows["clock_err_s"].notna().any() else 0.0
    pairs = pair_gbps(rows, err)
    ratio = (pairs / per).dropna()
    if not len(ratio):
        return []
    sp = spread(ratio)
    out = [("p50", float(r["payload_bytes"]) / (float(r["p50"]) + err) / 1e9, float(ratio.median()), sp)]
    if "window_s" in rows and rows["window_s"].notna().any():
        g = pair_gbps(rows[rows["window_s"] > 0], col="window_s")
        wr = (g / per).dropna()
        if len(wr):
            out.append(("post to landing", float(g.median()), float(wr.median()), spread(wr)))
    out.append(("upper quartile", float(np.percentile(pairs, 75)), float(np.percentile(ratio, 75)), sp))
    return out


def pair_gbps(rows: pd.DataFrame, err: float = 0.0, col: str = "seconds") -> pd.Series:
    """Per (pair, request, iteration): payload / (the later of the pair's two times + ``err``, a clock bound);
    ``col``: which time (``window_s``: from a destination's post to its landing)."""
    g = rows.groupby(["pair", "req", "iter"]).agg(t=(col, "max"), b=("payload_bytes", "first"))
    return g["b"] / (g["t"] + err) / 1e9


def key(r) -> str:
    """A case's full key, as the one line names it."""
    what = "bulk" if r["variant"] == "bulk" else (r["variant"] if r["variant"] != "paged" else
                                                  f"{r['allocation']} {int(r['block_size'])}-token blocks")
    return (f"case {int(r.name) if not isinstance(r.name, tuple) else r.name} ({r['transport']} {r['op']} "
            f"{r['model']} {int(r['tokens'])} tokens, {what}, {r['memory']}, {r['overlap']})")


def line(s: dict) -> str:
    """The one line of a SUSPECT (or NOISY) case (a verdict that brings its own line, results/wire.py: that)."""
    if "line" in s:
        return s["line"]
    if s["what"] == "wake":
        return (f"SUSPECT: {s['key']}: rank {s['rank']}'s landing stamp (pair {s['pair']}, request {s['req']}) "
                f"precedes its wait's return (or its own post call's) by {s['value'] * 1e6:.0f} us (in every "
                f"iteration), beyond the wake-up bound {s['bound'] * 1e6:.0f} us measured on this machine by {s['margin_pct']:.0f}% (spread {s['spread_pct']:.0f}%): the stamp is not when "
                "the bytes landed")
    if s["what"] == "lead":
        return (f"SUSPECT: {s['key']}: rank {s['rank']}'s landing stamp (pair {s['pair']}, request {s['req']}) "
                f"precedes its wait's return (or its own post call's) by {s['value'] * 1e6:.0f} us, "
                f"{100 * s['value'] / s['own']:.0f}% of the {s['own'] * 1e6:.0f} us that iteration reports (beyond "
                f"{100 * LEAD_SHARE:.0f}% and {s.get('floor', LEAD_FLOOR_S) * 1e6:.0f} us by {s['margin_pct']:.0f}%, in most "
                "iterations): a wake-up takes tens of us, so the stamp is not when the bytes landed")
    beside = "each iteration against the copy beside it, median; " if s["what"] == "memory copy" else ""
    head = (f"{s['key']}: {s['value']:.2f} GB/s ({s.get('measure', 'p50')}) beyond the path's bound "
            f"{s['bound']:.2f} GB/s ({s['what']}) by {s['margin_pct']:.0f}% ({beside}spread {s['spread_pct']:.0f}%, "
            f"noise margin {100 * COPY_MARGIN:.0f}%)")
    if s.get("verdict") == "NOISY":
        return (f"NOISY: {head}, but its fastest iterations are within this run's best copy of its bytes ({s['best']:.2f} GB/s): other work on this "
                "machine can make that, so no verdict; for one, run it with fewer jobs beside it, or --bind core")
    return f"SUSPECT: {head}: faster than the bytes can move"


def skew_lines(st: pd.DataFrame | None) -> list[str]:
    """One line per case whose ranks' clocks are matched only within more than 5% of its p50 (``clock_flag``,
    report/tables.py): its time is uncertain by that much, so the footer names it beside the run's status."""
    if st is None or "clock_flag" not in st or not len(st):
        return []
    out = []
    for _, r in st[st["clock_flag"].fillna(False).astype(bool)].set_index("case").iterrows():
        err, p50 = float(r["clock_err_s"]), float(r["p50"])
        out.append(f"SKEW: {key(r)}: the ranks' clocks are matched only within {err * 1e6:.0f} us, "
                   f"{100 * err / p50:.0f}% of its p50 ({p50 * 1e6:.0f} us): its time is that uncertain, not an OK "
                   "measurement (a larger request, or fewer jobs beside it)")
    return out
