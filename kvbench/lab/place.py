"""A kvbench run with its ranks in the lab's nodes: one MPMD mpiexec (MPICH's hydra, in the root namespace),
each node's ranks started through ``ip netns exec`` (the process manager reaches them through inherited
file descriptors, which no namespace stops), every rank told its node's NICs.

What each rank gets: ``KVBENCH_LAB_NICS`` (its NICs, comma-separated), KVBENCH_SOCKET_IFNAME ``=<first NIC>``
(tcp's data path; ``-O ifname``/``addr`` in the run's arguments beat it), and MPICH kept on the rails as the
selftest keeps it on its veth (selftest/run.py MPI_ENV: every rank remote, UCX or libfabric on tcp over the
NICs named).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from kvbench.job.launch import LIVE, descendants, kill_tree
from kvbench.lab.net import Lab
from kvbench.selftest import run as selftest

GRACE_S = 5.0  # past the timeout or on a signal: SIGTERM, this long for the ranks' own exit path, then SIGKILL


def rank_env(nics: list[str], netmod: str, args: list[str]) -> dict:
    """The launch's environment (ours, this kvbench first on PYTHONPATH) with the lab's NICs."""
    extra = dict(selftest.MPI_ENV[netmod], KVBENCH_LAB_NICS=",".join(nics))
    extra["UCX_NET_DEVICES" if netmod == "ucx" else "FI_TCP_IFACE"] = ",".join(nics) if netmod == "ucx" else nics[0]
    if "UCX_NET_DEVICES" in os.environ:  # the user's own list stands (a NIC left out of it: a rail the footer names)
        extra["UCX_NET_DEVICES"] = os.environ["UCX_NET_DEVICES"]
    pinned = any(a.split("=", 1)[0].rpartition(".")[2] in ("ifname", "addr") for a in _options(args))
    if not pinned:
        extra["KVBENCH_SOCKET_IFNAME"] = "=" + nics[0]
    env = selftest.rank_env(extra)
    if pinned:
        env.pop("KVBENCH_SOCKET_IFNAME", None)
    return env


def _options(args: list[str]) -> list[str]:
    """The values of the run's -O options."""
    out = []
    for i, a in enumerate(args):
        if a in ("-O", "--option") and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith("-O") and len(a) > 2:
            out.append(a[2:])
        elif a.startswith("--option="):
            out.append(a.split("=", 1)[1])
    return out


def command(mpiexec: str, lab: Lab, per_node: int, args: list[str]) -> list[str]:
    """mpiexec -n K ip netns exec <node 0> python -m kvbench run ARGS : -n K ... <node N-1> ...: node n's
    ranks are n*K .. n*K+K-1."""
    cmd = [mpiexec]
    for n in range(lab.nodes):
        cmd += ([":"] if n else []) + ["-n", str(per_node), "ip", "netns", "exec", lab.node_ns(n), sys.executable,
                                       "-m", "kvbench", "run", *args]
    return cmd


def launch(cmd: list[str], env: dict, timeout: float) -> int:
    """Run the launch with its output on ours; past ``timeout`` s, or on an exception (an interrupt), its whole
    process tree ends (SIGTERM, GRACE_S, SIGKILL).  Its exit code, 124 on a timeout."""
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    LIVE.add(p.pid)
    tree: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while p.poll() is None:
            tree.update(descendants(p.pid))
            if time.monotonic() > deadline:
                print(f"# lab run: timed out after {timeout:g} s: ending the launch", flush=True)
                kill_tree(p.pid, tree, GRACE_S)
                p.wait()
                return 124
            time.sleep(0.2)
        return p.returncode
    finally:
        if p.poll() is None or p.returncode != 0:
            tree.update(descendants(p.pid))
            kill_tree(p.pid if p.poll() is None else None, tree, GRACE_S if p.poll() is None else 0.0)
            p.wait()
        LIVE.discard(p.pid)
