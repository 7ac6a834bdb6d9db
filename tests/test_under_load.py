"""Verdicts that hold under load (issue: no lie reads OK, item 6): beside two CPU-bound processes on this
machine, honest shm and tcp runs end OK, never SUSPECT (each timed iteration is judged against the harness's
copy made beside it, so the load moves a row and its bound alike), while a lie about the bytes is still caught:
its verdict rests on content, not on time."""
import subprocess
import sys

import pytest
from helpers.args import UNDER_LOAD
from helpers.launch import liar_env

ENV = liar_env()


@pytest.fixture
def hogs():
    """Two busy loops, one per CPU of these machines, for as long as the test runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


@pytest.mark.alone  # it brings its own load: another test's beside it would be a third
def test_honest_runs_beside_two_busy_loops_end_ok(kvrun, hogs):
    r = kvrun(["-t", "shm,tcp", "-n", "8"], timeout=400)
    assert r.code == 0 and "SUSPECT" not in r.out, r.out + r.err
    assert r.out.rstrip().splitlines()[-2].endswith("OK"), r.out
    assert all(p.poll() is None for p in hogs)  # the load was there throughout


@pytest.mark.alone
def test_a_skipped_iteration_is_caught_beside_two_busy_loops(kvrun, hogs):
    r = kvrun(UNDER_LOAD["skip"], env=ENV, timeout=400)
    assert r.code == 2 and "FAILED" in r.out, r.out + r.err
    assert all(p.poll() is None for p in hogs)


@pytest.mark.alone
def test_a_compressing_path_is_caught_beside_two_busy_loops(kvrun, hogs):
    """Its verdict rests on the kernel's byte count of its sockets, not on time: load does not hide it."""
    r = kvrun(UNDER_LOAD["compress"], env=ENV, timeout=400)
    assert r.code == 6 and "fewer bytes than it claims to move" in r.out, r.out + r.err
    assert all(p.poll() is None for p in hogs)


@pytest.mark.alone
def test_a_forger_is_caught_beside_two_busy_loops(kvrun, hogs):
    """Its verdict rests on content (keyed: the rest of a range cannot be written without carrying it)."""
    r = kvrun(UNDER_LOAD["forge"], env=ENV, timeout=400)
    assert r.code == 2 and "FAILED" in r.out, r.out + r.err
    wrong = r.table().query("role != 'prefill'").groupby("transport")["nwrong"].sum()
    assert (wrong > 0).all() and len(wrong) == 2, wrong
    assert all(p.poll() is None for p in hogs)
