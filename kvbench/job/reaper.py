"""A rank's reaper: a small process in a session of its own that outlives its rank when something outside kills
it, and does what the rank could not (stdlib only).

MPICH's launcher (hydra) dies of a SIGHUP, and its proxies then SIGKILL every rank's process group at once, so
no code of the ranks runs to say so (docs/reliability.md).  Each rank starts a reaper before MPI does, holding
a pipe to it; the rank says its run id, then (rank 0) its sidecar, and ``done`` once the run ended by itself or
through the exit path.  When the pipe closes without ``done``, the rank was killed: the reaper removes the run's
files in /dev/shm on its host (MPICH's segments once no live process maps them), and rank 0's reaper writes the
sidecar while it still says INCOMPLETE -- INTERRUPTED when the launcher ended first (its SIGHUP), else it keeps
INCOMPLETE with the cause -- removes the result set's lock and half-written ``.tmp`` files, and says the one line
on the launcher's stderr (opened while the launcher lived) when the launcher ended first.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

from kvbench.job import cleanup, safefile

LAUNCHERS = {"mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich"}  # hydra's names
SWEEP_S = 5.0  # how long the reaper waits for the other ranks of its host to be gone before it gives up


def launcher_pid(pid: int | None = None, depth: int = 4) -> int | None:
    """The launcher among this process's nearest ancestors (hydra: rank -> proxy -> mpiexec), or None."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() in LAUNCHERS:
                    return pid
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


class Reaper:
    """The rank's end of the pipe (``start``): ``tell(key, value)``, and ``done()`` when the run ends by itself."""

    def __init__(self, proc: subprocess.Popen | None):
        self.proc = proc

    def tell(self, key: str, value: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(f"{key} {value}\n".encode())
            self.proc.stdin.flush()
        except OSError:
            self.proc = None  # the reaper is gone: the run goes on without it

    def done(self) -> None:
        """The run ends by itself or through the exit path: the reaper leaves everything as it is."""
        self.tell("done", "-")
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc = None


def start(rank: int) -> Reaper:
    """Start this rank's reaper (before MPI: no fork from an MPI process); a Reaper that does nothing when it
    cannot be started."""
    launcher = launcher_pid()
    err = subprocess.DEVNULL
    if launcher is not None:
        try:  # the launcher's own stderr, so that the line still reaches the user once the launcher is gone
            err = os.open(f"/proc/{launcher}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
        except OSError:
            err = subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvbench.job.reaper", str(os.getpid()), str(rank),
                                 str(launcher or 0)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True, close_fds=True)
    except OSError:
        proc = None
    finally:
        if err is not subprocess.DEVNULL:
            os.close(err)
    return Reaper(proc)


def sweep_run(run_id: str, seconds: float = SWEEP_S) -> None:
    """Remove run ``run_id``'s files in /dev/shm once their owners are gone (the other ranks of the host die
    moments after this one), with the MPICH segments their registries list that no live process maps."""
    end = time.monotonic() + seconds
    while True:
        cleanup.sweep_orphans(run_id)
        if not cleanup.leftovers(run_id) or time.monotonic() > end:
            return
        time.sleep(0.1)


def record(meta_path: str, launcher_first: bool, launcher: int, rank_pid: int) -> str | None:
    """Rank 0's sidecar, while it says INCOMPLETE: the cause, and INTERRUPTED when the launcher ended first;
    then the result set's lock and .tmp files go.  Returns the line to say, if any."""
    parquet = meta_path[: -len(".meta.json")] + ".parquet"
    line = None
    try:
        meta = json.loads(safefile.read_text(meta_path))  # never through a link (safefile.py)
        if meta.get("status") == "INCOMPLETE":
            host = socket.gethostname()
            if launcher_first:
                line = (f"kvbench: interrupted: rank 0 on {host}: the launcher (pid {launcher}) ended before the run "
                        "(a SIGHUP or a kill: its proxies then kill every rank); finished cases are kept")
                meta.update(status="INTERRUPTED", reason=line)
            else:
                meta.update(reason=f"rank 0 (pid {rank_pid}) on {host} was killed from outside (SIGKILL, or its "
                                   "launcher ended the job after another rank died): the run did not end by itself")
            meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            safefile.write_whole(meta_path, lambda fh: fh.write(json.dumps(meta, indent=2, default=str).encode()),
                                 cleanup.own_tmp_of(meta_path))
    except (OSError, ValueError):  # (safefile.UnsafeFile is an OSError)
        pass
    for path in cleanup.set_tmp_files(parquet):
        try:
            safefile.remove(path)  # a link or another user's file under the name stays (nobody to tell here)
        except OSError:
            pass
    lock = cleanup.lock_path(parquet)
    try:  # the lock is free now (its holder is dead) unless a resume took it meanwhile: then it stays
        fd = safefile.open_own(lock, os.O_RDWR)  # never through a link, never another user's (UnsafeFile: OSError)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(lock)
        finally:
            os.close(fd)
    except OSError:
        pass
    return line


def launcher_ended_first(pid: int) -> bool:
    """Whether the launcher was ended from outside before the rank died.  After a rank's SIGKILL hydra reports
    it and exits with a code (9), so at the rank's death the launcher still lives, or is a zombie that exited;
    after the launcher's SIGHUP it is a zombie killed by a signal, or already reaped (gone)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    if fields[0] != "Z":
        return False
    try:  # a zombie's wait status (field 52): killed by a signal, or exited with a code
        return bool(int(fields[49]) & 0x7F)
    except (IndexError, ValueError):
        return True


def main(argv: list[str]) -> int:
    # a whole tree told to end at once (a lab run's or a batch system's SIGTERM to every process) reaches the
    # reaper with its rank: it outlives the rank by design, and ends when the rank's pipe closes
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    rank_pid, rank, launcher = int(argv[0]), int(argv[1]), int(argv[2])
    facts: dict[str, str] = {}
    buf = b""
    while True:
        data = os.read(0, 4096)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for ln in lines:
            key, _, value = ln.decode().partition(" ")
            facts[key] = value
    if "done" in facts:
        return 0
    first = launcher_ended_first(launcher)
    if facts.get("meta") and rank == 0:
        line = record(facts["meta"], first, launcher, rank_pid)
        if line:
            try:
                print(line, file=sys.stderr, flush=True)
            except OSError:  # the terminal hung up (the SIGHUP's cause): the sidecar holds the line
                pass
    if facts.get("run"):
        sweep_run(facts["run"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
