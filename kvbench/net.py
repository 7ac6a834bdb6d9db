"""Network plumbing shared by the socket-based transports: address selection, socket tuning.

Address rules (NCCL's): ``options["addr"]``, else ``options["ifname"]`` or
KVBENCH_SOCKET_IFNAME (comma-separated name prefixes, ``=`` exact, ``^``
exclude), else the local address routing to this host's name (127.0.0.1 if
that is loopback).  A cluster user pins kvbench to the data-plane NIC this way.
"""
from __future__ import annotations

import os
import socket
import struct

import numpy as np

from .transports.base import LEN, TransportError

IOV_MAX = 1024


def if_addr(name: str) -> str | None:
    """IPv4 address of interface ``name`` (SIOCGIFADDR), None if it has none."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def select_addr(hostname: str, options: dict) -> tuple[str, str | None]:
    """(address, interface) to listen on, by the rules in the module docstring."""
    names = [n for _, n in socket.if_nameindex()]
    spec = options.get("ifname") or os.environ.get("KVBENCH_SOCKET_IFNAME")
    if options.get("addr"):
        addr = str(options["addr"])
    elif spec:
        exclude, exact = spec.startswith("^"), "=" in spec[:2]
        pats = [p for p in spec.lstrip("^=").split(",") if p]
        for n in names:
            if any(n == p if exact else n.startswith(p) for p in pats) != exclude and (a := if_addr(n)):
                return a, n
        have = ", ".join(f"{n} ({if_addr(n) or 'no IPv4'})" for n in names)
        raise TransportError(f"no interface with an IPv4 address matches '{spec}'; available: {have}")
    else:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(hostname), 9))  # UDP: a route lookup, nothing is sent
                addr = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
        addr = "127.0.0.1" if addr.startswith("127.") else addr
    return addr, next((n for n in names if if_addr(n) == addr), None)


def sysctl(name: str, field: int = 0) -> int:
    try:
        with open(f"/proc/sys/net/{name}") as fh:
            return int(fh.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def tune(s: socket.socket, want: int) -> None:
    """TCP_NODELAY and socket buffers (before connect/listen, so the window scale fits)."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if want <= 0:
        return  # leave it to autotuning
    for opt, force, cap, auto in ((socket.SO_SNDBUF, 32, "wmem", "tcp_wmem"),
                                  (socket.SO_RCVBUF, 33, "rmem", "tcp_rmem")):
        try:  # SO_SNDBUFFORCE=32 / SO_RCVBUFFORCE=33 need CAP_NET_ADMIN
            s.setsockopt(socket.SOL_SOCKET, force, want)
        except OSError:
            limit = sysctl(f"core/{cap}_max")
            if 2 * limit >= min(want, sysctl(f"ipv4/{auto}", 2)):  # the kernel doubles it
                s.setsockopt(socket.SOL_SOCKET, opt, min(want, limit))


def py_vec(sock, mv: memoryview, descs: np.ndarray, col: int, writing: bool) -> None:
    """Fallback for kvbench._native.sendv/recvv: sendmsg/recvmsg_into, IOV_MAX ranges a call."""
    offs, lens = descs[:, col].tolist(), descs[:, LEN].tolist()
    i, skip, n = 0, 0, len(offs)
    while i < n:
        j = min(n, i + IOV_MAX)
        iov = [mv[o : o + k] for o, k in zip(offs[i:j], lens[i:j])]
        iov[0] = iov[0][skip:]
        moved = sock.sendmsg(iov) if writing else sock.recvmsg_into(iov, 0, socket.MSG_WAITALL)[0]
        if moved == 0 and not writing:
            raise ConnectionError("peer closed the connection mid-transfer")
        moved += skip  # counted from the start of range i
        while i < j and moved >= lens[i]:
            moved -= lens[i]
            i += 1
        skip = moved
