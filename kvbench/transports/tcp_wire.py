"""tcp's own byte count: per peer, what the kernel says its data connections sent and received (struct tcp_info).

Read with getsockopt(TCP_INFO) outside the timed windows (harness/wirerows.py samples it after each timed
iteration's closing barrier), so the count costs the transfer nothing.  The control connections (layer-ready
signals) are left out: they carry no payload.
"""
from __future__ import annotations

from kvbench.fabric.procsock import counted  # the kernel's struct tcp_info, read once for every user


def counts(lanes: dict) -> dict[int, tuple[int, int]]:
    """Per peer, (sent, received) summed over its data connections (every lane and rail); a peer with any
    connection the kernel does not count is left out."""
    out = {}
    for peer, per_lane in lanes.items():
        got = [counted(c.sock) for rails in per_lane for c in rails]
        if got and all(s >= 0 for s, _ in got):
            out[peer] = (sum(s for s, _ in got), sum(r for _, r in got))
    return out
