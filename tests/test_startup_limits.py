"""An MPI start-up that would fail for a limit (issue 45, item 5): at `ulimit -n 32` MPICH's UCX fails MPI_Init on
every rank with a UCX trace and no word of the limit; kvbench says it once, before MPI, with the limit to raise."""
from __future__ import annotations

import os
import resource
import sys

import pytest
from helpers.launch import ROOT, launch, mpiexec

from kvbench.job import comm


def test_the_limit_is_read_and_told_with_its_fix(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (32, 1 << 20))
    assert comm.open_files_short().startswith("open files limit (ulimit -n) is 32: MPI and its transports need")
    assert comm.open_files_short().endswith("(ulimit -n 4096)")
    monkeypatch.setattr(resource, "getrlimit", lambda _: (32, 32))
    assert "its hard limit is 32 too" in comm.open_files_short()
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1 << 20))
    assert comm.open_files_short() == ""


@pytest.mark.launches
def test_ulimit_n_32_is_one_line_and_exit_1(tmp_path):
    if mpiexec() is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = ["/bin/sh", "-c", f"ulimit -Sn 32 && exec {mpiexec()} -n 2 {sys.executable} -m kvbench run -t shm -n 1 "
           f"-w 0 --tokens 16 -b 16 -e 16 -o {tmp_path}"]
    rc, out, err = launch(cmd, 60, env)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert rc == 1 and lines == [ln for ln in lines if ln.startswith("kvbench: error: open files limit")], out + err
    assert len(lines) == 1 and not os.listdir(tmp_path)
