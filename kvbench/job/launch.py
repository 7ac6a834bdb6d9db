"""Process trees of launches (mpiexec and its ranks), for the scripts that start them with a timeout.

hydra's proxies start sessions of their own, so a process group misses the
ranks: a launch is followed through /proc as a tree instead, and a process is
named by its pid and start time (pids are reused).
"""
from __future__ import annotations

import glob
import os
import time


def starttime(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return None if f[0] in "ZX" else int(f[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> dict[int, int]:
    """root's process tree from /proc as {pid: start time} (live processes only)."""
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


def mpich_segments(pids) -> set[str]:
    """Names of the /dev/shm/mpich_shm_* segments these processes map."""
    got = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                got.update(ln.rsplit("/", 1)[-1].split()[0] for ln in fh if "/dev/shm/mpich_shm_" in ln)
        except OSError:
            pass
    return got


def remove_orphan_segments(names) -> None:
    """After a launch: its MPICH segments still on disk that no process maps any more (docs/pitfalls.md#mpich-leftovers)."""
    left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    if not left:
        return
    time.sleep(0.3)  # let killed ranks unmap
    busy = mpich_segments(int(d) for d in os.listdir("/proc") if d.isdigit())
    for n in left:
        if n not in busy:
            try:
                os.unlink(f"/dev/shm/{n}")
            except OSError:
                pass
