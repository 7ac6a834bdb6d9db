"""memory 'auto' (the procurement suites' axis): device pools for the transports that move device memory where a
GPU is, host memory for the rest, and a preamble line that says which, or that there is no GPU here."""
from __future__ import annotations

import pytest

from kvbench.config import memauto as A
from kvbench.config import suite as S

AXES = {"transport": ["shm", "tcp", "cuda_ipc", "staged", "verbs"], "memory": ["auto"], "op": ["push"],
        "tokens": [16], "block_size": [16]}


@pytest.fixture(params=[True, False], ids=["gpu", "no-gpu"])
def gpu(request, monkeypatch):
    monkeypatch.setattr(A, "_gpu_here", lambda: request.param)
    return request.param


def test_auto_gives_device_pools_only_to_device_paths_and_only_with_a_gpu(gpu):
    suite = S.validate({"name": "x", "axes": AXES})
    cases = S.expand(suite)
    got = {c["transport"]: c["memory"] for c in cases}
    assert got == {"shm": "host", "tcp": "host", **{t: "cuda" if gpu else "host" for t in A.DEVICE_PATHS}}
    line, = A.memory_lines(suite, cases)
    if gpu:
        assert line == "# memory auto: device pools (cuda) for cuda_ipc, staged, verbs; host memory for the rest"
    else:
        assert line.startswith("# memory auto: no GPU: host memory only (cuda_ipc, staged, verbs move device")
    assert A.memory_lines(S.validate({"name": "x", "axes": dict(AXES, memory=["host"])}), cases) == []


def test_the_device_paths_are_the_transports_whose_pools_can_be_device_memory():
    from kvbench import transports

    cuda = {n for n in ("cuda_ipc", "staged", "verbs", "shm", "tcp", "mpi", "loopback")
            if "cuda" in transports.load(n).caps.memory}
    assert cuda == set(A.DEVICE_PATHS)


@pytest.mark.parametrize("name", ["procurement", "procurement-overlap"])
def test_the_buyers_suites_run_device_pools_where_a_gpu_is(name):
    assert S.load(name).axes.memory == ["auto"]
