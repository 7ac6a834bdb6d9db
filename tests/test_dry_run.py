"""`kvbench run --dry-run`: the cases and the estimate, exit 0, nothing written; and the estimate's arithmetic."""
from __future__ import annotations

import os
import re
import types

from helpers.launch import kvbench_cli

from kvbench.config import suite as S
from kvbench.results import estimate as E

SAID = re.compile(r"^# (\d+) cases, (\d+) measurements, about ([\d.]+) (s|min|h) here \((\d+) s;", re.M)


def said(out: str) -> tuple[int, int, float]:
    """(cases, measurements, seconds) from a dry run's last line."""
    m = SAID.search(out)
    assert m, out
    return int(m[1]), int(m[2]), float(m[5])


def files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def test_dry_run_under_mpiexec_writes_nothing(kvrun, tmp_path):
    out = tmp_path / "results"
    r = kvrun(["quick", "--dry-run", "-n", "2", "-w", "0"], out_dir=out)
    assert r.code == 0, r.err
    cases, meas, seconds = said(r.out)
    assert cases == len(S.expand(S.load("quick"))) == 18
    assert meas > 0 and seconds > 0
    assert r.out.count("# dry run:") == 1  # rank 0 alone prints
    assert not os.path.exists(out) or files_under(out) == []
    assert r.results is None


def test_dry_run_without_mpiexec_lists_each_case(tmp_path):
    r = kvbench_cli("run", "-t", "shm,tcp", "--op", "push,pull", "--tokens", "64", "-b", "16", "-e", "32",
                    "--dry-run", "-o", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    cases, _, seconds = said(r.stdout)
    assert cases == 2 * 2 * 2
    assert seconds > 0
    assert len(re.findall(r"^\s+\d+\s+(shm|tcp)\s", r.stdout, re.M)) == 8
    assert not (tmp_path / "r").exists()


def test_dry_run_many_cases_counts_per_transport():
    r = kvbench_cli("run", "procurement", "--dry-run")
    assert r.returncode == 0, r.stderr
    suite = S.load("procurement")
    cases, _, _ = said(r.stdout)
    assert cases == len(S.expand(suite))
    for name in suite.axes.transport:
        assert re.search(rf"^\s+{re.escape(name)}\s+\d+ cases$", r.stdout, re.M), name


def test_dry_run_refuses_a_mistake_in_one_line():
    r = kvbench_cli("run", "-t", "nosuch", "--dry-run")
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("kvbench: error:")


def test_estimate_sums_transfers_and_fixed_costs():
    suite = types.SimpleNamespace(iters=10, warmup=2, check=True, target_ci=None, ci_budget=0, variants=["paged"],
                                  pool_factor=2.0, workload=None)
    case = dict(transport="x", op="push", model="llama-3-8b", tokens=1024, prefix_hit=0, dtype="fp16", memory="host",
                prefill_ms=0.0)
    nbytes = E.request_bytes(case, {})
    e = E.estimate(suite, [case], rates={"x": (1.0, "test")}, available=lambda n: True)
    xfer = nbytes / 1e9
    want = (E.START_S + E.SETUP_S + 2 * 2.0 * nbytes / (E.FILL_GBPS * 1e9) + E.MEASURE_S
            + 13 * (xfer + E.ITER_S) + nbytes / (E.VERIFY_GBPS * 1e9))
    assert abs(e.seconds - want) < 1e-6
    assert e.measurements == 1
    gone = E.estimate(suite, [case], rates={}, available=lambda n: False)
    assert gone.measurements == 0 and gone.skipped == ["x"] and gone.seconds == E.START_S


def test_duration_words():
    assert E.duration(40) == "about 40 s"
    assert E.duration(600) == "about 10 min"
    assert E.duration(7200) == "about 2.0 h"
