"""Launching benchmark jobs (mpiexec and its ranks, native tools) from the checkout, and what kvbench can run.

Shared by the benchmark scripts in this folder.  The launching itself (a
timeout, the process tree followed through /proc and killed whole, MPICH
leftovers removed) is kvbench.job.launch's, the selftest's too.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # kvbench's process-tree helpers, from a checkout without install

from kvbench.job import launch as L  # noqa: E402


def launch(cmd: list[str], timeout: float, env=None) -> tuple[int, str]:
    """Run one job from the checkout's root (kvbench.job.launch.launch: timeout, whole-tree kill, this job's
    own MPICH segments removed); (exit code, output)."""
    return L.launch(cmd, timeout, env, cwd=ROOT)


def kvbench_exe() -> list[str]:
    """The command that runs kvbench from this interpreter's environment (its script, else ``python -m``)."""
    exe = os.path.join(os.path.dirname(sys.executable), "kvbench")
    return [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "kvbench"]


def availability(kv: list[str], names: list[str]) -> dict[str, str | None]:
    """transport or engine -> None when kvbench can run it here, else the reason (from ``kvbench list``)."""
    rc, out = launch(kv + ["list"], 60)
    got: dict[str, str | None] = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\S+)\s+(available|unavailable: .*)$", line)
        if m and m.group(1) in names:
            got[m.group(1)] = None if m.group(2) == "available" else m.group(2).split(": ", 1)[1]
    return {n: got.get(n, f"kvbench list failed (exit {rc})" if rc else "not listed by kvbench list")
            for n in names}
