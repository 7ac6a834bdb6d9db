"""The bench-* scripts run end to end (tiny sizes; their numbers are checked by people, not here)."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, mpiexec


def bench(script, *args, timeout=240):
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install`")
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), "--mpirun", exe, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_fidelity_prints_kvbench_reference_and_ratio():
    r = bench("fidelity.py", "--sizes", "65536", "--repeat", "1", "-n", "3", "-w", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith(("tcp ", "mpi "))]
    assert {row[0] for row in rows} == {"tcp", "mpi"}
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)  # kvbench GB/s, reference GB/s


def test_overlap_prints_a_verdict_per_row():
    r = bench("overlap.py", "-t", "shm", "--tokens", "128", "--ratios", "2", "-n", "3", "--repeats", "2")
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1 = a row outside the tolerance; still a table
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("shm ")]
    assert len(rows) == 4 and {row[-1] for row in rows} <= {"PASS", "FAIL"}  # push/pull x serial/streaming
    for row in rows:  # exp p50 is the median of the two launches' p50s, so it lies within their range
        lo, hi = map(float, row[7].split(".."))
        assert lo <= float(row[6]) <= hi


def test_engines_prints_kvbench_beside_the_native_tool():
    r = bench("engines.py", "--engines", "nixl", "--sizes", "262144", "--repeat", "1", "-n", "3", "-w", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    if "unavailable" in out and "nixl push" not in out:
        pytest.skip("nixl unavailable here")
    assert "nixl_reference WRITE" in out and "# nixl: median ratio" in out
