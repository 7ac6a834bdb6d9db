"""Faults on real ranks: each ends the job in seconds with one line naming the rank, the case and the
cause, the sidecar's status, the finished cases kept, and none of the run's /dev/shm files left."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers.args import LONG, SHM
from helpers.asserts import assert_failed, cases_kept
from helpers.launch import ROOT, launch_then, leftovers_of, mpiexec


@pytest.mark.parametrize("rank", [0, 1])
def test_error_on_one_rank_fails_the_job(kvrun, rank):
    r = kvrun(SHM, env={"KVBENCH_FAULT": f"post:{rank}"}, timeout=60)
    assert_failed(r, "ERROR", 4, f"rank {rank} on ", "case 1 (shm push llama-3-8b 256 tokens, bulk)",
                  "TransportError: injected fault")


def test_stall_during_setup_ends_at_the_setup_deadline(kvrun):
    t0 = time.monotonic()
    r = kvrun([*SHM, "--setup-timeout", "3"], env={"KVBENCH_FAULT": "stall-setup:1"}, timeout=60)
    assert time.monotonic() - t0 < 40
    assert_failed(r, "TIMEOUT", 5, "rank 0 on ", "setup of shm (allocate and fill", "did not end within 3 s")
    assert cases_kept(r) == []


def test_stall_during_a_case_ends_at_its_timeout_and_keeps_earlier_cases(kvrun):
    r = kvrun([*SHM, "--timeout", "3"], env={"KVBENCH_FAULT": "stall-case:1:2"}, timeout=60)
    assert_failed(r, "TIMEOUT", 5, "rank 0 on ", "case 2 (shm push", "16-token blocks", "did not end within 3 s")
    assert cases_kept(r) == [1]


def test_tcp_connection_closed_mid_layer(kvrun):
    r = kvrun(["-t", "tcp", *SHM[2:]], env={"KVBENCH_FAULT": "tcp-close:0"}, timeout=60)
    line = assert_failed(r, "ERROR", 4, "case 1 (tcp push")
    assert "connection" in line, line


def test_wrong_token_is_refused_and_fails_the_job(kvrun):
    r = kvrun(["-t", "tcp", *SHM[2:]], env={"KVBENCH_FAULT": "token:1"}, timeout=60)
    assert_failed(r, "ERROR", 4, "rank 1 on ", "setup of tcp", "did not accept rank 1")
    assert "refused connection from 127.0.0.1" in r.err and "bad token" in r.err


def test_corrupted_byte_fails_with_its_own_status(kvrun):
    r = kvrun([*SHM, "--inject-corruption", "1"])
    assert r.code == 2 and "FAILED" in r.out
    assert r.meta()["status"] == "FAILED" and r.meta()["total_wrong"] == 3  # one element per checked case


def test_killed_rank_ends_the_job_keeps_cases_and_its_reaper_cleans_up(kvrun, tmp_path):
    """No code of a SIGKILLed rank runs (and the launcher SIGKILLs the others): each rank's reaper (job/reaper.py)
    removes the run's /dev/shm files and rank 0's says in the sidecar what happened; the next run's sweep
    (test_cleanup.py) remains for a reaper that could not run."""
    r = kvrun(SHM, env={"KVBENCH_FAULT": "kill:1:2"}, timeout=60)  # (kvrun: none of its /dev/shm files left)
    assert r.code != 0
    assert "Traceback" not in r.err
    meta = r.meta()
    assert meta["status"] == "INCOMPLETE"  # no rank survived to say more: the run never ended by itself
    assert "was killed from outside" in meta["reason"]
    assert cases_kept(r) == [1]
    assert [f for f in os.listdir(os.path.dirname(r.results)) if f.endswith((".tmp", ".lock"))] == []


def _launch_and_interrupt(args, tmp_path, sig):
    return launch_then(args, tmp_path, lambda proc: os.killpg(proc.pid, sig))


@pytest.mark.launches
def test_ctrl_c_is_one_line_and_keeps_finished_cases(tmp_path):
    import glob
    import json

    args = LONG
    code, out, err, res = _launch_and_interrupt(args, tmp_path, signal.SIGINT)
    lines = [ln for ln in err.splitlines() if ln.startswith("kvbench: ")]
    assert len(lines) == 1 and lines[0].startswith("kvbench: interrupted: rank "), err
    assert "SIGINT (Ctrl-C)" in lines[0]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert code == 130, (code, err)
    meta_path = glob.glob(str(res / "*" / "*.meta.json"))[0]
    meta = json.load(open(meta_path))
    assert meta["status"] == "INTERRUPTED"
    import pandas as pd

    assert 1 in set(pd.read_parquet(meta_path.replace(".meta.json", ".parquet")).case)
    assert leftovers_of(meta_path.replace(".meta.json", ".parquet")) == []


@pytest.mark.launches
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (a private /dev/shm)")
def test_quick_suite_in_a_64_mib_dev_shm_is_one_line_not_a_bus_error(tmp_path):
    exe = mpiexec()
    res = tmp_path / "results"
    script = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {exe} -n 2 {sys.executable} -m kvbench run quick "
              f"-o {res}")
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("kvbench: ")]
    assert p.returncode == 1 and len(lines) == 1, (p.returncode, p.stdout, p.stderr)
    assert "shm: pools need" in lines[0] and "/dev/shm" in lines[0] and "MiB is free" in lines[0]
    assert "--shm-size" in lines[0]
    assert "Bus error" not in p.stderr and "Traceback" not in p.stderr
    assert not res.exists() or not any(res.rglob("*.*"))


@pytest.mark.check
@pytest.mark.launches
def test_an_exit_path_that_hangs_still_ends_at_its_own_deadline():
    """The exit path itself may not hang (a stuck file system, a wedged MPI): with a cleanup that never returns, the
    process still ends at the exit path's deadline (kvbench/job/guard.py EXIT_BACKSTOP_S, 1 s here) with the
    status's exit code, its one line out first."""
    code = ("import time; from kvbench.job import guard; guard.EXIT_BACKSTOP_S = 1.0; "
            "guard.GUARD.cleanups.append(lambda: time.sleep(3600)); guard.GUARD.fail('TIMEOUT', 'a planted hang')")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the exit path hung past its deadline: nothing ended the process")
    assert p.returncode == 5, (p.returncode, p.stdout, p.stderr)  # TIMEOUT's code
    assert p.stderr.startswith("kvbench: timeout: rank 0 on ") and p.stderr.rstrip().endswith(": a planted hang")
    assert time.monotonic() - t0 < 30
