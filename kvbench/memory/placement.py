"""Placement: which GPU a rank binds (its rank on the node, or ``--gpu-map``) and which RDMA NIC is nearest that GPU
by PCIe affinity (sysfs), as pure functions of what they are given (tests pass a fake sysfs tree).

On an 8-GPU node without placement every rank would make its context on GPU 0; with it, local rank k takes GPU
k (modulo the GPUs it sees), or the k-th entry of ``--gpu-map``.  The NIC nearest a GPU is the one whose PCI path
shares the longest prefix with the GPU's (the same PCIe switch before the same root port, before another socket),
as NCCL and UCX choose; ties go to the lower name.
"""
from __future__ import annotations

import os


class PlacementError(ValueError):
    """A --gpu-map that names GPUs this node does not have (one line)."""


def parse_gpu_map(text: str | None) -> list[int] | None:
    """``--gpu-map 0,1,..`` as a list of GPU ordinals (None when not given); PlacementError for a bad one."""
    if text is None:
        return None
    if not str(text).strip():
        raise PlacementError("--gpu-map: empty (give 0,1,.. one GPU index per local rank)")
    out = []
    for item in str(text).split(","):
        item = item.strip()
        if not item.isdigit():
            raise PlacementError(f"--gpu-map {text}: '{item}' is not a GPU index (give 0,1,.. one per local rank)")
        out.append(int(item))
    return out


def check_gpu_map(gpu_map: list[int] | None, count: int) -> None:
    """Refuse a map naming a GPU beyond the ``count`` this node sees (none: every index is nonexistent)."""
    if not gpu_map:
        return
    bad = [g for g in gpu_map if g >= count]
    if bad:
        sees = "no GPU" if count == 0 else f"{count} GPU{'s' if count > 1 else ''} (0-{count - 1})"
        raise PlacementError(f"--gpu-map names GPU {bad[0]}, but this node has {sees}")


def gpu_for(local_rank: int, count: int, gpu_map: list[int] | None = None) -> int:
    """The GPU ordinal of the rank ``local_rank`` on its node: the map's entry, else local rank modulo ``count``."""
    if gpu_map:
        return gpu_map[local_rank % len(gpu_map)]
    return local_rank % max(1, count)


def _pci_parts(path: str) -> list[str]:
    """The PCI components of a resolved sysfs device path (root complex, bridges, the device)."""
    return [p for p in os.path.realpath(path).split(os.sep) if p.startswith("pci") or p.count(":") == 2]


def distance(a: str, b: str) -> int:
    """PCIe hops between two resolved sysfs device paths: components not on their common prefix."""
    pa, pb = _pci_parts(a), _pci_parts(b)
    common = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        common += 1
    return len(pa) + len(pb) - 2 * common


def nearest_nic(gpu_bus_id: str, sysfs: str = "/sys") -> tuple[str, int] | None:
    """(RDMA device name, PCIe hops) of the NIC nearest the GPU at ``gpu_bus_id``; None without RDMA devices."""
    gpu = os.path.join(sysfs, "bus", "pci", "devices", gpu_bus_id.lower())
    ib = os.path.join(sysfs, "class", "infiniband")
    try:
        nics = sorted(os.listdir(ib))
    except OSError:
        return None
    if not nics:
        return None
    if not os.path.exists(gpu):
        return nics[0], -1  # the GPU is not in sysfs (a container): any NIC, hops unknown
    return min(((n, distance(gpu, os.path.join(ib, n, "device"))) for n in nics), key=lambda x: (x[1], x[0]))
