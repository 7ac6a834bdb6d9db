"""--register in the harness: which cases share a transport and pool, whose pool its peers reach (registered
once even under per-request), why a transport cannot register per request, and the sidecar's counts of the
registrations a transport made and undid.  The timed calls themselves are the iteration's (schedule.py)."""
from __future__ import annotations

from kvbench.transports.registration import pool_once


def session_key(case: dict) -> tuple:
    """Cases that share one transport instance and pool: same memory kind, copy engine and --register; under
    per-request also the same op (it decides whose pool peers reach, which stays registered once)."""
    reg = case.get("register", "once")
    return case.get("memory", "host"), case.get("copy", "batch"), reg, case["op"] if reg == "per-request" else ""


def reached(rank: int, op: str, pairs) -> bool:
    """Peers reach into this rank's pool in ``op``: it is a push's destination or a pull's source."""
    return any(rank == (d if op == "push" else s) for s, d in pairs)


def reason(cls, case: dict) -> str | None:
    """Why --register per-request cannot run on ``cls`` (None where it can, or the case registers once)."""
    if case.get("register", "once") != "per-request" or (cls.per_request() and not cls.caps.local_only):
        return None
    return (f"--register per-request: {cls.caps.unregistered or f'{cls.name} has no per-request registration'} "
            "(per-request: nixl, mooncake)")


def setup_note(t) -> str:
    """The reason of a ``register`` setup row: why nothing was registered, or nothing."""
    if t.caps.unregistered:
        return t.caps.unregistered
    return "" if pool_once(t.ctx) else ("--register per-request: no pool registered at setup (each request's "
                                        "blocks are, around its transfer)")


def count(h, t, case: dict, active: bool) -> None:
    """After a per-request transport's cases (collective): per rank, the registrations it made and undid, and
    whether its pool was registered at setup, for the sidecar's ``per_request`` (rank 0: "<transport> <op>" -> per rank)."""
    if case.get("register", "once") != "per-request":
        return
    got = h.comm.gather(t.info().get("per_request") if active else None)
    if h.rank == 0:  # the sidecar's extra fields (cli/run.py footer)
        h.extra_meta.setdefault("per_request", {})[f"{case['transport']} {case['op']}"] = got
