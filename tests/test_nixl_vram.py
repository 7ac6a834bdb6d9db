"""nixl registers a CUDA pool as VRAM with the GPU's ordinal, read from a real ``torch.device("cuda", 0)`` (it
constructs without a GPU) against a stand-in for ``nixl._api`` with register_memory's real argument shapes."""
import os
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fakes import cuda_driver  # noqa: E402

from kvbench.memory.device import DevicePool  # noqa: E402
from kvbench.transports.base import Context  # noqa: E402


class _Agent:
    registered: list = []

    def __init__(self, name, cfg):
        self.backends = ["UCX"]

    def register_memory(self, descs, mem_type):
        assert isinstance(descs, np.ndarray) and descs.shape == (1, 3), descs
        _Agent.registered.append((descs.tolist(), mem_type))
        return object()

    def get_agent_metadata(self):
        return b"md"


@pytest.mark.parametrize("dev", [0, 1])
def test_vram_registration_takes_the_device_index(monkeypatch, dev):
    api = types.ModuleType("nixl._api")
    api.nixl_agent, api.nixl_agent_config = _Agent, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    from kvbench.transports.nixl import NixlTransport

    fake = cuda_driver.FakeDriver(devices=2)
    t = fake.alloc(1 << 16, dev)
    assert isinstance(t.device, torch.device) and t.device == torch.device("cuda", dev)
    pool = DevicePool(t, "cuda")
    _Agent.registered.clear()
    tr = NixlTransport(Context(0, 2, "h", "r1", memory="cuda"))
    meta = tr.register(pool)
    assert _Agent.registered == [([[pool.addr, pool.nbytes, dev]], "VRAM")] and meta.endswith(b"md")


def test_vram_takes_the_nic_nearest_its_gpu_unless_the_user_chose(monkeypatch):
    api = types.ModuleType("nixl._api")
    api.nixl_agent, api.nixl_agent_config = _Agent, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    monkeypatch.setenv("UCX_NET_DEVICES", "placeholder")  # restored after the test, whatever register sets
    monkeypatch.delenv("UCX_NET_DEVICES")
    from kvbench.transports.nixl import NixlTransport

    pool = DevicePool(cuda_driver.FakeDriver().alloc(1 << 16), "cuda")
    tr = NixlTransport(Context(0, 2, "h", "r2", memory="cuda", gpu=0, nic="mlx5_3"))
    tr.register(pool)
    assert os.environ["UCX_NET_DEVICES"] == "mlx5_3:1"
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")  # the user's choice stands
    NixlTransport(Context(0, 2, "h", "r3", memory="cuda", gpu=0, nic="mlx5_3")).register(pool)
    assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"
