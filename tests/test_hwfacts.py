"""kvbench env's GPU/RDMA facts from a fake sysfs (no RDMA device here) and lspci text."""
import os

from kvbench.results import machine as hwfacts


def fake_ib(tmp_path):
    pci = tmp_path / "devices" / "0000:41:00.0"
    (pci / "net" / "ens1f0").mkdir(parents=True)
    (pci / "net" / "ens1f0" / "mtu").write_text("9000\n")
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    os.symlink(pci, tmp_path / "class" / "infiniband" / "mlx5_0" / "device")
    for name, val in {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "Ethernet",
                      "rate": "200 Gb/sec (4X HDR)"}.items():
        (port / name).write_text(val + "\n")
    return tmp_path


def test_rdma_ports_from_sysfs(tmp_path, monkeypatch):
    monkeypatch.setattr(hwfacts, "relaxed_ordering", lambda pci: f"on ({pci})")
    got = hwfacts.rdma_devices(str(fake_ib(tmp_path)))
    assert got == [{"device": "mlx5_0", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp",
                    "link_layer": "Ethernet", "rate": "200 Gb/sec (4X HDR)", "netdev_mtu": 9000,
                    "pci": "0000:41:00.0", "relaxed_ordering": "on (0000:41:00.0)"}]
    assert hwfacts.rdma_devices(str(tmp_path / "none")) == []


def test_relaxed_ordering_from_lspci_devctl():
    on = "\tDevCtl:\tCorrErr- NonFatalErr+ FatalErr+ UnsupReq+\n\t\tRlxdOrd+ ExtTag+ PhantFunc- AuxPwr- NoSnoop+"
    assert hwfacts.relaxed_ordering("x", on) == "on"
    assert hwfacts.relaxed_ordering("x", on.replace("RlxdOrd+", "RlxdOrd-")) == "off"
    assert hwfacts.relaxed_ordering("x", "Capabilities: [60] Express").startswith("unknown (no DevCtl")


def test_env_lines_name_the_facts_a_buyer_needs(tmp_path):
    f = {"gpus": [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771, "driver": "570.86", "pci": "0:1B",
                   "cuda": "12.8"}],
         "rdma": [], "gpudirect": hwfacts.gpudirect(str(tmp_path)), "memlock": hwfacts.memlock(), "topology": None}
    out = hwfacts.lines(f)
    assert out[0] == "GPU 0            NVIDIA H200, 143771 MiB, driver 570.86, CUDA 12.8, PCI 0:1B"
    assert out[1].startswith("GPUDirect        nvidia-peermem not loaded; kernel ")
    assert out[2].startswith("memlock          ") and "hard" in out[2]
