"""The lab's network: namespaces, veth NICs, rail bridges, tbf shaping, the spine, and the state file.

Names carry ``kvbl-<id>`` (``<id>`` = ``<pid>-<hex>`` of the ``up`` that made it): node namespaces
``kvbl-<id>-n<i>``, the switch namespace ``kvbl-<id>-sw``.  Nothing is added to the root namespace: the
veth pairs are made with one end in a node (``rail<r>``) and the other in the switch (``n<i>r<r>``), whose
bridge ``br<r>`` is rail r.  Node n's NIC on rail r has 10.(100+r).0.(n+1)/24; the switch's bridge on rail r
10.(100+r).0.254 (it routes between rails only with a spine).  Every veth end has a tbf qdisc at the rate
(both directions of every link, as a switch port); with a spine each bridge has one at the spine's rate
(traffic routed into its rail), and each node sends what a rail-r address sends through rail r (policy
routes), so a cross-rail flow crosses the spine.  ``/run/kvbench-lab/<id>.json`` records a lab while it is up.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field

from kvbench.selftest import netns as N

STATE_DIR = "/run/kvbench-lab"
PREFIX = "kvbl-"
NS_RE = re.compile(r"^kvbl-(.+)-(n\d+|sw)$")
MAX_NODES, MAX_RAILS = 64, 8
run = N._run  # one command, its failure as NetnsError (selftest/netns.py)


def address(rail: int, node: int) -> str:
    """Node ``node``'s address on rail ``rail``."""
    return f"10.{100 + rail}.0.{node + 1}"


def spine_address(rail: int) -> str:
    return f"10.{100 + rail}.0.254"


@dataclass
class Lab:
    id: str
    nodes: int
    rails: int
    rate_bits: int
    spine_bits: int = 0  # 0: no spine (rail-only)
    created: str = ""
    namespaces: list[str] = field(default_factory=list)  # what exists so far (down removes these)
    owner: int = 0  # the `lab run` that made it for itself (it goes when that process does); 0: `lab up`'s

    def node_ns(self, n: int) -> str:
        return f"{PREFIX}{self.id}-n{n}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.id}-sw"

    def nics(self) -> list[str]:
        """Every node's NIC names (the same in each node)."""
        return [f"rail{r}" for r in range(self.rails)]

    def describe(self) -> str:
        spine = f", spine {N.fmt_rate(self.spine_bits)}" if self.spine_bits else ", rail-only"
        return (f"lab {self.id}: {self.nodes} nodes x {self.rails} rails at {N.fmt_rate(self.rate_bits)} per NIC"
                f"{spine}; node n, rail r = 10.(100+r).0.(n+1)/24 on NIC rail<r> in {self.node_ns(0)[:-1]}<n>")


def state_path(lab_id: str) -> str:
    return os.path.join(STATE_DIR, f"{lab_id}.json")


def save(lab: Lab) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(lab.id) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(asdict(lab), fh)
    os.replace(tmp, state_path(lab.id))


def labs() -> list[Lab]:
    """The labs recorded as up, oldest first."""
    try:
        files = sorted(f for f in os.listdir(STATE_DIR) if f.endswith(".json"))
    except OSError:
        return []
    out = []
    for f in files:
        try:
            with open(os.path.join(STATE_DIR, f)) as fh:
                out.append(Lab(**json.load(fh)))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda lab: lab.created)


def check(nodes: int, rails: int) -> None:
    if not 2 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes {nodes}: between 2 and {MAX_NODES}")
    if not 1 <= rails <= MAX_RAILS:
        raise ValueError(f"--rails {rails}: between 1 and {MAX_RAILS}")


def _sysctl(ns: str, *settings: str) -> None:
    run(["ip", "netns", "exec", ns, "sysctl", "-qw", *settings])


def _add_ns(lab: Lab, ns: str) -> None:
    run(["ip", "netns", "add", ns])
    lab.namespaces.append(ns)
    save(lab)  # recorded before anything is put in it: an interrupted up is still found by down
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def up(nodes: int, rails: int, rate_bits: int, spine_bits: int = 0, lab_id: str | None = None,
       owner: int = 0) -> Lab:
    """Build a lab; on any failure (or interrupt) whatever was made is removed before the error propagates."""
    check(nodes, rails)
    lab = Lab(lab_id or N.new_run_id(), nodes, rails, rate_bits, spine_bits,
              time.strftime("%Y-%m-%dT%H:%M:%S%z"), owner=owner)
    # checked before anything is made: the failure path below removes every namespace of this id, a live lab's too
    if os.path.exists(state_path(lab.id)) or any((m := NS_RE.match(ns)) and m.group(1) == lab.id
                                                 for ns in N.list_namespaces()):
        raise N.NetnsError(f"lab {lab.id} is up already (kvbench lab status): give another --id, or down it first")
    try:
        sw = lab.switch_ns
        _add_ns(lab, sw)
        for r in range(rails):
            run(["ip", "-n", sw, "link", "add", f"br{r}", "type", "bridge"])
            run(["ip", "-n", sw, "link", "set", f"br{r}", "up"])
        for n in range(nodes):
            ns = lab.node_ns(n)
            _add_ns(lab, ns)
            # a reply may come back on another rail than its request left by (a misroute, a spine): keep it
            _sysctl(ns, "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
            for r in range(rails):
                nic, port = f"rail{r}", f"n{n}r{r}"
                run(["ip", "-n", ns, "link", "add", nic, "type", "veth", "peer", "name", port, "netns", sw])
                run(["ip", "-n", ns, "addr", "add", f"{address(r, n)}/24", "dev", nic])
                _sysctl(ns, f"net.ipv4.conf.{nic}.rp_filter=0")
                run(["ip", "-n", ns, "link", "set", nic, "up"])
                run(["ip", "-n", sw, "link", "set", port, "master", f"br{r}", "up"])
                N.add_tbf(ns, nic, rate_bits)
                N.add_tbf(sw, port, rate_bits)
        if spine_bits:
            _spine(lab)
    except BaseException:
        down(lab)
        raise
    return lab


def _spine(lab: Lab) -> None:
    """Routing between the rails in the switch, shaped at the spine's rate; nodes send a rail-r address's
    packets through rail r (to the spine when the destination is on another rail)."""
    sw = lab.switch_ns
    _sysctl(sw, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
    for r in range(lab.rails):
        run(["ip", "-n", sw, "addr", "add", f"{spine_address(r)}/24", "dev", f"br{r}"])
        N.add_tbf(sw, f"br{r}", lab.spine_bits)
    for n in range(lab.nodes):
        ns = lab.node_ns(n)
        for r in range(lab.rails):
            table = str(100 + r)
            run(["ip", "-n", ns, "route", "add", f"10.{100 + r}.0.0/24", "dev", f"rail{r}", "table", table])
            run(["ip", "-n", ns, "route", "add", "10.0.0.0/8", "via", spine_address(r), "dev", f"rail{r}",
                 "table", table])
            run(["ip", "-n", ns, "rule", "add", "from", address(r, n), "table", table])


def down(lab: Lab) -> list[str]:
    """Remove the lab's namespaces (their veths, bridges and qdiscs go with them) and its record."""
    names = set(lab.namespaces) | {lab.switch_ns} | {lab.node_ns(n) for n in range(lab.nodes)}
    removed = [ns for ns in sorted(set(N.list_namespaces()) & names) if N.remove_namespace(ns)]
    for path in (state_path(lab.id), state_path(lab.id) + ".tmp"):
        try:
            os.unlink(path)
        except OSError:
            pass
    return removed


def orphans() -> list[Lab]:
    """Labs whose `lab run` died without removing them (kill -9): their launch still runs in their namespaces."""
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return b"lab" in fh.read()  # a pid reused by another program is not the lab's owner
        except OSError:
            return False

    return [lab for lab in labs() if lab.owner and not alive(lab.owner)]


def strays() -> list[str]:
    """Lab namespaces no record names (a record removed by hand, a host crash's leftovers)."""
    known = {ns for lab in labs() for ns in lab.namespaces}
    return [ns for ns in N.list_namespaces() if NS_RE.match(ns) and ns not in known]


def counters(lab: Lab, node: int) -> dict[str, tuple[int, int]]:
    """A node's NICs' (tx_bytes, rx_bytes), read from inside its namespace."""
    p = run(["ip", "-n", lab.node_ns(node), "-s", "-j", "link", "show"])
    return {d["ifname"]: (int(d["stats64"]["tx"]["bytes"]), int(d["stats64"]["rx"]["bytes"]))
            for d in json.loads(p.stdout) if d["ifname"].startswith("rail")}
