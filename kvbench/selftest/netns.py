"""Two network namespaces joined by a shaped veth pair: set-up, tear-down, byte counters.

Namespaces are ``kvb-<pid>-<rand>-a`` and ``-b`` (``<pid>-<rand>`` is the run id).
A run holds an exclusive flock on ``/run/kvbench-selftest/<id>.lock`` while it
lives; a namespace whose lock can be taken belongs to a run that is gone (killed,
crashed) and is removed by the next selftest.  The veth ends are
created directly inside the namespaces and both are named ``kvb0``, so one
``-O tcp.ifname``/``UCX_NET_DEVICES`` value fits every rank and nothing is ever
added to the root namespace.  Addresses are 10.201.0.1/30 (a) and 10.201.0.2/30
(b), assigned inside the namespaces only.  Both directions get a ``tbf`` qdisc.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

IFNAME = "kvb0"
ADDR_A, ADDR_B, PREFIX = "10.201.0.1", "10.201.0.2", 30
LOCK_DIR = "/run/kvbench-selftest"
NS_RE = re.compile(r"^kvb-(\d+)-([0-9a-f]+)-([ab])$")
CMD_TIMEOUT_S = 10.0

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class NetnsError(RuntimeError):
    pass


def parse_rate(text: str) -> int:
    """A tc-style rate in bits/s: ``1gbit``, ``500mbit``, ``2.5gbit``, ``100kbit`` or a bare number of bits/s.

    tc's byte units (``mbps``, ``gbps`` = bytes per second) are refused, as too easily misread.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in ("", *_UNITS):
        raise ValueError(f"rate '{text}': want a number with bit, kbit, mbit, gbit or tbit (e.g. 1gbit, 500mbit)")
    bits = float(m.group(1)) * _UNITS.get(m.group(2) or "bit")
    if not 10**6 <= bits <= 10**12:
        raise ValueError(f"rate '{text}': between 1mbit and 1tbit")
    return int(round(bits))


def fmt_rate(bits: float) -> str:
    return f"{bits / 1e9:g}gbit" if bits >= 1e9 else f"{bits / 1e6:g}mbit"


def tbf_params(rate_bits: int) -> tuple[int, int]:
    """(burst, limit) in bytes for ``tc qdisc ... tbf rate R burst B limit Q``.

    burst: 2 ms of the rate, at least 64 KiB.  The qdisc's watchdog fires late by
    up to the softirq latency of a busy machine; tokens that accrue meanwhile
    are kept only up to ``burst``, so a burst that covers that lateness keeps the
    long-run rate at R (1 ms fell short of the TCP-over-Ethernet ceiling that
    2 ms reaches: docs/evidence.md).  64 KiB
    holds one GSO packet whole (smaller bursts make tbf split GSO packets in
    software).  It is also what an idle link lends a transfer at line speed: a
    layer sent after an idle gap may finish up to burst/R early (2 ms at 1 Gbit/s,
    inside the streaming row's tolerance), and a 1 s bulk transfer gains 0.2%.
    limit (queue): 50 ms of the rate, at least 8 MiB.  A TCP socket may keep
    tcp_limit_output_bytes (a sysctl) in the qdisc, and kvbench and UCX open
    more than one; a drop would measure TCP's loss recovery, not the link.  The
    queue's depth does not move when a flow's last byte leaves (the qdisc is
    work-conserving), so a deep queue costs the measurement nothing.
    """
    rate_bytes = rate_bits / 8
    return max(int(rate_bytes * 2e-3), 64 * 1024), max(int(rate_bytes * 0.05), 8 * 2**20)


def _run(cmd: list[str], check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"'{' '.join(cmd)}' did not end within {timeout:g} s") from None
    if check and p.returncode != 0:
        raise NetnsError(f"'{' '.join(cmd)}' failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def missing_tools() -> list[str]:
    return [t for t in ("ip", "tc") if shutil.which(t) is None]


def new_run_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def _lock_path(run_id: str) -> str:
    return os.path.join(LOCK_DIR, f"{run_id}.lock")


def claim(run_id: str) -> int:
    """Take the run's lock (held until ``release``); the fd is not inherited by child processes."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(_lock_path(run_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def release(run_id: str, fd: int | None) -> None:
    try:
        os.unlink(_lock_path(run_id))
    except OSError:
        pass
    if fd is not None:
        os.close(fd)


def running(run_id: str) -> bool:
    """True while the run that made ``run_id`` holds its lock."""
    try:
        fd = os.open(_lock_path(run_id), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: its run is gone (or never got that far)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


@dataclass
class Link:
    run_id: str
    rate_bits: int
    burst: int = 0
    limit: int = 0
    lock_fd: int | None = None

    @property
    def ns_a(self) -> str:
        return f"kvb-{self.run_id}-a"

    @property
    def ns_b(self) -> str:
        return f"kvb-{self.run_id}-b"

    def prefix(self, side: str) -> list[str]:
        """Command prefix that runs a program inside namespace a or b."""
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b]


def list_namespaces() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def setup(run_id: str, rate_bits: int) -> Link:
    """Create both namespaces, the veth pair, addresses, loopback, and tbf on both ends.

    On any failure whatever was made is removed before the error propagates."""
    link = Link(run_id, rate_bits, *tbf_params(rate_bits))
    try:
        link.lock_fd = claim(run_id)
        _run(["ip", "netns", "add", link.ns_a])
        _run(["ip", "netns", "add", link.ns_b])
        _run(["ip", "-n", link.ns_a, "link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME,
              "netns", link.ns_b])
        for ns, addr in ((link.ns_a, ADDR_A), (link.ns_b, ADDR_B)):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            add_tbf(ns, IFNAME, rate_bits)
    except BaseException:
        teardown(link)
        raise
    return link


def add_tbf(ns: str, dev: str, rate_bits: int) -> None:
    """Shape ``dev`` in namespace ``ns`` to ``rate_bits`` with a token bucket (``tbf_params``'s burst and limit)."""
    burst, limit = tbf_params(rate_bits)
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst),
          "limit", str(limit)])


def remove_namespace(ns: str) -> bool:
    """Kill what lives in ``ns`` and delete it (its veths and qdiscs go with it); whether it was deleted."""
    if kill_inside(ns):
        time.sleep(0.1)
    return _run(["ip", "netns", "del", ns], check=False).returncode == 0


def kill_inside(ns: str) -> list[int]:
    """SIGKILL the processes living in namespace ``ns`` (ours: nothing else runs in a selftest namespace)."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    pids = [int(x) for x in p.stdout.split() if x.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def teardown(link: Link) -> list[str]:
    """Remove both namespaces (the veth pair and its qdiscs go with them); returns what was removed."""
    removed = []
    for ns in (link.ns_a, link.ns_b):
        if ns in list_namespaces() and remove_namespace(ns):
            removed.append(ns)
    release(link.run_id, link.lock_fd)
    link.lock_fd = None
    return removed


def sweep_leftovers() -> list[str]:
    """Remove the namespaces (and lock files) of earlier selftests that are no longer running."""
    removed, gone = [], set()
    for ns in list_namespaces():
        m = NS_RE.match(ns)
        if not m:
            continue
        rid = f"{m.group(1)}-{m.group(2)}"
        if running(rid):
            continue
        kill_inside(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
        gone.add(rid)
    try:  # lock files of runs that died before making their namespaces
        gone |= {f[:-5] for f in os.listdir(LOCK_DIR) if f.endswith(".lock") and not running(f[:-5])}
    except OSError:
        pass
    for rid in gone:
        release(rid, None)
    return removed


def qdisc_stats(ns: str) -> dict:
    """The tbf qdisc's counters on kvb0 in ``ns``: bytes, packets, drops, overlimits, and its options."""
    p = _run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", IFNAME])
    for q in json.loads(p.stdout or "[]"):
        if q.get("kind") == "tbf":
            return q
    raise NetnsError(f"no tbf qdisc on {IFNAME} in {ns}")


def link_stats(ns: str) -> dict:
    """kvb0's interface counters in ``ns`` (stats64: rx/tx bytes and packets)."""
    p = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", IFNAME])
    return json.loads(p.stdout)[0]["stats64"]


@dataclass
class Counters:
    a_to_b: int  # bytes through a's tbf (a -> b)
    b_to_a: int  # bytes through b's tbf
    b_rx: int  # bytes b's kvb0 received
    drops: int  # packets tbf dropped, both ends

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.a_to_b - other.a_to_b, self.b_to_a - other.b_to_a, self.b_rx - other.b_rx,
                        self.drops - other.drops)


def counters(link: Link) -> Counters:
    qa, qb = qdisc_stats(link.ns_a), qdisc_stats(link.ns_b)
    return Counters(int(qa["bytes"]), int(qb["bytes"]), int(link_stats(link.ns_b)["rx"]["bytes"]),
                    int(qa.get("drops", 0)) + int(qb.get("drops", 0)))
