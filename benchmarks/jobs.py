"""Launching benchmark jobs (mpiexec and its ranks, native tools) with a timeout, and cleaning up.

Shared by the benchmark scripts in this folder.  hydra's proxies start
sessions of their own, so a process group misses the ranks: a job is
followed through /proc as a process tree instead, and killed whole.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVE: set[int] = set()  # process trees (root pids) of launches in flight


def starttime(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with the pid, its identity (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> dict[int, int]:
    """root's process tree from /proc as {pid: start time} (hydra's proxies start sessions of their own,
    so a process group misses the ranks)."""
    kids: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(stat.split("/")[2]))
    out, todo = {}, [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if (st := starttime(c)) is not None:
                out[c] = st
            todo.append(c)
    return out


def shm_of(pids) -> set[str]:
    """mpich_shm_* segments these processes map."""
    got = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                got.update(ln.rsplit("/", 1)[-1].split()[0] for ln in fh if "/dev/shm/mpich_shm_" in ln)
        except OSError:
            pass
    return got


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
    (PLATFORM pitfall 8).  The segments this job's ranks map are recorded while
    it runs; those still on disk and mapped by nobody once it is gone are removed.
    Other jobs' segments are never touched.
    """
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=ROOT, env=env)
    except OSError as exc:
        return 127, f"cannot start {cmd[0]}: {exc.strerror}"
    LIVE.add(p.pid)
    mine: set[str] = set()
    tree: dict[int, int] = {}
    deadline, chunks = time.monotonic() + timeout, []
    while True:
        tree.update(descendants(p.pid))
        mine |= shm_of(tree)
        try:
            out, _ = p.communicate(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                kill_tree(p.pid, tree)
                out, _ = p.communicate()
                chunks.append(f"\n(timed out after {timeout:g} s)")
                break
    LIVE.discard(p.pid)
    rc = p.returncode if not chunks else 124
    if rc != 0:  # ranks a dead launcher left behind (the launcher itself is reaped: not by pid)
        kill_tree(None, tree)
    left = [n for n in mine if os.path.exists(f"/dev/shm/{n}")]
    if left:
        time.sleep(0.3)  # let killed ranks unmap
        busy = shm_of(int(d) for d in os.listdir("/proc") if d.isdigit())
        for n in left:
            if n not in busy:
                try:
                    os.unlink(f"/dev/shm/{n}")
                except OSError:
                    pass
    return rc, (out or "") + "".join(chunks)
