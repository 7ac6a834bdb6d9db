"""Tables from results: the live nccl-tests-style table and reading result files.

Nothing here imports the harness or a transport: reports are built from rows.
"""
from __future__ import annotations

import json
import os
import textwrap

import pandas as pd

from kvbench.model.schemes import FLOWS
from kvbench.results import costs
from kvbench.results.samples import FOOTNOTE
from kvbench.results.store import SCHEMA_VERSION, case_stats, transfer_rows, upgrade

# re-exported: build.py and older callers read them here
from .counts import MIN_ROUNDS, WRONG_NOTE, _i, checks_text, spread_pct, spread_text, wrong_counts, wrong_text  # noqa: F401

# (header, width, formatter of a case_stats line)
COLUMNS = [
    ("transport", 10, lambda r: r["transport"]),
    ("op", 4, lambda r: r["op"]),
    ("model", 12, lambda r: r["model"]),
    ("tokens", 6, lambda r: f"{r['tokens']}"),
    ("dtype", 8, lambda r: r["dtype"]),
    ("layout", 11, lambda r: r["layout"]),
    ("alloc", 10, lambda r: r["allocation"]),
    ("coal", 4, lambda r: r["coalesce"]),
    ("pairs", 5, lambda r: _i(r.get("pairs"))),
    ("infl", 4, lambda r: f"{r['inflight']}"),
    ("blk(tok)", 8, lambda r: "-" if r["variant"] != "paged" else f"{r['block_size']}"),
    ("blk(B)", 8, lambda r: "-" if r["variant"] != "paged" else f"{r['block_bytes']}"),
    ("descs", 7, lambda r: f"{r['descriptors']}"),
    ("desc(B)", 10, lambda r: f"{r['payload_bytes'] / max(r['descriptors'], 1):.0f}"),
    ("payload(B)", 11, lambda r: f"{r['payload_bytes']}"),
    ("n", 5, lambda r: _i(r.get("samples"))),
    ("p50(us)", 9, lambda r: _f(r["p50"] * 1e6, ".1f")),
    ("ci%", 5, lambda r: _f(r.get("ci_pct"), ".1f") + _stop(r)),
    ("p99(us)", 9, lambda r: _f(r["p99"] * 1e6, ".1f")),
    ("GB/s", 7, lambda r: _f(r["gbps"], ".2f")),
    ("aggGB/s", 7, lambda r: _f(r.get("agg_gbps"), ".2f")),
    ("±%", 6, spread_text),
    ("bulk%", 7, lambda r: bulk_pct_text(r)),
    ("ceiling", 10, lambda r: r.get("ceil_name") or "-"),
    ("#wrong", 6, lambda r: wrong_text(r)),
    ("#chk", 5, lambda r: checks_text(r)),
    ("clock", 5, lambda r: _clock(r)),
    ("us/L", 6, lambda r: _f(r.get("cost_us"), ".1f")),  # time per layer outside the wire (costs.py)
]
REFERENCES = ("bulk", "chunk-64K", "chunk-256K", "chunk-1M", "chunk-4M")  # the ceiling is the best of these

# Axes nearly every run keeps at their default: a column each, shown only when some case of the run leaves it, so
# the usual host table stays nccl-tests narrow while a GPU, codec or real-prefill run says what each row moved.
# axis -> (default, column, the default column it follows; axes after the same one keep this order)
VARIANT_AXES = {
    "memory": ("host", ("mem", 9, lambda r: _axis(r, "memory")), "transport"),
    "copy": ("batch", ("copy", 6, lambda r: _axis(r, "copy")), "transport"),
    "scales": ("none", ("scales", 9, lambda r: _axis(r, "scales")), "dtype"),
    "codec": ("none", ("codec", 13, lambda r: _axis(r, "codec")), "dtype"),
    "prefill": ("clock", ("prefill", 7, lambda r: _axis(r, "prefill")), "infl"),
    # a workload's rows differ by their arrival process: without it, rows of four arrival rates read alike
    "arrival": ("none", ("arrival", 13, lambda r: _axis(r, "arrival")), "infl"),
    # a traffic matrix (harness/flows.py): the row's one flow alone ("0->1"), or all flows at once
    "flow": ("", ("flow", 7, lambda r: _axis(r, "flow") or "-"), "pairs"),
    # --register per-request: each request registers its blocks inside its time; reg(us) is that cost's p50
    "register": ("once", ("register", 11, lambda r: _axis(r, "register")), "transport"),
    # --tp P:D (prefill TP : decode TP) and a block's head order: rows of one model differ by them alone
    "tp": ("1", ("tp", 5, lambda r: _axis(r, "tp")), "model"),
    "head_layout": ("", ("heads", 5, lambda r: _axis(r, "head_layout") or "-"), "layout"),
}
# a variant axis's further columns, after its own
AXIS_EXTRA = {"register": [("reg(us)", 8, lambda r: _f(_us(r.get("register_p50")), ".1f")),
                           ("dereg(us)", 9, lambda r: _f(_us(r.get("deregister_p50")), ".1f"))]}
STORED_AS = {"arrival": "workload", "flow": "flows"}  # a suite case's axis -> the result rows' column that holds it
OVERLAP_ANCHORS = {"dtype": "tokens", "infl": "handshk"}  # the exposed-time table has neither dtype nor infl


def _axis(r, key: str) -> str:
    """A case's value on a variant axis; its default when the result predates the column."""
    v = r.get(key)
    if v is None or (isinstance(v, float) and pd.isna(v)):
        v = r.get(STORED_AS.get(key, key))
    if key == "flow" and not v and r.get("scheme") in FLOWS:  # a suite's case: its flows, alone then together
        v = "all"
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return VARIANT_AXES[key][0]
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)  # a tp column read as floats


def variant_axes(cases) -> list[str]:
    """The variant axes on which some case (a suite case or a summarized row) leaves the default."""
    return [k for k, (dflt, _, _) in VARIANT_AXES.items() if any(_axis(c, k) != dflt for c in cases)]


def columns_for(cases, overlap: bool = False) -> list:
    """The live table's columns for these cases: the default ones plus a column per variant axis they use."""
    extra: dict[str, list] = {}
    for key in variant_axes(cases):
        _, col, anchor = VARIANT_AXES[key]
        extra.setdefault(OVERLAP_ANCHORS.get(anchor, anchor) if overlap else anchor, []).extend([col, *AXIS_EXTRA.get(key, ())])
    return [c for col in (OVERLAP_COLUMNS if overlap else COLUMNS) for c in (col, *extra.get(col[0], ()))]


def _clock(r) -> str:
    """'ok', or 'SKEW' when the pair's clock correction is uncertain by more than 5% of the p50."""
    return "-" if pd.isna(r.get("clock_err_s")) else ("SKEW" if r.get("clock_flag") else "ok")


def _stop(r) -> str:
    """'+' after the p50's interval when --target-ci's budget ran out before the target was met."""
    return "+" if r.get("ci_stop") == "budget" else ""


def _us(x):
    return None if x is None or pd.isna(x) else x * 1e6


def _wrap(text: str) -> list[str]:
    """A legend as '#' lines of the table's width."""
    return ["# " + ln for ln in textwrap.wrap(text, 104)]


def bulk_pct_text(r) -> str:
    """A row's bulk%, marked * above its ceiling beyond both spreads (noise) and ~ above it within them."""
    return _f(r.get("bulk_pct"), ".1f") + ("*" if r.get("noise") else "~" if r.get("at_ceiling") else "")


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def header_lines(columns=None) -> list[str]:
    """Column headers, '#'-prefixed like nccl-tests."""
    cols = " ".join(f"{h:>{w}}" for h, w, _ in columns or COLUMNS)
    cols = "#" + cols[1:]  # the first column is wider than its name
    return ["# GB/s = 10^9 bytes/s of one request's KV payload at its p50 time; time = until the destination",
            "# knows the last byte landed (max over the pair's ranks); aggGB/s = all requests of all pairs of an",
            "# iteration / the time the last one landed (median); ±% = spread: interquartile range of the per-round",
            "# medians, (n) after it: from n < 5 rounds, too few to decide a *; bulk% = GB/s / the ceiling: the",
            "# best of the same payload as one descriptor per layer (bulk) or in contiguous chunks of 64K-4M, named",
            "# in 'ceiling'; * = above the ceiling by more than the two spreads (noise), ~ = above it within them",
            "# (at the ceiling: the same rate);",
            *_wrap(WRONG_NOTE + ";"),
            "# clock = SKEW when the ranks' clocks are matched only within more than 5% of p50 (clocks.py);",
            "# us/L = kvbench's own time per layer outside the wire: posting calls + its notifications + landing",
            "# stamp to wait return (us, median over iterations of the slowest rank; costs.py);",
            "# n = samples behind the percentiles (requests x iterations); ci% = half the p50's 95% confidence",
            "# interval (order statistics; - below 6 samples), % of p50 (+ = --ci-budget ran out before --target-ci was met);",
            f"# {FOOTNOTE}",
            *_variant_note(columns), "#", cols]


VARIANT_NOTES = {"flow": "flow = a matrix's flow alone (SRC->DST) or all flows at once",
                 "mem": "mem = where the pools live", "copy": "copy = the copy engine of device bytes",
                 "scales": "scales = fp8 scale planes", "codec": "codec = the wire encoding",
                 "prefill": "prefill = clock (a timer) or real (the model's matmuls)",
                 "tp": "tp = prefill TP : decode TP (one number: both sides)",
                 "heads": "heads = a block's head order at P:D (NHD: a head slice is a descriptor per token; HND: per block)",
                 "arrival": "arrival = the workload's arrival process (requests/s per prefill rank)",
                 "register": "register = once (the pool at setup) or per-request (each request's blocks, inside its "
                             "time; reg(us)/dereg(us) = that request's registering/deregistering p50, dereg after "
                             "the landing)"}


def _variant_note(columns) -> list[str]:
    """The header line saying what the variant columns a table shows mean (none shown: no line)."""
    shown = [h for h, _, _ in columns or () if h in VARIANT_NOTES]
    if not shown:
        return []
    return ["# " + "; ".join(VARIANT_NOTES[h] for h in shown) + " (shown as some case leaves the default)"]


def format_line(r: dict, columns=None) -> str:
    """One table row."""
    columns = columns or COLUMNS
    if r.get("status") == "skipped":
        lead = " ".join(f"{f(r):>{w}}" for h, w, f in columns[:4])
        return f"{lead}   skipped: {r['reason']}"
    return " ".join(f"{f(r):>{w}}" for _, w, f in columns)


BULK_KEYS = ["transport", "memory", "copy", "op", "model", "tokens", "prefix_hit", "dtype", "tp", "pp", "scheme",
             "world_size", "inflight"]
BULK_KEYS += ["scales"]  # v3: each fp8 scale-plane format has its own references (kvbench/model/planes.py)
BULK_KEYS += ["flow_mode", "flows"]  # v7: a matrix's flow alone against its own references, all flows against theirs
BULK_KEYS += ["register"]  # v7: a per-request case's references register per request too


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """case_stats plus bulk% (each paged case against the bulk case of the same payload)."""
    df = transfer_rows(df)  # setup rows have tables of their own (report/setup.py)
    st = case_stats(df)
    for col, dflt in (("memory", "host"), ("copy", "batch"), ("register", "once")):  # older rows: the defaults
        if col in st:
            st[col] = st[col].astype(object).where(st[col].notna(), dflt)
    # every checked iteration's count, not the check pass's alone: -c all's failing timed iteration shows here
    counts = wrong_counts(df)
    for col in counts:
        st[col] = st["case"].map(counts[col])
    # a matrix's measurement (harness/flows.py): its one flow ("0->1") alone, or "all" of them
    flows = df[df["flow"].astype(str) != ""].groupby("case")["flow"].agg(lambda s: s.iloc[0] if s.nunique() == 1 else "all") \
        if "flow" in df else pd.Series(dtype=object)
    st["flows"] = st["case"].map(flows).astype(object).fillna("")
    if "flow_mode" not in st:
        st["flow_mode"] = ""
    st["flow_mode"] = st["flow_mode"].astype(object).fillna("")
    bulk = st[st["variant"] == "bulk"].set_index(BULK_KEYS)["gbps"]
    # one reference per payload; a run that measured one twice (a pair sweep before sessions were grouped): their median
    bulk = bulk.groupby(level=list(range(len(BULK_KEYS))), dropna=False).median()
    keyed = st.set_index(BULK_KEYS).index
    st["bulk_gbps"] = [bulk.get(k, float("nan")) if k in bulk.index else float("nan") for k in keyed]
    # the ceiling: the best of the same bytes as one descriptor per layer or in contiguous chunks, measured
    # alongside; bulk% is against it, and a row above it by more than the two spreads is noise, flagged
    st["spread_pct"] = st["case"].map(spread_pct(df))
    st["spread_rounds"] = st["case"].map(spread_pct(df, rounds=True))
    refs = st[st["variant"].isin(REFERENCES)].sort_values("gbps").groupby(BULK_KEYS).last()
    best = {k: (r["gbps"], r["variant"], r["spread_pct"], r["spread_rounds"]) for k, r in refs.iterrows()}
    nan = (float("nan"), "", float("nan"), float("nan"))
    st["ceil_gbps"], st["ceil_name"], ceil_spread, ceil_rounds = zip(*[best.get(k, nan) for k in keyed]) \
        if len(st) else ((), (), (), ())
    st["bulk_pct"] = 100 * st["gbps"] / st["ceil_gbps"]
    over = st["bulk_pct"] > 100 + st["spread_pct"].fillna(0) + pd.Series(ceil_spread, index=st.index).fillna(0)
    # a spread from fewer than MIN_ROUNDS rounds (2-4 medians) is no measure of noise: it decides no *
    enough = (st["spread_rounds"].fillna(0) >= MIN_ROUNDS) & (pd.Series(ceil_rounds, index=st.index).fillna(0) >= MIN_ROUNDS)
    over = over & enough
    st["noise"] = over & (st["variant"] == "paged")  # hot beats the ceiling by design (cache-resident)
    # above its ceiling within the two spreads: the same rate as the ceiling, said so rather than shown as a gain
    st["at_ceiling"] = (st["bulk_pct"] > 100) & ~over & (st["variant"] == "paged")
    # the seeds' model of exposed time, from the measured bulk bandwidth: streaming hides all but the
    # excess of transfer over prefill and the last layer's share; serial hides nothing
    st["T_ms"] = st["payload_bytes"] / (st["bulk_gbps"] * 1e9) * 1e3
    p_ms = st["prefill_s"].fillna(0) * 1e3
    streaming = (st["T_ms"] - p_ms).clip(lower=0) + st["T_ms"] / st["layers"]
    st["model_ms"] = streaming.where(st["overlap"] == "streaming", st["T_ms"])
    st["exposed_ms"] = st["exposed_p50"] * 1e3
    st["diff_ms"] = st["exposed_ms"] - st["model_ms"]
    # one clock: the bound on the destination's clock correction, flagged past 5% of the time it corrects
    timed = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    err = timed.groupby("case")["clock_err_s"].max() if "clock_err_s" in timed else pd.Series(dtype=float)
    st["clock_err_s"] = st["case"].map(err)
    st["clock_flag"] = st["clock_err_s"] > 0.05 * st["p50"]
    st = st.join(costs.per_case(df), on="case")  # time per layer outside the wire
    return st


OVERLAP_COLUMNS = [
    ("transport", 10, lambda r: r["transport"]),
    ("op", 4, lambda r: r["op"]),
    ("overlap", 9, lambda r: r["overlap"]),
    ("handshk", 7, lambda r: r["handshake"]),
    ("model", 12, lambda r: r["model"]),
    ("tokens", 6, lambda r: f"{r['tokens']}"),
    ("L", 3, lambda r: f"{r['layers']}"),
    ("blk(tok)", 8, lambda r: "-" if r["variant"] == "bulk" else f"{r['block_size']}"),
    ("alloc", 10, lambda r: r["allocation"]),
    ("payload(B)", 11, lambda r: f"{r['payload_bytes']}"),
    ("P(ms)", 8, lambda r: _f(r["prefill_s"] * 1e3, ".2f")),
    ("T(ms)", 8, lambda r: _f(r["T_ms"], ".2f")),
    ("hs(us)", 7, lambda r: _f(r["handshake_p50"] * 1e6, ".0f")),
    ("n", 5, lambda r: _i(r.get("exposed_samples"))),
    ("exp p50", 8, lambda r: _f(r["exposed_p50"] * 1e3, ".2f")),
    ("p95", 8, lambda r: _f(r["exposed_p95"] * 1e3, ".2f")),
    ("p99", 8, lambda r: _f(r["exposed_p99"] * 1e3, ".2f")),
    ("model", 8, lambda r: _f(r["model_ms"], ".2f")),
    ("diff", 7, lambda r: _f(r["diff_ms"], "+.2f")),
    ("#wrong", 6, lambda r: wrong_text(r)),
    ("#chk", 5, lambda r: checks_text(r)),
    ("clock", 5, lambda r: _clock(r)),
]


def overlap_header_lines(columns=None) -> list[str]:
    """Headers of the exposed-time table (suites with a prefill clock, streaming or a handshake)."""
    cols = " ".join(f"{h:>{w}}" for h, w, _ in columns or OVERLAP_COLUMNS)
    return ["# exposed = time from prefill end until decode knows the last byte landed (decode's clock, start",
            "# synchronized by a barrier), ms; P = prefill time; T = payload / bulk GB/s of this path;",
            "# model = max(0, T - P) + T/L when streaming, T when serial; diff = exp p50 - model;",
            "# hs = allocate-then-stream handshake round trip (us, p50); n = exposed-time samples behind the",
            f"# percentiles; {FOOTNOTE}", *_wrap(WRONG_NOTE), *_variant_note(columns), "#", "#" + cols[1:]]


def uses_overlap(cases: list[dict]) -> bool:
    """True when a suite's cases need the exposed-time table."""
    return any(c.get("overlap") == "streaming" or float(c.get("prefill_ms") or 0) > 0 or
               c.get("handshake", "off") != "off" for c in cases)


class LivePrinter:
    """Rank 0's printer: keeps rows; ``flush`` prints the lines of the cases not printed yet.

    The runner flushes when a transport's cases are all in: a paged row's bulk% needs the references
    measured alongside it (interleaved with it by default), so its line waits for them.
    """

    def __init__(self, out=print, columns=None):
        self.out = out
        self.columns = columns or COLUMNS
        self.frames: list[pd.DataFrame] = []
        self.pending: list[int] = []
        self._last: tuple[int, pd.DataFrame] | None = None  # the last flush's summary and the transfer rows it covered

    def add(self, rows: list[dict]) -> None:
        from kvbench.results.store import ROW_COLUMNS

        if rows:
            self.frames.append(pd.DataFrame(rows, columns=ROW_COLUMNS))
            self.pending.append(rows[0]["case"])

    def flush(self) -> None:
        if not self.pending:
            return
        df = pd.concat(self.frames, ignore_index=True)
        whole = summarize(df)
        self._last = (len(transfer_rows(df)), whole)
        st = whole.set_index("case")
        for case in self.pending:
            self.out(format_line(st.loc[case].to_dict() | {"case": case}, self.columns))
        self.pending = []

    def summary_of(self, df: pd.DataFrame) -> pd.DataFrame:
        """``summarize(df)`` for the footer, ``df`` being the result set's transfer rows: the last flush's when it
        covered as many (the printer holds a subset of the set's rows, so as many are the same; a resumed run's
        earlier rows make more)."""
        if self._last is not None and self._last[0] == len(df) and not self.pending:
            return self._last[1]
        return summarize(df)


# The sidecar's statuses of a run that ended cleanly (kvbench/job/status.py): any other one, INCOMPLETE, TIMEOUT,
# ERROR, FAILED, SUSPECT, INTERRUPTED or a status this version does not know, is said on every table the run's rows
# are in, since its rows are what it stored before it ended, failed the check, or beat a physical bound
ENDED_CLEANLY = ("OK", "UNCHECKED", "NOTHING MEASURED")


def run_status(meta: dict) -> str | None:
    """The status of a run that did not end cleanly, from its sidecar; None for a clean one or an unknown one
    (no sidecar, or one older than the status field)."""
    status = meta.get("status")
    return None if status is None or status in ENDED_CLEANLY else str(status)


def status_lines(meta: dict) -> list[str]:
    """The terminal table's word on a run that did not end cleanly (none for a clean one)."""
    status = run_status(meta)
    if status is None:
        return []
    why = ("the check found wrong elements (#wrong)" if status == "FAILED"
           else "the rows below are the cases it stored before it ended")
    return [f"# status {status}: {meta.get('reason') or 'no reason recorded'}", f"# {why}"]


def read(path: str) -> tuple[pd.DataFrame, dict]:
    """Load a result table and its sidecar; refuse a schema this version does not know."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such result file")
    meta_path = path[: -len(".parquet")] + ".meta.json" if path.endswith(".parquet") else path + ".meta.json"
    meta = {}
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
    try:
        return upgrade(pd.read_parquet(path), meta.get("schema_version", SCHEMA_VERSION)), meta
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
