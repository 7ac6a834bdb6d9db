"""--nic auto (memory/affinity.py, harness/placing.py): NICs ranked by NCCL's path types on a fake sysfs tree of
two sockets, a PCIe switch shared by a GPU and a NIC, a NIC on the far socket and a virtual one; the preamble's
warning for a far NIC; bad --nic input."""
from __future__ import annotations

import os

import pytest

from kvbench.harness import placing
from kvbench.memory import affinity as A


@pytest.fixture
def sysfs(tmp_path):
    """Socket 0: CPUs 0-3, root complex pci0000:00 with a switch (upstream 01:00.0) holding the GPU (03:00.0) and
    eth0 (04:00.0), and eth1 on another root port of pci0000:00's; socket 1: CPUs 4-7, root complex pci0000:80
    with eth2; veth0 virtual."""
    root = tmp_path / "sys"
    dev = root / "devices"
    sw = dev / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"
    gpu = sw / "0000:02:00.0" / "0000:03:00.0"
    paths = {"eth0": sw / "0000:02:01.0" / "0000:04:00.0", "eth1": dev / "pci0000:00" / "0000:00:02.0" / "0000:05:00.0",
             "eth2": dev / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0", "veth0": dev / "virtual" / "net" / "veth0"}
    for p in [gpu, *paths.values()]:
        p.mkdir(parents=True)
    for p, node in ((dev / "pci0000:00", 0), (dev / "pci0000:80", 1)):
        (p / "numa_node").write_text(f"{node}\n")
    for name, p in paths.items():
        (root / "class" / "net" / name).mkdir(parents=True)
        os.symlink(p, root / "class" / "net" / name / "device")
    (root / "class" / "net" / "lo").mkdir(parents=True)
    for n, cpus in ((0, "0-3"), (1, "4-7")):
        (dev / "system" / "node" / f"node{n}").mkdir(parents=True)
        (dev / "system" / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    return str(root), str(gpu)


def test_without_a_gpu_the_socket_decides(sysfs):
    root, _ = sysfs
    near0 = A.rank_nics({0, 1}, root)
    assert [(n["name"], n["level"]) for n in near0] == [("eth0", "NODE"), ("eth1", "NODE"), ("eth2", "SYS"),
                                                          ("veth0", "VIRT")]
    assert "node 0" in near0[0]["why"]
    near1 = A.rank_nics({5, 6}, root)
    assert near1[0]["name"] == "eth2" and near1[0]["level"] == "NODE" and near1[1]["level"] == "SYS"
    assert A.cpulist("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


def test_with_a_gpu_the_pcie_path_decides_in_nccls_order(sysfs):
    root, gpu = sysfs
    got = {n["name"]: n["level"] for n in A.rank_nics({4}, root, gpu)}  # the rank's CPUs do not matter now
    assert got == {"eth0": "PIX", "eth1": "PHB", "eth2": "SYS", "veth0": "VIRT"}
    lines = A.matrix_lines(root, [("gpu 03:00.0", gpu)])
    assert lines[2].split() == ["cpu", "node", "0", "NODE", "NODE", "SYS", "VIRT"]
    assert lines[3].split()[-4:] == ["SYS", "SYS", "NODE", "VIRT"]  # cpu node 1
    assert lines[4].split()[-4:] == ["PIX", "PHB", "SYS", "VIRT"]


def test_a_far_nic_is_warned_and_every_rank_says_why(sysfs, monkeypatch):
    root, _ = sysfs
    for var in ("UCX_NET_DEVICES", "UCX_MAX_RNDV_RAILS"):  # set first, so that the teardown removes what placing sets
        monkeypatch.setenv(var, "placeholder")
        monkeypatch.delenv(var)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    near = dict(placing.NO_GPU, host="h", error="")
    placing.place_nics(near, ["auto"], root)
    assert near["netdevs"][0] == "eth0" and near["nic_level"] == "NODE" and "--nic auto" in near["nic_why"]
    assert os.environ["UCX_NET_DEVICES"] == "eth0" and os.environ["UCX_MAX_RNDV_RAILS"] == "1"
    far = dict(placing.NO_GPU, host="h", error="")
    placing.place_nics(far, ["eth2"], root)
    assert far["netdevs"] == ["eth2"] and far["nic_level"] == "SYS"
    lines = placing.nic_lines([near, far])
    assert lines[0].startswith("# nic rank0: eth0") and lines[1].startswith("# nic rank1: eth2")
    assert "WARNING: 1 rank(s) use a NIC on the far socket, e.g. rank 1" in lines[2]


def test_bad_nic_is_one_line_and_nothing_written(kvrun):
    for args, why in ((["--nic", "kvbnope9"], "no interface 'kvbnope9'"), (["--nic", "auto,eth0"], "give auto")):
        r = kvrun(["-t", "tcp", "-n", "1", "-w", "0", "--tokens", "16", *args], timeout=60)
        assert r.code == 1 and why in r.err and len(r.err.strip().splitlines()) == 1, r.out + r.err
        assert r.results is None


def test_nic_auto_runs_tcp_on_the_nearest_nic_and_the_rows_name_it(kvrun):
    nics = [n["name"] for n in A.rank_nics(os.sched_getaffinity(0)) if n["level"] != "VIRT"]
    from kvbench.transports.sockets import if_addr

    nics = [n for n in nics if if_addr(n)]
    if not nics:
        pytest.skip("no physical interface with an IPv4 address here")
    r = kvrun(["-t", "tcp", "--nic", "auto", "-m", "llama-3-8b", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2",
               "-w", "1", "--variants", "paged"], timeout=120)
    assert r.code == 0, r.out + r.err
    assert f"# nic rank0: {nics[0]}" in r.out and "(--nic auto)" in r.out
    rows = r.transfers()
    assert set(rows.rail_nics) == {nics[0]} and set(rows.rails) == {1}
    assert all(p["netdevs"][0] == nics[0] for p in r.meta()["placement"])
