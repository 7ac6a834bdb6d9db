"""The wire's own byte count in the rows (issue 42, item 2).

A transport that can count what its own connections carried says so with ``wire_counts()``: per peer, the
bytes sent to it and received from it so far (tcp: the kernel's struct tcp_info, transports/tcp_wire.py).  The
harness samples it before a case's first timed iteration (``carriage.nic_mark``) and after each timed
iteration's closing barrier (``carriage.after_iteration``), both outside the timed window, and each timed row
carries in ``wire_counted_bytes`` its request's share of that iteration's count: on the source's row what went
to the destination, on the destination's row what came from the source.  Every other transport's rows, and a
case's check-pass and setup rows, carry NaN; ``wire_bytes`` stays the computed payload + control bytes everywhere.
"""
from __future__ import annotations

from kvbench.results.schema import WIRE_DEFAULTS as DEFAULTS  # noqa: F401  (rows.py's base_row)

nan = float("nan")


def sample(t) -> dict | None:
    """Per peer, (sent, received) bytes the transport's connections counted so far; None where it counts none."""
    get = getattr(t, "wire_counts", None)
    return get() if get is not None else None


def take(m, t) -> None:
    """After a timed iteration's closing barrier: per peer, what moved since the last sample, appended to
    ``m.wire`` (one entry per timed iteration, as ``m.rec``)."""
    if m.wire_before is None:
        return
    now = sample(t) or {}
    m.wire.append({p: (s - m.wire_before[p][0], r - m.wire_before[p][1])
                   for p, (s, r) in now.items() if p in m.wire_before})
    m.wire_before = now


def per_entry(wire: list, entries, rank: int) -> dict[int, list[float]]:
    """Per entry (by its index in ``entries``) that crosses a connection of this rank, per timed iteration its
    counted bytes (NaN where the peer was not counted)."""
    if not wire:
        return {}
    # one connection carries every request of the iteration between its two ranks (and, pairs sending both ways,
    # the other flow's 32-byte pull requests): the count is split between them by their payloads' share
    share: dict[tuple[bool, int], int] = {}
    for e in entries:
        if e.src != e.dst and rank in (e.src, e.dst):
            key = (e.src == rank, e.dst if e.src == rank else e.src)
            share[key] = share.get(key, 0) + e.payload
    out = {}
    for k, e in enumerate(entries):
        if e.src == e.dst or rank not in (e.src, e.dst):
            continue
        sending = e.src == rank
        peer, total = (e.dst if sending else e.src), share[(sending, e.dst if sending else e.src)]
        out[k] = [w[peer][0 if sending else 1] * e.payload / total if total and peer in w else nan for w in wire]
    return out


def at(counted: dict, k: int, it: int) -> float:
    """Entry ``k``'s counted bytes in timed iteration ``it`` (``per_entry``), NaN where it has none."""
    got = counted.get(k)
    return float(got[it]) if got is not None and it < len(got) else nan
