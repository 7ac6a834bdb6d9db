"""Rails: one request striped across several NICs, each rail carrying an equal share of its bytes.

* ``split(descs, n)``: the descriptor array cut into ``n`` arrays whose bytes differ by at most one; a
  descriptor that straddles a cut is split into two (numpy cumsum and searchsorted, no step per descriptor).
  The rails' arrays, concatenated in order, move exactly the bytes of ``descs`` to the same places.
* ``Splits``: the split of each array a transport is handed, cached by its identity (the harness posts the
  same arrays every iteration), with per rail its bytes and descriptors.
* ``Striped``: the handle of a request posted on several rails; it lands when its last rail lands.
* ``select_rails``: which NICs (or addresses) the rails use.
"""
from __future__ import annotations

import os
import socket

import numpy as np

from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.transports.base import TransportError
from kvbench.transports.sockets import if_addr, select_addr


def split(descs: np.ndarray, n: int) -> list[np.ndarray]:
    """``descs`` as ``n`` arrays of consecutive byte ranges; rail r carries bytes [r*T//n, (r+1)*T//n) of the
    request's T bytes in descriptor order."""
    if n < 1:
        raise ValueError(f"rails: {n} rails (need 1 or more)")
    descs = np.asarray(descs, dtype=np.int64).reshape(-1, 3)
    if n == 1:
        return [descs]
    lens = descs[:, LEN]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if len(ends) else 0
    starts = ends - lens
    cuts = (total * np.arange(n + 1, dtype=np.int64)) // n  # byte positions of the rails' edges
    # per rail the first descriptor ending after its start and the first ending at or after its end
    first = np.searchsorted(ends, cuts[:-1], side="right")
    last = np.searchsorted(ends, cuts[1:], side="left")
    out = []
    for r in range(n):  # one step per rail, never per descriptor
        lo, hi = int(cuts[r]), int(cuts[r + 1])
        if hi <= lo:
            out.append(np.empty((0, 3), dtype=np.int64))
            continue
        i, j = int(first[r]), int(last[r])
        part = descs[i : j + 1].copy()
        s = np.maximum(starts[i : j + 1], lo)
        skip = s - starts[i : j + 1]  # bytes of a descriptor before the rail's start
        part[:, SRC] += skip
        part[:, DST] += skip
        part[:, LEN] = np.minimum(ends[i : j + 1], hi) - s
        part = part[part[:, LEN] > 0]  # zero-length descriptors carry nothing on any rail
        out.append(np.ascontiguousarray(part))
    return out


class Splits:
    """Per descriptor array a transport is handed, its rails' arrays, bytes and descriptors (cached by the
    array's identity; the cache holds the array, so its id stays its own)."""

    def __init__(self, n: int):
        self.n = n
        self._cache: dict[int, tuple] = {}

    def of(self, descs: np.ndarray) -> list[np.ndarray]:
        hit = self._cache.get(id(descs))
        if hit is None or hit[0] is not descs:
            if len(self._cache) >= 4096:
                self._cache.clear()
            parts = split(descs, self.n)
            hit = self._cache[id(descs)] = (descs, parts)
        return hit[1]


def shares(layers: list[np.ndarray], n: int) -> tuple[list[int], list[int]]:
    """Per rail, the bytes and descriptors of a request whose layers are posted one array each (untimed:
    the rows' rail columns)."""
    nbytes, ndescs = [0] * n, [0] * n
    for d in layers:
        for r, part in enumerate(split(d, n)):
            nbytes[r] += int(part[:, LEN].sum())
            ndescs[r] += len(part)
    return nbytes, ndescs


class Striped:
    """A request posted on several rails: done when every rail's job is."""

    __slots__ = ("jobs",)

    def __init__(self, jobs: list):
        self.jobs = jobs


def lab_nics() -> list[str]:
    """KVBENCH_LAB_NICS (``kvbench lab run`` sets it, kvbench/lab/place.py): this rank's lab NICs, in order."""
    return [n for n in os.environ.get("KVBENCH_LAB_NICS", "").split(",") if n]


def handed(ctx) -> list[str]:
    """The NICs an engine that picks its own lanes was handed: --nic's (those it uses), else the lab's; ``-O
    rails=N`` keeps the first N."""
    nics = list(ctx.netdevs[: ctx.nic_rails]) if getattr(ctx, "netdevs", None) else lab_nics()
    want = int((ctx.options or {}).get("rails") or 0)
    return nics[:want] if want else nics


def ucx_devices(ctx, name: str) -> str:
    """``-O rails=N`` on a transport whose lanes UCX picks: UCX_NET_DEVICES becomes the first N NICs handed to
    this rank (UCX_MAX_RNDV_RAILS and UCX_MAX_RMA_RAILS N) unless the user set UCX_NET_DEVICES to something else than the lab's
    own list; what was set ('' when nothing).  Called before the transport's UCX context is made."""
    want = int((ctx.options or {}).get("rails") or 0)
    if not want:
        return ""
    nics = handed(ctx)
    if len(nics) < want:
        raise TransportError(f"{name}: -O rails={want}: this rank was handed {len(nics)} NIC(s)"
                             f"{' (' + ','.join(nics) + ')' if nics else ''}: name them with --nic A,B or run in a lab")
    now = os.environ.get("UCX_NET_DEVICES")
    if now is not None and now != ",".join(lab_nics()):
        return ""  # the user's list stands: a NIC left out of it is a rail that carries nothing (the footer says)
    os.environ["UCX_NET_DEVICES"] = ",".join(nics)
    for var in ("UCX_MAX_RNDV_RAILS", "UCX_MAX_RMA_RAILS"):  # rendezvous and one-sided puts/gets (UCX: 2 and 1)
        os.environ[var] = str(want)
    return f"UCX_NET_DEVICES={','.join(nics)} UCX_MAX_RNDV_RAILS={want} UCX_MAX_RMA_RAILS={want}"


def select_rails(hostname: str, options: dict, nics: list[str] | None = None) -> list[tuple[str, str | None]]:
    """(address, interface) of each rail: ``addr=A,B`` (one rail per address), ``ifname=X,Y`` (one per entry,
    its first interface with an IPv4 address), ``rails=N`` (the first N interfaces ``ifname`` matches, or of
    ``nics``, the ones --nic ranked, or else of the lab's NICs); else the one rail of ``select_addr``."""
    want = int(options.get("rails") or 0)
    addrs = [a for a in str(options.get("addr") or "").split(",") if a]
    lab = lab_nics()
    nics = nics or lab or None
    # in a lab the NIC list beats the lab's own pin of its first NIC (KVBENCH_SOCKET_IFNAME), so rails=N stripes
    spec = options.get("ifname") or (None if lab else os.environ.get("KVBENCH_SOCKET_IFNAME"))
    names = [n for _, n in socket.if_nameindex()]
    if addrs:
        if want > len(addrs):
            raise TransportError(f"rails={want}: more rails than the {len(addrs)} addresses of addr={options['addr']}")
        found = [(a, next((n for n in names if if_addr(n) == a), None)) for a in addrs[: want or len(addrs)]]
    elif spec and not spec.startswith("^") and (want or "," in spec):
        exact = spec.startswith("=")
        pats = [p for p in spec.lstrip("=").split(",") if p]
        per = [[n for n in names if (n == p if exact else n.startswith(p)) and if_addr(n)] for p in pats]
        have = ", ".join(f"{n} ({if_addr(n) or 'no IPv4'})" for n in names)
        if not want:
            missing = [p for p, hit in zip(pats, per) if not hit]
            if missing:
                raise TransportError(f"ifname={spec}: no interface with an IPv4 address matches '{missing[0]}'; "
                                     f"available: {have}")
            chosen = [hit[0] for hit in per]
        else:
            chosen = list(dict.fromkeys(n for hit in per for n in hit))
        if want > len(chosen):
            raise TransportError(f"rails={want}: more rails than the {len(chosen)} NICs ifname={spec} matches "
                                 f"(available: {have})")
        found = [(if_addr(n), n) for n in chosen[: want or len(chosen)]]
    elif nics and not options.get("addr") and not spec:
        usable = [n for n in nics if if_addr(n)]
        if want > len(usable):
            raise TransportError(f"rails={want}: more rails than the {len(usable)} NICs with an IPv4 address "
                                 f"({', '.join(usable) or 'none'})")
        found = [(if_addr(n), n) for n in usable[: max(1, want)]]
    elif want > 1:
        raise TransportError(f"rails={want}: name the NICs (-O ifname=eth0,eth1 or --nic auto) or addresses (-O addr=A,B)")
    else:
        found = [select_addr(hostname, options)]
    if len({a for a, _ in found}) < len(found):
        raise TransportError(f"rails: two rails on one address ({', '.join(a for a, _ in found)}): each rail needs "
                             "its own NIC or address")
    return found
