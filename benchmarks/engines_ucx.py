"""ucx in engines.py: ucx_perftest (ucp_put_bw and ucp_get one-sided, like kvbench's ucx transport; tag_bw
two-sided, like its -O mode=tag) at kvbench's message sizes."""
from __future__ import annotations

import subprocess

import native_tools as nt  # (subprocess only)

TOOL = ("libucx", "bin", "ucx_perftest")  # under site-packages (the ucxx wheel's UCX)


def tools(a, mpirun):
    """ucx_perftest per test and size: {(op, size, tool): GB/s}, and notes (failures)."""
    got, notes = {}, []
    runs = [(op, test, 1) for op, test in (("push", "tag_bw"), ("push", "ucp_put_bw"), ("pull", "ucp_get"))]
    runs += [("push", "ucp_put_bw", a.layers), ("pull", "ucp_get", a.layers)]  # bulk's working set: see describe
    for op, test, times in runs:
        name = f"ucx_perftest {test}" + (f" x{times}" if times > 1 else "")
        for size in a.sizes:
            try:
                got[(op, size, name)] = nt.ucx_run(test, times * size, a.tls, a.ucx_budget, 60)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                notes.append(f"{name} {size}: {str(exc).splitlines()[0]}")
    return got, notes


def describe(a, i: dict) -> None:
    """The header's lines on what differs between ucx_perftest and kvbench's ucx rows (i: rank 0's info())."""
    ep = next(iter(i.get("lanes", {}).values()), {})
    lanes = ep.get("put", []) or ep.get("tag_send", [])
    print(f"#   ucx_perftest (UCX_TLS={a.tls}, one buffer, back to back, -n from {a.ucx_budget:.0e} B): put_bw/get"
          " are one-sided like kvbench's ucx transport (a put or get per descriptor run and a flush per request,")
    print("#   then kvbench's own notification); tag_bw is two-sided, like kvbench's -O mode=tag (a 32 B header per"
          " request; its pull sends a request, then the source tag-sends)")
    print(f"#   'x{a.layers}': ucx_perftest with one message of {a.layers} x size, a kvbench request's bytes: the"
          " tool's buffer is then as large as bulk's working set (out of the CPU caches from 1 MiB up), so compare"
          " bulk with it; the single-buffer runs stay in the caches, as hot does")
    if lanes:
        print(f"#   ucx kvbench: UCX_TLS={i.get('UCX_TLS')}, protocol for large messages: {lanes[-1]};"
              f" progress: {i.get('progress')} (ucx_perftest spins)")
