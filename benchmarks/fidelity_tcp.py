"""The tcp reference of fidelity_ref.py: one TCP_NODELAY socket, ``sendmsg`` / ``recvmsg_into`` per 1024 ranges.

A module of its own because fidelity_ref.py (the ``tcp`` reference) and fidelity_ref_engines.py (mooncake's
notification socket is this connection) both use it: kept in either, the two would import each other.  No
kvbench code and no MPI import (the ranks' ``comm`` is passed in).
"""
from __future__ import annotations

import bisect
import socket

import numpy as np


def tcp_setup(comm, nbytes: int):
    """A connected TCP_NODELAY socket (rank 1 listens; buffers autotuned, as kvbench's tcp)."""
    if comm.rank == 1:
        ls = socket.create_server(("127.0.0.1", 0))
        comm.send(ls.getsockname(), dest=0)
        sock, _ = ls.accept()
        ls.close()
    else:
        sock = socket.create_connection(comm.recv(source=1))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _vec(sock, iov: list, ends: list, sending: bool) -> None:
    """All of ``iov`` (cumulative byte ends ``ends``) through sendmsg / recvmsg_into, resuming after a
    partial call where it stopped (bisect: no Python step per range)."""
    cur, done, total = iov, 0, ends[-1]
    while True:
        n = sock.sendmsg(cur) if sending else sock.recvmsg_into(cur, 0, socket.MSG_WAITALL)[0]
        if n <= 0:
            raise SystemExit("fidelity_ref: tcp peer closed the connection")
        done += n
        if done >= total:
            return
        i = bisect.bisect_right(ends, done)
        cur = iov[i:]
        cur[0] = cur[0][done - (ends[i - 1] if i else 0):]


def tcp_once(comm, sock, buf: np.ndarray, d: np.ndarray, op: str):
    mv, col = memoryview(buf), 0 if comm.rank == 0 else 1
    chunks = [d[i:i + 1024] for i in range(0, len(d), 1024)]
    iovs = [([mv[r[col]:r[col] + r[2]] for r in c.tolist()], np.cumsum(c[:, 2]).tolist()) for c in chunks]
    sending, one = comm.rank == 0, bytearray(1)

    def once():
        if op == "pull":  # the source's layer-ready byte (kvbench's tcp signals on a socket), then the ask
            if sending:
                sock.sendall(one)
                sock.recv_into(one, 1, socket.MSG_WAITALL)
            else:
                sock.recv_into(one, 1, socket.MSG_WAITALL)
                sock.sendall(one)
        for iov, ends in iovs:
            _vec(sock, iov, ends, sending)
    return once
