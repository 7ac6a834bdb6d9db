"""Deadlines between every two steps, the sidecar when rank 0 is the stuck rank, SIGHUP, and tcp-close on a
push's receiver (issue 32, problems 2, 5, 8 and 9): each ends the job in seconds with one line, the same
status in the exit code and the sidecar, the finished cases kept and none of the run's /dev/shm files left."""
import glob
import json
import os
import signal
import time

import pandas as pd
import pytest
from helpers.args import LONG, SHM
from helpers.asserts import assert_failed, cases_kept
from helpers.launch import launch_then, leftovers_of

MARGIN_S = 20  # start-up, the exit path and a loaded machine, beyond the deadline itself


def timed(kvrun, args, fault, limit_s):
    t0 = time.monotonic()
    r = kvrun(args, env={"KVBENCH_FAULT": fault}, timeout=limit_s + MARGIN_S + 30)
    assert time.monotonic() - t0 < limit_s + MARGIN_S, r.err
    return r


@pytest.mark.timeout(90)
def test_rank_stopped_before_its_rows_reach_rank_0_ends_at_the_gap_deadline(kvrun):
    r = timed(kvrun, [*SHM, "--timeout", "3"], "stall-between-cases:1:2", 3)
    assert_failed(r, "TIMEOUT", 5, "rank 0 on ", "case 2 (shm push", "the steps between cases",
                  "did not end within 3 s")
    assert cases_kept(r) == [1]


@pytest.mark.timeout(90)
def test_rank_stopped_between_transports_ends_at_the_gap_deadline(kvrun):
    args = ["-t", "shm,tcp", *SHM[2:], "--timeout", "3"]
    r = timed(kvrun, args, "stall-between-transports:1", 3)
    assert_failed(r, "TIMEOUT", 5, "rank 0 on ", "the steps between cases", "did not end within 3 s")
    assert r.meta()["groups_done"] == ["shm"] and set(r.table().transport) == {"shm"}  # tcp's never started


@pytest.mark.timeout(90)
def test_rank_stopped_after_the_last_case_ends_at_the_gap_deadline(kvrun):
    r = timed(kvrun, [*SHM, "--timeout", "3"], "stall-after-last:1", 3)
    assert_failed(r, "TIMEOUT", 5, "rank 0 on ", "the steps between cases", "did not end within 3 s")
    assert r.meta()["groups_done"] == ["shm"] and cases_kept(r) == [1, 2, 3]


@pytest.mark.timeout(90)
def test_rank_stopped_at_the_last_barrier_ends_at_the_finish_deadline(kvrun):
    """The footer is out (every case ran) but the job did not end: the line and the sidecar say TIMEOUT."""
    r = timed(kvrun, [*SHM, "--timeout", "3"], "stall-finalize:1", 10)
    lines = [ln for ln in r.err.splitlines() if ln.startswith("kvbench: ")]
    assert r.code == 5 and len(lines) == 1, (r.code, r.err)
    assert lines[0].startswith("kvbench: timeout: rank 0 on ") and "the end of the run (last barrier" in lines[0]
    assert "did not end within 10 s" in lines[0]
    assert r.meta()["status"] == "TIMEOUT" and r.meta()["reason"] == lines[0]
    assert r.meta()["groups_done"] == ["shm"] and cases_kept(r) == [1, 2, 3]


@pytest.mark.timeout(90)
def test_rank_0_stuck_the_sidecar_says_timeout_like_the_exit_code(kvrun):
    """Rank 0 writes the sidecar; stopped, it cannot: the rank that timed out records it in its place."""
    r = timed(kvrun, [*SHM, "--timeout", "3"], "stall-case:0:2", 3 + 2 + 3)  # + rank 1's grace + its wait for an ack
    assert_failed(r, "TIMEOUT", 5, "rank 1 on ", "case 2 (shm push", "did not end within 3 s")
    assert cases_kept(r) == [1]


@pytest.mark.timeout(60)
def test_tcp_close_acts_on_a_push_receiver(kvrun):
    r = kvrun(["-t", "tcp", *SHM[2:]], env={"KVBENCH_FAULT": "tcp-close:1"}, timeout=40)
    line = assert_failed(r, "ERROR", 4, "case 1 (tcp push")
    assert "connection" in line, line


def _children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.split("/")[2]))
    return sorted(out)


@pytest.mark.launches
@pytest.mark.timeout(90)
@pytest.mark.parametrize("rank", [0, 1])
def test_sighup_to_a_rank_is_interrupted(tmp_path, rank):
    """UCX takes SIGHUP for its debug dump when MPI starts; the guard takes it back."""
    args = LONG

    def hup(proc):  # the first row is printed: MPI and UCX are up on every rank
        ranks = [r for p in _children(proc.pid) for r in _children(p)]
        assert len(ranks) == 2, ranks
        os.kill(ranks[rank], signal.SIGHUP)  # the proxy starts rank 0 first

    code, _, err, out = launch_then(args, tmp_path, hup, timeout=40)
    lines = [ln for ln in err.splitlines() if ln.startswith("kvbench: ")]
    assert code == 130, (code, err)
    assert len(lines) == 1 and lines[0].startswith("kvbench: interrupted: rank ") and "SIGHUP" in lines[0], err
    meta_path = glob.glob(str(out / "*" / "*.meta.json"))[0]
    with open(meta_path) as fh:
        meta = json.load(fh)
    assert meta["status"] == "INTERRUPTED" and meta["reason"] == lines[0]
    assert leftovers_of(meta_path.replace(".meta.json", ".parquet")) == []


@pytest.mark.launches
@pytest.mark.timeout(90)
def test_sighup_to_the_launcher_is_interrupted_said_and_cleaned_by_the_reapers(tmp_path):
    """hydra's mpiexec dies of a SIGHUP and its proxy SIGKILLs every rank's process group at once: no code of a
    rank runs.  Each rank's reaper (job/reaper.py, a session of its own) sees its rank gone after the launcher:
    rank 0's says the one line on the launcher's stderr and INTERRUPTED in the sidecar, and they remove the
    run's /dev/shm files and the result set's lock.  The launcher's own exit status is hydra's (SIGHUP: 129)."""
    args = [*SHM[:-4], "-n", "150", "-w", "1", "--variants", "bulk,paged", "--rounds", "1"]  # 3 cases
    code, out, err, res = launch_then(args, tmp_path, lambda proc: os.kill(proc.pid, signal.SIGHUP), timeout=40)
    assert code in (-signal.SIGHUP, 128 + signal.SIGHUP), (code, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("kvbench: ")]
    assert len(lines) == 1 and lines[0].startswith("kvbench: interrupted: rank 0 on "), err
    assert "the launcher (pid " in lines[0] and "ended before the run" in lines[0]
    meta_path = glob.glob(str(res / "*" / "*.meta.json"))[0]
    with open(meta_path) as fh:
        meta = json.load(fh)
    assert meta["status"] == "INTERRUPTED" and meta["reason"] == lines[0]
    parquet = meta_path.replace(".meta.json", ".parquet")
    assert leftovers_of(parquet) == []
    assert [f for f in os.listdir(os.path.dirname(parquet)) if f.endswith((".tmp", ".lock"))] == []
    assert 1 in set(pd.read_parquet(parquet).case)  # the first row was on the screen: its case is kept



def _term_all_kill_ranks(proc):
    """What a batch system's tear-down can do: SIGTERM to every process of the job, then SIGKILL to all but the
    reapers before the ranks' exit paths ran (their own cleanup never happens)."""
    from kvbench.job.launch import descendants

    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)  # nobody acts on the SIGTERM before the SIGKILL
    for pid in tree:
        os.kill(pid, signal.SIGTERM)
    for pid in tree:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            is_reaper = b"kvbench.job.reaper" in fh.read()
        os.kill(pid, signal.SIGCONT if is_reaper else signal.SIGKILL)


@pytest.mark.launches
@pytest.mark.timeout(90)
def test_a_tree_told_to_end_at_once_is_cleaned_by_the_reapers_it_held(tmp_path):
    """SIGTERM reaches each rank's reaper with its rank (a lab run's tear-down, a batch system): the reaper
    outlives its rank by design, so it ignores it and removes the run's files once its rank is gone."""
    from kvbench.job.reaper import SWEEP_S

    args = [*SHM[:-4], "-n", "150", "-w", "1", "--variants", "bulk,paged", "--rounds", "1"]
    code, out, err, res = launch_then(args, tmp_path, _term_all_kill_ranks, timeout=40)
    assert code != 0, out
    parquet = glob.glob(str(res / "*" / "*.meta.json"))[0].replace(".meta.json", ".parquet")
    end = time.monotonic() + SWEEP_S + 10  # the reapers sweep once their ranks are gone
    while leftovers_of(parquet) and time.monotonic() < end:
        time.sleep(0.2)
    assert leftovers_of(parquet) == []
