"""Preflight counts a cuda pool against its GPU's free memory (summed over the ranks sharing that GPU) and host
pools against host RAM: a device pool larger than the host's RAM is not refused for RAM it never uses."""

from kvbench.harness import preflight
from kvbench.memory import device

GiB = 2**30


class _Comm:
    rank, hostname = 0, "h"

    def __init__(self, ranks=1):
        self.ranks = ranks

    def allgather(self, x):
        return [x] * self.ranks


WHERE = {"host": "h", "gpu": 0, "gpu_bus": "0000:1b:00.0"}


def test_cuda_pools_count_against_the_gpu_not_host_ram(monkeypatch):
    monkeypatch.setattr(preflight.memory, "available_bytes", lambda: 8 * GiB)
    monkeypatch.setattr(device, "free_bytes", lambda kind, dev=0: (100 * GiB, 141 * GiB))
    assert preflight.check(_Comm(), [("staged", 40 * GiB, GiB // 8, "cuda")], {}, where=WHERE) is None
    why = preflight.check(_Comm(), [("staged", 40 * GiB, GiB // 8, "torch-cpu")], {}, where=WHERE)
    assert why.startswith("staged: pools need") and "on host h" in why  # host pools: host RAM


def test_cuda_pools_beyond_the_gpus_free_memory_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(preflight.memory, "available_bytes", lambda: 512 * GiB)
    monkeypatch.setattr(device, "free_bytes", lambda kind, dev=0: (60 * GiB, 141 * GiB))
    assert preflight.check(_Comm(1), [("cuda_ipc", 30 * GiB, GiB // 8, "cuda")], {}, where=WHERE) is None
    why = preflight.check(_Comm(2), [("cuda_ipc", 30 * GiB, GiB // 8, "cuda")], {}, where=WHERE)  # 2 ranks, 1 GPU
    assert why and "GPU h:0000:1b:00.0 (2 ranks)" in why and "60.00 GiB free" in why and "\n" not in why


def test_host_runs_never_ask_the_gpu(monkeypatch):
    monkeypatch.setattr(device, "free_bytes", lambda *a: (_ for _ in ()).throw(AssertionError("asked")))
    monkeypatch.setattr(preflight.memory, "available_bytes", lambda: 512 * GiB)
    assert preflight.check(_Comm(), [("shm", GiB, GiB // 8)], {}, where=None) is None
