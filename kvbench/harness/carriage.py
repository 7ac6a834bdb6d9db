"""Which NIC carried each case (a mixin of the harness): every rank samples every NIC's byte counters before
a case's first timed iteration and after its last (outside the timed windows, once per case, not per
descriptor), and its rows carry the deltas, the carrier and a note when that is not the NIC asked for.

Before the first case, ``check_routes`` (collective) resolves the NIC each pinned network transport
(``-O ifname``/``addr`` or KVBENCH_SOCKET_IFNAME) will listen on: one that does not exist is a one-line
error before anything is written; a route to a peer that leaves by another NIC is a preamble line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

from kvbench.fabric import carriers as C
from kvbench.fabric import nics
from kvbench.harness import railrows, wirerows
from kvbench.harness.pathcheck import Protocols, spans
from kvbench.harness.state import UserError
from kvbench.model.schemes import make_pairs
from kvbench.transports import options as O
from kvbench.transports.base import TransportError
from kvbench.transports.rails import select_rails
from kvbench.transports.sockets import if_addr, select_addr

nan = float("nan")
DEFAULTS = C.COLUMNS


def route_dev(dst: str, src: str) -> str | None:
    """The interface the kernel sends ``src`` -> ``dst`` packets out of (``ip route get``); None if unknown."""
    if shutil.which("ip") is None:
        return None
    try:
        p = subprocess.run(["ip", "-j", "route", "get", dst, "from", src], capture_output=True, text=True, timeout=5)
        return json.loads(p.stdout)[0].get("dev") if p.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def pinned_addr(name: str, hostname: str, options: dict) -> list[tuple[str, str | None]] | None:
    """(address, interface) per rail a socket transport was told to use (one without rails), None when it was
    not pinned; a NIC or address that does not exist raises UserError."""
    if "ifname" not in O.known(name):
        return None
    if not (options.get("ifname") or options.get("addr") or os.environ.get("KVBENCH_SOCKET_IFNAME")):
        return None
    try:  # a striping transport's rails are every NIC it was told to use (transports/rails.py)
        found = select_rails(hostname, options) if "rails" in O.known(name) else [select_addr(hostname, options)]
    except TransportError as exc:
        raise UserError(f"{name}: {exc}") from None
    for addr, ifname in found:
        if options.get("addr") and ifname is None and not addr.startswith("127.") and if_addr("lo") != addr:
            raise UserError(f"{name}: -O addr={addr}: no interface of this host has that address")
    return found


class Carrying(Protocols):
    """Counter samples around a case's timed iterations, and the rows' carrier columns (with what carried them in
    the engine's words and this process's sockets: pathcheck.Protocols)."""

    route_lines: list[str] = []  # the preamble's lines about routes (rank 0)
    pinned: dict[str, list] = {}  # transport -> the NICs it was told to use on this rank (check_routes)

    def check_routes(self, cases: list[dict], scheme: str) -> None:
        """Collective: every rank's pinned (address, NIC) per socket transport; an error on any rank is every
        rank's UserError; rank 0 keeps the preamble lines of routes leaving by another NIC."""
        mine, err = {}, None
        for name in dict.fromkeys(c["transport"] for c in cases):
            try:
                got = pinned_addr(name, self.comm.hostname, self.opts.transport_options.get(name, {}))
            except UserError as exc:
                err = err or f"rank {self.rank} ({self.comm.hostname}): {exc}"
                continue
            if got is not None:
                mine[name] = got
        every = self.comm.allgather((mine, err))
        errors = [e for _, e in every if e]
        if errors:
            raise UserError(errors[0])
        self.pinned = {name: [n for _, n in rails if n] for name, rails in mine.items() if any(n for _, n in rails)}
        lines = []
        for s, d in make_pairs(scheme, self.comm.size, self.opts.matrix) if self.comm.size > 1 else []:
            if self.rank not in (s, d):
                continue
            peer = d if s == self.rank else s
            for name, rails in mine.items():
                theirs = every[peer][0].get(name) or []
                for (addr, ifname), (to, _) in zip(rails, theirs):  # rail i dials the peer's rail i (tcp.py)
                    if ifname and (dev := route_dev(to, addr)) not in (None, ifname):
                        lines.append(f"# WARNING: {name}: rank {self.rank} was asked for {ifname} ({addr}) but its route "
                                     f"to rank {peer} ({to}) leaves by {dev}: its bytes will not cross "
                                     f"{ifname} (each row's carrier and carrier_note say what did)")
        self.route_lines = [ln for part in self.comm.gather(lines) or [] for ln in dict.fromkeys(part)]

    def nic_mark(self, m, t) -> None:
        """Before the case's first timed iteration (outside its window): every NIC's counters, and the kernel's
        count of each rail of transport ``t`` (railrows.py)."""
        m.nic_before = nics.sample(nvlink=m.case.get("memory") == "cuda")
        m.rails_before = railrows.counters(t)
        m.wire_before = wirerows.sample(t)
        self.sock_mark(m)

    def after_iteration(self, m, t, timed: bool) -> dict | None:
        """After an iteration's closing barrier (outside its window): on a timed one, the wire count of transport
        ``t`` since the last sample (wirerows.py); a staged transport's per-stage seconds (None for the rest)."""
        if timed:
            wirerows.take(m, t)
        return t.take_stages() if hasattr(t, "take_stages") else None

    def nic_take(self, m, t, iters: int) -> None:
        """After its last timed iteration (``iters`` of them): add what every NIC and rail moved since ``nic_mark``."""
        if m.nic_before is not None:
            after = nics.sample(nvlink=m.case.get("memory") == "cuda")
            m.nic_moved = C.add(m.nic_moved or {}, C.delta(m.nic_before, after))
            m.nic_before = None
        railrows.delta(m.rails_before, railrows.counters(t) if m.rails_before else None, m.rail_wire)
        self.sock_take(m)
        m.rails_before, m.timed = None, m.timed + iters

    def carrier_columns(self, m, s) -> dict:
        """This rank's carrier columns for the case's timed rows (DEFAULTS where it sampled nothing), and the
        case's carrier_proto (pathcheck.py)."""
        if m.nic_moved is None:
            return self.proto_columns(m, s)
        n = len(m.rec)
        sent = n * sum(e.payload for e in m.entries if e.src == self.rank)
        received = n * sum(e.payload for e in m.entries if e.dst == self.rank)
        c = C.carriage(m.nic_moved, sent, received)
        asked = self.pinned.get(m.case["transport"], [])
        network = bool(getattr(s.t.caps, "network", False)) and not s.local
        return {"nic_bytes": c.nic_bytes, "carrier": c.carrier, "carrier_tx_bytes": float(c.tx_bytes),
                "carrier_rx_bytes": float(c.rx_bytes), "wire_over_payload": c.wire_over_payload,
                "nic_asked": ",".join(asked), "carrier_note": C.note(c.carrier, asked, network),
                **self.proto_columns(m, s)}


def footer_lines(df) -> list[str]:
    """Rank 0: one line per note, naming the cases and ranks whose carrier it describes (not what was asked, or a
    loopback): a sweep of a thousand cases over one loopback says so once."""
    by: dict[str, tuple[set, set]] = {}
    for (case, rank), note in notes(df).items():
        cases, ranks = by.setdefault(note, (set(), set()))
        cases.add(int(case))
        ranks.add(int(rank))
    return [f"# CARRIER case{'s' * (len(c) > 1)} {spans(c)} rank{'s' * (len(r) > 1)} {spans(r)}: {note}"
            for note, (c, r) in by.items()]


def notes(df) -> dict:
    """{(case, rank): carrier_note} of the timed rows that have one."""
    if df is None or "carrier_note" not in df:
        return {}
    d = df[(df["carrier_note"].astype(object).fillna("") != "") & (df["iter"] >= 0)]
    return {(int(c), int(r)): str(g["carrier_note"].iloc[0]) for (c, r), g in d.groupby(["case", "rank"])}


def sidecar(df) -> dict:
    """For the sidecar: per case and rank, the carrier, its bytes, wire/payload and the note (timed rows)."""
    if df is None or "carrier" not in df:
        return {}
    d = df[(df["iter"] >= 0) & (df["carrier"].astype(object).fillna("") != "")]
    out: dict = {}
    for (case, rank), g in d.groupby(["case", "rank"]):
        r = g.iloc[0]
        out.setdefault(str(int(case)), {})[str(int(rank))] = {
            "carrier": r["carrier"], "asked": r["nic_asked"], "note": r["carrier_note"],
            "nic_bytes": C.decode(r["nic_bytes"]), "wire_over_payload": round(float(r["wire_over_payload"]), 4)}
    return out
