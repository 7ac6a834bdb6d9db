"""``python -m kvbench.gpucheck``: what the GPU half measures, on the GPU machine at hand.

Runs with the machine's own Python and the packages a CUDA image ships (torch; cupy when present), the C
extension built in place, no network and no MPI: single-GPU checks run in this process; the two-rank ones
(cuda_ipc) in two processes it starts itself, which exchange the IPC handle over a pipe; the harness's
2-rank rows (staged, cuda_ipc through kvbench run) only where an MPI launcher exists.  Prints one short table
last and writes every number to results/runs/<machine>/<time>_gpucheck.json.  Without a GPU it stops at once with
one line (exit 2).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

from kvbench.gpucheck import checks
from kvbench.memory import device


class Row(dict):
    """One line of the table: check, what, GB/s (or nan), status (ok / FAIL / skipped), note."""


def parse(argv):
    p = argparse.ArgumentParser(prog="kvbench.gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("--pool-mib", type=int, default=1024, help="device pool for fill/verify and copies (MiB)")
    p.add_argument("--block-kib", type=int, default=32, help="block size of the copy-engine layer (KiB)")
    p.add_argument("--blocks", type=int, default=4096, help="blocks per copy-engine layer")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (median kept)")
    p.add_argument("--mpirun", default=None, help="MPI launcher for the harness rows (default: mpiexec on PATH)")
    p.add_argument("-o", "--results", default="results/runs", help="results directory (default results/runs/, "
                   "which git ignores)")
    p.add_argument("--only", default="", help="comma list of checks: pool,copy,hostdev,ipc,harness,prefill")
    a = p.parse_args(argv)
    for name in ("pool_mib", "block_kib", "blocks", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, not {getattr(a, name)}")
    if a.blocks * a.block_kib > a.pool_mib * 1024 // 2:
        p.error(f"--blocks x --block-kib ({a.blocks * a.block_kib} KiB) must fit in half of --pool-mib "
                f"({a.pool_mib} MiB): source and destination halves")
    known = {"pool", "copy", "hostdev", "ipc", "harness", "prefill"}
    a.only = [x for x in a.only.split(",") if x] or sorted(known)
    bad = [x for x in a.only if x not in known]
    if bad:
        p.error(f"--only {','.join(bad)}: not one of {','.join(sorted(known))}")
    return a


def table(rows: list[dict]) -> str:
    """The closing table: one line per row, GB/s = 10^9 B/s."""
    out = ["# gpu-check (GB/s = 10^9 B/s)", f"{'check':<10} {'what':<34} {'GB/s':>8}  {'status':<8} note"]
    for r in rows:
        g = r.get("gbps")
        gs = f"{g:8.2f}" if isinstance(g, float) and g == g else f"{'-':>8}"
        out.append(f"{r['check']:<10} {r['what']:<34} {gs}  {r['status']:<8} {r.get('note', '')}".rstrip())
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse(argv)
    why = device.probe("cuda")
    if why:
        print(f"gpu-check: no GPU here: {why}", file=sys.stderr)
        return 2
    rows = checks.run_all(a)
    text = table(rows)
    from kvbench.results.store import machine_name, system_description

    folder = os.path.join(a.results, machine_name())
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "_gpucheck")
    path, k = base + ".json", 1
    while os.path.exists(path):  # never overwrite a result
        path, k = f"{base}-{k}.json", k + 1
    with open(path, "w") as fh:
        json.dump({"argv": sys.argv, "rows": rows, "system": system_description()}, fh, indent=1, default=str)
    print(text)
    print(f"# written: {path}")
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
