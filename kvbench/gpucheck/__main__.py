"""``python -m kvbench.gpucheck``: what the GPU half measures, on the GPU machine at hand (or its CPU rehearsal).

Runs with the machine's own Python and the packages a CUDA image ships, plus what ``make gpu-wheels`` carries
(pydantic, the mpich wheel's launcher), the C extension built in place, no network.  First the floors: the
device's own copy rate and its PCIe link.  Then the steps: pool fill and check, the copy engines, host<->device,
cuda_ipc between two processes it starts itself, staged over tcp against host tcp, real-prefill streaming
against a plain matmul, and the real suites on device pools (the last three through ``kvbench run`` under the
launcher).  Every row is timed on the stream that carries its work (or by the host clock after it), names that
clock, and carries its share of its floor; rows with a goal say whether they meet it ("below goal" on a GPU;
FAIL is for wrong bytes and errors).  Each step has a wall-time budget and is guarded: a failure is a FAIL row
and the next step runs.  Rows are printed as each step ends and saved at once to
results/runs/<machine>/<time>_gpucheck.json, then the whole table is printed.  Exit 0 when no row FAILs, 1
otherwise; without a GPU (``--device cuda``) it stops at once with one line (exit 2).  ``--device cpu`` is the
rehearsal: torch-cpu pools, the table says so.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from kvbench.memory import device

from . import checks, ipc, launched, runner
from .floors import Floors
from .runner import table  # noqa: F401  (the closing table; tests and callers take it from here)

STEPS = ("pool", "copy", "hostdev", "ipc", "staged", "prefill", "suites")
# wall seconds each; the floors' step (the reference) runs before any of them, always
BUDGET_S = {"reference": 30, "pool": 30, "copy": 45, "hostdev": 20, "ipc": 60, "staged": 90, "prefill": 90,
            "suites": 120}
DEFAULTS = {"cuda": dict(pool_mib=1024, block_kib=32, blocks=4096, repeats=5),
            "cpu": dict(pool_mib=16, block_kib=32, blocks=64, repeats=2)}


def parse(argv):
    p = argparse.ArgumentParser(prog="kvbench.gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (a GPU), or cpu: the rehearsal on torch-cpu pools (no GPU figure)")
    p.add_argument("--pool-mib", type=int, default=None, help="device pool for fill/verify and copies (MiB; "
                   "default 1024 on cuda, 16 on cpu)")
    p.add_argument("--block-kib", type=int, default=None, help="block size of the copy-engine layer (KiB; 32)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per copy-engine layer (4096 on cuda, 64 on cpu)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per measurement (median kept)")
    p.add_argument("--mpirun", default=None, help="MPI launcher for the two-rank steps (default: mpiexec beside "
                   "this Python, else on PATH)")
    p.add_argument("--deadline", type=float, default=420.0, help="wall seconds for all steps together (default "
                   "420: with the install, make gpu-check fits 8 minutes); each step also has its own budget")
    p.add_argument("-o", "--results", default="results/runs", help="results directory (default results/runs/, "
                   "which git ignores)")
    p.add_argument("--only", default="", help=f"comma list of steps: {','.join(STEPS)}")
    a = p.parse_args(argv)
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for name in ("pool_mib", "block_kib", "blocks", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, not {getattr(a, name)}")
    if a.deadline <= 0:
        p.error(f"--deadline must be positive, not {a.deadline:g}")
    if a.blocks * a.block_kib > a.pool_mib * 1024 // 2:
        p.error(f"--blocks x --block-kib ({a.blocks * a.block_kib} KiB) must fit in half of --pool-mib "
                f"({a.pool_mib} MiB): source and destination halves")
    a.only = [x for x in a.only.split(",") if x] or sorted(STEPS)
    bad = [x for x in a.only if x not in STEPS]
    if bad:
        p.error(f"--only {','.join(bad)}: not one of {','.join(sorted(STEPS))}")
    return a


def _machine() -> tuple[str, dict]:
    """(folder name, description) of this machine; the hostname alone where the results wing cannot load."""
    try:
        from kvbench.results.store import machine_name, system_description

        return machine_name(), system_description()
    except Exception as exc:  # a missing package costs the description, never the run
        return socket.gethostname().split(".")[0] or "unknown", {"error": runner.one_line(exc)}


def _release_cache(target) -> None:
    if not target.rehearsal:
        import torch

        torch.cuda.empty_cache()


def main(argv=None) -> int:
    a = parse(argv)
    if a.device == "cuda":
        why = device.probe("cuda")
        if why:
            print(f"gpu-check: no GPU here: {why}", file=sys.stderr)
            return 2
    target = checks.Target(a.device)
    if target.rehearsal:
        checks.install_fake_driver(target)
    name, system = _machine()
    path = runner.new_path(os.path.join(a.results, name), "_gpucheck" + ("-cpu-rehearsal" if target.rehearsal else ""))
    runs = path[: -len(".json")] + "-runs"  # kvbench run's own results for the two-rank steps
    rec = runner.Recorder(path, {"argv": sys.argv, "device": a.device, "rehearsal": target.rehearsal,
                                 "system": system})
    print(runner.header(target.rehearsal))
    print(runner.columns(), flush=True)
    end = time.monotonic() + a.deadline
    runner.run_step(rec, "device", lambda: [checks.device_row(target)], 60)
    fl = Floors()
    runner.run_step(rec, "reference", lambda: checks.reference_rows(a, target, fl), BUDGET_S["reference"])
    steps = {"pool": lambda b: checks.pool_rows(a, target, fl), "copy": lambda b: checks.copy_rows(a, target, fl),
             "hostdev": lambda b: checks.hostdev_rows(a, target, fl),
             "ipc": lambda b: ipc.ipc_rows(a, target, b - 5, fl),  # its own deadline first: the rows so far come back
             # launches end 10 s before the step's budget: time to kill them whole (SIGTERM first) and say so
             "staged": lambda b: launched.staged_rows(a, target, runs, time.monotonic() + b - 10, fl),
             "prefill": lambda b: launched.prefill_rows(a, target, runs, time.monotonic() + b - 10, fl),
             "suites": lambda b: launched.suite_rows(a, target, runs, time.monotonic() + b - 10, fl)}
    for step in STEPS:
        if step not in a.only:
            continue
        left = end - time.monotonic()
        budget = min(BUDGET_S[step], left)
        if left < min(10, BUDGET_S[step]):
            rec.add([runner.row(step, "step", status="FAIL", note=f"not started: the run's --deadline of "
                                f"{a.deadline:.0f} s is spent")])
            continue
        runner.run_step(rec, step, lambda s=step, b=budget: steps[s](b), budget)
        try:
            _release_cache(target)
        except Exception:
            pass
    print()
    print(table(rec.rows, target.rehearsal))
    print(f"# written: {path}")
    return 1 if any(r["status"] == "FAIL" for r in rec.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
