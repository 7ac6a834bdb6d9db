"""Process trees of launches (mpiexec and its ranks): started with a timeout, killed whole (stdlib only).

The one launch() and kill_tree() of the selftest and the benchmark scripts.
hydra's proxies start sessions of their own, so a process group misses the
ranks: a launch is followed through /proc as a tree instead, and a process is
named by its pid and start time (pids are reused).
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
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
    """Names of the /dev/shm/mpich_shm_* segments these processes map or hold open (a segment is opened before it
    is mapped)."""
    got = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                got.update(ln.rsplit("/", 1)[-1].split()[0] for ln in fh if "/dev/shm/mpich_shm_" in ln)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("/dev/shm/mpich_shm_"):
                    got.add(link.rsplit("/", 1)[-1].split()[0])
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


LIVE: set[int] = set()  # launches in flight (root pids), for a caller's way out: kill_tree(root) each


def _signal_all(procs: dict[int, int | None], sig: int) -> None:
    for pid, st in procs.items():
        if st is not None and starttime(pid) == st:  # still the same process (pids are reused)
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_gone(procs: dict[int, int | None], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(starttime(q) == st for q, st in procs.items() if st):
        time.sleep(0.05)


def kill_tree(root: int | None, tree: dict[int, int] | None = None, grace: float = 0.0,
              seen: set[str] | None = None) -> None:
    """End root (a launch's process, or None) and its process tree, each process only if it is still the same one.

    ``tree`` ({pid: start time}, as recorded while it ran) defaults to root's tree in /proc now; it is taken
    before anything is signalled: once root is gone its descendants are nobody's children.  With ``grace``,
    SIGTERM first while root lives (kvbench's ranks then leave through their own exit path: one line, their
    segments removed), up to ``grace`` s for root and as long again for the rest; then SIGKILL.

    With ``seen`` (a set), the tree is stopped first and the MPICH segments it maps or holds open are added to
    it: a rank killed inside MPI_Init leaves a segment made after the launch's last look (launch())."""
    procs = dict(descendants(root) if tree is None and root else tree or {})
    if root:
        procs[root] = starttime(root)
    if seen is not None:  # nothing new is made or started between this look and the signals below
        while True:
            _signal_all(procs, signal.SIGSTOP)
            new = {q: st for q, st in (descendants(root) if root else {}).items() if q not in procs}
            if not new:
                break
            procs.update(new)  # started since the tree was taken (a proxy's rank): stopped too
        seen |= mpich_segments(procs)
    if grace > 0 and root and procs[root] is not None:
        _signal_all(procs, signal.SIGTERM)
        if seen is not None:
            _signal_all(procs, signal.SIGCONT)  # a stopped process takes its SIGTERM when it runs again
        _wait_gone({root: procs[root]}, grace)
        _wait_gone(procs, grace)
    _signal_all(procs, signal.SIGKILL)


def launch(cmd: list[str], timeout: float, env: dict | None = None, cwd: str | None = None,
           grace: float = 0.0) -> tuple[int, str]:
    """Run a command (with its process tree) for at most ``timeout`` s; (exit code, stdout+stderr); 124 = timeout,
    127 = it could not start.  Past the timeout, or on an interrupt, its whole tree is killed (``kill_tree``
    with ``grace``); after a failure, whatever its tree left behind is too.

    MPICH leaves /dev/shm/mpich_shm_* behind when ranks die without finishing (docs/pitfalls.md#mpich-leftovers).  The
    segments this launch's processes map are recorded while it runs (polled every 10 ms at first, then every
    250 ms: a job that dies within its first poll can still leave one unseen); those still on disk and mapped
    by nobody once it is gone are removed.  Other jobs' segments are never touched."""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=cwd, env=env)
    except OSError as exc:
        return 127, f"cannot start {cmd[0]}: {exc.strerror}"
    LIVE.add(p.pid)
    mine: set[str] = set()
    tree: dict[int, int] = {}
    deadline, tail, poll = time.monotonic() + timeout, "", 0.01
    try:
        while True:
            tree.update(descendants(p.pid))
            mine |= mpich_segments(tree)
            try:
                out, _ = p.communicate(timeout=poll)
                rc = p.returncode
                break
            except subprocess.TimeoutExpired:
                poll = min(0.25, 2 * poll)  # often at first: a job that fails at once maps its segments briefly
                if time.monotonic() > deadline:
                    tree.update(descendants(p.pid))
                    kill_tree(p.pid, tree, grace, seen=mine)
                    out, rc, tail = p.communicate()[0], 124, f"\n(timed out after {timeout:g} s)"
                    break
    except BaseException:
        tree.update(descendants(p.pid))
        kill_tree(p.pid, tree, grace, seen=mine)
        p.wait()
        raise
    finally:
        LIVE.discard(p.pid)
        if p.returncode != 0:  # ranks a dead launcher left behind (the launcher itself is reaped: not by pid)
            kill_tree(None, tree, seen=mine)
        remove_orphan_segments(mine)
    return rc, (out or "") + tail
