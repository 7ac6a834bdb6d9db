"""Shared fixtures: run kvbench under a real mpiexec, with a timeout and cleanup.

Every test that launches mpiexec goes through ``mpirun``: the launcher runs in
its own process group (killed whole on timeout), and /dev/shm is compared
before and after so that no test leaves segments behind.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def mpiexec() -> str | None:
    cand = os.path.join(BIN, "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/*"))


def in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` that a live process still maps (another job's, not left behind)."""
    used = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as fh:
                text = fh.read()
        except OSError:
            continue
        used.update(p for p in paths if p in text)
    return used


@dataclass
class Run:
    code: int
    out: str
    err: str
    results: str | None  # the parquet file the run wrote

    def table(self) -> pd.DataFrame:
        assert self.results, f"no results file\n{self.out}\n{self.err}"
        return pd.read_parquet(self.results)

    def meta(self) -> dict:
        assert self.results, f"no results file\n{self.out}\n{self.err}"
        with open(self.results.replace(".parquet", ".meta.json")) as fh:
            return json.load(fh)


def _launch(cmd, timeout, env):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out}\n{err}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stray ranks of an aborted job
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


@pytest.fixture
def kvrun(tmp_path):
    """kvrun(args, n=2, timeout=120, allow_leftovers=False) -> Run."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    before = shm_files()

    def run(args, n=2, timeout=120, aborts=False, env=None):
        e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [exe, "-n", str(n), sys.executable, "-m", "kvbench", "run", "-o", str(tmp_path / "results"), *args]
        code, out, err = _launch(cmd, timeout, e)
        new = shm_files() - before
        if aborts:  # a deliberate abort: MPICH leaves its segments (PLATFORM pitfall 8); ours must be gone
            for f in new:
                if os.path.basename(f).startswith("mpich_shm_"):
                    os.unlink(f)
            new = shm_files() - before
        new -= in_use(new)
        assert not new, f"/dev/shm files left behind: {sorted(new)}"
        found = sorted(glob.glob(str(tmp_path / "results" / "*" / "*.parquet")))
        return Run(code, out, err, found[-1] if found else None)

    return run


def kvbench_cli(*args, timeout=60):
    """Run `python -m kvbench ...` without MPI (size, list, env, report)."""
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)
