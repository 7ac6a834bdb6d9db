"""Three exits the contract names (issue 46 item 7): an input error is exit 1 and one line, before any file is
written -- a results folder no one can make, a result file that is not there, a run whose transports need a peer
launched as one rank."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbench.cli.main import build_parser
from kvbench.config import ConfigError, runconfig


def kvbench(*argv: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "MPI_Abort" not in r.stdout + r.stderr
    return lines[0]


@pytest.mark.launches
@pytest.mark.parametrize("out, made", [("/proc/kvb", "/proc/kvb"), ("/sys/kvb/x", "/sys/kvb")])
def test_a_results_folder_no_one_can_make_is_an_input_error(tmp_path, out, made):
    """Root passes every permission check, yet /proc and /sys take no new name: refused at the door, exit 1 (it
    was 4, an MPI_Abort line from rank 0 opening its files)."""
    line = one_line(kvbench("run", "-o", out, "-t", "loopback", cwd=tmp_path))
    assert f"-o '{out}': cannot make '{made}' there: " in line, line
    assert not os.path.exists(made)


@pytest.mark.launches
def test_a_result_file_that_is_not_there_is_named_with_the_reason(tmp_path):
    for argv in (["report", "nothere.parquet"], ["report", "-o", str(tmp_path / "page"), "nothere.parquet"]):
        assert one_line(kvbench(*argv, cwd=tmp_path)) == "kvbench: error: nothere.parquet: no such result file"
    assert not (tmp_path / "page").exists()


@pytest.mark.launches
def test_one_rank_with_transports_that_need_a_peer_is_an_input_error_and_writes_nothing(tmp_path):
    line = one_line(kvbench("run", "-o", str(tmp_path / "results"), "-t", "shm,tcp", cwd=tmp_path))
    assert "shm, tcp: one rank launched" in line and "mpirun -np 2 kvbench run" in line, line
    assert not (tmp_path / "results").exists()  # it wrote a result file and exited 3 before


@pytest.mark.parametrize("transports, refused", [("shm", True), ("tcp,mpi", True), ("loopback,shm", False),
                                                 ("loopback", False)])
def test_one_rank_runs_when_one_transport_runs_in_one_process(transports, refused):
    argv = ["run", "-t", transports]
    a = build_parser().parse_args(argv)
    if refused:
        with pytest.raises(ConfigError, match="one rank launched"):
            runconfig.build(a, argv, world=1)
    else:
        assert runconfig.build(a, argv, world=1).cases
    assert runconfig.build(a, argv, world=2).cases  # two ranks: every one runs
