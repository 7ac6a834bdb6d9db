"""A result set's lock: one run writes it at a time (``<set>.lock`` beside the parquet, fcntl.flock), and the
`.tmp` and `.lock` files of runs that were killed are removed by the next run into that folder (stdlib only).

The lock is held by rank 0 for the whole run and removed when it ends; a kill -9 leaves the file but not the
lock (the kernel drops it with the process), so a later run finds it free.  The file names its holder (pid and
host) so that a refused run can say who holds it.  A `.lock` or `.tmp` name that is a link, not a regular file
or another user's is never opened nor removed: it is refused in one line (job/safefile.py), as a results folder
others can write may hold one planted there.
"""
from __future__ import annotations

import fcntl
import glob
import os
import socket

from kvbench.job.cleanup import lock_path
from kvbench.job.safefile import UnsafeFile, check, open_own, remove


class LockHeld(Exception):
    """Another live process holds the result set's lock; the message names it."""


class ResultLock:
    """``ResultLock(parquet)`` takes the lock or raises LockHeld; ``release()`` removes it (idempotent)."""

    def __init__(self, parquet: str):
        self.path = lock_path(parquet)
        self.fd: int | None = None
        while True:
            fd = open_own(self.path, os.O_RDWR | os.O_CREAT)  # never through a link (UnsafeFile)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise LockHeld(f"another kvbench run holds {self.path} ({holder or 'holder unknown'})") from None
            # the holder before us may have removed the file between our open and our lock: lock the file
            # that is at the path now, not an unlinked one
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError:  # a full disk: the lock we hold goes, not an empty file that names no holder
            os.unlink(self.path)
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        """Remove the file while still holding the lock (a waiter then retries on a fresh file), then drop it."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def stale_names(folder: str) -> list[str]:
    """The `.tmp` and `.lock` files in ``folder`` (a killed run's, or a live one's)."""
    return sorted(glob.glob(os.path.join(folder, "*.tmp")) + glob.glob(os.path.join(folder, "*.lock")))


def planted(folder: str) -> None:
    """UnsafeFile for the first `.tmp` or `.lock` name in ``folder`` that is a link, not a regular file or another
    user's: the door refuses the run before it starts, as the sweep (sweep_stale) would after."""
    for path in stale_names(folder):
        check(path)


def sweep_stale(folder: str) -> list[str]:
    """Remove the `.tmp` and `.lock` files in ``folder`` whose result set no live run holds (a kill -9's);
    returns their paths.  UnsafeFile for one that is a link, not a regular file or another user's."""
    gone = []
    for path in stale_names(folder):
        check(path)  # before anything is opened: a planted link is refused, its target untouched
        name = path[: -len(".tmp")] if path.endswith(".tmp") else path
        for tail in (".parquet", ".meta.json", ".lock"):
            if name.endswith(tail):
                base = name[: -len(tail)]
                break
        else:
            continue  # not a file of a result set
        try:
            lock = ResultLock(base + ".parquet")
        except UnsafeFile:  # (an OSError, but not one to pass over: it ends the sweep)
            raise
        except (LockHeld, OSError):
            continue  # a live run's (or one we cannot touch): leave it
        try:
            if path != lock.path:
                remove(path)  # checked above; again here, as the name may have changed since
            gone.append(path)
        except UnsafeFile:
            raise
        except OSError:
            pass
        finally:
            lock.release()  # a stale .lock goes with it
    return gone
