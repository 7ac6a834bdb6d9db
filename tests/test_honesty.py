"""The harness against transports that lie (tests/liars.py), on 2 real ranks: every lie is caught,
deterministically, as wrong elements or as a completion time that cannot be."""
import os

import pytest
from helpers.args import LIAR_SMALL
from helpers.asserts import assert_failed
from helpers.launch import ROOT, liar_env, mpiexec

pytestmark = pytest.mark.alone  # honest stamps within the wake-up bound measured beside them

ENV = liar_env()


@pytest.mark.parametrize("liar,op", [("lie-nothing", "push"), ("lie-nothing", "pull"), ("lie-wrong-block", "push"),
                                     ("lie-wrong-block", "pull"), ("lie-early", "push"), ("lie-read-early", "pull")])
def test_a_lie_about_the_bytes_is_wrong_elements(kvrun, liar, op):
    r = kvrun(["-t", liar, "--op", op, *LIAR_SMALL], env=ENV)
    assert r.code == 2, r.out + r.err
    assert r.meta()["status"] == "FAILED"
    checks = r.table().query("iter == -1 and role == 'decode'")
    assert len(checks) == 2 and (checks.nwrong > 0).all()  # bulk and paged, each caught


@pytest.mark.check
def test_the_same_transport_honest_passes(kvrun):
    r = kvrun(["-t", "shm", "--op", "push,pull", *LIAR_SMALL])
    assert r.code == 0 and r.meta()["status"] == "OK", r.out + r.err  # within its bounds too: not SUSPECT
    dec = r.table().query("iter >= 0 and role == 'decode'")
    assert set(dec.bound_kind) == {"memory copy"} and (dec.bound_gbps > 0).all()  # one host: the harness's copy


@pytest.mark.check
def test_a_lie_about_the_time_is_caught_by_the_clock(kvrun):
    r = kvrun(["-t", "lie-stamp", "--op", "push", *LIAR_SMALL], env=ENV, timeout=90)
    assert_failed(r, "ERROR", 4, "rank 1 on ", "case 1 (lie-stamp push",
                  "before the source posted the last layer", "is not when the bytes landed")


@pytest.mark.check
def test_honest_tcp_passes_the_clock_check(kvrun):
    r = kvrun(["-t", "tcp", "--op", "push,pull", *LIAR_SMALL])
    assert r.code == 0, r.out + r.err
    t = r.table().query("iter >= 0")
    assert set(t.completion) == {"transport"}  # tcp's receive thread stamps the landing
    dec = t[t.role == "decode"]
    assert dec.skew_s.notna().all() and (dec.clock_err_s >= 0).all()
    assert r.meta()["status"] == "OK" and (dec.wake_bound_s > 0).all()  # its stamps within the wake-up bound
    assert dec.stamp_lead_s.notna().all() and set(dec.bound_kind) == {"memory copy"}  # loopback: no link rate


@pytest.mark.launches
def test_mpi_sendrecv_pull_sends_only_when_asked():
    """A pull is the destination asking: the source's serve sends nothing until the request arrives."""
    import subprocess
    import sys

    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    p = subprocess.run([exe, "-n", "2", sys.executable, os.path.join(ROOT, "tests", "scripts", "pull_asks.py")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sent_early=False landed=True" in p.stdout


@pytest.mark.parametrize("elem", [1, 2, 4])
def test_poison_never_equals_what_must_land(elem):
    """The complement poison: every element of a poisoned range is wrong, for every element size
    (a fixed poison byte equals the pattern for about 1 in 256 one-byte elements)."""
    import numpy as np

    from kvbench.memory import verify

    pool = np.zeros(1 << 20, np.uint8)
    descs = np.array([[0, 0, 1 << 18], [5000, 1 << 19, 65536]], np.int64)
    for epoch in (0, 7):
        verify.poison(pool, descs, 3, epoch)
        copy, where = verify.snapshot(pool, [descs])
        assert verify.count_wrong(copy, where, 3, elem, epoch) == ((1 << 18) + 65536) // elem


def test_the_pair_time_is_the_later_of_its_two_ranks():
    """A transfer is done when the destination knows, never when the sender returns: the max over the pair."""
    import pandas as pd

    from kvbench.results.store import pair_times

    rows = pd.DataFrame({"case": [1, 1, 1, 1], "pair": [0, 0, 0, 0], "req": [0] * 4, "iter": [0, 0, 1, 1],
                         "rank": [0, 1, 0, 1], "status": ["ok"] * 4, "seconds": [0.001, 0.004, 0.006, 0.002]})
    assert pair_times(rows).tolist() == [0.004, 0.006]
