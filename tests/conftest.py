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


# The files that take longest, first: `make test TEST_JOBS=2` hands whole files to its workers in collection order,
# and a long file handed out last keeps one worker busy while the other has nothing left to do
SLOW_FIRST = ("test_fault_matrix.py", "test_liar_matrix.py", "test_conformance.py", "test_benchmarks.py",
              "test_suites.py", "test_nohang_deadlines.py", "test_run.py", "test_report.py", "test_resume.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: order.get(it.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


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


def _launch(cmd, timeout, env):
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


@pytest.fixture
def kvrun(tmp_path):
    """kvrun(args, n=2, timeout=120, env=None, leftovers_ok=False) -> Run; asserts the run left nothing behind.
    With ``--resume FILE`` in args no -o is added, and the Run's results are FILE."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")

    def run(args, n=2, timeout=120, env=None, leftovers_ok=False, out_dir=None):
        e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        res = str(out_dir or tmp_path / "results")
        resume = args[args.index("--resume") + 1] if "--resume" in args else None
        # a resume continues its own file, where it is (-o with --resume is refused)
        cmd = [exe, "-n", str(n), sys.executable, "-m", "kvbench", "run", *([] if resume else ["-o", res]), *args]
        code, out, err = _launch(cmd, timeout, e)
        found = sorted(glob.glob(os.path.join(res, "*", "*.parquet")) + glob.glob(os.path.join(res, "*", "*.meta.json")))
        newest = max(found, key=os.path.getmtime) if found else None
        path = resume or (newest.replace(".meta.json", ".parquet") if newest else None)
        if not leftovers_ok:
            left = leftovers_of(path)
            assert not left, f"/dev/shm files of this run left behind: {left}"
        return Run(code, out, err, path)

    return run


def kvbench_cli(*args, timeout=60):
    """Run `python -m kvbench ...` without MPI (size, list, env, report)."""
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


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


def device_matches_host(a, t, descs, src_rank: int, epoch: int, writer: int | None = None) -> None:
    """The check's two steps on one pool's bytes twice over, a host array (memory/verify.py) and a torch CPU
    tensor (memory/device.py): the destination ranges poisoned, then ``epoch`` written at the source ranges by
    ``writer`` (default ``src_rank``); after each step both hold the same bytes."""
    import numpy as np

    from kvbench.memory import device, verify

    for host_step, device_step, rank in ((verify.poison, device.poison, src_rank),
                                         (verify.write_epoch, device.write_epoch, src_rank if writer is None else writer)):
        host_step(a, descs, rank, epoch)
        device_step(t, descs, rank, epoch)
        assert np.array_equal(a, t.numpy())
