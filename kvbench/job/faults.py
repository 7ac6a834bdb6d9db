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
"""
from __future__ import annotations

import os
import signal

KINDS = ("post", "kill", "stall-setup", "stall-case", "stall-between-cases", "stall-between-transports",
         "stall-after-last", "stall-finalize", "token", "tcp-close", "codec-wire")


def _parse(spec: str) -> list[tuple[str, int, int | None]]:
    out = []
    for item in filter(None, spec.split(",")):
        kind, _, rest = item.partition(":")
        rank, _, case = rest.partition(":")
        if kind not in KINDS or not rank.isdigit() or (case and not case.isdigit()):
            raise ValueError(f"KVBENCH_FAULT item '{item}' is not kind:rank[:case] with kind one of: {', '.join(KINDS)}")
        out.append((kind, int(rank), int(case) if case else None))
    return out


FAULTS = _parse(os.environ.get("KVBENCH_FAULT", ""))


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
