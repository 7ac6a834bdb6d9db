#!/usr/bin/env python3
"""make bench-connect: a transport's connection setup against the number of its peers (the bootstrap storm).

kvbench is launched on 2, 4 and 8 ranks of this host in the all-pairs scheme (every even rank with every odd
rank, all at once: each rank has N/2 peers) with the smallest case, and each launch's setup rows
(harness/setuprows.py; each carries world_size, the rank count) are read back: per transport and rank count, the
peers of a rank, its connect seconds per peer and in all, and the metadata exchange (an allgather over every
rank), each on the slowest rank.  A transport connects all its peers in one call, so its per-peer seconds are
that call divided by its peers.  More ranks than this host's CPUs oversubscribe it: the rows say so, and their
seconds then include waiting for a CPU.  Exit code 1 when a launch failed (its output's tail is printed).
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import pandas as pd  # noqa: E402
from jobs import kvbench_exe, launch  # noqa: E402

from kvbench.report import read  # noqa: E402

TRANSPORTS = "shm,tcp,mpi,mpi-sendrecv,nixl,ucx,mooncake"  # suites/lifecycle.yaml's
CASE = ["--scheme", "all-pairs", "--tokens", "16", "-b", "16", "-e", "16", "-n", "1", "-w", "1", "--rounds", "1",
        "--variants", "paged", "-c", "0", "--progress", "off"]


def per_transport(df: pd.DataFrame, ranks: int, cpus: int) -> list[dict]:
    """One line per transport of a launch: its slowest rank's connect (per peer and in all) and exchange."""
    out = []
    for name, g in df.groupby("transport", sort=False):
        s = g[g["row_kind"] == "setup"]
        if s.empty:  # skipped: unavailable here
            out.append({"transport": name, "ranks": ranks, "note": str(g["reason"].iloc[0])})
            continue
        conn = s[s["phase"] == "connect"].groupby("rank")["seconds"].agg(["sum", "size"])
        worst = conn["sum"].idxmax()
        out.append({"transport": name, "ranks": int(s["world_size"].iloc[0]), "peers": int(conn["size"].max()),
                    "per_peer_ms": conn.loc[worst, "sum"] / conn.loc[worst, "size"] * 1e3,
                    "total_ms": conn.loc[worst, "sum"] * 1e3,
                    "exchange_ms": s[s["phase"] == "exchange"]["seconds"].max() * 1e3,
                    "note": f"oversubscribed: {ranks} ranks on {cpus} CPUs" if ranks > cpus else ""})
    return out


def table(lines: list[dict]) -> list[str]:
    def f(x):
        return "-" if x is None or pd.isna(x) else f"{x:.2f}"

    out = ["# connect: all-pairs (every even rank with every odd rank, all at once); ms on the slowest rank; "
           "conn/peer = its connect call / its peers; exchange = the metadata allgather over every rank",
           f"#{'transport':>13} {'ranks':>5} {'peers':>5} {'conn/peer(ms)':>13} {'conn(ms)':>9} {'exch(ms)':>9}  note"]
    for r in sorted(lines, key=lambda r: (r["transport"], r["ranks"])):
        out.append(f"{r['transport']:>14} {r['ranks']:>5} {r.get('peers', '-'):>5} {f(r.get('per_peer_ms')):>13} "
                   f"{f(r.get('total_ms')):>9} {f(r.get('exchange_ms')):>9}  {r['note']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpirun", default="mpiexec", help="the MPI launcher (with its own flags, quoted)")
    ap.add_argument("-t", "--transports", default=TRANSPORTS)
    ap.add_argument("--ranks", default="2,4,8", help="rank counts, even (all-pairs pairs even with odd ranks)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    ap.add_argument("--kvbench-args", default="", help="more `kvbench run` flags, quoted")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.ranks.split(",")]
    if any(n < 2 or n % 2 for n in counts):
        ap.error(f"--ranks {a.ranks}: each count must be even and at least 2")
    cpus = len(os.sched_getaffinity(0))
    lines, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="kvbench-connect-") as tmp:
        for n in counts:
            out = os.path.join(tmp, str(n))
            cmd = [*shlex.split(a.mpirun), "-n", str(n), *kvbench_exe(), "run", "-o", out, "-t", a.transports,
                   *CASE, *shlex.split(a.kvbench_args)]
            print(f"# {n} ranks: {' '.join(cmd)}", file=sys.stderr, flush=True)
            rc, text = launch(cmd, a.timeout)
            found = glob.glob(os.path.join(out, "*", "*.parquet"))
            if rc or not found:
                failed += 1
                print(f"# {n} ranks: exit {rc}\n" + "\n".join(text.splitlines()[-20:]), file=sys.stderr)
                continue
            df, _ = read(found[0])
            lines += per_transport(df, n, cpus)
    for ln in table(lines):
        print(ln)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
