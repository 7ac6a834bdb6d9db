"""NIC affinity (--nic auto): each rank's network interfaces ranked by how near they sit to its GPU, or, without a
GPU, to the CPU socket (NUMA node) its CPUs are on, in NCCL's order of path types:

* PIX: through at most one PCIe switch (the GPU and the NIC below one switch);
* PXB: through several PCIe bridges, without the host bridge;
* PHB: through the CPU's PCIe host bridge (one root complex);
* NODE: across root complexes within one NUMA node (without a GPU: the NIC on the rank's socket);
* SYS: across the sockets' interconnect (the NIC on the far socket);
* VIRT: a virtual interface (veth, bridge, tunnel) with no PCI device: its locality is unknown.

Pure functions of a sysfs tree (tests pass a fake one); the loopback interface is never a candidate.
"""
from __future__ import annotations

import os

from kvbench.memory.placement import _pci_parts

LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS", "VIRT")


def cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_nodes(sysfs: str = "/sys") -> dict[int, set[int]]:
    """NUMA node -> its CPUs ({0: every CPU} where the kernel shows no nodes)."""
    base = os.path.join(sysfs, "devices", "system", "node")
    out = {}
    try:
        names = [n for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        names = []
    for n in names:
        try:
            with open(os.path.join(base, n, "cpulist")) as fh:
                out[int(n[4:])] = cpulist(fh.read())
        except (OSError, ValueError):
            continue
    return out or {0: set(range(os.cpu_count() or 1))}


def node_of_cpus(cpus: set[int], nodes: dict[int, set[int]]) -> int:
    """The NUMA node holding most of ``cpus`` (the lowest on a tie)."""
    return max(sorted(nodes), key=lambda n: len(nodes[n] & cpus))


def _numa(device: str) -> int:
    """The NUMA node of a device, from it or its nearest PCI ancestor (-1: unknown)."""
    path = os.path.realpath(device)
    while path and path != os.sep:
        try:
            with open(os.path.join(path, "numa_node")) as fh:
                return int(fh.read().strip())
        except (OSError, ValueError):
            path = os.path.dirname(path)
    return -1


def netdevs(sysfs: str = "/sys") -> list[dict]:
    """Every network interface but loopback: name, its PCI device path ("" for a virtual one) and NUMA node."""
    base = os.path.join(sysfs, "class", "net")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for n in names:
        if n == "lo":
            continue
        dev = os.path.join(base, n, "device")
        real = os.path.realpath(dev) if os.path.exists(dev) else ""
        pci = real if real and "/virtual/" not in real and _pci_parts(real) else ""
        out.append({"name": n, "pci": pci, "numa": _numa(pci) if pci else -1})
    return out


def level(nic: dict, node: int, nnodes: int, gpu_pci: str = "", gpu_numa: int = -1) -> str:
    """The path type between a rank (its GPU at ``gpu_pci``, or its CPUs on NUMA node ``node``) and ``nic``."""
    if not nic["pci"]:
        return "VIRT"
    if gpu_pci:
        a, b = _pci_parts(gpu_pci), _pci_parts(nic["pci"])
        common = 0
        for x, y in zip(a, b):
            if x != y:
                break
            common += 1
        if common >= 2:  # below one root port: a switch's downstream ports, or deeper
            return "PIX" if len(a) + len(b) - 2 * common <= 4 else "PXB"
        if common == 1:
            return "PHB"
        node = gpu_numa if gpu_numa >= 0 else node
    numa = nic["numa"] if nic["numa"] >= 0 or nnodes > 1 else node  # one node: the kernel often says -1
    if numa < 0:
        return "SYS"
    return "NODE" if numa == node else "SYS"


def rank_nics(cpus: set[int], sysfs: str = "/sys", gpu_pci: str = "", only: list[str] | None = None) -> list[dict]:
    """This rank's interfaces, nearest first (by level, then name): each with its level and why."""
    nodes = cpu_nodes(sysfs)
    node = node_of_cpus(cpus, nodes)
    gpu_numa = _numa(gpu_pci) if gpu_pci else -1
    out = []
    for nic in netdevs(sysfs):
        if only is not None and nic["name"] not in only:
            continue
        lv = level(nic, node, len(nodes), gpu_pci, gpu_numa)
        if lv == "VIRT":
            why = "a virtual interface: no PCI device, locality unknown"
        elif gpu_pci:
            why = f"{lv} to the GPU at {os.path.basename(gpu_pci)}"
        else:
            where = f"NUMA node {nic['numa']}" if nic["numa"] >= 0 else "the only NUMA node"
            why = f"{lv}: on {where}, the rank's CPUs on node {node}"
        out.append(dict(nic, level=lv, why=why, node=node))
    return sorted(out, key=lambda x: (LEVELS.index(x["level"]), x["name"]))


def gpus(sysfs: str = "/sys") -> list[tuple[str, str]]:
    """NVIDIA GPUs on the PCI bus: (name, device path), in bus order (the names are bus order, not CUDA's)."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    out = []
    try:
        devs = sorted(os.listdir(base))
    except OSError:
        return []
    for d in devs:
        try:
            with open(os.path.join(base, d, "vendor")) as v, open(os.path.join(base, d, "class")) as c:
                vendor, cls = v.read().strip(), c.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and cls[:6] in ("0x0302", "0x0300"):
            out.append((f"gpu {d[5:]}", os.path.realpath(os.path.join(base, d))))
    return out


def matrix_lines(sysfs: str = "/sys", gpus: list[tuple[str, str]] | None = None) -> list[str]:
    """`kvbench env`'s affinity matrix: per NUMA node (and per GPU, ``gpus``: (name, PCI path)), each NIC's level."""
    nics = netdevs(sysfs)
    if not nics:
        return []
    nodes = cpu_nodes(sysfs)
    names = [n["name"] for n in nics]
    width = max(6, *(len(n) for n in names))
    out = ["# NIC affinity (NCCL's path types: PIX, PXB, PHB, NODE, SYS; VIRT: no PCI device)",
           f"{'':<12}" + "".join(f"{n:>{width + 1}}" for n in names)]
    for node in sorted(nodes):
        out.append(f"{'cpu node ' + str(node):<12}" + "".join(f"{level(n, node, len(nodes)):>{width + 1}}" for n in nics))
    for name, pci in gpus or []:
        g = _numa(pci)
        out.append(f"{name:<12}" + "".join(f"{level(n, max(g, 0), len(nodes), pci, g):>{width + 1}}" for n in nics))
    return out
