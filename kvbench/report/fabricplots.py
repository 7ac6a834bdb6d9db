"""The Fabric section's figures: per-NIC bars (each rail's GB/s, or each NIC's share of a case's bytes by its
kernel counters) and per flow its GB/s alone against with every flow (report/fabric.py's tables, drawn)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from kvbench.fabric import carriers as C
from kvbench.report.plots import _panels

MAX_BARS = 24  # groups of bars beyond this are unreadable: the table says the rest


def nic_bytes(df: pd.DataFrame) -> pd.DataFrame:
    """Per (case, rank, NIC) the bytes its counters moved over the case's timed iterations (carrier columns)."""
    if "nic_bytes" not in df:
        return pd.DataFrame()
    d = df[(df["iter"] >= 0) & (df["nic_bytes"].astype(object).fillna("") != "")]
    out = [{"case": c, "transport": g["transport"].iloc[0], "rank": r, "nic": nic, "bytes": tx + rx}
           for (c, r), g in d.groupby(["case", "rank"]) for nic, (tx, rx) in C.decode(g["nic_bytes"].iloc[0]).items()
           if tx + rx > 0]
    return pd.DataFrame(out)


def _run(t: pd.DataFrame) -> pd.Series | str:
    """A bar group's run prefix: the run's label where a report holds several, else nothing."""
    return t["run"] + " " if t["run"].nunique() > 1 else ""


def _bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    x, w = np.arange(len(groups)), 0.8 / max(1, len(series))
    for k, (name, ys) in enumerate(series.items()):
        ax.bar(x + k * w - 0.4 + w / 2, ys, w, label=name)
    top = max((y for ys in series.values() for y in ys if np.isfinite(y)), default=0)
    if top > 0:
        ax.set_ylim(0, top * 1.3)  # room for the legend above the tallest bar
    ax.set_xticks(x, groups, rotation=30, ha="right", fontsize=7)
    ax.grid(alpha=.3, axis="y")
    ax.legend(fontsize=7, loc="upper right", frameon=False)  # the rotated group labels take the space below


def per_nic(rails: pd.DataFrame, moved: pd.DataFrame) -> Iterator[tuple]:
    """Bars per NIC: a striped case's GB/s per rail, and where no case striped, each NIC's share of the bytes."""
    if len(rails):
        r = rails.assign(group=_run(rails) + "case " + rails["case"].astype(str) + " " + rails["transport"]
                         + " " + rails["op"])
        groups = list(dict.fromkeys(r["group"]))[:MAX_BARS]
        nics = list(dict.fromkeys(r["nic"]))
        fig, (ax,) = _panels(1, "GB/s per rail")
        _bars(ax, groups, {n: [float(r[(r["group"] == g) & (r["nic"] == n)]["gbps"].sum()) for g in groups]
                           for n in nics})
        ax.set_ylabel("GB/s (10^9 B/s) at the case's p50")
        yield (f"Per rail of each striped case ({len(groups)} shown), its NIC's GB/s at the case's p50: rails that "
               "work carry equal bars; a short bar is a rail that idled (docs/fabric.md).", fig)
    elif len(moved):
        m = moved.assign(group=_run(moved) + "case " + moved["case"].astype(str) + " " + moved["transport"]
                         + " rank " + moved["rank"].astype(str))
        groups = list(dict.fromkeys(m["group"]))[:MAX_BARS]
        nics = list(dict.fromkeys(m["nic"]))
        total = m.groupby("group")["bytes"].sum()
        fig, (ax,) = _panels(1, "bytes per NIC")
        _bars(ax, groups, {n: [100 * float(m[(m["group"] == g) & (m["nic"] == n)]["bytes"].sum()) / total[g]
                               for g in groups] for n in nics})
        ax.set_ylabel("% of the NICs' bytes in the case's timed iterations")
        yield (f"Per case and rank ({len(groups)} shown), each NIC's share of the bytes its kernel counters moved "
               "while the case was timed: the carrier is the NIC with the tall bar (lo: loopback, not a link).", fig)


def flows(table: pd.DataFrame) -> Iterator[tuple]:
    """Per flow of a traffic matrix its GB/s alone against with every flow at once."""
    if table.empty:
        return
    t = table.assign(group=_run(table) + "case " + table["case"].astype(str) + " " + table["transport"] + " "
                     + table["flow"].astype(str))
    groups = list(dict.fromkeys(t["group"]))[:MAX_BARS]
    fig, (ax,) = _panels(1, "flows: isolated against congested")
    pick = t.drop_duplicates("group").set_index("group").loc[groups]
    _bars(ax, groups, {"alone (isolated)": list(pick["isolated_gbps"]),
                       "with every flow (congested)": list(pick["congested_gbps"])})
    ax.set_ylabel("GB/s (10^9 B/s) at p50")
    yield (f"Per flow ({len(groups)} shown), its GB/s alone and with every flow of its matrix at once: the ratio "
           "is its slowdown (an incast of N flows into one link: about N).", fig)
