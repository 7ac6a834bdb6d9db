"""Percent of line rate: the rate of the link a bandwidth row used, and achieved / that rate.

Where the rate comes from, in order: ``--link-gbps`` (given); a rate the transport or the device layer
put in its ``info()`` (``link_gbps`` and ``link``: NVLink/PCIe generation and width, the hook for the
device layer); the NIC's reported speed when a pair's ranks sit on different hosts (nominal); kvbench's own
copy of the same bytes beside the case's iterations when they share a host (``bound_gbps``, measured, not
nominal: never a row of the run it judges, which a lying row would make the line).  A file older than those
copies falls back to the best host copy row of its run, and says so.  Otherwise the row says it cannot tell,
instead of guessing.
"""
from __future__ import annotations

import math

import pandas as pd
from pydantic import BaseModel, field_validator

# the same payload (everything but the path and the direction): the best host copy of it is the host's line
PAYLOAD_KEYS = ["model", "tokens", "prefix_hit", "dtype", "tp", "pp", "scheme", "world_size", "inflight"]


class LinkOverride(BaseModel):
    """``--link-gbps``: one rate for every row, or TRANSPORT=GBPS pairs (GB/s = 10^9 B/s)."""

    default: float | None = None
    per_transport: dict[str, float] = {}

    @field_validator("default")
    @classmethod
    def _positive(cls, v):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--link-gbps {v}: a positive number of GB/s")
        return v

    @classmethod
    def parse(cls, text: str | None) -> LinkOverride:
        """'12.5' or 'tcp=12.5,nixl=50' (one line on a mistake)."""
        if not text:
            return cls()
        default, per = None, {}
        for part in text.split(","):
            name, _, val = part.rpartition("=")
            try:
                gbps = float(val)
            except ValueError:
                raise ValueError(f"--link-gbps '{text}': expected GBPS or TRANSPORT=GBPS[,...] in GB/s") from None
            if not (gbps > 0 and math.isfinite(gbps)):
                raise ValueError(f"--link-gbps '{text}': {val} is not a positive number of GB/s")
            if name:
                per[name.strip()] = gbps
            else:
                default = gbps
        return cls(default=default, per_transport=per)

    def get(self, transport: str) -> float | None:
        return self.per_transport.get(transport, self.default)


def cross_host(df: pd.DataFrame, meta: dict) -> pd.Series:
    """Per case: True when a pair's ranks ran on different hosts (the bytes crossed a NIC)."""
    hosts = meta.get("hosts") or []
    if not hosts or len(set(hosts)) == 1:
        return pd.Series(False, index=pd.Index(df["case"].unique(), name="case"))
    host = df["rank"].map(lambda r: hosts[int(r)] if 0 <= int(r) < len(hosts) else "?")
    n = host.groupby([df["case"], df["pair"]]).nunique()
    return (n > 1).groupby(level="case").any()


def transport_link(meta: dict, transport: str) -> tuple[float, str] | None:
    """The hook: a nominal rate a transport or the device layer recorded in its info() (link_gbps, link)."""
    for info in (meta.get("transports") or {}).get(transport) or []:
        if isinstance(info, dict) and info.get("link_gbps"):
            return float(info["link_gbps"]), f"nominal: {info.get('link', 'reported by ' + transport)}"
    return None


def nic_link(meta: dict, transport: str) -> tuple[float, str] | None:
    """The NIC a network path used (named by the transport's info, or the host's only NIC with a speed)."""
    speeds = {k: v for k, v in ((meta.get("system") or {}).get("nic_speed_mbps") or {}).items() if v}
    named = [i.get("ifname") for i in (meta.get("transports") or {}).get(transport) or []
             if isinstance(i, dict) and i.get("ifname")]
    if named and named[0] in speeds:
        return speeds[named[0]] / 8e3, f"nominal: NIC {named[0]} {speeds[named[0]]} Mb/s (rank 0's host)"
    if not named and len(speeds) == 1:
        (name, mbps), = speeds.items()
        return mbps / 8e3, f"nominal: NIC {name} {mbps} Mb/s (the host's only NIC with a speed)"
    return None


def add_line_rate(st: pd.DataFrame, df: pd.DataFrame, meta: dict, override: LinkOverride | None = None,
                  bandwidth: pd.Series | None = None) -> pd.DataFrame:
    """Adds link_gbps, link (where the rate came from) and pct_line (GB/s / link_gbps, %) to a summary.

    ``bandwidth`` marks the rows that are bandwidth rows (the others get no rate: their times include a
    prefill or a queue); by default every row.
    """
    override = override or LinkOverride()
    st = st.copy()
    bw = pd.Series(True, index=st.index) if bandwidth is None else bandwidth.reindex(st.index).fillna(False)
    xhost = st["case"].map(cross_host(df, meta)).fillna(False)
    # host paths: the best copy of the same payload measured in this run, over every same-host reference
    copies = own_copy(df)
    refs = st[bw & ~xhost & (st["memory"] == "host") & st["ceil_gbps"].notna()]
    best = {}
    for key, g in refs.groupby(PAYLOAD_KEYS):
        top = g.loc[g["ceil_gbps"].idxmax()]
        best[key] = (float(top["ceil_gbps"]),
                     f"measured: best host copy ({top['transport']} {top['ceil_name']}; an older file: a row of its run)")
    rates, sources = [], []
    for i, r in st.iterrows():
        got = None
        if not bw[i]:
            got = (math.nan, "-")
        elif override.get(r["transport"]) is not None:
            got = (override.get(r["transport"]), "given: --link-gbps")
        else:
            got = transport_link(meta, r["transport"])
        if got is None and xhost[i]:
            got = nic_link(meta, r["transport"]) or (math.nan, "unknown: the NIC's speed is not recorded")
        if got is None and r["memory"] != "host":
            got = (math.nan, f"unknown: {r['memory']} memory, the device layer reported no link rate")
        if got is None and r["case"] in copies.index:
            got = (float(copies[r["case"]]), "measured: kvbench's own copy of the same bytes beside its iterations")
        if got is None:
            got = best.get(tuple(r[k] for k in PAYLOAD_KEYS), (math.nan, "unknown: no host copy of this payload measured"))
        rates.append(got[0])
        sources.append(got[1])
    st["link_gbps"] = rates
    st["link"] = sources
    st["pct_line"] = 100 * st["gbps"] / st["link_gbps"]
    st.loc[~bw, "pct_line"] = math.nan
    return st


def own_copy(df: pd.DataFrame) -> pd.Series:
    """Per case: the median GB/s of the harness's own copies of its bytes beside its timed iterations (harness/
    bounds.Beside, the rows' ``bound_gbps`` where ``bound_kind`` is a memory copy); empty for older files."""
    if df is None or not {"bound_gbps", "bound_kind", "case", "iter"} <= set(df.columns):
        return pd.Series(dtype=float)
    d = df[(df["iter"] >= 0) & (df["bound_kind"] == "memory copy") & df["bound_gbps"].notna()]
    return d.groupby("case")["bound_gbps"].median()
