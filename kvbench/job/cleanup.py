"""Shared-memory files a run leaves behind, and how to remove them (stdlib only).

Two kinds of files outlive a run that ends badly (docs/pitfalls.md: mpich-leftovers,
abort-returns, small-dev-shm):

* kvbench's own pool segments, ``kvbench_{run_id}_r{rank}_p{pid}``: the shm
  transport unlinks them once every rank has mapped them, but a rank killed
  during setup, or one that ends with ``os._exit`` (no atexit), leaks them.
* MPICH's ``mpich_shm_*`` files, left whenever a job ends without
  ``MPI_Finalize``: after ``MPI_Abort``, ``os._exit``, or a SIGKILL from the
  launcher.

Every file kvbench writes here carries its owner's pid, so that a later run
can tell a leftover (its process is gone) from a file in use.  After MPI
initialises, each rank records the MPICH files it maps in a small registry,
``kvbench_{run_id}_mpich_r{rank}_p{pid}`` (one path per line), so that those
can be found again once the rank is dead.

The failing rank of a job calls ``unlink_mpich(mapped_mpich())`` and
``unlink_run(run_id)`` before it ends the job; ``kvbench run`` calls
``sweep_orphans()`` at its start on every host for whatever a killed job left; ``kvbench list``
tells what is there (``survey``), so that a user who does not run again learns of it too.

A result set's temporary and lock files are named here too (``tmp_of``, ``lock_path``, ``set_tmp_files``):
results/ writes and sweeps them, and a rank's reaper (job/reaper.py, which may not import results/) removes
them after a kill.

Pids are only meaningful in this host's (and this pid namespace's) process
table: containers that share one /dev/shm but not their pid namespace would
see each other's live files as orphans, so ``sweep_orphans`` is for a
/dev/shm private to the container or host.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from kvbench.job import safefile

SHM_DIR = "/dev/shm"  # read at call time, so tests can monkeypatch it

# kvbench_<run>_r<rank>_p<pid> (a pool segment) or kvbench_<run>_mpich_r<rank>_p<pid> (a registry)
_OWNED = re.compile(r"kvbench_(?P<run>.+?)_(?P<registry>mpich_)?r(?P<rank>\d+)_p(?P<pid>\d+)")


# ----- a result set's own files beside its table (named here, below results/, so that a rank's reaper can find them)
def tmp_of(path: str) -> str:
    """Where ``path`` is written before it is renamed over itself (a kill mid-write leaves this name)."""
    return path + ".tmp"


def own_tmp_of(path: str) -> str:
    """A second writer's temporary name for ``path``, apart from its owner's ``tmp_of`` (which may be mid-write)."""
    return f"{path}.{os.getpid()}.tmp"


def lock_path(parquet: str) -> str:
    """The result set's lock file (results/lock.py)."""
    return parquet[: -len(".parquet")] + ".lock" if parquet.endswith(".parquet") else parquet + ".lock"


def set_tmp_files(parquet: str) -> list[str]:
    """The half-written files a killed run can leave of result set ``parquet``: its table's and its sidecar's."""
    return [tmp_of(parquet), tmp_of(parquet[: -len(".parquet")] + ".meta.json")]


def _unlink(path: str) -> bool:
    """Remove ``path``; False when it was already gone (another rank or sweeper got there first)
    or is not ours to remove (another user's file in the sticky /dev/shm)."""
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def _is_mpich(path: str) -> bool:
    """``path`` names an MPICH segment directly in SHM_DIR (a registry cannot point anywhere else)."""
    return (os.path.basename(path).startswith("mpich_shm_")
            and os.path.dirname(os.path.realpath(path)) == os.path.realpath(SHM_DIR))


def _maps_paths(maps_file: str) -> list[str]:
    """The file paths mapped in one /proc/<pid>/maps, without deleted files."""
    paths = []
    with open(maps_file) as fh:
        for line in fh:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(" (deleted)"):
                paths.append(fields[5])
    return paths


def segment_path(run_id: str, rank: int) -> str:
    """Where this process keeps its pool segment: ``{SHM_DIR}/kvbench_{run_id}_r{rank}_p{pid}``."""
    return f"{SHM_DIR}/kvbench_{run_id}_r{rank}_p{os.getpid()}"


def shm_free_bytes(path: str | None = None) -> int:
    """Bytes an unprivileged process may still write in ``path`` (default SHM_DIR), from statvfs."""
    st = os.statvfs(SHM_DIR if path is None else path)
    return st.f_bavail * st.f_frsize


def _mine(path: str) -> bool:
    """``path`` is a regular file of this user's, not a link (/dev/shm is anyone's folder: a link or another
    user's file named like kvbench's is neither read nor removed, only left where it is)."""
    try:
        return safefile.why_unsafe(path, os.lstat(path)) is None
    except OSError:
        return False


def _run_files(run_id: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(glob.escape(SHM_DIR), f"kvbench_{glob.escape(run_id)}_*"))
                  if _mine(p))


def unlink_run(run_id: str) -> list[str]:
    """Unlink every file of run ``run_id`` on this host (any rank's segment or registry, and the MPICH segments
    a registry lists: a rank may map one that this one does not, and once its registry is gone nobody would
    know the segment for the run's); returns those removed.

    Unlinking a segment other ranks still map is harmless: their mappings stay valid.
    """
    removed = []
    for path in _run_files(run_id):
        m = _OWNED.fullmatch(os.path.basename(path))
        if m is not None and m["registry"]:
            removed += unlink_mpich(_listed(path) or [])
        if _unlink(path):
            removed.append(path)
    return removed


def mapped_mpich() -> list[str]:
    """The ``mpich_shm_*`` files in SHM_DIR that this process maps (deleted ones left out)."""
    seen = []
    for p in _maps_paths("/proc/self/maps"):
        if p not in seen and _is_mpich(p):
            seen.append(p)
    return seen


def record_mpich(run_id: str, rank: int) -> str | None:
    """Write this process's registry of mapped MPICH files; returns its path, or None if it maps none.

    Call once, after MPI has initialised.
    """
    paths = mapped_mpich()
    if not paths:
        return None
    reg = f"{SHM_DIR}/kvbench_{run_id}_mpich_r{rank}_p{os.getpid()}"
    fd = safefile.create_new(reg, 0o600)  # /dev/shm: anyone's folder (never through a link, never another's file)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(p + "\n" for p in paths))
    return reg


def unlink_mpich(paths) -> list[str]:
    """Unlink those of the MPICH segments ``paths`` that still exist; returns those removed."""
    return [p for p in paths if _unlink(p)]


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never a pid of ours; os.kill(0, ...) would address a process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # exists but belongs to someone else / not a pid we can judge: keep its files
    try:  # a zombie (killed, not yet reaped) maps nothing and will write nothing: its files are leftovers
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _mapped_anywhere() -> set[str]:
    """Every MPICH segment in SHM_DIR that some live process maps (unreadable maps are skipped)."""
    used = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            used.update(p for p in _maps_paths(maps) if os.path.basename(p).startswith("mpich_shm_"))
        except OSError:  # the process ended, or is not ours to read
            continue
    return used


def _owned():
    """(path, name match, owner alive) for each file in SHM_DIR named like kvbench's, in name order."""
    for path in sorted(glob.glob(os.path.join(glob.escape(SHM_DIR), "kvbench_*"))):
        m = _OWNED.fullmatch(os.path.basename(path))
        if m is not None and _mine(path):
            yield path, m, _alive(int(m["pid"]))


def _listed(registry: str) -> list[str] | None:
    """The MPICH segments a registry names that still exist in SHM_DIR; None when it cannot be read."""
    try:
        listed = [line.strip() for line in safefile.read_text(registry).splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):  # a concurrent sweep took it, another user's, or a link (UnsafeFile)
        return None
    return [seg for seg in listed if _is_mpich(seg) and os.path.exists(seg)]


def sweep_orphans(run_id: str | None = None) -> list[str]:
    """Remove the kvbench files in SHM_DIR whose owning process is gone (of run ``run_id`` alone, when given:
    a killed rank's reaper); returns what was removed.

    A dead process's registry first takes the MPICH segments it lists with it, each one only if it
    still exists and no live process maps it.  Nothing else is touched: live processes' files,
    other jobs' MPICH segments, files not named like kvbench's.  Safe to run in several processes at once.
    """
    removed: list[str] = []
    used = None
    for path, m, alive in _owned():
        if alive or (run_id is not None and m["run"] != run_id):
            continue
        if m["registry"]:
            listed = _listed(path)
            if listed is None:
                continue
            for seg in listed:
                if used is None:
                    used = _mapped_anywhere()
                if os.path.realpath(seg) not in used and _unlink(seg):
                    removed.append(seg)
        if _unlink(path):
            removed.append(path)
    return removed


def held_bytes(paths) -> int:
    """The space the files ``paths`` hold in SHM_DIR (allocated blocks: a sparse file holds what it wrote)."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_blocks * 512
        except OSError:  # removed meanwhile
            continue
    return total


@dataclass
class Survey:
    """What SHM_DIR holds of kvbench's and MPICH's, by whether its owner still runs (``survey``)."""

    orphans: list[str] = field(default_factory=list)  # what ``sweep_orphans`` would remove now
    stray_mpich: list[str] = field(default_factory=list)  # this user's MPICH segments no live process maps, in no registry
    in_use: list[str] = field(default_factory=list)  # kvbench files of live processes
    orphan_runs: list[str] = field(default_factory=list)  # run ids of the orphans, in name order
    live_runs: list[str] = field(default_factory=list)


def survey() -> Survey:
    """Look at SHM_DIR without touching it: leftovers of runs whose processes are gone, and files in use.

    An MPICH segment counts as a leftover only when no live process maps it: those a dead rank's registry
    lists go with the next sweep; this user's others (a job that registered none) no sweep removes.
    """
    s = Survey()
    listed: set[str] = set()
    for path, m, alive in _owned():
        runs = s.live_runs if alive else s.orphan_runs
        if m["run"] not in runs:
            runs.append(m["run"])
        if alive:
            s.in_use.append(path)
            continue
        s.orphans.append(path)
        if m["registry"]:
            listed.update(os.path.realpath(seg) for seg in _listed(path) or ())
    mpich = sorted(glob.glob(os.path.join(glob.escape(SHM_DIR), "mpich_shm_*")))
    if not mpich:
        return s
    used = _mapped_anywhere()
    for seg in mpich:
        if os.path.realpath(seg) in used:
            continue
        if os.path.realpath(seg) in listed:
            s.orphans.append(seg)
            continue
        try:
            mine = os.stat(seg).st_uid == os.getuid()  # another user's processes' maps are not ours to read
        except OSError:
            continue
        if mine:
            s.stray_mpich.append(seg)
    return s


def leftovers(run_id: str, names=()) -> list[str]:
    """Which of run ``run_id``'s files and of the MPICH segments ``names`` still exist."""
    return _run_files(run_id) + [p for p in names if os.path.exists(p)]
