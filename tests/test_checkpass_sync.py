"""The check pass orders device work before a peer touches it: after poisoning the destination's ranges and
after writing an epoch into the source's, the device is synchronised before the transfer (a peer process or a
NIC reads and writes that memory outside this rank's streams)."""
import types

import numpy as np
import pytest

pytest.importorskip("torch")

from kvbench.harness import checkpass  # noqa: E402
from kvbench.harness.state import Measurement  # noqa: E402
from kvbench.memory import device  # noqa: E402


class _Comm:
    def isend_bytes(self, *a):
        return None

    def waitall(self, reqs):
        pass


def test_sync_follows_poison_and_every_epoch_write(monkeypatch):
    monkeypatch.setenv("KVBENCH_CHECK_ON_DEVICE", "1")  # torch-cpu pools take the device path of the check
    log = []
    for name in ("poison", "write_epoch", "snapshot"):
        real = getattr(device, name)
        monkeypatch.setattr(device, name, lambda *a, _n=name, _r=real: (log.append(_n), _r(*a))[1])
    monkeypatch.setattr(device, "sync", lambda pool: log.append("sync"))
    src, dst = device.alloc(1 << 16, "torch-cpu"), device.alloc(1 << 16, "torch-cpu")
    device.fill(src.tensor, 0)
    layers = [np.array([[0, 4096, 512], [8192, 0, 1024]], np.int64), np.array([[16384, 20000, 256]], np.int64)]
    e = types.SimpleNamespace(src=0, dst=0, layers=layers, pair=0, req=0)
    itr = types.SimpleNamespace(on_final=None, on_landed=None, dests=[], sources=[], bound_at={(0, 0): 0.0})

    def run_once(m, it):
        log.append("transfer")
        for k in range(len(layers)):
            itr.on_final([k])
            log.append("peer reads")
            for s, d, n in layers[k]:
                dst.array[d:d + n] = src.array[s:s + n]
        itr.on_landed(e, 1.0)

    m = Measurement(no=1, case={"dtype": "fp16"}, g={}, entries=[e], itr=itr)
    m.clock = {0: (None, 0.0, 0.0)}
    wrong = checkpass.check(_Comm(), 0, m, [src, dst], run_once)
    assert wrong == [0]
    first = log.index("transfer")
    assert "poison" in log[:first] and log[first - 1] == "sync"  # the poison is in memory before the transfer
    for i, what in enumerate(log):
        if what == "peer reads":
            assert log[i - 1] == "sync" and log[i - 2] == "write_epoch", log
