"""-c all: every timed iteration verified outside its timed window, with guard zones around the ranges; the
vectorised check against the per-range reference it replaced; the check levels' bad input."""

import numpy as np
import pytest
from helpers.args import TEN
from helpers.launch import ROOT, liar_env

from kvbench.memory import verify

ENV = liar_env()


@pytest.mark.check
def test_a_transport_skipping_one_timed_iteration_in_ten_fails_under_c_all_and_passes_under_c_1(kvrun):
    r = kvrun([*TEN, "-c", "all"], env=ENV, timeout=120)
    assert r.code == 2 and r.meta()["status"] == "FAILED", r.out + r.err
    (line,) = [ln for ln in r.out.splitlines() if ln.startswith("# FAILED case")]
    assert "case 1 (lie-skip push llama-3-8b 64 tokens" in line and line.endswith("in iteration 1"), line
    t = r.transfers().query("role == 'decode'")
    wrong = t.set_index("iter")["nwrong"]
    assert wrong[1] > 0 and (wrong.drop(1) == 0).all()  # every timed row carries its own count; the check pass too
    assert "verifying, outside the timed windows" in r.out
    # -c 1 checks one more transfer after timing, which this transport makes: OK, as the README says
    r = kvrun([*TEN, "-c", "1"], env=ENV, timeout=120)
    assert r.code == 0 and r.meta()["status"] == "OK", r.out + r.err
    assert r.table().query("iter >= 0").nwrong.isna().all()


@pytest.mark.launches
@pytest.mark.parametrize("value", ["2", "some"])
def test_a_check_level_that_is_not_0_1_or_all_is_one_line_and_exit_1(value):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "-t", "shm", "-c", value], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 1 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.splitlines() == [f"kvbench: error: argument -c/--check: invalid choice: '{value}' "
                                     "(choose from 0, 1, all)"]


def test_check_every_is_all_and_suites_say_it_too():
    from kvbench.cli.main import build_parser
    from kvbench.config import suite as S

    assert build_parser().parse_args(["run", "--check", "every"]).check == "all"
    assert [S.check_level(v) for v in (0, 1, True, "all", "every", "0")] == [False, True, True, "all", "all", False]
    assert S.validate({"check": "all"}, "x").check == "all"
    with pytest.raises(S.SuiteError, match="check"):
        S.validate({"check": 2}, "x")


def _reference(rank, descs, epoch):
    return np.concatenate([verify.expected(rank, s, n, epoch) for s, _, n in descs.tolist()])


def test_the_vectorised_check_computes_what_the_per_range_reference_did():
    rng = np.random.default_rng(7)
    for aligned in (False, True):
        for _ in range(10):
            k = int(rng.integers(1, 40))
            s, n = rng.integers(0, 1 << 20, k), rng.integers(1, 3000, k)
            if aligned:
                s, n = s // 4 * 4, n // 4 * 4 + 4
            descs = np.stack([s, s, n], 1).astype(np.int64)
            assert np.array_equal(verify.expected_ranges(3, descs, 9), _reference(3, descs, 9))
            x = verify.Expected(3, descs)
            assert np.array_equal(x.at(9), _reference(3, descs, 9))


def test_the_check_counts_across_steps_of_many_ranges(monkeypatch):
    monkeypatch.setattr(verify, "_CHUNK", 10000)  # several vectorised steps, one range larger than a step
    pool = np.zeros(1 << 20, np.uint8)
    descs = np.array([[0, 0, 4096], [8192, 8192, 30000], [40000, 40000, 6], [50000, 50000, 4096]], np.int64)
    verify.write_epoch(pool, descs, 2, 5)
    copy, where = verify.snapshot(pool, [descs])
    assert np.array_equal(copy, _reference(2, descs, 5)) and verify.count_wrong(copy, where, 2, 2, 5) == 0
    copy[4096 + 30000 + 1] ^= 1  # a byte of the 6-byte range (whole elements of 2 bytes)
    copy[3] ^= 1
    assert verify.count_wrong(copy, where, 2, 2, 5) == 2
    verify.poison(pool, descs, 2, 5)
    copy, where = verify.snapshot(pool, [descs])
    assert verify.count_wrong(copy, where, 2, 4, 5) == 1024 + 7500 + 6 + 1024  # 6 B is not whole 4-byte elements


def test_guard_zones_are_the_bytes_around_the_ranges_and_never_a_range():
    ranges = np.array([[100, 50], [120, 100], [5000, 10], [9000, 1000], [10000, 0]], np.int64)
    g = verify.guard_zones(ranges, 20000, 64)
    assert g[:, 0].tolist() == g[:, 1].tolist()
    assert [(int(a), int(a + n)) for a, _, n in g] == [(0, 100), (220, 284), (4936, 5000), (5010, 5074),
                                                        (8936, 9000), (10000, 10064), (19936, 20000)]
    covered = np.zeros(20000, bool)
    for a, n in ranges.tolist():
        covered[a:a + n] = True
    assert not any(covered[a:a + n].any() for a, _, n in g.tolist())


@pytest.mark.parametrize("memory", ["host", "torch-cpu"])
def test_an_iteration_that_moved_nothing_is_wrong_in_every_element(monkeypatch, memory):
    """Each timed iteration starts from poison (the complement of what must land, checkpass.Every.before): one whose
    transfer moved nothing is wrong in every element, though its ranges still hold the previous iteration's bytes
    (one-byte elements: without the poison about 1 in 256 of them would read right)."""
    import types

    from kvbench.harness import checkpass
    from kvbench.harness.state import Measurement
    from kvbench.memory import device
    from kvbench.model.layout import Pool

    if memory == "torch-cpu":
        pytest.importorskip("torch")
        monkeypatch.setenv("KVBENCH_CHECK_ON_DEVICE", "1")  # torch-cpu pools take the device path of the check
        src, dst = device.alloc(1 << 16, memory), device.alloc(1 << 16, memory)
    else:
        src, dst = Pool(np.zeros(1 << 16, np.uint8)), Pool(np.zeros(1 << 16, np.uint8))
    layers = [np.array([[0, 4096, 8192], [16384, 32768, 8192]], np.int64), np.array([[40960, 20480, 4096]], np.int64)]
    e = types.SimpleNamespace(src=0, dst=0, layers=layers, pair=0, req=0)
    m = Measurement(no=1, case={"dtype": "fp8-e4m3"}, g={}, entries=[e], itr=None)
    every = checkpass.Every(0, m, [src, dst], 1 << 16)
    for it, moves in ((0, True), (1, False)):
        every.before(it)
        if moves:
            for s, d, n in np.concatenate(layers).tolist():
                dst.array[d:d + n] = src.array[s:s + n]
        every.landed()
        every.count()
    assert every.wrong == [[0], [8192 + 8192 + 4096]]
