"""Byte counters of every NIC this process can see: kernel interfaces (/sys/class/net/*/statistics), RDMA
ports (port_xmit_data and port_rcv_data count 4-byte words) and, when asked, NVLink through NVML.

A sample is ``{name: (tx_bytes, rx_bytes)}``.  Names: the interface's (``eth0``, ``lo``), ``<device>:<port>``
for an RDMA port (``mlx5_0:1``), ``nvlink<gpu>`` for a GPU's NVLinks together.  Inside a network namespace
(``ip netns exec`` mounts its own /sys) the sample is that namespace's interfaces.  A counter that cannot be
read is left out, never guessed.
"""
from __future__ import annotations

import os

SYS = "/sys"
RDMA_WORD = 4  # port_xmit_data / port_rcv_data count octets divided by 4 (InfiniBand PortCounters)
LOOPBACK = "lo"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def names(root: str = SYS) -> list[str]:
    """The kernel's network interfaces, sorted."""
    try:
        return sorted(os.listdir(os.path.join(root, "class", "net")))
    except OSError:
        return []


def net_counters(root: str = SYS) -> dict[str, tuple[int, int]]:
    """Per kernel interface: (tx_bytes, rx_bytes)."""
    out = {}
    for n in names(root):
        stats = os.path.join(root, "class", "net", n, "statistics")
        tx, rx = _read_int(os.path.join(stats, "tx_bytes")), _read_int(os.path.join(stats, "rx_bytes"))
        if tx is not None and rx is not None:
            out[n] = (tx, rx)
    return out


def rdma_counters(root: str = SYS) -> dict[str, tuple[int, int]]:
    """Per RDMA port ``<device>:<port>``: (bytes sent, bytes received), from the port's 4-byte-word counters."""
    base = os.path.join(root, "class", "infiniband")
    out = {}
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return out
    for dev in devices:
        try:
            ports = sorted(os.listdir(os.path.join(base, dev, "ports")), key=lambda p: (len(p), p))
        except OSError:
            continue
        for port in ports:
            c = os.path.join(base, dev, "ports", port, "counters")
            tx, rx = _read_int(os.path.join(c, "port_xmit_data")), _read_int(os.path.join(c, "port_rcv_data"))
            if tx is not None and rx is not None:
                out[f"{dev}:{port}"] = (tx * RDMA_WORD, rx * RDMA_WORD)
    return out


_NVML: list = []  # [pynvml module] once initialised, [None] when it cannot be


def nvlink_counters() -> dict[str, tuple[int, int]]:
    """Per GPU ``nvlink<i>``: (bytes sent, bytes received) over all its NVLinks, from NVML's throughput fields
    (KiB); empty where pynvml, a GPU or the fields are missing."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.append(pynvml)
        except Exception:  # no pynvml, no driver: no NVLink counters here
            _NVML.append(None)
    nv = _NVML[0]
    if nv is None:
        return {}
    out = {}
    try:
        fields = [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
        for i in range(nv.nvmlDeviceGetCount()):
            vals = nv.nvmlDeviceGetFieldValues(nv.nvmlDeviceGetHandleByIndex(i), fields)
            if all(v.nvmlReturn == 0 for v in vals):
                out[f"nvlink{i}"] = (int(vals[0].value.ullVal) * 1024, int(vals[1].value.ullVal) * 1024)
    except Exception:  # an older NVML without the fields: no NVLink counters rather than a failed case
        return {}
    return out


def sample(root: str = SYS, nvlink: bool = False) -> dict[str, tuple[int, int]]:
    """Every counter at once: kernel interfaces, RDMA ports, and NVLink when ``nvlink`` (a GPU case)."""
    out = net_counters(root)
    out.update(rdma_counters(root))
    if nvlink:
        out.update(nvlink_counters())
    return out
