"""mooncake in engines.py: transfer_engine_bench over tcp, a batch of LAYERS requests of SIZE at distinct offsets
(one kvbench request), 1 thread, write and read."""
from __future__ import annotations

import os
import subprocess

import native_tools as nt  # (subprocess only)

TOOL = ("mooncake", "transfer_engine_bench")  # under site-packages (the mooncake wheel)


def tools(a, mpirun):
    """A transfer_engine_bench target, then one initiator run per op and size: {(op, size, tool): GB/s}, and
    notes (failures)."""
    got, notes = {}, []
    buffer_size = max(256 << 20, max(a.sizes) * a.layers)
    log = os.path.join(a.work, "mooncake_target.log")
    try:
        _, session = nt.mooncake_target(buffer_size, log)
        for op, mop in (("push", "write"), ("pull", "read")):
            for size in a.sizes:
                tool = f"transfer_engine_bench {mop}"
                try:
                    got[(op, size, tool)] = nt.mooncake_run(session, mop, size, a.layers, 1, a.mc_duration,
                                                            buffer_size, 30 + a.mc_duration)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    notes.append(f"{tool} {size}: {str(exc).splitlines()[0]}")
    except RuntimeError as exc:
        notes.append(f"transfer_engine_bench target: {exc}")
    finally:
        nt._kill_all()
    return got, notes


def describe(a, i: dict) -> None:
    """The header's lines on what differs between transfer_engine_bench and kvbench's mooncake rows."""
    L = a.layers
    print(f"#   transfer_engine_bench: tcp, --batch_size={L} (= descriptors of one kvbench request, at distinct"
          f" offsets, the same {L} every batch: bulk's working set) --threads=1, {a.mc_duration} s, busy-polls"
          " each task, no notification;")
    print(f"#   mooncake kvbench: protocol={i.get('protocol')}, a request's {L} layers as one batch of {L} descriptors,"
          f" one get_batch_transfer_status; notify={i.get('notify', '?').split()[0]} (socket: the initiator sends"
          " the tag per request on a TCP socket the destination sleeps on; mpi: the harness's MPI message); a"
          " rank done early (a pull's source) sleeps in the barrier after the iteration, as the tool's target idles")
