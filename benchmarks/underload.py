"""make bench-underload: honest runs beside CPU-bound processes end OK, and the lies about bytes are still caught.

Starts HOGS busy loops (default 2, one per CPU of a 2-core machine) for the whole script, then runs, in turn,
RUNS times each (default 20):

* ``kvbench run -t shm,tcp -n 8`` (the default model and sweep, 8 timed iterations a case), and
* ``make bench``'s job: ``kvbench run quick`` (its default SUITE),

and once each the liars whose verdicts rest on content and byte counts, not on time: a skipped timed
iteration under ``-c all``, a path that compresses the fill, a forger of the public fill (tests/liars.py).
Every launch is 2 ranks on this host with a timeout; its results go to a temporary folder that is removed.

It prints one line per launch (status, exit code, seconds, the SUSPECT/FAILED line if any) and a summary:
how many honest runs ended OK, and whether each liar was caught.  Exit 0 when every honest run is OK and
every liar caught, else 1.

    python benchmarks/underload.py [--mpirun .venv/bin/mpiexec] [--runs 20] [--hogs 2] [--parts runs,bench,liars]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from jobs import ROOT, kvbench_exe, launch

CAUGHT = {"skip": {"FAILED"}, "compress": {"FAILED", "SUSPECT"}, "forge": {"FAILED", "SUSPECT"}}  # liar: statuses


def liars() -> tuple[dict, dict]:
    """The liars' arguments and environment as tests/test_under_load.py launches them (tests/helpers)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers.args import UNDER_LOAD
    from helpers.launch import liar_env

    return UNDER_LOAD, dict(os.environ, **liar_env(root=True))


def status_of(out_dir: str) -> tuple[str, str]:
    """(status, reason) from the run's sidecar; ('-', why) without one."""
    metas = glob.glob(os.path.join(out_dir, "*", "*.meta.json"))
    if not metas:
        return "-", "no sidecar"
    m = json.load(open(metas[0]))
    return str(m.get("status", "-")), str(m.get("reason") or "")


def one(mpirun: list[str], kv: list[str], args: list[str], work: str, tag: str, timeout: float,
        env: dict | None = None) -> tuple[str, int, float, str]:
    out = os.path.join(work, tag)
    t0 = time.monotonic()
    rc, text = launch([*mpirun, "-n", "2", *kv, "run", "-o", out, *args], timeout, env)
    secs = time.monotonic() - t0
    status, reason = status_of(out)
    if not reason and rc:
        reason = next((ln for ln in text.splitlines() if ln.startswith("kvbench: ")), text.strip()[-200:])
    shutil.rmtree(out, ignore_errors=True)
    return status, rc, secs, reason


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("--runs", type=int, default=20, help="launches of each honest job (default 20)")
    ap.add_argument("--hogs", type=int, default=2, help="busy loops beside them (default 2)")
    ap.add_argument("--parts", default="runs,bench,liars", help="runs (shm,tcp -n 8), bench (make bench's job), "
                    "liars; comma-separated (default all three)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one launch may take (default 900)")
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    if a.runs < 1 or a.hogs < 0 or not parts or any(p not in ("runs", "bench", "liars") for p in parts):
        ap.error("--runs >= 1, --hogs >= 0, --parts from runs, bench, liars")
    mpirun, kv = shlex.split(a.mpirun), kvbench_exe()
    work = tempfile.mkdtemp(prefix="kvbench-underload-")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
    print(f"# make bench-underload: {a.hogs} busy loops beside every launch; {os.cpu_count()} CPUs; load at start "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    honest: dict[str, list[str]] = {}
    caught: dict[str, bool] = {}
    start = time.monotonic()
    try:
        jobs = ([("runs", ["-t", "shm,tcp", "-n", "8"])] if "runs" in parts else []) + \
               ([("bench", ["quick"])] if "bench" in parts else [])
        for i in range(a.runs):
            for name, args in jobs:
                st, rc, secs, why = one(mpirun, kv, args, work, f"{name}-{i}", a.timeout)
                honest.setdefault(name, []).append(st)
                print(f"{name:>6} {i + 1:>3}  {st:<10} exit {rc:>3}  {secs:7.1f} s  {why[:160]}", flush=True)
        if "liars" in parts:
            cases, env = liars()
            for name, args in cases.items():
                st, rc, secs, why = one(mpirun, kv, args, work, f"liar-{name}", a.timeout, env)
                caught[name] = st in CAUGHT[name]
                print(f"{'liar':>6} {name:<9} {st:<10} exit {rc:>3}  {secs:7.1f} s  {why[:160]}", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("# load at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()) +
          f"; total {time.monotonic() - start:.0f} s")
    for name, sts in honest.items():
        print(f"# {name}: {sts.count('OK')} of {len(sts)} OK" + (
            "" if sts.count("OK") == len(sts) else f" (others: {', '.join(s for s in sts if s != 'OK')})"))
    for name, ok in caught.items():
        print(f"# liar {name}: {'caught' if ok else 'NOT CAUGHT'}")
    good = all(s == "OK" for sts in honest.values() for s in sts) and all(caught.values())
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
