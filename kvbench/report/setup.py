"""Setup rows read back (harness/setuprows.py): per transport and memory kind what its setup cost each rank, the
registration sweep against pool size, and each case's first transfer against its steady p50.

The table's seconds are the slowest rank's (a job waits for it); a register time is the sum over a rank's pools.
"""
from __future__ import annotations

from itertools import chain

import pandas as pd

from kvbench.results.store import case_stats

from . import plots

GiB, MiB = 2**30, 2**20


def setup_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The setup rows of a result table (none in a table older than schema 6)."""
    return df[df["row_kind"] == "setup"] if "row_kind" in df else df.iloc[:0]


def size_name(n: float) -> str:
    return f"{n / GiB:g}G" if n >= GiB else f"{n / MiB:g}M"


def keys_of(s: pd.DataFrame) -> list[str]:
    """What tells one transport's setup from another's: transport and memory, and --register and op where a run
    has per-request rows (schema 7: a per-request transport sets up per op, with no pool registered on its
    initiator; a once transport's rows carry its first case's op)."""
    per = "register" in s and (s["register"] == "per-request").any()
    return ["transport", "memory"] + (["register", "op"] if per else [])


def first_vs_steady(df: pd.DataFrame, st: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per case with a first-transfer row: its first transfer (per request the later rank, then the slowest
    request) against its steady p50, both in ms, and their ratio."""
    s = setup_rows(df)
    first = s[s["phase"] == "first"]
    cols = list(dict.fromkeys([*keys_of(s), "variant", "op"]))
    if first.empty:
        return pd.DataFrame(columns=["case", *cols, "first_ms", "p50_ms", "ratio"])
    st = case_stats(df) if st is None else st
    per = first.groupby(["case", "pair", "req"])["seconds"].max().groupby("case").max() * 1e3
    keys = first.groupby("case")[[*cols, "payload_bytes"]].first()
    out = keys.assign(first_ms=per, p50_ms=st.set_index("case")["p50"].reindex(keys.index) * 1e3).reset_index()
    out["ratio"] = out["first_ms"] / out["p50_ms"]
    return out


def per_transport(df: pd.DataFrame, st: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per (transport, memory): alloc, fill, register (s), connect s per peer, register s at each
    --pool-sizes size (columns ``reg@<size>``), and its first case's first transfer against that case's p50."""
    s = setup_rows(df)
    if s.empty:
        return pd.DataFrame()
    fvs = first_vs_steady(df, st)
    keys = keys_of(s)
    lines = []
    for key, g in s[s["phase"] != "first"].groupby(keys, sort=False):  # a first row carries its own case's op
        def slowest(phase, per_rank="sum", g=g):
            x = g[g["phase"] == phase]
            return float(x.groupby("rank")["seconds"].agg(per_rank).max()) if len(x) else float("nan")

        reg = g[g["phase"] == "register"]
        line = {**dict(zip(keys, key)), "alloc_s": slowest("alloc"), "fill_s": slowest("fill"),
                "register_s": slowest("register"), "connect_s": slowest("connect", "max"),
                "peers": int(g[g["phase"] == "connect"].groupby("rank").size().max() if (g["phase"] == "connect").any()
                             else 0),
                "note": next((r for r in reg["reason"] if r), "")}
        for size, x in g[g["phase"] == "pool-register"].groupby("region_bytes"):
            line[f"reg@{size_name(size)}"] = float(x["seconds"].max())
        f = fvs[(fvs[keys] == pd.Series(dict(zip(keys, key)))).all(axis=1)].sort_values("case")
        if len(f):
            line.update(f.iloc[0][["first_ms", "p50_ms", "ratio"]].to_dict())
        lines.append(line)
    return pd.DataFrame(lines)


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def table_lines(df: pd.DataFrame, st: pd.DataFrame | None = None) -> list[str]:
    """`kvbench run`'s setup table, after the bandwidth table (nothing without setup rows)."""
    t = per_transport(df, st)
    if t.empty:
        return []
    sizes = [c for c in t.columns if c.startswith("reg@")]
    reg = "register" in t
    head = (f"{'transport':>12} {'mem':>6} " + (f"{'register':>11} {'op':>4} " if reg else "") + f"{'alloc(s)':>9} {'fill(s)':>8} {'reg(s)':>8} "
            + "".join(f"{c:>10} " for c in sizes) + f"{'conn(s)/peer':>12} {'first(ms)':>10} {'p50(ms)':>9} "
            f"{'first/p50':>9}")
    # comment lines, as the footer's: a reader of the table's uncommented lines reads the bandwidth rows alone
    out = ["#", "# setup: each phase on the slowest rank; reg = registering its pool(s) (reg@SIZE: --pool-sizes, "
           "register alone); conn = connect per peer; first = the first case's first transfer (a warm-up) against "
           "that case's steady p50", "#" + head[1:]]
    for _, r in t.iterrows():
        out.append(f"#{r['transport']:>11} {r['memory']:>6} " + (f"{r['register']:>11} {r['op']:>4} " if reg else "")
                   + f"{_f(r['alloc_s'], '.4f'):>9} {_f(r['fill_s'], '.4f'):>8} "
                   f"{_f(r['register_s'], '.4f'):>8} " + "".join(f"{_f(r.get(c), '.4f'):>10} " for c in sizes)
                   + f"{_f(r['connect_s'], '.4f'):>12} {_f(r.get('first_ms'), '.3f'):>10} "
                   f"{_f(r.get('p50_ms'), '.3f'):>9} {_f(r.get('ratio'), '.1f'):>9}")
    out += [f"# {note}" for note in dict.fromkeys(r["note"] for _, r in t.iterrows() if r["note"])]
    return out


def add_section(page, runs) -> None:
    """The report's Setup section: per run, transport and memory the phases, the first transfers against their
    steady p50, and registration against pool size (plots.register_vs_pool)."""
    per, firsts, reg = [], [], []
    for r in runs:
        st = r.st[r.st["status"] != "skipped"]
        t = per_transport(r.df, st)
        if t.empty:
            continue
        per.append(t.assign(run=r.label))
        firsts.append(first_vs_steady(r.df, st).assign(run=r.label))
        s = setup_rows(r.df)
        pool = s[(s["phase"] == "pool-register") & s["seconds"].notna()]
        reg.append(pool.groupby(["transport", "region_bytes"])["seconds"].max().reset_index().assign(run=r.label))
    if not per:
        return
    reg_df = pd.concat(reg, ignore_index=True)
    reg_df["pool_gib"] = reg_df["region_bytes"] / GiB
    table = pd.concat(per, ignore_index=True)
    cols = ["run", "transport", "memory", *(["register", "op"] if "register" in table else []), "alloc_s", "fill_s",
            "register_s"]
    table = table[cols + [c for c in table.columns if c.startswith("reg@")] +
                  [c for c in ("connect_s", "peers", "first_ms", "p50_ms", "ratio", "note") if c in table]]
    page.add_section("Setup", [
        "What each transport cost before its first timed byte, on the slowest rank: allocate and fill its pool, "
        "register it (reg@SIZE: --pool-sizes, one pool of that size registered after the setup), connect (per "
        "peer), and the first transfer of each case (its first warm-up iteration, the one that builds connections, "
        "descriptor lists and handles) against the same case's steady p50. docs/methodology.md says what each "
        "phase holds and what it cannot."],
        tables=[("setup per transport", table.round(6)),
                ("first transfer against steady p50, per case", pd.concat(firsts, ignore_index=True).round(4))],
        figures=chain(plots.register_vs_pool(reg_df), plots.first_vs_steady(pd.concat(firsts, ignore_index=True))))
