"""Placement: each rank's GPU (local rank, or --gpu-map), the RDMA NIC nearest it by PCIe affinity (a fake sysfs
tree), what rows and preamble say about a pair sharing a GPU; and the bad inputs of --memory cuda and --gpu-map,
each one line, exit 1, nothing written."""
import os

import pytest
from helpers.asserts import assert_nothing_written, assert_one_line

from kvbench.harness import placing
from kvbench.memory import placement


def test_local_rank_takes_its_gpu_and_the_map_overrides():
    assert [placement.gpu_for(r, 8) for r in range(10)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert [placement.gpu_for(r, 8, [3, 1]) for r in range(3)] == [3, 1, 3]
    assert placement.parse_gpu_map("0, 2,1") == [0, 2, 1] and placement.parse_gpu_map(None) is None
    with pytest.raises(placement.PlacementError, match="'x' is not a GPU index"):
        placement.parse_gpu_map("0,x")
    with pytest.raises(placement.PlacementError, match="names GPU 2, but this node has 2 GPUs"):
        placement.check_gpu_map([0, 2], 2)
    with pytest.raises(placement.PlacementError, match="names GPU 0, but this node has no GPU"):
        placement.check_gpu_map([0], 0)


def _sysfs(root, gpus: dict, nics: dict) -> str:
    """A sysfs tree: devices under /sys/devices/pci..., linked from bus/pci/devices and class/infiniband/*/device."""
    for path in [*gpus.values(), *nics.values()]:
        os.makedirs(os.path.join(root, "devices", *path.split("/")), exist_ok=True)
    os.makedirs(os.path.join(root, "bus", "pci", "devices"))
    for bus, path in gpus.items():
        os.symlink(os.path.join(root, "devices", *path.split("/")), os.path.join(root, "bus", "pci", "devices", bus))
    for name, path in nics.items():
        os.makedirs(os.path.join(root, "class", "infiniband", name))
        os.symlink(os.path.join(root, "devices", *path.split("/")),
                   os.path.join(root, "class", "infiniband", name, "device"))
    return str(root)


def test_the_nic_nearest_each_gpu_by_pcie_affinity(tmp_path):
    # two sockets, a PCIe switch per GPU/NIC pair (as on an 8-GPU node), one NIC on its own root port
    gpus = {"0000:1b:00.0": "pci0000:00/0000:00:01.0/0000:1a:00.0/0000:1b:00.0",
            "0000:9a:00.0": "pci0000:80/0000:80:01.0/0000:99:00.0/0000:9a:00.0"}
    nics = {"mlx5_1": "pci0000:80/0000:80:01.0/0000:99:00.0/0000:9c:00.0",
            "mlx5_0": "pci0000:00/0000:00:01.0/0000:1a:00.0/0000:1c:00.0",
            "mlx5_2": "pci0000:00/0000:00:03.0/0000:30:00.0"}
    root = _sysfs(tmp_path, gpus, nics)
    assert placement.nearest_nic("0000:1B:00.0", root) == ("mlx5_0", 2)  # the NIC behind the GPU's own switch
    assert placement.nearest_nic("0000:9a:00.0", root) == ("mlx5_1", 2)
    assert placement.nearest_nic("0000:5e:00.0", root) == ("mlx5_0", -1)  # GPU not in sysfs: any NIC, hops unknown
    assert placement.nearest_nic("0000:1b:00.0", str(tmp_path / "none")) is None  # no RDMA device


def test_rows_and_preamble_say_which_gpu_and_nic_and_a_shared_gpu():
    where = [dict(placing.NO_GPU, host="a", gpu=0, gpu_bus="0000:1b:00.0", nic="mlx5_0"),
             dict(placing.NO_GPU, host="a", gpu=0, gpu_bus="0000:1b:00.0", nic="mlx5_0"),
             dict(placing.NO_GPU, host="a", gpu=1, gpu_bus="0000:9a:00.0", nic="mlx5_1"),
             dict(placing.NO_GPU, host="b", gpu=0, gpu_bus="0000:1b:00.0", nic="mlx5_0")]
    assert placing.same_gpu(where, 0, 1) and not placing.same_gpu(where, 0, 2) and not placing.same_gpu(where, 0, 3)
    cuda = {"memory": "cuda", "transport": "nixl"}
    assert placing.columns(where, 2, cuda, 2, 3) == {"gpu": 1, "nic": "mlx5_1", "same_gpu": False}
    assert placing.columns(where, 0, dict(cuda, transport="cuda_ipc"), 0, 1) == {"gpu": 0, "nic": "", "same_gpu": True}
    assert placing.columns(where, 0, {"memory": "host", "transport": "tcp"}, 0, 1) == \
        {"gpu": -1, "nic": "", "same_gpu": False}
    lines = placing.preamble(where, [cuda], [(0, 1), (2, 3)])
    assert lines[0] == "# gpus: rank0=0(mlx5_0)  rank1=0(mlx5_0)  rank2=1(mlx5_1)  rank3=0(mlx5_0)"
    assert "ranks 0 and 1 share GPU 0 on a" in lines[1] and "HBM copies" in lines[1]
    assert placing.preamble(where, [{"memory": "host"}], [(0, 1)]) == []


def test_a_host_run_records_no_gpu_in_rows_and_sidecar(kvrun):
    r = kvrun(["-t", "shm", "--tokens", "64", "-n", "1", "-w", "0", "--variants", "paged", "--rounds", "1"])
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert (df.gpu == -1).all() and (df.nic == "").all() and not df.same_gpu.any()
    assert [p["gpu"] for p in r.meta()["placement"]] == [-1, -1] and [p["local_rank"] for p in r.meta()["placement"]] \
        == [0, 1]


# --memory cuda where no GPU is: tests/test_staged.py::test_cuda_memory_without_a_gpu_is_refused_in_one_line_...
BAD = [(["-t", "tcp", "--memory", "cuda"], ["--memory cuda: tcp moves host memory, not cuda"]),
       (["-t", "shm", "--gpu-map", "0,7"], ["--gpu-map names GPU"])]


@pytest.mark.parametrize("args,needles", BAD)
def test_device_bad_input_is_one_line_exit_1_nothing_written(kvrun, tmp_path, args, needles):
    r = kvrun([*args, "--tokens", "64", "-n", "1", "-w", "0"], timeout=60)
    assert_one_line(r, *needles)
    assert_nothing_written(tmp_path)
