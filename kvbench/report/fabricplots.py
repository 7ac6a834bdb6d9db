"""The Fabric section's figures: per-NIC bars (each rail's GB/s, or each NIC's share of a case's bytes by its
kernel counters) and per flow its GB/s alone against with every flow (report/fabric.py's tables, drawn)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from kvbench.fabric import carriers as C
from kvbench.report.plotstyle import _plt

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


def _bars(title: str, groups: list[str], series: dict[str, list[float]], xlabel: str):
    """A figure of horizontal bar groups, one per group, named on the y axis (one line each, so that no two names
    overlap however many there are) and the legend below the panel, inside the figure."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 1.9 + 0.22 * len(groups) * max(1, len(series)) ** .5 + 0.18 * len(series)),
                           layout="constrained")
    y, h = np.arange(len(groups))[::-1], 0.8 / max(1, len(series))
    for k, (name, xs) in enumerate(series.items()):
        ax.barh(y + 0.4 - h / 2 - k * h, xs, h, label=name)
    ax.set_yticks(y, groups, fontsize=7)
    ax.set_ylim(-0.6, len(groups) - 0.4)
    ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=.3, axis="x")
    # the figure's own legend, below the panel: the constrained layout makes room for it, so it is never clipped
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", frameon=False,
               ncol=min(4, max(1, len(series))))
    return fig


def per_nic(rails: pd.DataFrame, moved: pd.DataFrame) -> Iterator[tuple]:
    """Bars per NIC: a striped case's GB/s per rail, and where no case striped, each NIC's share of the bytes."""
    if len(rails):
        r = rails.assign(group=_run(rails) + "case " + rails["case"].astype(str) + " " + rails["transport"]
                         + " " + rails["op"])
        groups = list(dict.fromkeys(r["group"]))[:MAX_BARS]
        nics = list(dict.fromkeys(r["nic"]))
        fig = _bars("GB/s per rail", groups, {n: [float(r[(r["group"] == g) & (r["nic"] == n)]["gbps"].sum())
                                                  for g in groups] for n in nics}, "GB/s (10^9 B/s) at the case's p50")
        yield (f"Per rail of each striped case ({len(groups)} shown), its NIC's GB/s at the case's p50: rails that "
               "work carry equal bars; a short bar is a rail that idled (docs/fabric.md).", fig)
    elif len(moved):
        m = moved.assign(group=_run(moved) + "case " + moved["case"].astype(str) + " " + moved["transport"]
                         + " rank " + moved["rank"].astype(str))
        groups = list(dict.fromkeys(m["group"]))[:MAX_BARS]
        nics = list(dict.fromkeys(m["nic"]))
        total = m.groupby("group")["bytes"].sum()
        fig = _bars("bytes per NIC", groups, {n: [100 * float(m[(m["group"] == g) & (m["nic"] == n)]["bytes"].sum())
                                                  / total[g] for g in groups] for n in nics},
                    "% of the NICs' bytes in the case's timed iterations")
        yield (f"Per case and rank ({len(groups)} shown), each NIC's share of the bytes its kernel counters moved "
               "while the case was timed: the carrier is the NIC with the tall bar (lo: loopback, not a link).", fig)


def flows(table: pd.DataFrame) -> Iterator[tuple]:
    """Per flow of a traffic matrix its GB/s alone against with every flow at once."""
    if table.empty:
        return
    t = table.assign(group=_run(table) + "case " + table["case"].astype(str) + " " + table["transport"] + " "
                     + table["flow"].astype(str))
    groups = list(dict.fromkeys(t["group"]))[:MAX_BARS]
    pick = t.drop_duplicates("group").set_index("group").loc[groups]
    fig = _bars("flows: isolated against congested", groups,
                {"alone (isolated)": list(pick["isolated_gbps"]), "with every flow (congested)": list(pick["congested_gbps"])},
                "GB/s (10^9 B/s) at p50")
    yield (f"Per flow ({len(groups)} shown), its GB/s alone and with every flow of its matrix at once: the ratio "
           "is its slowdown (an incast of N flows into one link: about N).", fig)
