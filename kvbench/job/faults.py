"""Fault injection for the reliability tests: inert unless KVBENCH_FAULT is set.

``KVBENCH_FAULT=kind:rank[:case]``, several separated by commas.  ``case``
(1-based, as the table numbers cases) limits a fault to that case; without it
the fault fires at the first chance.  Kinds:

  post         raise a TransportError at the first transfer (an error on one rank)
  kill         SIGKILL this rank in the middle of a transfer (a node dying)
  stall-setup  SIGSTOP this rank while it fills its pool (a hung node during setup)
  stall-case   SIGSTOP this rank at the start of a case's first iteration
  stall-between-cases      SIGSTOP this rank after a case's check, before its rows go to rank 0
  stall-between-transports SIGSTOP this rank once a transport is closed, before the next one's setup
  stall-after-last         SIGSTOP this rank after the last transport's cases, before the footer
  stall-finalize           SIGSTOP this rank at the run's last barrier, before MPI's finalisation
  token        present a wrong token to the peers' listeners
  tcp-close    tcp: close the data connection half-way through a layer
  codec-wire   codecs: flip one bit in the middle of every frame this rank receives, before decoding

and the fault matrix's points, ``action@point`` with action ``stop`` (SIGSTOP: a hung node), ``kill`` (SIGKILL:
a node dying), ``segv`` (SIGSEGV: a library crashing, as a registration past its limit does) or ``raise`` (an
exception on that rank's main thread), e.g. ``KVBENCH_FAULT=stop@check:1:2``:

  before-setup        once the run's files are open, before the first transport's setup
  fill                while this rank fills its pool
  connect             after the pools are registered, before this rank connects to its peers
  case                at the start of a case's first iteration (after its barrier)
  check               at the start of a case's check pass (after its barrier)
  between-cases       after a case's check, before its rows go to rank 0
  between-transports  once a transport is closed, before the next one's setup
  after-last          after the last transport's cases, before the footer
  table-write         rank 0: between writing the table's .tmp and renaming it over the table; another
                      rank: once its rows reached rank 0 (while rank 0 writes them)
  sidecar-finish      rank 0: between writing the sidecar's last .tmp and renaming it; another rank: as it
                      waits for rank 0's footer (the end of the run's status)

With KVBENCH_FAULT_STAMP=<file> set, a point appends the moment it fires (time.time(), what, rank) to that
file first: the fault matrix measures from there how long the job took to end.
"""
from __future__ import annotations

import os
import signal
import time

KINDS = ("post", "kill", "stall-setup", "stall-case", "stall-between-cases", "stall-between-transports",
         "stall-after-last", "stall-finalize", "token", "tcp-close", "codec-wire")
ACTIONS = ("stop", "kill", "segv", "raise")
# the older stall-* kinds are stop@ these points
STALLS = {"stall-setup": "fill", "stall-case": "case", "stall-between-cases": "between-cases",
          "stall-between-transports": "between-transports", "stall-after-last": "after-last"}
POINTS = ("before-setup", "fill", "connect", "case", "check", "between-cases", "between-transports", "after-last",
          "table-write", "sidecar-finish")


class InjectedFault(RuntimeError):
    """The exception a ``raise@point`` fault raises."""


def _known(kind: str) -> bool:
    action, at, point = kind.partition("@")
    return kind in KINDS or (bool(at) and action in ACTIONS and point in POINTS)


def _parse(spec: str) -> list[tuple[str, int, int | None]]:
    out = []
    for item in filter(None, spec.split(",")):
        kind, _, rest = item.partition(":")
        rank, _, case = rest.partition(":")
        if not _known(kind) or not rank.isdigit() or (case and not case.isdigit()):
            raise ValueError(f"KVBENCH_FAULT item '{item}' is not kind:rank[:case] with kind one of: {', '.join(KINDS)}, "
                             f"or action@point with action one of {', '.join(ACTIONS)} and point one of {', '.join(POINTS)}")
        out.append((kind, int(rank), int(case) if case else None))
    return out


try:  # read at import; a switch that is not one is the run's one line at its door (cli/run.py), not a traceback
    FAULTS, ERROR = _parse(os.environ.get("KVBENCH_FAULT", "")), ""
except ValueError as exc:
    FAULTS, ERROR = [], str(exc)


def armed(kind: str, rank: int, case: int | None = None) -> bool:
    """Whether fault ``kind`` fires on ``rank`` now (in ``case``, when given)."""
    return any(k == kind and r == rank and (c is None or case is None or c == case) for k, r, c in FAULTS)


def hit(kind: str, rank: int, case: int | None = None) -> None:
    """Act out the faults that only need the process itself (kill, stall-*)."""
    if not armed(kind, rank, case):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind.startswith("stall"):
        os.kill(os.getpid(), signal.SIGSTOP)


def at(point: str, rank: int, case: int | None = None) -> None:
    """The fault matrix's named point ``point`` (POINTS): stop, kill or raise here if KVBENCH_FAULT says so."""
    stall = next((k for k, p in STALLS.items() if p == point), None)
    for action in ACTIONS:
        if armed(f"{action}@{point}", rank, case) or (action == "stop" and stall and armed(stall, rank, case)):
            stamp = os.environ.get("KVBENCH_FAULT_STAMP")
            if stamp:
                with open(stamp, "a") as fh:
                    fh.write(f"{time.time():.3f} {action}@{point} {rank}\n")
            if action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            else:
                raise InjectedFault(f"raise@{point} (KVBENCH_FAULT)")
