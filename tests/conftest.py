"""Fixtures and hooks; what the tests share otherwise is in tests/helpers/.

Every test that launches mpiexec goes through ``kvrun`` (or a module's own launching fixture): the launcher
runs in its own process group (killed whole on timeout), and the run's own /dev/shm files must be gone after it.

The tiers (Makefile): ``make test`` runs everything; ``make check`` the tests marked ``inprocess`` (here: every
test that starts no process) and those marked ``check`` (one real launch per honesty mechanism).
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers.launch import kvbench_run, mpiexec

ROOT = Path(__file__).resolve().parent.parent
# each session (a tier of `make test` or `make check`) writes its slowest tests here, one file per marker expression
DURATIONS_DIR = Path(os.environ.get("KVBENCH_DURATIONS_DIR", ROOT / "results" / "runs" / "test-durations"))
SLOWEST = 30
_timed: list[tuple[float, str, str]] = []
_began = time.time()

# The files that take longest, first: `make test` (TEST_JOBS=2) hands whole files to its workers in collection order,
# and a long file handed out last keeps one worker busy while the other has nothing left to do
SLOW_FIRST = ("test_fault_matrix.py", "test_liar_matrix.py", "test_conformance.py", "test_benchmarks.py",
              "test_suites.py", "test_nohang_deadlines.py", "test_run.py", "test_report.py", "test_resume.py")
# Fixtures that launch processes (kvbench under mpiexec, a browser, a lab, busy loops); a fixture built on one of
# them counts too (pytest lists a test's fixtures with those they use).  A test that starts a process some other
# way (kvbench_cli, launch_then, subprocess) is marked `launches`.
LAUNCHING = {"kvrun", "launched", "matrix", "real", "lifecycle", "lab", "hogs"}


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: order.get(it.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order
    for it in items:  # in-process: `make check` runs every one of them
        if not LAUNCHING & set(getattr(it, "fixturenames", ())) and it.get_closest_marker("launches") is None:
            it.add_marker(pytest.mark.inprocess)


def pytest_runtest_logreport(report):
    _timed.append((report.duration, report.when, report.nodeid))


def pytest_sessionfinish(session, exitstatus):
    """The slowest tests of this session, with its wall time, commit and outcome, in DURATIONS_DIR/<tier>.txt
    (the controller only: xdist's workers report their tests to it)."""
    if hasattr(session.config, "workerinput") or not _timed:
        return
    tier = re.sub(r"[^a-z0-9]+", "-", session.config.option.markexpr or "all").strip("-") or "all"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "-"
    lines = [f"# pytest -m '{session.config.option.markexpr or ''}': {time.time() - _began:.0f} s wall, "
             f"{session.testscollected} collected, exit {int(exitstatus)}, commit {commit or '-'}, "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"# the {SLOWEST} slowest phases (seconds, phase, test)"]
    lines += [f"{d:8.2f} {w:8} {n}" for d, w, n in sorted(_timed, reverse=True)[:SLOWEST]]
    try:
        DURATIONS_DIR.mkdir(parents=True, exist_ok=True)
        (DURATIONS_DIR / f"{tier}.txt").write_text("\n".join(lines) + "\n")
    except OSError as exc:  # a read-only checkout still tests
        print(f"kvbench tests: durations not written to {DURATIONS_DIR}: {exc}")


@pytest.fixture
def kvrun(tmp_path):
    """kvrun(args, n=2, timeout=120, env=None, leftovers_ok=False, out_dir=None) -> Run; asserts the run left
    nothing behind.  With ``--resume FILE`` in args no -o is added, and the Run's results are FILE."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")

    def run(args, n=2, timeout=120, env=None, leftovers_ok=False, out_dir=None):
        return kvbench_run(exe, args, str(out_dir or tmp_path / "results"), n, timeout, env, leftovers_ok)

    return run


@pytest.fixture(scope="module")
def lab():
    """A 2-node, 2-rail lab at 1 Gbit/s for the test module (root), removed after it (helpers/lab.py)."""
    import secrets

    from helpers.lab import _why_not_root

    from kvbench.lab import net

    if _why_not_root():
        pytest.skip(_why_not_root())
    made = net.up(2, 2, 10**9, lab_id=f"t{os.getpid()}-{secrets.token_hex(2)}")
    try:
        yield made
    finally:
        net.down(made)
