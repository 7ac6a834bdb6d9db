"""make lab (root): rails, incast, bidir and the engines' carriers on a lab of namespaces, each as a ratio to
the shaped rate.

Builds a lab of 4 nodes with 2 rails each, every NIC shaped at RATE (tbf, each direction; docs/lab.md), runs
kvbench in it through ``kvbench lab run`` and removes the lab on any exit (an error, Ctrl-C, SIGTERM, SIGHUP):

* tcp from node 0 to node 1 over 1 rail, then over 2 (``-O rails=2``): each against the link, their ratio, and
  each rail's share of the bytes by its NIC's counters (issue 33: >= 1.8x, each rail 40-60%);
* incast, nodes 0, 1, 2 -> 3 on rail 0: the aggregate into node 3 against the link (within 10%), each flow's
  slowdown (2.5-3.5) and its rate alone against the link (within 10%);
* bidir on rail 0, 0 <-> 1 and 2 <-> 3: each direction at once against the same direction alone (>= 0.9x);
* mpi and nixl over both rails: their rate against one link, and the NICs that carried their bytes.

Payloads are MB_PER_REQUEST MiB so that a 1 Gbit/s link is measured over a quarter second or more; few
iterations keep the whole in a few minutes.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile

import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def kvbench(*args: str, timeout: float = 600) -> str:
    """``python -m kvbench ARGS`` from this tree; its stdout (a failure raises with its output)."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "kvbench", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:  # interrupted or too long: SIGTERM lets `lab run` end its launch's ranks itself
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"kvbench {' '.join(args)} exited {p.returncode}:\n{out[-3000:]}{err[-3000:]}")
    return out


def rows(out: str) -> pd.DataFrame:
    """The timed transfer rows of the run whose output is ``out``."""
    df = pd.read_parquet(re.search(r"^# results: (\S+\.parquet)$", out, re.M).group(1))
    return df[(df["iter"] >= 0) & (df["row_kind"] == "transfer") & (df["status"] == "ok")]


def pair_gbps(df: pd.DataFrame, pair: int = 0) -> float:
    """A pair's GB/s: its request's bytes over the p50 of each iteration's later rank."""
    g = df[df["pair"] == pair]
    return float(g["payload_bytes"].iloc[0]) / float(g.groupby("iter")["seconds"].max().median()) / 1e9


def shares(df: pd.DataFrame, rank: int, nics: list[str]) -> list[float]:
    """Each NIC's share of what ``rank`` sent, by the NICs' counters (the rows' nic_bytes)."""
    import json

    moved = json.loads(df[df["rank"] == rank]["nic_bytes"].iloc[0] or "{}")
    sent = [moved.get(n, [0, 0])[0] for n in nics]
    return [s / sum(sent) if sum(sent) else float("nan") for s in sent]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="every NIC's shaped rate (tc units; default 1gbit)")
    ap.add_argument("--mb", type=int, default=32, help="MiB per request (default 32)")
    ap.add_argument("-n", "--iters", type=int, default=3, help="timed iterations per case (default 3)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("make lab: error: needs root (network namespaces, veth, bridges, tc)", file=sys.stderr)
        return 1
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", a.rate)
    if not m:
        print(f"make lab: error: rate '{a.rate}' is not <number>kbit|mbit|gbit", file=sys.stderr)
        return 1
    link = float(m.group(1)) * UNITS[m.group(2)] / 8 / 1e9  # GB/s
    lab_id = f"mk{os.getpid()}-{secrets.token_hex(2)}"

    def ended(signum, _frame):
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, ended)
    out_dir = tempfile.mkdtemp(prefix="kvbench-lab-")
    size = f"{a.mb}MiB"
    common = ["--variants", "bulk", "-n", str(a.iters), "-w", "1", "--progress", "off", "-o", out_dir]
    one_flow = os.path.join(out_dir, "one-flow.csv")  # node 0 -> node 1 alone: the others stay idle
    with open(one_flow, "w") as fh:
        fh.write(f"0,{size},0,0\n0,0,0,0\n0,0,0,0\n0,0,0,0\n")
    incast = os.path.join(out_dir, "incast.csv")
    with open(incast, "w") as fh:
        fh.write(f"0,0,0,{size}\n0,0,0,{size}\n0,0,0,{size}\n0,0,0,0\n")
    bidir = os.path.join(out_dir, "bidir.csv")
    with open(bidir, "w") as fh:
        fh.write(f"0,{size},0,0\n{size},0,0,0\n0,0,0,{size}\n0,0,{size},0\n")
    print(f"# make lab: 4 nodes x 2 rails at {a.rate} ({link:.4f} GB/s per NIC, each direction), {size} per "
          f"request, {a.iters} timed iterations; results in {out_dir}")
    kvbench("lab", "up", "--nodes", "4", "--rails", "2", "--rate", a.rate, "--id", lab_id)
    try:
        run = ("lab", "run", "--id", lab_id, "--")
        flow = ["--scheme", "matrix", "--matrix"]
        one = rows(kvbench(*run, "-t", "tcp", *flow, one_flow, *common))
        two = rows(kvbench(*run, "-t", "tcp", "-O", "rails=2", *flow, one_flow, *common))
        r1 = one[one["flow_mode"] == "isolated"]
        r2 = two[two["flow_mode"] == "isolated"]
        g1, g2 = pair_gbps(r1), pair_gbps(r2)
        sh = shares(r2, 0, ["rail0", "rail1"])
        print(f"rails   tcp 1 rail  {g1 / link:5.2f} x link   2 rails {g2 / link:5.2f} x link   2/1 = {g2 / g1:.2f}"
              f"   (>= 1.8)   rail shares {sh[0]:.2f} / {sh[1]:.2f} (0.40-0.60)   carrier "
              f"{r2[r2['rank'] == 0]['carrier'].iloc[0]}")
        inc = rows(kvbench(*run, "-t", "tcp", *flow, incast, *common))
        con = inc[inc["flow_mode"] == "congested"]
        agg = float(con["receiver_gbps"].iloc[0])
        print(f"incast  3->1 on rail0: aggregate {agg / link:5.2f} x link (0.90-1.10)")
        for f, g in con.groupby("flow"):
            alone = float(g["payload_bytes"].iloc[0]) / float(g["isolated_s"].iloc[0]) / 1e9
            print(f"        flow {f}: slowdown {float(g['slowdown'].iloc[0]):.2f} (2.5-3.5)   alone "
                  f"{alone / link:5.2f} x link (0.90-1.10)")
        bi = rows(kvbench(*run, "-t", "tcp", *flow, bidir, *common))
        con = bi[bi["flow_mode"] == "congested"]
        for f, g in con.groupby("flow"):
            ratio = float(g["isolated_s"].iloc[0]) / float(g["congested_s"].iloc[0])
            print(f"bidir   {f}: both ways at once {ratio:5.2f} x one-way (>= 0.9)   one-way "
                  f"{float(g['payload_bytes'].iloc[0]) / float(g['isolated_s'].iloc[0]) / 1e9 / link:5.2f} x link")
        for t in ("mpi", "nixl"):
            try:
                df = rows(kvbench(*run, "-t", t, *common))
            except RuntimeError as exc:
                print(f"engine  {t}: failed: {str(exc).splitlines()[0]}")
                continue
            if df.empty:
                print(f"engine  {t}: no timed rows (unavailable here)")
                continue
            sh = shares(df, 0, ["rail0", "rail1"])
            print(f"engine  {t} over 2 rails: {pair_gbps(df) / link:5.2f} x one link   carrier "
                  f"{df[df['rank'] == 0]['carrier'].iloc[0]}   rail shares {sh[0]:.2f} / {sh[1]:.2f}")
    finally:
        kvbench("lab", "down", "--id", lab_id)
        print(f"# make lab: lab {lab_id} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
