"""make soak: thousands of iterations across transports; resident memory and open files per rank must not grow.

One kvbench launch runs every available host transport, push and pull, for
many iterations each, one case after the other (--rounds 1, so that a case's
samples see only its own iterations).  The harness samples each rank's RSS and
open file descriptors (psutil) when a case has warmed up, half-way through its
iterations and when they end, and after each transport closes; this script
prints them and fails when RSS grew by 50 MB or more after warm-up, or when the
open descriptors changed over the second half of a case.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobs import launch  # noqa: E402

RSS_LIMIT = 50e6  # bytes of growth per rank after warm-up


def verdicts(resources: list[dict]) -> tuple[list[str], bool]:
    """Table lines (one per transport, case and rank) and whether each stayed within the limits: RSS grew by less
    than RSS_LIMIT after warm-up, and the open descriptors did not change over the second half of the iterations
    (an engine may open a few lazily once, e.g. Mooncake; a leak grows with the iterations)."""
    by = {}
    for x in resources:
        by.setdefault((x["transport"], x.get("case", 0), x["rank"]), {})[x["phase"]] = x
    closed = {(t, r): x["open_fds"] for (t, c, r), ph in by.items() for p, x in ph.items() if p == "closed"}
    lines, ok = [], True
    lines.append(f"# {'transport':<12} {'case':>4} {'rank':>4} {'RSS warm (MB)':>14} {'RSS end (MB)':>13} "
                 f"{'growth (MB)':>11} {'fds warm':>8} {'fds mid':>7} {'fds end':>7} {'after close':>11}  verdict")
    for (name, case, rank), ph in sorted(by.items()):
        warm, mid, end = ph.get("warm"), ph.get("mid", ph.get("warm")), ph.get("end")
        if warm is None or end is None:
            continue
        grow = end["rss_bytes"] - warm["rss_bytes"]
        good = grow < RSS_LIMIT and end["open_fds"] == mid["open_fds"]
        ok &= good
        lines.append(f"  {name:<12} {case:>4} {rank:>4} {warm['rss_bytes'] / 1e6:>14.1f} {end['rss_bytes'] / 1e6:>13.1f} "
                     f"{grow / 1e6:>11.1f} {warm['open_fds']:>8} {mid['open_fds']:>7} {end['open_fds']:>7} "
                     f"{closed.get((name, rank), '-'):>11}  {'PASS' if good else 'FAIL'}")
    return lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("-t", "--transports", default="loopback,shm,tcp,mpi,mpi-sendrecv,nixl,ucx,mooncake")
    ap.add_argument("-n", "--iters", type=int, default=1500, help="timed iterations per case (default 1500)")
    ap.add_argument("-w", "--warmup", type=int, default=50, help="warm-up iterations per case (default 50)")
    ap.add_argument("--tokens", type=int, default=128, help="prompt tokens (default 128: 16 MiB of llama-3-8b)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds for the whole launch")
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="kvbench-soak-")
    cmd = [a.mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-t", a.transports, "--op", "push,pull",
           "-b", "64", "-e", "64", "--tokens", str(a.tokens), "-n", str(a.iters), "-w", str(a.warmup),
           "--variants", "paged", "--rounds", "1", "--name", "soak", "-o", out]
    print(f"# soak: {' '.join(cmd[3:])}", flush=True)
    rc, text = launch(cmd, a.timeout)
    print("\n".join(ln for ln in text.splitlines() if not ln.startswith("# WARNING") and "NOTE" not in ln))
    metas = glob.glob(os.path.join(out, "*", "*.meta.json"))
    if rc != 0 or not metas:
        print(f"# soak: FAILED: the run ended with exit code {rc}")
        return 1
    meta = json.load(open(metas[0]))
    lines, ok = verdicts(meta.get("resources", []))
    print(f"# resources per rank and case (limits: RSS growth after warm-up < {RSS_LIMIT / 1e6:.0f} MB; open file "
          f"descriptors unchanged from half-way to the end); results {metas[0]}")
    print("\n".join(lines))
    print(f"# soak: {'PASS' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
