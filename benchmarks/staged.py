#!/usr/bin/env python3
"""make bench-staged: the staged pipeline against the same transfer unpipelined (-O pipeline=off).

Launches alternate (on, off, on, off, ...) so a slow phase of a shared machine hits both; each launch
measures bulk and paged rows of one request over ``--inner`` on torch-cpu pools.  Prints, per mode, the
median over launches of the request's p50 time and each rank's per-stage seconds (gather on the source,
wire on both, scatter on the destination), then the speed-up of the pipeline.  Exit code 1 when a launch
fails or a row has wrong bytes; the speed-up is reported, not asserted (a 2-core VM has no spare core for a
stage to overlap on).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import pandas as pd  # noqa: E402
from jobs import launch  # noqa: E402


def one(mpirun: str, mode: str, a, out: str) -> pd.DataFrame:
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", out, "-t", "staged", "--memory",
           "torch-cpu", "--copy", a.copy, "-O", f"inner={a.inner}", "-O", f"pipeline={mode}", "-O",
           f"slot_mib={a.slot_mib}", "-O", f"slots={a.slots}", "-m", a.model, "--tokens", str(a.tokens),
           "-n", str(a.iters), "--variants", "bulk,paged", "--name", f"staged-{mode}"]
    rc, text = launch(cmd, 900)
    if rc != 0:
        sys.exit(f"kvbench failed ({rc}): {' '.join(cmd)}\n{text[-3000:]}")
    path = sorted(glob.glob(os.path.join(out, "*", "*.parquet")), key=os.path.getmtime)[-1]
    df = pd.read_parquet(path)
    if (df["nwrong"].fillna(0) > 0).any():
        sys.exit(f"wrong bytes in {path}")
    return df.assign(mode=mode)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mpirun", default="mpiexec")
    p.add_argument("--inner", default="tcp")
    p.add_argument("--copy", default="batch")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--slot-mib", type=int, default=4, help="bounce slot size, MiB (the transport's default)")
    p.add_argument("--slots", type=int, default=3, help="slots per peer and direction (the transport's default)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="launches per mode, alternating")
    a = p.parse_args(argv)
    out = tempfile.mkdtemp(prefix="kvbench-staged-")
    frames = [one(a.mpirun, m, a, out) for _ in range(a.repeats) for m in ("on", "off")]
    df = pd.concat(frames)
    df = df[df["iter"] >= 0]
    # a request's time: the max over its two ranks per iteration; per-stage seconds per rank
    t = df.groupby(["mode", "variant", "iter", "case"])["seconds"].max().groupby(["mode", "variant"]).median()
    st = df.groupby(["mode", "variant", "role"])[["gather_s", "wire_s", "scatter_s"]].median()
    payload = df.groupby("variant")["payload_bytes"].first()
    print(f"# staged over {a.inner}, {a.model} {a.tokens} tokens, slots {a.slot_mib} MiB x {a.slots}, "
          f"copy {a.copy}; medians of {a.repeats} alternating launches per mode; GB/s = 10^9 B/s")
    print(f"{'variant':<8} {'mode':<4} {'p50 ms':>8} {'GB/s':>6}  {'gather ms':>9} {'wire ms src/dst':>16} "
          f"{'scatter ms':>10}")
    for v in ("bulk", "paged"):
        for m in ("on", "off"):
            if (m, v) not in t.index:
                continue
            src, dst = st.loc[(m, v, "prefill")], st.loc[(m, v, "decode")]
            print(f"{v:<8} {m:<4} {t[(m, v)] * 1e3:8.1f} {payload[v] / t[(m, v)] / 1e9:6.2f}  "
                  f"{src['gather_s'] * 1e3:9.1f} {src['wire_s'] * 1e3:7.1f}/{dst['wire_s'] * 1e3:<8.1f} "
                  f"{dst['scatter_s'] * 1e3:10.1f}")
        if (("on", v) in t.index) and (("off", v) in t.index):
            print(f"{v:<8} pipeline speed-up: {t[('off', v)] / t[('on', v)]:.2f}x (on vs off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
