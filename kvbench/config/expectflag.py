"""``--expect``: the path a run's cases are meant to measure (fabric/expect.py derives it under ``auto``)."""
from __future__ import annotations

import argparse

from kvbench.fabric.expect import CHOICES, ExpectError, parse

HELP = ("the path the cases are meant to measure: shm, nvlink, rdma, tcp, any (no verdict; the carrier_proto "
        "column stays) or auto (default: from each case's transport, memory and placement: shared memory for "
        "ranks of one host, NVLink for device pools of one node, an RDMA NIC across hosts where there is one, "
        "else tcp; tcp's own path is tcp). A row carried by another path ends the run FALLBACK (exit 7)")


def arg(text: str) -> str:
    """argparse type of --expect: one of CHOICES, or one line naming them."""
    try:
        return parse(text)
    except ExpectError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(CHOICES)})") from None
