"""The fabric: per flow of a traffic matrix its time alone against its time with every flow (slowdown, fairness,
GB/s into each receiver), and per rail of a striped transport its GB/s and Mpps (harness/flows.py, railrows.py).

``flow_table`` and ``rail_table`` read the rows (schema 7; older files have neither and give empty tables);
``table_lines`` prints both after the bandwidth table, as `kvbench run` and `kvbench report` do; ``add_section``
adds them to the report's page.
"""
from __future__ import annotations

from itertools import chain

import pandas as pd

from kvbench.results.store import transfer_rows


def _timed(df: pd.DataFrame) -> pd.DataFrame:
    df = transfer_rows(df)
    return df[(df["status"] == "ok") & (df["iter"] >= 0)]


def flow_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per congested flow: its isolated and congested p50 (ms), slowdown, GB/s, the case's fairness and
    its receiver's aggregate GB/s."""
    if "flow_mode" not in df:
        return pd.DataFrame()
    ok = _timed(df)
    c = ok[(ok["flow_mode"] == "congested") & ok["role"].isin(["decode", "both"])]
    if c.empty:
        return pd.DataFrame()
    keys = ["case", "transport", "op", "variant", "flow", "rank"]
    g = c.groupby(keys, sort=True).agg(bytes=("payload_bytes", "first"), isolated_s=("isolated_s", "first"),
                                       congested_s=("congested_s", "first"), slowdown=("slowdown", "first"),
                                       fairness=("fairness", "first"), receiver_gbps=("receiver_gbps", "first"))
    g = g.reset_index().rename(columns={"rank": "receiver"})
    g["isolated_ms"], g["congested_ms"] = g["isolated_s"] * 1e3, g["congested_s"] * 1e3
    g["isolated_gbps"], g["congested_gbps"] = g["bytes"] / g["isolated_s"] / 1e9, g["bytes"] / g["congested_s"] / 1e9
    return g[["case", "transport", "op", "variant", "flow", "receiver", "bytes", "isolated_ms", "congested_ms",
              "slowdown", "isolated_gbps", "congested_gbps", "fairness", "receiver_gbps"]]


def rail_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per (case, rail) of a striped transport's destination rows: its NIC, its share of the bytes and
    descriptors, GB/s and Mpps at the case's p50, and the kernel's count against the share."""
    if "rails" not in df:
        return pd.DataFrame()
    ok = _timed(df)
    ok = ok[(ok["rails"] > 1) & ok["role"].isin(["decode", "both"])]
    if ok.empty:
        return pd.DataFrame()
    out = []
    for (case, pair), rows in ok.groupby(["case", "pair"], sort=True):
        r = rows.iloc[0]
        p50 = float(rows.groupby("iter")["seconds"].max().median())
        nics = r["rail_nics"].split(",")
        wire = [int(x) for x in r["rail_wire_bytes"].split(",")] if r["rail_wire_bytes"] else [None] * len(nics)
        reqs = rows["req"].nunique()
        if r["rail_bytes"]:  # kvbench striped the request: its own split
            share, descs = [int(x) for x in r["rail_bytes"].split(",")], [int(x) for x in r["rail_descs"].split(",")]
        elif r["rail_wire_bytes"]:  # an engine picked its lanes: each rail's share is what its sockets counted
            share, descs = [w // max(1, reqs) for w in wire], [float("nan")] * len(nics)
        else:
            continue
        for k, nic in enumerate(nics):
            out.append({"case": case, "transport": r["transport"], "op": r["op"], "variant": r["variant"],
                        "pair": pair, "rail": k, "nic": nic, "bytes": share[k], "share_pct": 100 * share[k] / max(1, sum(share)),
                        "gbps": share[k] / p50 / 1e9 if p50 > 0 else float("nan"),
                        "mpps": descs[k] / p50 / 1e6 if p50 > 0 else float("nan"),
                        "wire_pct": 100 * wire[k] / max(1, sum(w or 0 for w in wire)) if wire[k] is not None else float("nan"),
                        "wire_per_share": wire[k] / (share[k] * reqs) if wire[k] is not None and share[k] else float("nan")})
    return pd.DataFrame(out)


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def table_lines(df: pd.DataFrame) -> list[str]:
    """The fabric tables as '#' lines (nothing without flows or rails)."""
    out = []
    f = flow_table(df)
    if len(f):
        out += ["#", "# flows: each alone (isolated) and all at once (congested), p50 of the later of its two ranks; "
                "slowdown = congested / isolated; fairness = min/max GB/s over the case's flows; rxGB/s = GB/s into "
                "the receiver over all its flows",
                f"#{'transport':>11} {'op':>4} {'variant':>7} {'flow':>6} {'iso(ms)':>9} {'cong(ms)':>9} "
                f"{'slowdown':>8} {'isoGB/s':>7} {'GB/s':>7} {'fair':>5} {'rxGB/s':>7}"]
        for _, r in f.iterrows():
            out.append(f"#{r['transport']:>11} {r['op']:>4} {r['variant']:>7} {r['flow']:>6} "
                       f"{_f(r['isolated_ms'], '.3f'):>9} {_f(r['congested_ms'], '.3f'):>9} {_f(r['slowdown'], '.2f'):>8} "
                       f"{_f(r['isolated_gbps'], '.2f'):>7} {_f(r['congested_gbps'], '.2f'):>7} "
                       f"{_f(r['fairness'], '.2f'):>5} {_f(r['receiver_gbps'], '.2f'):>7}")
    t = rail_table(df)
    if len(t):
        out += ["#", "# rails: per NIC its share of each request (by bytes), GB/s and Mpps (descriptors/s) at the "
                "case's p50, and wire% = its part of the kernel's count over every rail (TCP_INFO); an engine that picks "
                "its own lanes (nixl, ucx): share% is what this process's sockets counted on each NIC",
                f"#{'transport':>11} {'op':>4} {'variant':>7} {'pair':>4} {'rail':>4} {'nic':>12} {'share%':>6} "
                f"{'GB/s':>7} {'Mpps':>7} {'wire%':>6}"]
        for _, r in t.iterrows():
            out.append(f"#{r['transport']:>11} {r['op']:>4} {r['variant']:>7} {r['pair']:>4} {r['rail']:>4} "
                       f"{r['nic']:>12} {r['share_pct']:>6.1f} {_f(r['gbps'], '.2f'):>7} {_f(r['mpps'], '.3g'):>7} "
                       f"{_f(r['wire_pct'], '.1f'):>6}")
    return out


def add_section(page, runs) -> None:
    """The report's Fabric section: per flow isolated against congested, per rail GB/s and Mpps."""
    from kvbench.report import fabricplots

    flows = [flow_table(r.df).assign(run=r.label) for r in runs]
    rails = [rail_table(r.df).assign(run=r.label) for r in runs]
    moved = [fabricplots.nic_bytes(r.df).assign(run=r.label) for r in runs]
    flows, rails, moved = [f for f in flows if len(f)], [t for t in rails if len(t)], [m for m in moved if len(m)]
    if not flows and not rails and not moved:
        return
    tables = []
    if flows:
        tables.append(("flows: isolated against congested", pd.concat(flows, ignore_index=True).round(4)))
    if rails:
        tables.append(("rails: per NIC", pd.concat(rails, ignore_index=True).round(4)))
    page.add_section("Fabric", [
        "Traffic matrices (--scheme matrix, bidir): each flow alone, then every flow at once, in one launch; "
        "slowdown = congested / isolated p50, fairness = min/max GB/s over the flows, rxGB/s = GB/s into a receiver "
        "over all its flows. Rails (tcp -O ifname=X,Y / addr=A,B / rails=N): per NIC its byte share of each "
        "request, GB/s and Mpps at the p50, and the kernel's count of its connection (docs/fabric.md). Per NIC: "
        "what each NIC's kernel counters moved while a case was timed (the carrier)."],
        tables=tables,
        figures=chain(fabricplots.per_nic(pd.concat(rails, ignore_index=True) if rails else pd.DataFrame(),
                                          pd.concat(moved, ignore_index=True) if moved else pd.DataFrame()),
                      fabricplots.flows(pd.concat(flows, ignore_index=True) if flows else pd.DataFrame())))
