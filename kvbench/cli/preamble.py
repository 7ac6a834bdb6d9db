"""The preamble of `kvbench run` on rank 0: what runs, where, how it is bound, what it will cost, and the
warnings a reader needs before the first row (moved out of run.py, which drives the run)."""
from __future__ import annotations

from collections import Counter

from kvbench import __version__, transports
from kvbench.memory.copy import preamble_lines as copy_lines
from kvbench.results import estimate


def same_host_warnings(cases: list[dict], pairs, hosts: list[str]) -> list[str]:
    """Network transports whose pairs share a host measure loopback, not the wire: say so."""
    shared = [(s, d) for s, d in pairs if hosts[s] == hosts[d]]
    out = []
    for name in dict.fromkeys(c["transport"] for c in cases):
        try:
            caps = transports.load(name).caps
        except Exception:  # unavailable: its rows say why
            continue
        if caps.network and shared:
            s, d = shared[0]
            out.append(f"# WARNING: {name} is a network transport but {len(shared)} of {len(pairs)} pairs share a "
                       f"host (e.g. ranks {s},{d} on {hosts[s]}): this measures the host's loopback, not a link "
                       "between nodes")
    return out


def cpu_lines(mode: str, hosts: list[str], cpus: list[list[int]]) -> list[str]:
    """Preamble: how ranks are bound, and a note when ranks of one host may share CPUs."""
    def fmt(c):
        return f"{c[0]}-{c[-1]}" if len(c) > 1 and c == list(range(c[0], c[-1] + 1)) else ",".join(map(str, c))

    shared = [(a, b) for a in range(len(hosts)) for b in range(a + 1, len(hosts))
              if hosts[a] == hosts[b] and set(cpus[a]) & set(cpus[b])]
    out = [f"# cpus: {'bound by kvbench (--bind core)' if mode == 'core' else 'as launched'}: "
           + "  ".join(f"rank{r}={fmt(c)}" for r, c in enumerate(cpus[:8])) + (" ..." if len(cpus) > 8 else "")]
    if shared:
        a, b = shared[0]
        out.append(f"# NOTE: ranks {a} and {b} on {hosts[a]} may run on the same CPUs: after an idle wait the "
                   "scheduler can wake a receiver onto its sender's CPU and slow an isolated layer (docs/usage.md, CPU binding); "
                   "bind them with --bind core, mpirun -bind-to core or srun --cpu-bind=cores")
    return out


def preamble(c, suite, argv, hosts) -> list[str]:
    """The run's first lines: version, suite, ranks and hosts, the command, MPI, the iteration plan."""
    per_host = ", ".join(f"{h}({n})" for h, n in Counter(hosts).items())
    return [
        f"# kvbench {__version__}  suite={suite.name}  ranks={c.size}  scheme={suite.scheme}  hosts={per_host}",
        f"# argv: kvbench {' '.join(argv)}",
        f"# MPI: {c.library()}",
        f"# iterations={suite.iters} warmup={suite.warmup} check={CHECK_WORD[suite.check]} seed={suite.seed}"
        + (f" rounds={suite.turns()} (a transport's cases take turns, {suite.iters // suite.turns()}+ iterations at a time)"
           if suite.turns() > 1 else "")
        + (f" target-ci={suite.target_ci:g}% (the least iterations above, then more per case until its p50's 95% "
           f"interval is within it or {suite.ci_budget:g} s are spent)" if suite.target_ci else ""),
    ] + copy_lines(suite)


# the preamble's word for each check level; the footer says what the check cost
CHECK_WORD = {False: "off", True: "on (one checked transfer after timing)",
              "all": "all (every timed iteration and one more transfer, verified outside the timed windows)"}


def estimate_line(cfg) -> str:
    """One line: the case count and the run's expected wall time here (results/estimate.py)."""
    return estimate.preamble_line(cfg.suite, cfg.cases, cfg.shapes(), cfg.results)
