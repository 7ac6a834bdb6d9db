"""The non-MPI commands: list, env, report, help."""
import os
import secrets
import subprocess
import sys

import pytest
from helpers.launch import kvbench_cli, table_rows

from kvbench import transports


@pytest.mark.launches
def test_list_shows_every_transport_with_a_status():
    r = kvbench_cli("list")
    assert r.returncode == 0, r.stderr
    for name in transports.names():
        line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [name])
        status = line.split(None, 1)[1].strip()
        assert status == "available" or (status.startswith("unavailable: ") and len(status) > 13), line
    assert "unavailable: " in r.stdout  # cuda_ipc, verbs, staged at least
    assert "deepseek-v3" in r.stdout and "quick" in r.stdout
    assert "   8,192 tokens context" in next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["llama-3-8b"])
    # the shipped traces, with their requests and duration (kvbench trace prints the same from every line)
    assert "  mooncake-conversation   12,031 requests   3,537.0 s" in r.stdout
    assert "  mooncake-synthetic       3,993 requests" in r.stdout
    assert "# /dev/shm (shared memory" in r.stdout  # and what of kvbench's and MPICH's is there (test_cleanup.py)


@pytest.mark.launches
def test_list_sweep_removes_what_ended_runs_left():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    planted = f"/dev/shm/kvbench_t{secrets.token_hex(4)}_r0_p{dead.pid}"  # an ended run's segment (its pid is gone)
    kept = f"/dev/shm/kvbench_t{secrets.token_hex(4)}_r0_p{os.getpid()}"  # a live process's: it stays
    for path in (planted, kept):
        with open(path, "w") as fh:
            fh.write("x")
    try:
        r = kvbench_cli("list", "--sweep")
        assert r.returncode == 0, r.stderr
        assert "# swept " in r.stdout and "file(s) of ended runs from /dev/shm" in r.stdout
        assert not os.path.exists(planted) and os.path.exists(kept)
    finally:
        for path in (planted, kept):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.launches
def test_env_describes_the_machine():
    r = kvbench_cli("env")
    assert r.returncode == 0, r.stderr
    for key in ("cpu_model", "memory", "MPI", "GPUs", "RDMA devices", "NICs", "numpy"):
        assert key in r.stdout


@pytest.mark.launches
def test_run_help_teaches_the_vocabulary():
    r = kvbench_cli("run", "--help")
    assert r.returncode == 0
    for word in ("descriptor", "coalesce", "bulk%", "push", "pull", "--inflight", "--overlap", "--arrival"):
        assert word in r.stdout


def test_report_reprints_a_stored_table(kvrun):
    run = kvrun(["-t", "shm", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2", "-w", "0", "--variants", "bulk,paged"])
    assert run.code == 0, run.err
    r = kvbench_cli("report", run.results)
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout)
    assert [x["alloc"] for x in rows] == ["bulk", "random"] and all(x["#wrong"] == "0" for x in rows)
    assert table_rows(run.out) == rows  # the live table, reprinted from the result file
    # a host run without codec, scale planes or a real prefill shows none of those columns
    assert not {"mem", "copy", "codec", "scales", "prefill"} & set(rows[0])
