"""``kvbench run --compact``: the live table with only the columns nccl-tests users scan (path, op, size, blocks,
GB/s, Gb/s, p50, n, #wrong, status) and a legend of three lines; the rows are the full table's (tables.py's
summarize, format_line and LivePrinter), and every column stays in the result file."""
from __future__ import annotations

import pandas as pd

from .counts import _i, wrong_text
from .tables import _f, columns_for, header_lines, overlap_header_lines, uses_overlap

# the columns, and a legend of three lines instead of the full table's
COMPACT_COLUMNS = [
    ("path", 16, lambda r: r["transport"] + ("" if r["variant"] == "paged" else f"/{r['variant']}")),
    ("op", 4, lambda r: r["op"]),
    ("size", 9, lambda r: _size(r.get("payload_bytes"))),
    ("blocks", 7, lambda r: _i(r.get("descriptors"))),
    ("GB/s", 7, lambda r: _f(r["gbps"], ".2f")),
    ("Gb/s", 7, lambda r: _f(r["gbps"] * 8, ".1f")),
    ("p50(us)", 9, lambda r: _f(r["p50"] * 1e6, ".1f")),
    ("n", 5, lambda r: _i(r.get("samples"))),
    ("#wrong", 6, lambda r: wrong_text(r)),
    ("status", 9, lambda r: _status(r)),
]
COMPACT_LEGEND = [
    "# GB/s = 10^9 B/s of one request's KV payload (size) at its p50 time; Gb/s = 8 x GB/s; blocks = descriptors",
    "# per request; path/REF = a reference measured beside the paged rows (bulk: one descriptor per layer, chunk-N)",
    "# status: ok, FAILED (#wrong > 0), unchecked (-c 0), SKEW (clocks), noise (above the ceiling); all: no --compact",
]


def _size(n) -> str:
    """Bytes with a binary unit: 2097152 -> '2MiB', 1572864 -> '1.5MiB' (config/sizes.human, which -b reads)."""
    if n is None or pd.isna(n):
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".rstrip("0").rstrip(".") + unit
    return f"{n:.0f}B"


def _status(r) -> str:
    """A compact row's word: FAILED, SKEW, noise, unchecked or ok (the full table's #wrong, clock and bulk% marks)."""
    wrong = r.get("nwrong_checked")
    if wrong is not None and not pd.isna(wrong) and wrong > 0:
        return "FAILED"
    if r.get("clock_flag") is True or r.get("clock_flag") == 1:
        return "SKEW"
    if r.get("noise") is True or r.get("noise") == 1:
        return "noise"
    return "unchecked" if wrong is None or pd.isna(wrong) else "ok"


def live_table(cases: list[dict], compact: bool = False) -> tuple[list, list[str]]:
    """The live table of a run's cases, (columns, header lines): the exposed-time table when they need it, else
    the compact one (``--compact``) or the full one."""
    if uses_overlap(cases):
        columns = columns_for(cases, True)
        return columns, overlap_header_lines(columns)
    if compact:
        cols = " ".join(f"{h:>{w}}" for h, w, _ in COMPACT_COLUMNS)
        return COMPACT_COLUMNS, [*COMPACT_LEGEND, "#", "#" + cols[1:]]
    columns = columns_for(cases)
    return columns, header_lines(columns)
