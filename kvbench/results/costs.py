"""Time per layer outside the wire: what kvbench itself adds to a transfer it times.

Each timed iteration records on every rank (schedule.Iteration.cost):

* ``post_s``: seconds inside the transport's prepare/post/start/serve/signal calls (on the timed path
  for the initiator), of which ``lib_s`` inside the library call that moves or queues the bytes (a
  writev, a Put, a transfer submission, a two-sided path's pack): that part is the wire or the library's
  own posting, which a plain reference pays too, so kvbench's own cost is ``post_s - lib_s``;
* ``notify_s``: seconds in the harness's own notifications (one-sided push completion, a pull's
  layer-ready MPI messages);
* ``wake_s`` (per request): from the transport's landing stamp to the moment the harness's wait
  returned (only where the transport stamps the landing itself, in C where the last byte was read, by
  its receive thread or by tcp's waiting caller; empty where the harness stamps it, since the two are
  then the same moment).

Readers turn them into microseconds per layer: per (case, iteration) the largest value over the ranks,
then the median over iterations, divided by the layers of a request (and the requests a rank posts).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # every rank builds cost columns; only rank 0 and the readers make frames (per_case imports it)
    import pandas as pd

COLUMNS = ["post_s", "lib_s", "notify_s", "wake_s"]  # result rows, schema 3 (results/store.py)
NAN = float("nan")


# per entry, the iteration's lists -> the row's column: wake_s here, the other two for results/bounds.py
PER_ENTRY = {"wake_s": "wake_s", "lead_s": "stamp_lead_s", "window_s": "window_s",
             "register_s": "register_s", "deregister_s": "deregister_s"}  # --register per-request (schema 7)


def reorder(cost: list[dict], pos: list[int]) -> list[tuple]:
    """Per timed iteration (post_s, lib_s, notify_s, {PER_ENTRY key: per entry in the rows' order}); ``pos``:
    row k's place in the iteration's completion order."""
    out = []
    for c in cost:
        per = {key: c.get(key) or [] for key in PER_ENTRY}
        out.append((c["post_s"], c["lib_s"], c["notify_s"],
                    {key: [v[p] if p < len(v) else None for p in pos] for key, v in per.items()}))
    return out


def row(cost: list[tuple] | None, it: int, k: int) -> dict:
    """The cost columns of entry ``k``'s row for timed iteration ``it``."""
    if not cost or it >= len(cost):
        return {}
    post, lib, note, per = cost[it]
    out = {"post_s": float(post), "lib_s": float(lib), "notify_s": float(note)}
    for key, col in PER_ENTRY.items():
        v = per[key][k] if k < len(per[key]) else None
        out[col] = NAN if v is None else float(v)
    return out


def per_case(df: pd.DataFrame) -> pd.DataFrame:
    """Per case, microseconds per layer: post_us (kvbench's own posting: post_s - lib_s), lib_us (inside the
    library's data call), notify_us, wake_us, and cost_us = post + notify + wake (NaN read as 0 in the sum)."""
    import pandas as pd

    cols = ["post_us", "lib_us", "notify_us", "wake_us", "cost_us"]
    if df is None or not set(COLUMNS) <= set(df.columns):
        return pd.DataFrame(columns=cols)
    ok = df[(df["status"] == "ok") & (df["iter"] >= 0) & df["post_s"].notna()]
    if ok.empty:
        return pd.DataFrame(columns=cols)
    # a rank's post/notify are per iteration over all its requests: one value per (case, rank, iter)
    ok = ok.assign(own_s=ok["post_s"] - ok["lib_s"])
    rank = ok.groupby(["case", "rank", "iter"]).agg(own_s=("own_s", "first"), lib_s=("lib_s", "first"),
                                                    notify_s=("notify_s", "first"), wake_s=("wake_s", "max"),
                                                    reqs=("req", "nunique"), pairs=("pair", "nunique"))
    per_req = rank[["own_s", "lib_s", "notify_s", "wake_s"]].div(rank["reqs"] * rank["pairs"], axis=0)
    it = per_req.groupby(level=["case", "iter"]).max()  # the slowest rank of the iteration
    med = it.groupby(level="case").median()
    layers = ok.groupby("case")["layers"].first()
    out = pd.DataFrame({name: med[c] / layers * 1e6 for name, c in
                        (("post_us", "own_s"), ("lib_us", "lib_s"), ("notify_us", "notify_s"), ("wake_us", "wake_s"))})
    out["cost_us"] = out[["post_us", "notify_us", "wake_us"]].fillna(0).sum(axis=1)
    return out


def sidecar(df: pd.DataFrame | None) -> dict:
    """For the sidecar: per case, microseconds per layer outside the wire (see per_case)."""
    if df is None:
        return {}
    out = {}
    for case, r in per_case(df).iterrows():
        out[str(int(case))] = {k: (None if math.isnan(v) else round(float(v), 2)) for k, v in r.items()}
    return out


def fmt(x) -> str:
    """A table cell: microseconds with one decimal, '-' when unknown."""
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.1f}"
