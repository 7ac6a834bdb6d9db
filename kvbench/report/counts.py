"""Per case counts a table shows: its wrong elements over every checked iteration (#wrong, #chk) and the spread
of its per-round medians (±%, with its number of rounds when that is too few to decide a noise flag).

Pure functions of result rows (report/tables.py shows them)."""
from __future__ import annotations

import pandas as pd

MIN_ROUNDS = 5  # a spread from fewer rounds is printed with its n and decides no * (its quartiles are 2-4 medians)


def _i(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{int(x)}"


def wrong_text(r) -> str:
    """A row's #wrong: wrong elements over every checked iteration ('-' = not checked)."""
    return _i(r.get("nwrong_checked"))


def checks_text(r) -> str:
    """How many checked iterations (a workload: checked requests) its #wrong covers ('-' = not checked)."""
    return "-" if pd.isna(r.get("nwrong_checked")) else _i(r.get("nwrong_iters"))


WRONG_NOTE = ("#wrong = destination elements that failed the check, summed over the #chk checked iterations (the "
              "check pass, and each timed one under -c all; a workload: its checked requests); - = not checked")


def wrong_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Per case (the index): ``nwrong_checked``, the wrong elements of its destination rows summed over every
    checked iteration, and ``nwrong_iters``, how many that covers: the check pass (iter -1), each timed iteration
    whose rows carry a count (-c all), a workload's each checked request.  A case nothing checked is absent; a file
    without per-iteration counts (before -c all, or -c 1) sums the check pass alone, as it always read."""
    d = df[df["nwrong"].notna()]
    if "role" in d:  # a source's rows carry 0 (checkpass.py): the counts are the destination's
        d = d[d["role"] != "prefill"]
    if d.empty:
        return pd.DataFrame({"nwrong_checked": pd.Series(dtype=float), "nwrong_iters": pd.Series(dtype=float)})
    workload = d["workload"].fillna("none") != "none" if "workload" in d else pd.Series(False, index=d.index)
    # a timed iteration is one check of every pair and request; a workload's request is a check of its own
    n_iter = d[~workload].groupby("case")["iter"].nunique()
    n_req = d[workload].groupby("case").size()
    return pd.DataFrame({"nwrong_checked": d.groupby("case")["nwrong"].sum().astype(float),
                         "nwrong_iters": pd.concat([n_iter, n_req]).groupby(level=0).sum().astype(float)})


def spread_pct(df: pd.DataFrame, rounds: bool = False) -> pd.Series:
    """Per case: the interquartile range of its per-round median times, in % of their median (NaN with one round:
    no spread to measure, where 0 would read as a steady one); ``rounds``: the number of rounds instead."""
    ok = df[(df["status"] == "ok") & (df["iter"] >= 0) & df["round"].notna() & df["seconds"].notna()]
    if ok.empty:  # a workload's rows have no rounds
        return pd.Series(dtype=float)
    t = ok.groupby(["case", "round", "pair", "req", "iter"])["seconds"].max()
    per_round = t.groupby(["case", "round"]).median()
    if rounds:
        return per_round.groupby("case").size().astype(float)
    q = per_round.groupby("case").quantile([0.25, 0.5, 0.75]).unstack()
    return (100 * (q[0.75] - q[0.25]) / q[0.5]).where(per_round.groupby("case").size() > 1)


def spread_text(r) -> str:
    """A row's ±%: with its number of rounds in parentheses when there are fewer than MIN_ROUNDS."""
    v, n = r.get("spread_pct"), r.get("spread_rounds")
    if v is None or pd.isna(v):
        return "-"
    return f"{v:.1f}" if n is None or pd.isna(n) or n >= MIN_ROUNDS else f"{v:.0f}({int(n)})"
