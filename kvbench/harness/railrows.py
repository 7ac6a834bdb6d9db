"""Rails in the rows: per rail of a striping transport (tcp's ``-O rails``), its NIC, the bytes and descriptors of
each request it carried, and what the kernel counted on its connection over the timed iterations.

A transport that stripes says so with ``rail_names()`` (one name per rail) and ``rail_counters()`` (per peer and
rail: bytes sent and acknowledged, bytes received); every other transport's rows carry ``rails`` 0.
"""
from __future__ import annotations

from kvbench.transports.rails import handed, shares

EMPTY = {"rails": 0, "rail_nics": "", "rail_bytes": "", "rail_descs": "", "rail_wire_bytes": ""}


def counters(t) -> dict | None:
    """The transport's per-peer, per-rail kernel byte counts now; None where it has none."""
    get = getattr(t, "rail_counters", None)
    return get() if get is not None else None


def delta(before: dict | None, after: dict | None, into: dict) -> None:
    """Add the counts between two samples to ``into`` (per peer, per rail: [sent, received])."""
    if not before or not after:
        return
    for p, rails in after.items():
        acc = into.setdefault(p, [[0, 0] for _ in rails])
        for r, ((s1, r1), (s0, r0)) in enumerate(zip(rails, before.get(p, rails))):
            acc[r][0] += max(0, s1 - s0) if s0 >= 0 else 0
            acc[r][1] += max(0, r1 - r0) if r0 >= 0 else 0


def engine_rails(given: list[str], sockets: dict | None, iters: int) -> dict:
    """An engine that picks its own lanes (UCX, NIXL on UCX): the NICs it was handed and, with two or more, the
    bytes this process's own TCP connections moved over each of them per timed iteration (sent + received: one
    rank of a pair sends, the other receives).  Bytes over RDMA do not pass a socket: there the counts stay
    empty (the NIC counters in the carrier columns are the evidence)."""
    out = dict(EMPTY, rail_nics=",".join(given))
    if len(given) < 2:
        return out
    per = [sum((sockets or {}).get(n, (0, 0))) for n in given]
    out["rails"] = len(given)
    if sum(per):
        out["rail_wire_bytes"] = ",".join(str(round(b / max(1, iters))) for b in per)
    return out


def columns(t, itr, entries, rank: int, wire: dict, iters: int, sockets: dict | None = None) -> dict[int, dict]:
    """Per entry (by its index in ``entries``), its rows' rail columns."""
    names = getattr(t, "rail_names", None)
    if names is None:  # an engine that picks its own paths: the NICs handed to it (--nic, the lab's, -O rails)
        ctx = getattr(t, "ctx", None)
        given = handed(ctx) if ctx is not None and t.caps.network else []
        one = engine_rails(given, sockets, iters)
        return {k: dict(one) for k in range(len(entries))}
    names = names()
    if len(names) < 2:
        return {k: dict(EMPTY, rails=len(names), rail_nics=",".join(names)) for k in range(len(entries))}
    n, out = len(names), {}
    for k, e in enumerate(entries):
        one = itr.one.get(id(e)) if itr is not None else None
        nbytes, ndescs = shares([one] if one is not None else e.layers, n)
        peer = e.dst if e.src == rank else e.src
        got = wire.get(peer)
        side = 0 if e.src == rank else 1  # the source counts what was acknowledged, the destination what arrived
        per_iter = [round(c[side] / max(1, iters)) for c in got] if got else []
        out[k] = {"rails": n, "rail_nics": ",".join(names), "rail_bytes": ",".join(map(str, nbytes)),
                  "rail_descs": ",".join(map(str, ndescs)), "rail_wire_bytes": ",".join(map(str, per_iter))}
    return out
