"""tcp's own byte count: per peer, what the kernel says its data connections sent and received (struct tcp_info).

Read with getsockopt(TCP_INFO) outside the timed windows (harness/wirerows.py samples it after each timed
iteration's closing barrier), so the count costs the transfer nothing.  The control connections (layer-ready
signals) are left out: they carry no payload.
"""
from __future__ import annotations

import socket
import struct

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


def counts(lanes: dict) -> dict[int, tuple[int, int]]:
    """Per peer, (sent, received) summed over its data connections (every lane and rail); a peer with any
    connection the kernel does not count is left out."""
    out = {}
    for peer, per_lane in lanes.items():
        got = [counted(c.sock) for rails in per_lane for c in rails]
        if got and all(s >= 0 for s, _ in got):
            out[peer] = (sum(s for s, _ in got), sum(r for _, r in got))
    return out
