"""Which NIC carried a case's bytes: counter deltas, the carrier (the fewest NICs that moved >= 90% of the
bytes), wire bytes over payload, and a note when that is not the NIC asked for.

Pure arithmetic on ``nics.sample`` dicts ({name: (tx_bytes, rx_bytes)}).  The counters are the host's (or
the network namespace's), not the process's: ranks sharing a host count each other's bytes too.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from kvbench.fabric.nics import LOOPBACK

SHARE = 0.9  # a carrier set holds at least this share of the bytes every NIC moved
NONE = "none"  # the carrier of a payload no counted NIC moved (memory, or a path with no counter)
nan = float("nan")
# The result rows' carrier columns (schema 7) and their values where nothing was sampled (setup, check and
# skipped rows, older files).  On a timed row, over its case's timed iterations, from this rank's host or
# namespace: nic_bytes = encode() of every NIC that moved a byte; carrier = carriage()'s carrier;
# carrier_tx_bytes / carrier_rx_bytes = what the carrier sent and received; wire_over_payload = the carrier's
# bytes in the payload's direction(s) / the payload this rank sent and received; nic_asked = the NIC the
# transport was told to use ("" if none); carrier_note = note() ("" when there is nothing to say).
COLUMNS = {"nic_bytes": "", "carrier": "", "carrier_tx_bytes": nan, "carrier_rx_bytes": nan,
           "wire_over_payload": nan, "nic_asked": "", "carrier_note": ""}


def delta(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    """Bytes moved per NIC between two samples: NICs in both, those that moved a byte; a counter that went
    backwards (a device reset or re-created) counts 0."""
    out = {}
    for name in sorted(set(before) & set(after)):
        tx, rx = max(0, after[name][0] - before[name][0]), max(0, after[name][1] - before[name][1])
        if tx or rx:
            out[name] = (tx, rx)
    return out


def add(a: dict, b: dict) -> dict[str, tuple[int, int]]:
    """Two deltas summed per NIC (a case measured in several rounds)."""
    return {n: (a.get(n, (0, 0))[0] + b.get(n, (0, 0))[0], a.get(n, (0, 0))[1] + b.get(n, (0, 0))[1])
            for n in sorted(set(a) | set(b))}


def carrier(moved: dict) -> list[str]:
    """The fewest NICs, most bytes first, whose sent+received bytes reach SHARE of every NIC's; [] if none moved."""
    total = sum(tx + rx for tx, rx in moved.values())
    out, got = [], 0
    for name, (tx, rx) in sorted(moved.items(), key=lambda kv: (-(kv[1][0] + kv[1][1]), kv[0])):
        if total and got >= SHARE * total:
            break
        out.append(name)
        got += tx + rx
    return out if total else []


class Carriage(NamedTuple):
    """One rank's account of a case: its NICs' bytes and who carried them."""

    nic_bytes: str  # encode(moved)
    carrier: str  # comma-joined carrier NICs; NONE; "" when nothing moved and no payload passed this rank
    tx_bytes: int  # bytes the carrier NICs sent
    rx_bytes: int  # ... and received
    wire_over_payload: float  # carrier bytes in the payload's direction(s) / payload bytes (nan: no payload)


def carriage(moved: dict, sent: int, received: int) -> Carriage:
    """``moved``: this rank's NIC deltas over its timed iterations; ``sent``/``received``: payload bytes it
    sent and received in them.  When the NICs moved less than half the payload in its direction the carrier is
    NONE (the bytes went through memory); otherwise ``carrier()``."""
    need = sent + received
    along = sum(tx for tx, _ in moved.values()) * (sent > 0) + sum(rx for _, rx in moved.values()) * (received > 0)
    names = [NONE] if need and 2 * along < need else carrier(moved)
    tx = sum(moved[n][0] for n in names if n in moved)
    rx = sum(moved[n][1] for n in names if n in moved)
    ratio = (tx * (sent > 0) + rx * (received > 0)) / need if need else nan
    return Carriage(encode(moved), ",".join(names), tx, rx, ratio)


def per_nic(moved: dict, sent: int, received: int) -> dict[str, float]:
    """Each NIC's wire bytes over payload: its bytes in the payload's direction(s) / the payload (empty without
    payload); they sum to the whole rank's wire over payload."""
    need = sent + received
    return {n: (tx * (sent > 0) + rx * (received > 0)) / need for n, (tx, rx) in sorted(moved.items())} if need else {}


def note(carrier_text: str, asked: list[str] | None, network: bool) -> str:
    """What a network row must say about its carrier: '' when it is what was asked (or nothing to say)."""
    names = [n for n in carrier_text.split(",") if n]
    if not network or not names:
        return ""
    if names == [NONE]:
        return "no NIC carried the payload (counted NICs moved less than half of it)"
    if asked and not set(names) <= set(asked):
        return f"misrouted: asked {','.join(asked)}, carried by {','.join(names)}"
    if not asked and LOOPBACK in names:
        return f"loopback: carried by {','.join(names)}, not a NIC between hosts"
    return ""


def encode(moved: dict) -> str:
    """The rows' ``nic_bytes``: compact JSON {name: [tx_bytes, rx_bytes]}, names sorted."""
    return json.dumps({n: [int(tx), int(rx)] for n, (tx, rx) in sorted(moved.items())}, separators=(",", ":"))


def decode(text: str | None) -> dict[str, tuple[int, int]]:
    """``nic_bytes`` back as {name: (tx_bytes, rx_bytes)} ('' or missing: {})."""
    if not isinstance(text, str) or not text:
        return {}
    return {n: (int(v[0]), int(v[1])) for n, v in json.loads(text).items()}
