"""make bench-codecs: the codec sweep on shm, tcp over loopback and tcp over a 1 Gbit/s shaped link.

Each path runs one kvbench launch with every codec as interleaved cases (``--rounds``: the codecs take
turns, so a slow phase of the machine hits them alike), on realistic bf16 KV values (``--fill
realistic``), push, paged.  The shaped link is kvbench selftest's: two network namespaces joined by a
veth with tc tbf at RATE on both ends, one rank in each (root only; skipped with the reason otherwise).
Per path and codec the table prints payload and wire bytes, ratio, encode / decode / wire / effective
GB/s (the same iterations), the effective GB/s the pipelined model predicts from them and the path's
rate B (codec none's effective GB/s in the same run), both break-even link rates, and whether the
measured winner (against none; within the spreads: a tie) agrees with the predicted one.

    python benchmarks/codecs.py [--mpirun .venv/bin/mpiexec] [--rate 1gbit] [--tokens 256] [-n 6]

Exit code 0 when every prediction agrees with its measurement and, on the shaped link, a codec beats
none (measured); 1 otherwise; 2 when a launch failed.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CODECS = "none,exp-split,zstd,lz4,cast-fp8-e4m3"


def newest(outdir: str) -> str | None:
    found = glob.glob(os.path.join(outdir, "*", "*.parquet"))
    return max(found, key=os.path.getmtime) if found else None


def main(argv=None) -> int:
    import pandas as pd

    from kvbench.job.launch import launch
    from kvbench.report.codecs import codec_rows, table, verdicts
    from kvbench.selftest import netns as N
    from kvbench.selftest import run as S

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpirun", default=S.default_mpiexec())
    ap.add_argument("--rate", default="1gbit", help="shaped link rate (tc syntax, default 1gbit)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens (llama-3-8b bf16: 128 KiB each)")
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("--codecs", default=CODECS)
    # a codec's receiver reads each frame's header before posting its body: socket buffers of a few MB let
    # the link keep going meanwhile (none runs with the same buffers)
    ap.add_argument("--sockbuf", type=int, default=8 << 20, help="tcp socket buffer bytes (default 8 MiB)")
    ap.add_argument("--host-rate", type=float, help="skip the host run: tcp's loopback rate H in GB/s for the model")
    a = ap.parse_args(argv)
    out = tempfile.mkdtemp(prefix="kvbench-codecs-")
    base = ["-m", "llama-3-8b", "--dtype", "bf16", "--tokens", str(a.tokens), "--codec", a.codecs, "--fill",
            "realistic", "--op", "push", "--variants", "paged", "-b", "64", "-e", "64", "-n", str(a.iters),
            "-w", "1", "--rounds", str(min(5, a.iters)), "-O", f"tcp.sockbuf={a.sockbuf}", "-o", out]
    cores = os.cpu_count() or 1
    print(f"# kvbench bench-codecs: llama-3-8b {a.tokens} tokens bf16 (realistic values), push, 64-token blocks; "
          f"codecs {a.codecs}; {a.iters} iterations in {min(5, a.iters)} rounds; {cores} CPUs; GB = 10^9 B", flush=True)
    tables = []

    # 1. the host: shm and tcp over loopback, one launch
    rc, text = (0, "") if a.host_rate else launch([a.mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-t", "shm,tcp", *base], 1800,
                        S.rank_env({}), grace=S.GRACE_S)
    path = newest(out)
    if a.host_rate:
        H = a.host_rate
    elif rc != 0 or not path:
        print(f"# host run failed (exit {rc}):\n{text[-3000:]}")
        return 2
    else:
        host = verdicts(codec_rows(pd.read_parquet(path), cores))
        tables.append(host.assign(path=host.transport.map({"shm": "shm", "tcp": "tcp-loop"})))
        tcp_h = host[(host.transport == "tcp") & (host.codec == "none")]["eff"]
        H = float(tcp_h.iloc[0]) if len(tcp_h) else float("inf")

    # 2. the shaped link between two namespaces (root)
    shaped = None
    why = None if os.geteuid() == 0 else "needs root (network namespaces, tc)"
    why = why or (f"missing tools: {', '.join(N.missing_tools())}" if N.missing_tools() else None)
    if why is None:
        rate = N.parse_rate(a.rate)
        link = N.setup(N.new_run_id(), rate)
        try:
            env = {**S.MPI_ENV["ucx"], **S.TCP_ENV}
            before = set(glob.glob(os.path.join(out, "*", "*.parquet")))
            rc, text = launch(S.kvbench_cmd(a.mpirun, link, ["-t", "tcp", *base]), 3600, S.rank_env(env), grace=S.GRACE_S)
            new = sorted(set(glob.glob(os.path.join(out, "*", "*.parquet"))) - before)
            if rc != 0 or not new:
                print(f"# shaped-link run failed (exit {rc}):\n{text[-3000:]}")
                return 2
            shaped = verdicts(codec_rows(pd.read_parquet(new[-1]), cores, {"tcp": H}))
            tables.append(shaped.assign(path=f"tcp-{a.rate}"))
        finally:
            N.teardown(link)
    allrows = pd.concat(tables, ignore_index=True)
    print("# per path and codec; eff = payload / time until the decoded bytes are in the destination pool (p50); "
          "pred = the pipelined model at the measured B (none's eff); B* = break-even link rates (GB/s): "
          "serial, pipelined; measured/predicted: against none (tie: within the spreads)")
    for line in table(allrows.assign(transport=allrows.path)):
        print(line)
    if why:
        print(f"# tcp over a {a.rate} shaped link: skipped: {why}")
    codec_rows_ = allrows[allrows.codec != "none"]
    bad = codec_rows_[codec_rows_.agree == False]  # noqa: E712
    wrong = int(allrows.nwrong.clip(lower=0).sum())
    for _, r in bad.iterrows():
        print(f"# DISAGREE: {r.path} {r.codec}: measured {r.measured}, predicted {r.predicted}")
    for _, r in codec_rows_[codec_rows_.pipe_agree == False].iterrows():  # noqa: E712
        print(f"# note: {r.path} {r.codec}: the pipelined model alone called {r.pipelined} "
              f"({r.pred:.4f} GB/s predicted, {r.eff:.4f} measured, none {r.B:.4f}): the stages overlapped less "
              "than it assumes")
    ok = bad.empty and wrong == 0
    if shaped is not None:
        winners = shaped[(shaped.codec != "none") & (shaped.measured == "win")]
        print(f"# shaped link: codecs beating none (measured, same run): {', '.join(winners.codec) or 'none'}")
        ok = ok and not winners.empty
    print(f"# results: {out}")
    print(f"# bench-codecs: {'PASS' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
