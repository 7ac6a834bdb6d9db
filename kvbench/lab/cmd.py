"""``kvbench lab up|run|down|status``: its own parser (every option after ``run --`` goes to kvbench run).

A mistake is one line and exit 1 with nothing created.  A lab made by ``up`` stays until ``down``; one that
``run`` makes for itself (no lab up, or --nodes/--rails/--rate/--spine given) goes when it ends; an ``up`` or
``run`` that fails or is interrupted (Ctrl-C, SIGTERM, SIGHUP) removes what it made.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys

from kvbench.lab import net, place
from kvbench.selftest import netns as N
from kvbench.selftest.run import default_mpiexec

PROG = "kvbench lab"


class OneLine(argparse.ArgumentParser):
    """A bad argument is one line and exit 1, as every other mistake (argparse's own: usage and exit 2)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(1)


def parser() -> argparse.ArgumentParser:
    ap = OneLine(prog=PROG, description="A fabric of network namespaces (root): N nodes with R "
                                 "veth NICs each into R rail bridges, tc tbf on every link; kvbench runs with one "
                                 "namespace per node. docs/lab.md")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="build a lab (it stays until `kvbench lab down`)")
    r = sub.add_parser("run", help="kvbench run with its ranks in the lab's nodes: kvbench lab run [options] -- "
                       "<kvbench run arguments>")
    for p in (u, r):
        p.add_argument("--nodes", type=int, help="node namespaces (default 2)")
        p.add_argument("--rails", type=int, help="NICs per node, one rail bridge each (default 1)")
        p.add_argument("--rate", help="tbf rate of every NIC, each direction (tc units: 1gbit, 500mbit; default 1gbit)")
        p.add_argument("--spine", metavar="RATE", help="route between rails through a spine shaped at RATE "
                       "(default: none, rail-only)")
    u.add_argument("--id", help="the lab's id (default <pid>-<hex>)")
    r.add_argument("--id", help="the lab to use (default: the one lab up; with none up, or with --nodes/--rails/"
                   "--rate/--spine, one made for this run and removed after it)")
    r.add_argument("--ranks-per-node", type=int, default=1, help="ranks in each node (default 1)")
    r.add_argument("--nics", help="the NICs each rank is given, comma-separated (default every rail; tcp uses the "
                   "first unless the run's -O ifname/addr says otherwise)")
    r.add_argument("--netmod", choices=("ucx", "ofi"), default="ucx", help="MPICH's netmod over the rails (default ucx)")
    r.add_argument("--timeout", type=float, default=1800.0, help="seconds before the launch is ended (default 1800)")
    r.add_argument("--mpiexec", default=default_mpiexec(), help="MPICH's mpiexec (default: the venv's)")
    d = sub.add_parser("down", help="remove a lab (default: every kvbench lab, and stray lab namespaces)")
    d.add_argument("--id", help="only this lab")
    sub.add_parser("status", help="the labs that are up")
    return ap


def fail(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, run_args = argv[:i], argv[i + 1:]
    try:
        a = parser().parse_args(argv)
    except SystemExit as exc:  # a bad argument (one line, OneLine.error) or --help
        return int(exc.code or 0)
    try:
        sizes = _sizes(a) if a.cmd in ("up", "run") else None
    except ValueError as exc:
        return fail(str(exc))
    if a.cmd == "run" and not run_args:
        return fail("give the kvbench run arguments after --, e.g. kvbench lab run -- -t tcp --tokens 1024")
    if a.cmd == "run" and (err := _options_error(a)):
        return fail(err)
    if a.cmd == "up" and a.id is not None and (not a.id.replace("-", "").isalnum() or len(a.id) > 24):
        return fail(f"--id '{a.id}': 1 to 24 letters, digits and '-'")
    if os.geteuid() != 0:
        return fail("needs root (it creates network namespaces, veth pairs, bridges and tc qdiscs)")
    if missing := N.missing_tools():
        return fail(f"needs {' and '.join(missing)} (iproute2)")
    for lab in net.orphans():  # a lab whose `lab run` was killed: its launch ends with it, here
        gone = net.down(lab)
        print(f"# removed lab {lab.id} ({len(gone)} namespaces, the launch in them ended): the lab run that made "
              f"it (pid {lab.owner}) is gone")
    if a.cmd == "status":
        return status()
    if a.cmd == "down":
        return down(a.id)
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) is not signal.SIG_IGN}
    made = None
    try:
        if a.cmd == "up":
            lab = net.up(*sizes, lab_id=a.id)
            print(f"# {lab.describe()}\n# namespaces: {' '.join(lab.namespaces)}\n"
                  f"# kvbench lab run --id {lab.id} -- <kvbench run arguments>;  kvbench lab down --id {lab.id}")
            return 0
        lab, err = _which(a, sizes)
        err = err or _run_error(a, lab.rails if lab else sizes[1])
        if err:
            return fail(err)
        if lab is None:
            lab = made = net.up(*sizes, owner=os.getpid())
        return run(a, lab, run_args, made is not None)
    except KeyboardInterrupt:
        print(f"# {PROG}: INTERRUPTED", flush=True)
        return 130
    except N.NetnsError as exc:
        return fail(str(exc))
    finally:
        for s in old:  # a second signal must not skip the tear-down
            signal.signal(s, signal.SIG_IGN)
        for pid in list(place.LIVE):
            place.kill_tree(pid)
        if made is not None:
            net.down(made)
        for s, h in old.items():
            signal.signal(s, h)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _sizes(a) -> tuple[int, int, int, int]:
    """(nodes, rails, rate bits, spine bits) of up/run, validated (ValueError: one line)."""
    nodes, rails = 2 if a.nodes is None else a.nodes, 1 if a.rails is None else a.rails
    net.check(nodes, rails)
    rate = N.parse_rate(a.rate or "1gbit")
    return nodes, rails, rate, N.parse_rate(a.spine) if a.spine else 0


def _which(a, sizes) -> tuple[net.Lab | None, str]:
    """(the lab a run uses, or None to make one; an error)."""
    if a.id:
        found = [lab for lab in net.labs() if lab.id == a.id]
        return (found[0], "") if found else (None, f"--id {a.id}: no such lab is up (kvbench lab status)")
    if any(v is not None for v in (a.nodes, a.rails, a.rate, a.spine)):
        return None, ""
    up = net.labs()
    if len(up) > 1:
        return None, f"{len(up)} labs are up ({', '.join(lab.id for lab in up)}): say which with --id"
    return (up[0] if up else None), ""


def _run_error(a, rails: int) -> str:
    """What is wrong with run's own options for a lab of ``rails`` rails ('' if nothing), before it is built."""
    have = [f"rail{r}" for r in range(rails)]
    if bad := [n for n in (a.nics.split(",") if a.nics else []) if n not in have]:
        return f"--nics: {', '.join(bad)} does not exist in the lab (its NICs: {', '.join(have)})"
    return ""


def _options_error(a) -> str:
    """What is wrong with run's options that need no lab ('' if nothing): checked before anything is looked up."""
    if a.ranks_per_node < 1:
        return f"--ranks-per-node {a.ranks_per_node}: at least 1"
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        return f"--timeout {a.timeout}: seconds before the launch is ended, a number above 0"
    if not a.mpiexec:
        return "no mpiexec (pip install mpich)"
    return "" if shutil.which(a.mpiexec) else f"--mpiexec {a.mpiexec}: no such program (MPICH's mpiexec)"


def run(a, lab: net.Lab, args: list[str], ephemeral: bool) -> int:
    nics = a.nics.split(",") if a.nics else lab.nics()
    env = place.rank_env(nics, a.netmod, args)
    print(f"# {lab.describe()}" + (" (made for this run, removed after it)" if ephemeral else ""))
    k = a.ranks_per_node
    print(f"# ranks: {k} per node, node n holds ranks " + ("n" if k == 1 else f"{k}n..{k}n+{k - 1}")
          + f" in {lab.node_ns(0)[:-1]}<n>; NICs {','.join(nics)}; env "
          + " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(("KVBENCH_", "UCX_", "FI_", "MPIR_"))),
          flush=True)
    return place.launch(place.command(a.mpiexec, lab, a.ranks_per_node, args), env, a.timeout)


def down(lab_id: str | None) -> int:
    gone = []
    for lab in net.labs():
        if lab_id in (None, lab.id):
            gone += net.down(lab)
    for ns in net.strays():
        if lab_id is None or f"-{lab_id}-" in ns:
            gone += [ns] if N.remove_namespace(ns) else []
    print(f"# removed {len(gone)} namespace(s)" + (f": {' '.join(gone)}" if gone else ""))
    return 0


def status() -> int:
    up = net.labs()
    for lab in up:
        print(f"# {lab.describe()}\n#   namespaces: {' '.join(lab.namespaces)}")
    if not up:
        print("# no lab is up")
    for ns in net.strays():
        print(f"# stray namespace {ns} (no lab records it): kvbench lab down removes it")
    return 0
