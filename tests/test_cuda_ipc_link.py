"""cuda_ipc's link name, held to NVML's rules by a fake pynvml: devices are found by UUID (NVML's index follows
PCI order, which CUDA_VISIBLE_DEVICES and FASTEST_FIRST reorder), and only the links whose far end is the peer's
GPU (by PCI bus id) or an NVSwitch count."""
import sys
import types

import pytest

from kvbench.transports.cuda_ipc import _norm_bus, link_between


class NVMLError(Exception):
    pass


def fake_nvml(links: dict[str, list[tuple[int, str, int]]]):
    """``links``: per GPU UUID, its links as (state, far end's bus id, far end's type: 0 GPU, 2 switch)."""
    def link(h, i):
        if i >= len(links[h]):
            raise NVMLError("not supported")
        return links[h][i]

    return types.SimpleNamespace(
        nvmlInit=lambda: None, NVMLError=NVMLError, NVML_NVLINK_MAX_LINKS=18, NVML_NVLINK_DEVICE_TYPE_SWITCH=2,
        nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("looked up by index: NVML's order is not CUDA's"),
        nvmlDeviceGetNvLinkState=lambda h, i: link(h, i)[0],
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, i: types.SimpleNamespace(busId=link(h, i)[1].encode()),
        nvmlDeviceGetNvLinkRemoteDeviceType=lambda h, i: link(h, i)[2],
        nvmlDeviceGetNvLinkVersion=lambda h, i: 4)


def test_only_the_links_to_the_peer_count(monkeypatch):
    a, b, c = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"
    nv = fake_nvml({a: [(1, "00000000:9A:00.0", 0)] * 4 + [(1, "00000000:5D:00.0", 0)] * 2 + [(0, "", 0)] * 2})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    assert link_between(a, b, "0000:9a:00.0") == "NVLink4 x4 (direct)"  # not 6: two go to a third GPU
    assert link_between(a, c, "0000:1b:00.0") == "PCIe (no NVLink to the peer)"
    assert link_between(a, "aaaa", "") == "same GPU"


def test_an_nvswitch_carries_every_link(monkeypatch):
    a = "GPU-aaaa"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({a: [(1, "00000000:C1:00.0", 2)] * 18}))
    assert link_between(a, "GPU-bbbb", "0000:9a:00.0") == "NVLink4 x18 (NVSwitch)"


def test_bus_ids_compare_across_nvml_and_the_driver():
    assert _norm_bus(b"00000000:9A:00.0\x00") == _norm_bus("0000:9a:00.0") == "0000:9a:00.0"
