"""ucx in engines.py: ucx_perftest (ucp_put_bw and ucp_get one-sided, like kvbench's ucx transport; tag_bw
two-sided, like its -O mode=tag) at kvbench's message sizes."""
from __future__ import annotations

import subprocess

import native_tools as nt  # (subprocess only)

TOOL = ("libucx", "bin", "ucx_perftest")  # under site-packages (the ucxx wheel's UCX)


def tools(a, mpirun):
    """ucx_perftest per test and size: {(op, size, tool): GB/s}, and notes (failures)."""
    got, notes = {}, []
    for op, test in (("push", "tag_bw"), ("push", "ucp_put_bw"), ("pull", "ucp_get")):
        for size in a.sizes:
            try:
                got[(op, size, f"ucx_perftest {test}")] = nt.ucx_run(test, size, a.tls, a.ucx_budget, 60)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                notes.append(f"ucx_perftest {test} {size}: {str(exc).splitlines()[0]}")
    return got, notes


def describe(a, i: dict) -> None:
    """The header's lines on what differs between ucx_perftest and kvbench's ucx rows (i: rank 0's info())."""
    ep = next(iter(i.get("lanes", {}).values()), {})
    lanes = ep.get("put", []) or ep.get("tag_send", [])
    print(f"#   ucx_perftest (UCX_TLS={a.tls}, one buffer, back to back, -n from {a.ucx_budget:.0e} B): put_bw/get"
          " are one-sided like kvbench's ucx transport (a put or get per descriptor run and a flush per request,")
    print("#   then kvbench's own notification); tag_bw is two-sided, like kvbench's -O mode=tag (a 32 B header per"
          " request; its pull sends a request, then the source tag-sends)")
    if lanes:
        print(f"#   ucx kvbench: UCX_TLS={i.get('UCX_TLS')}, protocol for large messages: {lanes[-1]};"
              f" progress: {i.get('progress')} (ucx_perftest spins)")
