"""Where a probe runs: a mount and pid namespace of its own (private /dev/shm and /tmp, the checkout and $HOME
behind an overlay), or, where unshare cannot make one, the shared machine with leftovers found by run id.

The outer half (``run``) starts ``python tools/fuzz --inner SPEC`` inside ``unshare``; the inner half (``inner``)
is that namespace's pid 1: it mounts, runs the command, waits for the run's reapers, looks at what is left and
writes it to RESULT.  pid 1 ending takes every process of the namespace with it, so a timeout leaves nothing.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fuzz.judge import Result
from fuzz.probes import PRECIOUS, ROOT

FUZZ = Path(__file__).resolve().parent
UNSHARE = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
SETTLE_S = 15.0  # how long a run's reapers may take to clean up once its launcher ended
MARGIN_S = SETTLE_S + 30  # the outer deadline past a probe's limit: the inner one should always fire first
PRIVATE = "private: a mount and pid namespace per probe, its own /dev/shm and /tmp, the checkout and $HOME overlaid"
SHARED = ("shared: no namespace (unshare could not make one, or --shared); /dev/shm leftovers found by run id, "
          "the checkout scanned by mtime")


def detect() -> str:
    """PRIVATE when this machine lets us make a probe's namespace, else SHARED."""
    try:
        r = subprocess.run([*UNSHARE, "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return SHARED
    return PRIVATE if r.returncode == 0 else SHARED


# ----- the outer half
def run(argv: list[str], env: dict[str, str], limit: float, scratch: Path, mode: str) -> Result:
    """Run ``argv`` in ``scratch`` under the sandbox ``mode``; what it saw."""
    box = scratch / ".sandbox"
    box.mkdir(exist_ok=True)
    spec = {"argv": argv, "env": env, "limit": limit, "scratch": str(scratch), "private": mode == PRIVATE,
            "result": str(box / "result.json")}
    (box / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(FUZZ), "--inner", str(box / "spec.json")]
    t0 = time.monotonic()
    proc = subprocess.Popen([*UNSHARE, *cmd] if mode == PRIVATE else cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit + MARGIN_S)
    except subprocess.TimeoutExpired:
        _killpg(proc.pid)
        out, _ = proc.communicate()
        return Result(None, out, time.monotonic() - t0, timed_out=True, sandbox="the sandbox itself did not end")
    finally:
        _killpg(proc.pid)  # a shared-mode launch's stray ranks
    (box / "output.txt").write_text(out)  # kept with a failing probe's scratch folder, to read why
    try:
        seen = json.loads((box / "result.json").read_text())
    except (OSError, ValueError):
        return Result(proc.returncode, out, time.monotonic() - t0, sandbox=f"no result (exit {proc.returncode}): "
                      + (out.strip().splitlines() or ["no output"])[-1][:200])
    return Result(seen["code"], out, seen["seconds"], seen["timed_out"], seen["shm_left"], seen["written"],
                  seen["stray"], planted(scratch), seen["sandbox"])


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def planted(scratch: Path) -> list[str]:
    """The links a {gen:...} planted that are no longer links, or whose target no longer holds what it held."""
    bad = []
    try:
        lines = (scratch / ".planted").read_text().splitlines()
    except FileNotFoundError:
        return []
    for ln in lines:
        link, target = ln.split("\t")
        if not os.path.islink(link):
            bad.append(f"{link} is no longer a link")
        elif os.path.isfile(target) and Path(target).read_text() != PRECIOUS:
            bad.append(f"{target} changed")
        elif os.path.isdir(target) and os.listdir(target) != ["precious.txt"]:
            bad.append(f"{target} has new files: {sorted(os.listdir(target))}")
    return bad


# ----- the inner half: pid 1 of the probe's namespace (or a plain child in shared mode)
def _overlaid(scratch: Path) -> list[Path]:
    """The folders an overlay catches writes to: the checkout, and $HOME unless it holds the checkout or scratch."""
    home = Path(os.path.expanduser("~")).resolve()
    out = [ROOT]
    if home.is_dir() and home != Path("/") and not (ROOT.is_relative_to(home) or scratch.is_relative_to(home)):
        out.append(home)
    return out


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        raise OSError(f"mount {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def _mounts(scratch: Path) -> list[tuple[Path, Path]]:
    """Private /dev/shm and /tmp; each overlaid folder's writes go to an upper dir in scratch: (folder, upper)."""
    _mount("-t", "tmpfs", "tmpfs", "/dev/shm")
    uppers = []
    folders = list(_overlaid(scratch))
    for i, folder in enumerate(folders):
        up, work = scratch / ".sandbox" / f"up{i}", scratch / ".sandbox" / f"work{i}"
        up.mkdir()
        work.mkdir()
        _mount("-t", "overlay", "overlay", "-o", f"lowerdir={folder},upperdir={up},workdir={work}", str(folder))
        uppers.append((folder, up))
    # a private /tmp would hide a checkout cloned under /tmp: then /tmp stays shared (the checkout is overlaid)
    if not any(Path(f).resolve().is_relative_to("/tmp") for f in folders):
        _mount("-t", "tmpfs", "tmpfs", "/tmp")
    return uppers


def _pids() -> list[int]:
    """The live processes of this namespace other than ourselves (zombies reaped, or skipped)."""
    out = []
    for p in glob.glob("/proc/[0-9]*"):
        pid = int(p.rsplit("/", 1)[1])
        if pid == os.getpid():
            continue
        try:
            state = Path(p, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _comm(pid: int) -> str:
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} (pid {pid})"
    except OSError:
        return f"pid {pid}"


def _kill_all() -> None:
    for pid in _pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(proc: subprocess.Popen, limit: float, private: bool) -> tuple[int | None, bool]:
    """(exit code, timed out): past ``limit`` every process of the probe is killed."""
    try:
        return proc.wait(timeout=limit), False
    except subprocess.TimeoutExpired:
        _kill_all() if private else os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, True


def _settle_private() -> list[str]:
    """Wait for the run's reapers to finish; the processes still alive after SETTLE_S (then killed)."""
    end = time.monotonic() + SETTLE_S
    while time.monotonic() < end:
        _reap()
        if not _pids():
            return []
        time.sleep(0.1)
    stray = [_comm(p) for p in _pids()]
    _kill_all()
    return stray


def _run_leftovers(scratch: Path) -> list[str]:
    """Shared mode: the /dev/shm files of the runs whose sidecars are under scratch, found by their run id."""
    from kvbench.job import cleanup

    left = []
    for meta in glob.glob(str(scratch / "**" / "*.meta.json"), recursive=True):
        try:
            m = json.loads(Path(meta).read_text())
            left += cleanup.leftovers(m["run_id"], m.get("shm_segments", {}).get("mpich", []))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return left


def _files(top: Path) -> list[str]:
    return sorted(str(Path(d, f)) for d, dirs, files in os.walk(top) for f in files + [x for x in dirs
                  if os.path.islink(Path(d, x))])


def _written_private(uppers: list[tuple[Path, Path]]) -> list[str]:
    out = [f.replace(str(up), str(folder), 1) for folder, up in uppers for f in _files(up)]
    # /tmp is the probe's own only where it was mounted private (a checkout under /tmp keeps it shared)
    private_tmp = not any(Path(folder).resolve().is_relative_to("/tmp") for folder, _ in uppers)
    return out + (_files(Path("/tmp")) if private_tmp else [])


def _written_shared(since: float) -> list[str]:
    """Files of the checkout changed since ``since``, other than results/ (other jobs write there) and bytecode."""
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in (".git", "results", "__pycache__", ".venv")]
        out += [str(Path(d, f)) for f in files if os.lstat(Path(d, f)).st_mtime >= since]
    return out


def inner(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    scratch, private = Path(spec["scratch"]), spec["private"]
    res = {"code": None, "seconds": 0.0, "timed_out": False, "shm_left": [], "written": [], "stray": [], "sandbox": ""}
    try:
        uppers = _mounts(scratch) if private else []
    except OSError as exc:
        res["sandbox"] = str(exc)
        Path(spec["result"]).write_text(json.dumps(res))
        return 0
    since, t0 = time.time() - 1, time.monotonic()
    env = {**{k: v for k, v in os.environ.items() if k != "KVBENCH_FAULT"}, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONUNBUFFERED": "1", **spec["env"]}
    try:
        proc = subprocess.Popen(spec["argv"], cwd=scratch, env=env, start_new_session=not private)
    except OSError as exc:
        res["sandbox"] = f"could not start {spec['argv'][0]}: {exc}"
        Path(spec["result"]).write_text(json.dumps(res))
        return 0
    res["code"], res["timed_out"] = _wait(proc, spec["limit"], private)
    res["seconds"] = round(time.monotonic() - t0, 2)
    if private:
        res["stray"] = _settle_private()
        res["shm_left"] = sorted(os.listdir("/dev/shm"))
        res["written"] = _written_private(uppers)
    else:
        end = time.monotonic() + SETTLE_S
        while (left := _run_leftovers(scratch)) and time.monotonic() < end:
            time.sleep(0.2)
        res["shm_left"], res["written"] = [os.path.basename(p) for p in left], _written_shared(since)
    Path(spec["result"]).write_text(json.dumps(res))
    return 0
