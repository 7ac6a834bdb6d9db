"""--nic and tcp's rails on the command line: the interfaces named, or auto, checked against this host's."""
from __future__ import annotations

import os
import socket

from kvbench.config import ConfigError
from kvbench.memory import affinity
from kvbench.model.limits import clip
from kvbench.transports.base import TransportError
from kvbench.transports.rails import select_rails


def nic_arg(text: str | None) -> list[str] | None:
    """--nic: ["auto"], or the interfaces named, each one this host has (not loopback)."""
    if text is None:
        return None
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if names == ["auto"]:
        return names
    if not names or "auto" in names:
        raise ConfigError(f"--nic {text}: give auto, or interface names (eth0,eth1)")
    have = [n["name"] for n in affinity.netdevs()]  # loopback is not among them: it carries no fabric's bytes
    for n in sorted(names, key=lambda n: n == "lo"):  # a name that is nowhere first, then a loopback named
        if n not in have:
            what = "'lo' is the loopback interface, not a NIC" if n == "lo" else f"no interface {clip(n)} here"
            raise ConfigError(f"--nic {text[:80]}: {what} (have: {', '.join(have) or 'none'})")
    if len(set(names)) < len(names):
        raise ConfigError(f"--nic {text}: names an interface twice")
    return names


def check_nics(topts: dict, nic: list[str] | None = None, names: tuple = ("tcp",)) -> None:
    """tcp's NICs and rails against this host's interfaces: a NIC that does not exist, or more rails than NICs, is
    refused before anything is written (every rank is assumed to see the same interface names)."""
    opts = topts.get("tcp") or {}
    if "tcp" not in names or not (nic or opts.get("ifname") or opts.get("rails") or "," in str(opts.get("addr") or "")):
        return
    nics = None
    if nic:
        nics = [n["name"] for n in affinity.rank_nics(os.sched_getaffinity(0))] if nic == ["auto"] else nic
        if not (opts.get("addr") or opts.get("ifname")):  # as the transport reads them (tcp.py register)
            opts = dict(opts, rails=opts.get("rails") or (1 if nic == ["auto"] else len(nic)))
    try:
        select_rails(socket.gethostname(), opts, nics)
    except TransportError as exc:
        raise ConfigError(f"tcp NICs (-O, --nic): {exc}") from None
