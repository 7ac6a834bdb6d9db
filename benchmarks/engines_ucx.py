"""ucx in engines.py: ucx_perftest (tag_bw two-sided, like kvbench's ucx transport; ucp_put_bw and ucp_get
one-sided) at kvbench's message sizes."""
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
    lanes = next(iter(i.get("lanes", {}).values()), {}).get("tag_send", [])
    print(f"#   ucx_perftest (UCX_TLS={a.tls}, one buffer, back to back, -n from {a.ucx_budget:.0e} B): tag_bw is"
          " two-sided like kvbench's ucx transport (compare push with it; kvbench adds a 32 B header message per")
    print("#   request, sent when it is prepared); put_bw/get are one-sided (ucxx has none); kvbench's ucx pull is"
          " two-sided (a request, then the source tag-sends), shown against ucp_get as the tool's read")
    if lanes:
        print(f"#   ucx kvbench: UCX_TLS={i.get('UCX_TLS')}, tag protocol for large messages: {lanes[-1]};"
              f" progress: {i.get('progress')} (ucx_perftest spins)")
