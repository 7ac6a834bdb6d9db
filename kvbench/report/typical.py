"""A path's typical paged GB/s: the median over the sweep's paged rows, with a distribution-free 95% interval of that
median and n (rows), never the best row. A path whose rows are mostly noise or missed their CI target is said to be
"not measured to the target", with the reason; rows with wrong bytes or a SUSPECT time count for nothing.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.results.samples import p50_ci

from .rowstatus import status
from .verdicts import IN_PROCESS

MOSTLY = 0.5  # more than this share of a path's rows noisy or short of their CI target: not measured to the target
NOISE = ("noise", "noisy", "SKEW")  # a row status that says the time is not the path's own


def unmet_ci(rows: pd.DataFrame) -> pd.Series:
    """Per row: a CI target was set (--target-ci) and the p50's interval did not come within it."""
    if "ci_target_pct" not in rows:
        return pd.Series(False, index=rows.index)
    target = pd.to_numeric(rows["ci_target_pct"], errors="coerce")
    got = pd.to_numeric(rows["ci_pct"], errors="coerce") if "ci_pct" in rows else pd.Series(np.nan, index=rows.index)
    return target.notna() & ~(got <= target)


def _path_row(rows: pd.DataFrame, bad: pd.Series) -> dict:
    r0 = rows.iloc[0]
    path = r0["transport"] + ("" if r0["memory"] == "host" else f" ({r0['memory']})")
    kept = rows[~bad]
    noise = kept.apply(status, axis=1).isin(NOISE)
    unmet = unmet_ci(kept)
    lo, hi = p50_ci(kept["gbps"])  # results/samples.py: the tables' own order-statistic interval
    med = float(kept["gbps"].median()) if len(kept) else math.nan
    out = {"run": r0["run"], "path": path, "op": r0["op"], "typical paged GB/s": "-" if math.isnan(med) else f"{med:.2f}",
           "95% interval": "-" if math.isnan(lo) else f"{lo:.2f}-{hi:.2f}", "n (rows)": str(len(kept))}
    why = []
    if bad.any():
        why.append(f"{int(bad.sum())} of {len(rows)} rows left out (wrong bytes or SUSPECT)")
    if len(kept) and (noise | unmet).mean() > MOSTLY:
        word = "not measured to the target"
        if unmet.any():
            target = pd.to_numeric(kept["ci_target_pct"], errors="coerce").max()
            why.insert(0, f"{int(unmet.sum())} of {len(kept)} rows missed the ±{target:g}% CI target (median ci "
                          f"±{pd.to_numeric(kept['ci_pct'], errors='coerce').median():.1f}%)")
        if noise.any():
            why.insert(0, f"{int(noise.sum())} of {len(kept)} rows noise above their ceiling or noisy")
    elif not len(kept):
        word = "WRONG" if (rows["nwrong_checked"].fillna(0) > 0).any() else "SUSPECT"
    else:  # a typical value, saying what it left out
        word = "typical without its SUSPECT or wrong rows" if bad.any() else "typical"
    if r0["transport"] in IN_PROCESS:
        word, why = "reference", ["an in-process copy: the memory-copy reference, not a candidate"] + why
    return dict(out, status=word, why="; ".join(why) or "-")


def typical_paged(bw: pd.DataFrame) -> pd.DataFrame:
    """Per run, path (transport, memory) and op: the median GB/s of its paged rows, candidates first and in-process
    references last. ``bw``: bandwidth rows with ``suspect`` (SUSPECT) marked."""
    paged = bw[(bw["variant"] == "paged") & bw["gbps"].notna()]
    if paged.empty:
        return pd.DataFrame()
    out = []
    for _, rows in paged.groupby(["run", "transport", "memory", "op"], sort=False):
        bad = rows["suspect"].fillna(False).astype(bool) if "suspect" in rows else pd.Series(False, index=rows.index)
        out.append(_path_row(rows, bad | (rows["nwrong_checked"].fillna(0) > 0)))
    t = pd.DataFrame(out)
    return t.sort_values("status", key=lambda s: s == "reference", kind="stable").reset_index(drop=True)


def by_path(t: pd.DataFrame) -> pd.DataFrame:
    """``typical_paged`` with its ops side by side (one row per run and path, a cell 'GB/s (interval) n'), and one
    status: 'typical', or each op's other status with its reason."""
    out: dict = {}
    for _, r in t.iterrows():
        row = out.setdefault((r["run"], r["path"]), {"run": r["run"], "path": r["path"]})
        ci = "" if r["95% interval"] == "-" else f" ({r['95% interval']})"
        row[f"{r['op']} GB/s"] = f"{r['typical paged GB/s']}{ci} n {r['n (rows)']}"
        if r["status"] != "typical":
            why = "" if r["why"] == "-" else f": {r['why']}"
            row.setdefault("said", {}).setdefault(r["status"] + why, []).append(r["op"])
    for row in out.values():
        said = row.pop("said", {})
        row["status"] = "; ".join(f"{'/'.join(ops)} {word}" for word, ops in said.items()) or "typical"
    return pd.DataFrame(list(out.values())).fillna("-")
