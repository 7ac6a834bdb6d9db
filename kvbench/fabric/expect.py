"""The path a case is meant to measure: derived from its transport, memory kind and placement, or stated by
the user (``--expect``); a row whose carrier (proto.klass of its ``carrier_proto``) is another is a FALLBACK.

Derived (``auto``): a pair of one host moving host memory through an engine that may choose (ucx, nixl, mpi):
shared memory; device pools of one host: NVLink (cuda_ipc); pairs across hosts: an RDMA NIC where this host
has one, else TCP.  Transports that are one path have it as their own: tcp is TCP (over lo on one host: lo IS
its path), shm and loopback are memory, verbs is RDMA, cuda_ipc is NVLink, Mooncake is the protocol it was
asked for, staged is its inner transport's.  Stdlib only.
"""
from __future__ import annotations

import os

CHOICES = ("auto", "shm", "nvlink", "rdma", "tcp", "any")
WORDS = {"shm": "shared memory", "nvlink": "NVLink (cuda_ipc)", "rdma": "an RDMA NIC", "tcp": "TCP",
         "pcie": "PCIe", "any": "any path (no verdict)"}
CHOOSING = ("ucx", "nixl", "mpi", "mpi-sendrecv")  # engines that choose their path by placement
_TLS_SHM = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "all")


class ExpectError(ValueError):
    """A --expect value that is not one of CHOICES."""


def parse(text: str | None) -> str:
    """--expect's value, checked: one of CHOICES (None: auto)."""
    val = "auto" if text is None else text.strip().lower()  # an empty value is a mistake, not auto
    if val not in CHOICES:
        raise ExpectError(f"--expect {text}: choose from {', '.join(CHOICES)}")
    return val


def rdma_here(root: str = "/sys") -> bool:
    """This host has an RDMA device."""
    try:
        return bool(os.listdir(os.path.join(root, "class", "infiniband")))
    except OSError:
        return False


def expected(transport: str, memory: str, same_host: bool, options: dict | None = None, flag: str = "auto",
             rdma: bool | None = None) -> tuple[str, str]:
    """(the path class a case is meant to measure, why) for a rank whose pairs share its host or not."""
    if flag != "auto":
        return flag, f"--expect {flag}"
    o = options or {}
    rdma = rdma_here() if rdma is None else rdma
    if transport == "tcp":
        return "tcp", "tcp is its own path" + (", over lo on one host" if same_host else "")
    if transport in ("shm", "loopback"):
        return "shm", f"{transport} moves bytes through memory"
    if transport == "verbs":
        return "rdma", "verbs is RDMA"
    if transport == "cuda_ipc":
        return "nvlink", "device pools of one node"
    if transport == "mooncake":
        asked = str(o.get("protocol") or ("rdma" if rdma else "tcp"))
        return ("rdma" if asked == "rdma" else "tcp"), f"Mooncake was asked for {asked}"
    if transport == "staged":
        inner = str(o.get("inner", "tcp"))
        got, why = expected(inner, "host", same_host, {}, "auto", rdma)
        return got, f"its inner {inner}: {why}"
    if transport == "ucx" and o.get("tls"):
        tls = [t.strip() for t in str(o["tls"]).split(",")]
        if not any(t.split(":")[0] in _TLS_SHM for t in tls) and any(t.startswith("tcp") for t in tls):
            return "tcp", f"-O tls={o['tls']}"
    if transport not in CHOOSING:  # a plugin's: what it is meant to carry is not known here
        return "any", f"{transport}: a transport whose path kvbench does not know (--expect to state it)"
    if same_host:
        return ("nvlink", "device pools of one node") if memory == "cuda" else \
            ("shm", "ranks of one host, host memory")
    return ("rdma", "across hosts, an RDMA NIC here") if rdma else ("tcp", "across hosts, no RDMA NIC here")


def fallback(expected_class: str, carried_class: str) -> bool:
    """Whether a row that carried ``carried_class`` is a FALLBACK from ``expected_class`` (an unknown carrier,
    or --expect any, is no verdict)."""
    if expected_class == "any" or not carried_class:
        return False
    return expected_class not in carried_class.split("+")
