"""Launching kvbench (under a real mpiexec, or alone), in its own process group, and reading what it wrote."""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")  # liars.py, plugin.py, fakes/ and scripts/: what launched ranks import
BIN = os.path.dirname(sys.executable)


def mpiexec() -> str | None:
    cand = os.path.join(BIN, "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


@dataclass
class Run:
    code: int
    out: str
    err: str
    results: str | None  # the parquet file the run wrote

    def table(self) -> pd.DataFrame:
        assert self.results, f"no results file\n{self.out}\n{self.err}"
        return pd.read_parquet(self.results)

    def transfers(self) -> pd.DataFrame:
        """The transfer rows: the table without its setup rows (schema 6, iter -2)."""
        df = self.table()
        return df[df["row_kind"] != "setup"] if "row_kind" in df else df

    def meta(self) -> dict:
        assert self.results, f"no results file\n{self.out}\n{self.err}"
        with open(self.results.replace(".parquet", ".meta.json")) as fh:
            return json.load(fh)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a launch started with ``start_new_session=True``, its whole process group (a launch that is
    already gone is no error)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(cmd, timeout, env):
    """Run ``cmd`` in its own process group from the checkout; (exit code, stdout, stderr).  Past ``timeout`` the
    group is killed and the test fails; stray ranks of an aborted job are killed either way."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out}\n{err}") from None
    finally:
        kill_group(proc)  # stray ranks of an aborted job
    return proc.returncode, out, err


def leftovers_of(results: str | None) -> list[str]:
    """This run's own /dev/shm files still present, found by its run id (never by comparing /dev/shm
    before and after: another job's files would be counted as ours)."""
    from kvbench.job import cleanup

    if not results:
        return []
    with open(results.replace(".parquet", ".meta.json")) as fh:
        meta = json.load(fh)
    return cleanup.leftovers(meta["run_id"], meta.get("shm_segments", {}).get("mpich", []))


def kvbench_run(exe: str, args, res: str, n=2, timeout=120, env=None, leftovers_ok=False) -> Run:
    """``mpiexec -n N kvbench run -o RES ARGS`` (no -o with ``--resume FILE``: the Run's results are FILE); asserts
    the run left none of its /dev/shm files unless ``leftovers_ok``.  What conftest's ``kvrun`` runs."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    resume = args[args.index("--resume") + 1] if "--resume" in args else None
    # a resume continues its own file, where it is (-o with --resume is refused)
    cmd = [exe, "-n", str(n), sys.executable, "-m", "kvbench", "run", *([] if resume else ["-o", res]), *args]
    code, out, err = launch(cmd, timeout, e)
    found = sorted(glob.glob(os.path.join(res, "*", "*.parquet")) + glob.glob(os.path.join(res, "*", "*.meta.json")))
    newest = max(found, key=os.path.getmtime) if found else None
    path = resume or (newest.replace(".meta.json", ".parquet") if newest else None)
    if not leftovers_ok:
        left = leftovers_of(path)
        assert not left, f"/dev/shm files of this run left behind: {left}"
    return Run(code, out, err, path)


def kvbench_cli(*args, timeout=60):
    """Run `python -m kvbench ...` without MPI (size, list, env, report)."""
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def python_path(*more: str) -> str:
    """PYTHONPATH for a launch that imports from tests/ (liars.py, plugin.py): tests/, ``more``, then the caller's."""
    return os.pathsep.join([TESTS, *more, os.environ.get("PYTHONPATH", "")])


def liar_env(table: dict[str, str] | None = None, *, root: bool = False) -> dict[str, str]:
    """The environment of a launch whose ranks may pick any liar of ``table`` (default tests/liars.py's LIARS) as a
    transport: each registered by name, tests/ on PYTHONPATH (and the checkout with ``root``)."""
    if table is None:
        from liars import LIARS

        table = LIARS
    return {"KVBENCH_TRANSPORTS": ",".join(f"{k}={v}" for k, v in table.items()),
            "PYTHONPATH": python_path(*([ROOT] if root else []))}


@functools.cache
def unavailable(name: str) -> str | None:
    """Probe in a fresh process, once a session: some engines must load before MPI (docs/pitfalls.md#ucx-first)."""
    code = (f"from kvbench import transports; from kvbench.job import comm; comm.preload([{name!r}]); "
            f"r = transports.probe({name!r}); print('OK' if r is None else r)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-200:]])[-1]
    return None if line == "OK" else line


def table_rows(out: str) -> list[dict]:
    """The bandwidth table's rows in ``out`` (`kvbench run` or `kvbench report`), keyed by its header's names.

    Tests read a column by name: which columns show depends on the run (report/tables.py columns_for).  A
    skipped row has its leading columns and 'skipped' (the reason)."""
    head, rows = None, []
    for ln in out.splitlines():
        if ln.startswith("#transport"):
            head = ["transport", *ln.split()[1:]]
        elif head and ln.strip() and not ln.startswith("#"):
            lead, _, reason = ln.partition(" skipped: ")
            if reason:
                rows.append(dict(zip(head, lead.split())) | {"skipped": reason})
            else:
                rows.append(dict(zip(head, ln.split(), strict=True)))  # a row that does not fit its header fails
    return rows


def read_until_first_row(proc, seconds: float = 60) -> str:
    """What a launched run printed up to its first table row (MPI and the transports are up on every rank)."""
    seen, deadline = "", time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += line
        if line and not line.startswith("#"):
            break
    return seen


def launch_then(args, tmp_path, act, timeout: float = 30):
    """Launch a 2-rank run, wait for its first row, ``act(proc)`` on it; (exit code, stdout, stderr, results)."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    out = tmp_path / "results"
    proc = subprocess.Popen([exe, "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        seen = read_until_first_row(proc)
        act(proc)
        rest, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, seen + rest, err, out


def chromium() -> str | None:
    """The headless browser the page tests render with, or None (apt-get install chromium)."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(n)), None)
