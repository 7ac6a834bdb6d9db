"""What this process's own TCP connections carried: per connection the kernel's count (struct tcp_info's
tcpi_bytes_sent and tcpi_bytes_received), read through every socket in /proc/self/fd.

Per-process evidence, where a NIC's counters are the host's: another job pushing bytes through the same
loopback or NIC moves none of these counts.  A connection is named by the interface its packets leave by:
``lo`` when its peer's address is one of this host's own (the kernel routes those through loopback, whatever
interface owns the address), else the interface that holds its local address.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915

# byte offsets in the kernel's struct tcp_info (include/uapi/linux/tcp.h): tcpi_bytes_received (Linux 4.1) and
# tcpi_bytes_sent (Linux 4.19, RFC 4898 tcpEStatsPerfHCDataOctetsOut: every data byte sent, retransmissions included)
BYTES_RECEIVED, BYTES_SENT = 128, 200
_INFO_LEN = 256  # more than any kernel's struct: getsockopt returns what this kernel has


def counted(sock: socket.socket) -> tuple[int, int]:
    """(bytes sent, bytes received) by the kernel on this connection so far; (-1, -1) where it does not say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
    except OSError:
        return -1, -1
    if len(info) < BYTES_SENT + 8:  # a kernel before 4.19 has no tcpi_bytes_sent
        return -1, -1
    return struct.unpack_from("<Q", info, BYTES_SENT)[0], struct.unpack_from("<Q", info, BYTES_RECEIVED)[0]


def host_addrs() -> dict[str, str]:
    """{IPv4 address: interface} of this host (or network namespace)."""
    out = {}
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for n in names:
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", n.encode()[:15]))
                out[socket.inet_ntoa(got[20:24])] = n
            except OSError:
                continue
    return out


def sample() -> dict[int, tuple[str, str, int, int]]:
    """Per TCP connection of this process (by its socket's inode): (local address, peer address, bytes sent,
    bytes received) so far."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[8:-1])
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            sent, received = counted(s)
            if sent < 0:
                continue
            out[inode] = (s.getsockname()[0], s.getpeername()[0], sent, received)
        except OSError:  # a listener (no peer), a socket closed meanwhile
            continue
        finally:
            s.close()  # the duplicate only
    return out


def interface(local: str, peer: str, addrs: dict[str, str]) -> str:
    """The interface a connection's packets use: lo for a peer on this host, else the local address's owner."""
    try:
        ip = ipaddress.ip_address(peer.split("%")[0])
        if ip.is_loopback or peer in addrs or (ip.version == 6 and ip.ipv4_mapped and str(ip.ipv4_mapped) in addrs):
            return "lo"
    except ValueError:
        pass
    return addrs.get(local.removeprefix("::ffff:"), "?")


def delta(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    """Bytes this process's connections moved between two samples, per interface: {name: (sent, received)}.
    A connection opened meanwhile counts from 0; one closed meanwhile is lost (its count went with it)."""
    addrs, out = host_addrs(), {}
    for inode, (local, peer, tx, rx) in after.items():
        tx0, rx0 = before.get(inode, (local, peer, 0, 0))[2:]
        dtx, drx = max(0, tx - tx0), max(0, rx - rx0)
        if dtx or drx:
            name = interface(local, peer, addrs)
            a, b = out.get(name, (0, 0))
            out[name] = (a + dtx, b + drx)
    return dict(sorted(out.items()))


def netns() -> str:
    """This process's network namespace (its inode), '' where /proc does not say: ranks in two namespaces of one
    host (a lab's nodes) reach each other through NICs, not as one host."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""
