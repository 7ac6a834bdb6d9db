"""The control plane's waits leave the CPU: a rank that waits on its peer in a bcast, a gather or an allgather
(rank 0 writing the table, a peer stopped until a deadline fires) sleeps between tests of a request instead of
spinning in MPI; the barrier that starts a timed iteration still spins (its ranks leave it together)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.launch import ROOT, mpiexec

from kvbench.job import comm


@pytest.mark.launches
def test_a_waiting_rank_sleeps_in_the_control_planes_collectives_and_spins_only_in_the_timed_barrier():
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    p = subprocess.run([exe, "-n", "2", sys.executable, os.path.join(ROOT, "tests", "scripts", "idle_wait.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, start_new_session=True)
    assert p.returncode == 0, p.stdout + p.stderr
    got = {}
    for ln in p.stdout.split("\n"):
        if "cpu=" in ln:
            name, cpu, wall = ln.split()
            got[name] = (float(cpu.split("=")[1]), float(wall.split("=")[1]))
    assert set(got) == {"bcast", "gather", "allgather", "barrier_asleep", "barrier"}, p.stdout + p.stderr
    for name in ("bcast", "gather", "allgather", "barrier_asleep"):
        cpu, wall = got[name]
        assert wall > 0.5 and cpu < 0.25 * wall, (name, got)  # asleep: its CPU seconds a small part of the wait
    cpu, wall = got["barrier"]
    assert cpu > 0.25 * wall or cpu > got["bcast"][0] * 3, got  # spinning: the wait on a CPU (a loaded machine: less)


def test_a_sleeping_wait_naps_longer_as_it_goes_on_and_ends_when_its_request_completes(monkeypatch):
    naps, tests = [], []
    clock = [0.0]
    monkeypatch.setattr(comm.time, "perf_counter", lambda: clock[0])

    def nap(s):
        naps.append(s)
        clock[0] += s

    monkeypatch.setattr(comm.time, "sleep", nap)

    class Req:
        def Test(self):
            tests.append(clock[0])
            return clock[0] >= 0.5

    comm.asleep(Req())
    assert naps[0] == comm.NAP_S and max(naps) == comm.NAP_MAX_S  # from 50 us to 1 ms
    assert naps == sorted(naps)  # never shorter as the wait goes on
    assert len(tests) == len(naps) + 1 and tests[-1] >= 0.5 and tests[-2] < 0.5  # ends at its first completed test
    assert 0.5 <= clock[0] < 0.5 + comm.NAP_MAX_S + 1e-9
