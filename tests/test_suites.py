"""Every suite shipped in suites/ is accepted by the code shipped beside it, and runs end to end at tiny sizes.

A suite that the configuration refuses (as procurement once was: staged among its transports on host pools) fails a
buyer's `make procurement` seconds in; these tests fail first. The configuration sees each suite's full axes; the
launches shrink what costs time (prompt length, iterations, block sizes, variants, requests, and the transports to
shm, tcp and those that need a device), so every shipped suite runs in a few seconds.
"""
from __future__ import annotations

import pytest

from kvbench.cli.main import build_parser
from kvbench.config import runconfig
from kvbench.config import suite as S

SUITES = S.list_suites()
# measured here: shm and tcp, and the paths that need a GPU or an RDMA device (rows that say 'unavailable' on a
# machine without one); the others (engines with seconds of set-up, loopback, mpi) have tests of their own
RUN_HERE = ("shm", "tcp", "cuda_ipc", "verbs", "staged")
TINY = ["--tokens", "16", "-n", "2", "-w", "0", "--rounds", "1", "-b", "16", "-e", "16", "--variants", "bulk,paged",
        "--progress", "off", "--timeout", "60"]
WORKLOAD = ["--requests", "4", "--prompt", "16", "--decode-ms", "2"]  # a workload's own sizes
# a suite whose axis needs a longer prompt: fragmented:4 allocates runs of 4 blocks, so 4 blocks per request
LONGER = {"coalescing": ["--tokens", "64"]}


def test_suites_are_shipped():
    assert {"quick", "procurement", "procurement-overlap", "load"} <= set(SUITES)


@pytest.mark.parametrize("name", SUITES)
def test_the_configuration_accepts_every_shipped_suite_as_written(name):
    # the whole suite, every axis as shipped, on the 2 ranks `make bench` and `make procurement` launch
    cfg = runconfig.build(build_parser().parse_args(["run", name]), ["run", name], world=2)
    assert cfg.cases and set(c["transport"] for c in cfg.cases) == set(S.load(name).axes.transport)


def tiny_args(name: str) -> list[str]:
    suite = S.load(name)
    keep = [t for t in suite.axes.transport if t in RUN_HERE] or ["shm"]
    return [name, *TINY, "-t", ",".join(keep), *(WORKLOAD if suite.workload is not None else []),
            *LONGER.get(name, [])]


@pytest.mark.parametrize("name", SUITES)
def test_every_shipped_suite_runs_end_to_end_at_tiny_sizes(kvrun, name):
    r = kvrun(tiny_args(name), timeout=90)
    assert r.code == 0, f"{name}: exit {r.code}\n{r.out[-3000:]}\n{r.err[-3000:]}"
    df = r.table()
    ok = df[df["status"] == "ok"]
    assert len(ok), f"{name}: nothing measured\n{r.out[-3000:]}"
    skipped = df[df["status"] == "skipped"]
    assert skipped["reason"].str.startswith("unavailable: ").all(), skipped["reason"].unique()
    assert r.meta()["total_wrong"] == 0
