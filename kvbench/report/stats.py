"""The statistics that fit each kind of result row.

- bandwidth: a single request with nothing else on its clock (serial, no prefill, no handshake):
  GB/s, bulk%, %line, latency percentiles;
- exposed: a request timed against a prefill clock or a handshake: exposed ms against the model
  (GB/s of such times would count the prefill);
- workload: requests arriving at a rate into a bounded decode pool: queue and exposed tails,
  admitted and dropped, against the arrival rate (GB/s would count the queue).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.results.samples import percentile

from .link import LinkOverride, add_line_rate
from .tables import read, run_status, summarize

KINDS = ("bandwidth", "exposed", "workload")


def kind_of(st: pd.DataFrame) -> pd.Series:
    """Per summary line: bandwidth, exposed or workload."""
    # 'auto' (a prefill from FLOPs) and an absent setting fall back on the prefill time the rows carry
    prefill = pd.to_numeric(st["prefill_ms_set"], errors="coerce").fillna(st["prefill_s"].fillna(0) * 1e3)
    timed_alone = (st["overlap"] == "serial") & (prefill == 0) & (st["handshake"].fillna("off") == "off")
    out = pd.Series("exposed", index=st.index)
    out[timed_alone] = "bandwidth"
    out[st["workload"].fillna("none") != "none"] = "workload"
    return out


def arrival_rate(spec: str) -> float:
    """Requests per second per prefill rank of a workload's arrival ('poisson:R', 'interval:MS'; none: nan)."""
    kind, _, val = str(spec).partition(":")
    try:
        v = float(val)
    except ValueError:
        return float("nan")
    return v if kind == "poisson" else (1e3 / v if kind == "interval" and v > 0 else float("nan"))


def workload_stats(df: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """Per workload case, from the decode ranks' rows: counts and tails (ms) of admitted requests."""
    dec = df[(df["workload"].fillna("none") != "none") & (df["role"] == "decode")]
    out = []
    load = meta.get("load") or {}
    for case, g in dec.groupby("case"):
        ok = g[g["status"] == "ok"]
        first = g.iloc[0]
        r = {"case": case, "arrival": first["workload"], "rate_rps": arrival_rate(first["workload"]),
             "prefill_ranks": int(g["pair"].nunique()), "requests": len(g), "admitted": len(ok),
             "dropped": int((g["status"] != "ok").sum()),
             "payload_mean_B": float(ok["payload_bytes"].mean()) if len(ok) else np.nan}
        for name, col in (("queue", "queue_s"), ("exposed", "exposed_s"), ("landed", "seconds")):
            vals = ok[col].dropna().to_numpy() * 1e3
            for q in (50, 95, 99):
                r[f"{name}_p{q}_ms"] = percentile(vals, q)  # NaN where n cannot hold it (samples.py)
        facts = load.get(str(case), {})
        r["pool_peak"], r["pool_mean"] = facts.get("peak", np.nan), facts.get("mean", np.nan)
        r["pool_cap"] = facts.get("cap_blocks", np.nan)
        out.append(r)
    return pd.DataFrame(out)


@dataclass
class Run:
    """One result file, read and summarized."""

    path: str
    df: pd.DataFrame
    meta: dict
    st: pd.DataFrame  # summarize() + kind + link_gbps/link/pct_line
    wl: pd.DataFrame = field(default_factory=pd.DataFrame)  # workload_stats(), joined to st's case keys

    @property
    def name(self) -> str:
        """The result file's name without its suffix."""
        return os.path.basename(self.path).removesuffix(".parquet")

    @property
    def status(self) -> str | None:
        """The sidecar's status of a run that did not end cleanly (INCOMPLETE, TIMEOUT, ERROR...); None otherwise."""
        return run_status(self.meta)

    @property
    def label(self) -> str:
        """The run as every table and figure names it: its name, and its status when it did not end cleanly."""
        return self.name if self.status is None else f"{self.name} [{self.status}]"

    def of(self, kind: str) -> pd.DataFrame:
        return self.st[self.st["kind"] == kind]


def load_run(path: str, override: LinkOverride | None = None) -> Run:
    """Read a result file (upgrading a known older schema, refusing others) and compute its statistics."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such result file")
    df, meta = read(path)
    st = summarize(df)
    st["kind"] = kind_of(st)
    st = add_line_rate(st, df, meta, override, bandwidth=st["kind"] == "bandwidth")
    run = Run(path, df, meta, st)
    st.insert(0, "run", run.label)
    wl = workload_stats(df, meta)
    if len(wl):
        run.wl = st[["run", "case", "transport", "op", "model", "tokens", "block_size", "overlap", "variant"]].merge(
            wl, on="case")
    return run
