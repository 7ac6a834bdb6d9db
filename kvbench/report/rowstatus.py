"""A result row's status (SUSPECT, noisy, SKEW, WRONG, noise, at ceiling, ok) and the rows a verdict may rest on:
read by the summary, the typical GB/s and the plan alike.
"""
from __future__ import annotations

import re

import pandas as pd

# a row's status, strongest first: a status column of the rows (SUSPECT and the like) wins over what bulk% says
STATUS_COLUMNS = ("row_status", "verdict", "bound_status")


def status(r) -> str:
    """SUSPECT (or another status the rows carry), wrong elements, noise above the ceiling, at the ceiling, or ok."""
    # beyond a bound; beyond the copies beside it within their best (no verdict, results/bounds.py); clocks
    # matched only within more than 5% of its p50 (not an OK measurement)
    for col, word in (("suspect", "SUSPECT"), ("noisy_case", "noisy"), ("clock_flag", "SKEW")):
        flag = r.get(col)
        if flag is not None and not pd.isna(flag) and bool(flag):
            return word
    for col in STATUS_COLUMNS:
        if col in r and isinstance(r[col], str) and r[col] and r[col] != "ok":
            return r[col]
    if not pd.isna(r.get("nwrong_checked")) and r["nwrong_checked"] > 0:
        return "WRONG"
    if bool(r.get("noise")):
        return "noise"
    return "at ceiling" if bool(r.get("at_ceiling", False)) else "ok"


def suspect_cases(meta: dict, key: str = "suspects") -> set[int]:
    """The cases a run's sidecar names in its SUSPECT lines ('SUSPECT: case N (...)'; ``key`` "noisy": its NOISY
    lines), for rows that carry no status of their own."""
    return {int(m.group(1)) for line in meta.get(key) or [] if isinstance(line, str)
            for m in [re.search(r"\bcase (\d+)\b", line)] if m}


def trusted(st, meta: dict):
    """(the cases a plan may draw a rate from, how many were left out): none whose check found a wrong byte or
    whose time beat its path's bound (SUSPECT): a verdict drawn from them would price a link on bytes that did not
    arrive, or on a time that did not happen."""
    bad = untrusted(st, st["case"].isin(suspect_cases(meta)))
    return st[~bad], int(bad.sum())


def untrusted(st: pd.DataFrame, suspect: pd.Series) -> pd.Series:
    """The rows no verdict may rest on: SUSPECT (``suspect``), or a check that found a wrong byte."""
    return suspect | (st["nwrong"].fillna(0) > 0) if "nwrong" in st else suspect
