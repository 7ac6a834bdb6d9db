"""Launching benchmark jobs (mpiexec and its ranks, native tools) with a timeout, and cleaning up.

Shared by the benchmark scripts in this folder.  hydra's proxies start
sessions of their own, so a process group misses the ranks: a job is
followed through /proc as a process tree instead, and killed whole.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # kvbench's process-tree helpers, from a checkout without install

from kvbench.job.launch import descendants, remove_orphan_segments, starttime  # noqa: E402
from kvbench.job.launch import mpich_segments as shm_of  # noqa: E402

LIVE: set[int] = set()  # process trees (root pids) of launches in flight


def kill_tree(root: int | None, tree: dict[int, int]) -> None:
    """SIGKILL root (a child not yet reaped) and the processes seen in its tree, each only if it is
    still the same process."""
    for pid, st in [*([(root, None)] if root else []), *tree.items()]:
        if st is not None and starttime(pid) != st:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(cmd: list[str], timeout: float, env=None) -> tuple[int, str]:
    """Run one job (mpiexec and its ranks) with a timeout; kill its whole tree if it outlives it.

    MPICH leaves /dev/shm/mpich_shm_* behind when ranks die without finishing
    (docs/pitfalls.md#mpich-leftovers).  The segments this job's ranks map are recorded while
    it runs (polled every 10 ms at first, then every 250 ms: a job that dies within
    its first poll can still leave one unseen); those still on disk and mapped by
    nobody once it is gone are removed.  Other jobs' segments are never touched.
    """
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=ROOT, env=env)
    except OSError as exc:
        return 127, f"cannot start {cmd[0]}: {exc.strerror}"
    LIVE.add(p.pid)
    mine: set[str] = set()
    tree: dict[int, int] = {}
    deadline, chunks, poll = time.monotonic() + timeout, [], 0.01
    while True:
        tree.update(descendants(p.pid))
        mine |= shm_of(tree)
        try:
            out, _ = p.communicate(timeout=poll)
            break
        except subprocess.TimeoutExpired:
            poll = min(0.25, 2 * poll)  # often at first: a job that fails at once maps its segments briefly
            if time.monotonic() > deadline:
                kill_tree(p.pid, tree)
                out, _ = p.communicate()
                chunks.append(f"\n(timed out after {timeout:g} s)")
                break
    LIVE.discard(p.pid)
    rc = p.returncode if not chunks else 124
    if rc != 0:  # ranks a dead launcher left behind (the launcher itself is reaped: not by pid)
        kill_tree(None, tree)
    remove_orphan_segments(mine)
    return rc, (out or "") + "".join(chunks)


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
