"""Every suite shipped in suites/ is accepted by the code shipped beside it, and runs end to end at tiny sizes.

A suite that the configuration refuses (as procurement once was: staged among its transports on host pools) fails a
buyer's `make procurement` seconds in; these tests fail first. The configuration sees each suite's full axes; the
launches shrink what costs time (prompt length, iterations, the confidence budget, block sizes, variants, requests,
one model, and the transports to shm, tcp and those that need a device), so every shipped suite runs in seconds.
"""
from __future__ import annotations

import pytest

from kvbench.cli.main import build_parser
from kvbench.config import runconfig
from kvbench.config import suite as S

# every suite's honest rows must stay OK: a neighbour's load can delay a wake-up past the bound measured beside it
pytestmark = pytest.mark.alone

SUITES = S.list_suites()
# measured here: shm and tcp, and the paths that need a GPU or an RDMA device (rows that say 'unavailable' on a
# machine without one); the others (engines with seconds of set-up, loopback, mpi) have tests of their own
RUN_HERE = ("shm", "tcp", "cuda_ipc", "verbs", "staged")
TINY = ["--tokens", "16", "-n", "2", "-w", "0", "--rounds", "1", "-b", "16", "-e", "16", "--variants", "bulk,paged",
        "--progress", "off", "--timeout", "60"]
CI_BUDGET = ["--ci-budget", "0.2"]  # a suite's --target-ci still adapts each case, for a fifth of a second, not seconds
WORKLOAD = ["--requests", "4", "--prompt", "16", "--decode-ms", "2"]  # a workload's own sizes
# a suite whose axis needs a longer prompt: fragmented:4 allocates runs of 4 blocks, so 4 blocks per request
LONGER = {"coalescing": ["--tokens", "64"], "lifecycle": ["--pool-sizes", "1MiB,2MiB"],  # (lifecycle: its pools)
          "formats": ["--variants", "paged"]}  # formats x codecs: 50 cases with bulk, each format's paged row is its path


def ranks(name: str) -> int:
    """The ranks a suite runs on: 2 (`make bench`), or its largest P:D pair's P + D (layouts: 2:2, 4 ranks)."""
    pairs = [str(t).split(":") for t in S.load(name).axes.tp if ":" in str(t)]
    return max([2] + [int(p) + int(d) for p, d in pairs])


def test_suites_are_shipped():
    assert {"quick", "procurement", "procurement-overlap", "load"} <= set(SUITES)


@pytest.mark.parametrize("name", SUITES)
def test_the_configuration_accepts_every_shipped_suite_as_written(name):
    # the whole suite, every axis as shipped, on the 2 ranks `make bench` and `make procurement` launch (or its pairs')
    cfg = runconfig.build(build_parser().parse_args(["run", name]), ["run", name], world=ranks(name))
    assert cfg.cases and set(c["transport"] for c in cfg.cases) == set(S.load(name).axes.transport)


def tiny_args(name: str) -> list[str]:
    suite = S.load(name)
    keep = [t for t in suite.axes.transport if t in RUN_HERE] or ["shm"]
    # one model of several (the configuration test above takes every one): the harness runs each shape alike
    return [name, *TINY, "-t", ",".join(keep), "-m", suite.axes.model[0],
            *(WORKLOAD if suite.workload is not None else []), *(CI_BUDGET if suite.target_ci else []),
            *LONGER.get(name, [])]


@pytest.mark.parametrize("name", SUITES)
def test_every_shipped_suite_runs_end_to_end_at_tiny_sizes(kvrun, name):
    r = kvrun(tiny_args(name), n=ranks(name), timeout=90)
    assert r.code == 0, f"{name}: exit {r.code}\n{r.out[-3000:]}\n{r.err[-3000:]}"
    df = r.table()
    ok = df[df["status"] == "ok"]
    assert len(ok), f"{name}: nothing measured\n{r.out[-3000:]}"
    skipped = df[df["status"] == "skipped"]
    assert skipped["reason"].str.startswith("unavailable: ").all(), skipped["reason"].unique()
    assert r.meta()["total_wrong"] == 0


def test_each_skipped_case_restarts_the_deadline_between_cases(monkeypatch):
    # make procurement on a busy 2-core machine: the unavailable transports' 36 skipped cases each, emitted one
    # after another with no case armed, once added up to one "step between cases" past --timeout (TIMEOUT)
    import time

    from kvbench import transports
    from kvbench.harness.loop import Harness
    from kvbench.job.guard import GUARD

    class Comm:
        size, rank = 2, 0

        def allgather(self, x):
            return [x, x]

    seen = []
    h = Harness.__new__(Harness)
    h.comm = Comm()
    h.emit_skipped = lambda case, reason: (time.sleep(0.01), seen.append(GUARD._deadline))
    monkeypatch.setattr(transports, "probe", lambda name: "no such device here")
    monkeypatch.setattr(GUARD, "_gap", None)
    monkeypatch.setattr(GUARD, "_deadline", None)
    GUARD.between("the steps between cases (--timeout)", 3600)  # the watchdog thread is not running in this test
    try:
        h.run_transport("verbs", [{"op": "push"}] * 4, [(0, 1)])
    finally:
        GUARD.between(None)
    assert len(seen) == 4 and seen == sorted(seen) and len(set(seen)) == 4  # restarted after each skipped case
