"""Tables from results: the live nccl-tests-style table and reading result files.

Nothing here imports the harness or a transport: reports are built from rows.
"""
from __future__ import annotations

import json
import os

import pandas as pd

from .results import SCHEMA_VERSION, case_stats

# (header, width, formatter of a case_stats line)
COLUMNS = [
    ("transport", 9, lambda r: r["transport"]),
    ("op", 4, lambda r: r["op"]),
    ("model", 12, lambda r: r["model"]),
    ("tokens", 6, lambda r: f"{r['tokens']}"),
    ("dtype", 8, lambda r: r["dtype"]),
    ("layout", 11, lambda r: r["layout"]),
    ("alloc", 10, lambda r: r["allocation"]),
    ("coal", 4, lambda r: r["coalesce"]),
    ("pairs", 5, lambda r: _i(r.get("pairs"))),
    ("infl", 4, lambda r: f"{r['inflight']}"),
    ("blk(tok)", 8, lambda r: "-" if r["variant"] == "bulk" else f"{r['block_size']}"),
    ("blk(B)", 8, lambda r: "-" if r["variant"] == "bulk" else f"{r['block_bytes']}"),
    ("descs", 7, lambda r: f"{r['descriptors']}"),
    ("desc(B)", 10, lambda r: f"{r['payload_bytes'] / max(r['descriptors'], 1):.0f}"),
    ("payload(B)", 11, lambda r: f"{r['payload_bytes']}"),
    ("p50(us)", 9, lambda r: _f(r["p50"] * 1e6, ".1f")),
    ("p99(us)", 9, lambda r: _f(r["p99"] * 1e6, ".1f")),
    ("GB/s", 7, lambda r: _f(r["gbps"], ".2f")),
    ("aggGB/s", 7, lambda r: _f(r.get("agg_gbps"), ".2f")),
    ("bulk%", 6, lambda r: _f(r.get("bulk_pct"), ".1f")),
    ("#wrong", 6, lambda r: "-" if pd.isna(r["nwrong_checked"]) else f"{int(r['nwrong_checked'])}"),
]


def _i(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{int(x)}"


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def header_lines() -> list[str]:
    """Column headers, '#'-prefixed like nccl-tests."""
    cols = " ".join(f"{h:>{w}}" for h, w, _ in COLUMNS)
    cols = "#" + cols[1:] if cols.startswith(" ") else "#" + cols
    return ["# GB/s = 10^9 bytes/s of one request's KV payload at its p50 time; time = until the destination",
            "# knows the last byte landed (max over the pair's ranks); aggGB/s = all requests of all pairs of an",
            "# iteration / the time the last one landed (median); bulk% = GB/s / the same payload sent as one",
            "# descriptor per layer; #wrong = destination elements that failed the check (- = not checked)",
            "#", cols]


def format_line(r: dict) -> str:
    """One table row."""
    if r.get("status") == "skipped":
        lead = " ".join(f"{f(r):>{w}}" for h, w, f in COLUMNS[:4])
        return f"{lead}   skipped: {r['reason']}"
    return " ".join(f"{f(r):>{w}}" for _, w, f in COLUMNS)


BULK_KEYS = ["transport", "op", "model", "tokens", "prefix_hit", "dtype", "tp", "pp", "scheme", "world_size",
             "inflight"]


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """case_stats plus bulk% (each paged case against the bulk case of the same payload)."""
    st = case_stats(df)
    checked = df[df["iter"] == -1].groupby("case")["nwrong"].apply(lambda s: s.sum(min_count=1))
    st["nwrong_checked"] = st["case"].map(checked)
    bulk = st[st["variant"] == "bulk"].set_index(BULK_KEYS)["gbps"]
    keyed = st.set_index(BULK_KEYS).index
    st["bulk_gbps"] = [bulk.get(k, float("nan")) if k in bulk.index else float("nan") for k in keyed]
    st["bulk_pct"] = 100 * st["gbps"] / st["bulk_gbps"]
    return st


class LivePrinter:
    """Rank 0's printer: keeps rows, prints each case's line as it finishes."""

    def __init__(self, out=print):
        self.out = out
        self.frames: list[pd.DataFrame] = []

    def add(self, rows: list[dict]) -> None:
        from .results import ROW_COLUMNS

        if not rows:
            return
        self.frames.append(pd.DataFrame(rows, columns=ROW_COLUMNS))
        st = summarize(pd.concat(self.frames, ignore_index=True))
        case = rows[0]["case"]
        line = st[st["case"] == case].iloc[0].to_dict()
        self.out(format_line(line))

    def summary(self) -> pd.DataFrame | None:
        if not self.frames:
            return None
        return summarize(pd.concat(self.frames, ignore_index=True))


def read(path: str) -> tuple[pd.DataFrame, dict]:
    """Load a result table and its sidecar; refuse a schema this version does not know."""
    meta_path = path[: -len(".parquet")] + ".meta.json" if path.endswith(".parquet") else path + ".meta.json"
    meta = {}
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
    if meta.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {meta.get('schema_version')} (this kvbench reads {SCHEMA_VERSION})")
    return pd.read_parquet(path), meta
