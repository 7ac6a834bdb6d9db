"""The wire's own count against the payload (issue 42, item 2): a case whose transport counted fewer bytes on its
wire than the payload it claims to move, with no codec in the path, is SUSPECT (a compressing or forging path moved
fewer bytes than the row says).  Pure: rows in, verdicts out; the run's footer and status print them.

Counted rows are the timed rows with a ``wire_counted_bytes`` (schema 8, harness/wirerows.py: tcp's kernel count);
an older file, or a transport that counts nothing, has none and is never judged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.results.bounds import key

if TYPE_CHECKING:  # every rank imports the footer's modules; only rank 0 judges rows (it holds the frames)
    import pandas as pd

_KEYS = ["transport", "op", "model", "tokens", "variant", "allocation", "block_size", "memory", "overlap"]


def _no_codec(codec: pd.Series) -> pd.Series:
    return codec.astype(object).fillna("none").astype(str).isin(["", "none"])


def short(df: pd.DataFrame | None) -> list[dict]:
    """Per case whose counted wire carried less than its payload with no codec in the path: {case, key, payload,
    wire_bytes (the median counted bytes of its timed rows), line}."""
    if df is None or "wire_counted_bytes" not in df.columns or not len(df):
        return []
    import pandas as pd
    rows = df[(df["iter"] >= 0) & (df["status"] == "ok") & df["wire_counted_bytes"].notna() & _no_codec(df["codec"])]
    if "row_kind" in rows.columns:
        rows = rows[rows["row_kind"].astype(object).fillna("transfer") == "transfer"]
    out = []
    for case, g in rows.groupby("case"):
        payload = float(g["payload_bytes"].median())
        wire = float(g["wire_counted_bytes"].median())
        # a row's count is its share of its connection's bytes, headers included: an honest row is never below its
        # payload, so the case's median row short of its own payload is a path that did not move what it claims
        if float((g["wire_counted_bytes"] - g["payload_bytes"]).median()) >= 0:
            continue
        name = key(pd.Series({k: g[k].iloc[0] for k in _KEYS}, name=int(case)))
        out.append(dict(case=int(case), key=name, payload=payload, wire_bytes=wire,
                        line=f"SUSPECT: {name}: its wire carried {wire:.0f} B for a {payload:.0f} B payload with no "
                             "codec in the path: fewer bytes than it claims to move"))
    return out
