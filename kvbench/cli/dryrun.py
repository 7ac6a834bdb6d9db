"""`kvbench run --dry-run`: the cases a run would measure and how long it would take here, then exit 0.

Nothing starts: no MPI, no pool, no result file. The configuration is checked at the same door as a real run's
(one line and exit 1 for a mistake), with the world size the launcher gives (mpirun -np N) or ``--ranks``
(default 2) when there is none; only rank 0 prints, the other ranks of a launch exit at once.
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

from kvbench.cli.args import say_error
from kvbench.config import runconfig as config
from kvbench.job.guard import env_rank
from kvbench.model import shapes as M
from kvbench.results import estimate

SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
LISTED = 40  # more cases than this: one line per transport instead of one per case
AXES = ("op", "model", "tokens", "block_size", "dtype", "alloc", "coalesce", "layout", "memory", "inflight",
        "overlap", "prefill_ms", "codec", "arrival", "tp")


MAX_RANKS = 1 << 20  # --ranks: beyond this no launch is real, and pairing them would take the dry run minutes


def ranks_arg(text: str) -> int:
    """--ranks: a positive rank count, at most MAX_RANKS; one line naming the limit otherwise."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_RANKS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a rank count from 1 to {MAX_RANKS}")
    return n


def env_size() -> int | None:
    """The world size the launcher says, without starting MPI (None: no launcher)."""
    for k in SIZE_VARS:
        try:
            return int(os.environ[k])
        except (KeyError, ValueError):
            pass
    return None


def case_line(no: int, case: dict, varied: list[str]) -> str:
    """One case: its number, transport and the axes that vary in this sweep (all of them when none do)."""
    return f"  {no:>4}  {case['transport']:<12} " + "  ".join(f"{k}={case[k]}" for k in varied)


def dry_run(a, argv: list[str]) -> int:
    """Every rank: check the configuration, and on rank 0 print the cases and the estimate."""
    if env_rank() != 0:
        return 0
    world = env_size() or a.ranks
    cfg_d, err = config.door(a, argv, world)
    if err:
        return say_error(err)
    M.PRESETS.update({n: M.ModelShape(**f) for n, f in cfg_d["models"].items()})
    cfg = config.RunConfig.model_validate(cfg_d)
    for line in lines(cfg, world):
        print(line)
    return 0


def lines(cfg, world: int) -> list[str]:
    """What the dry run prints: a header, the cases (or a count per transport), the estimate and its inputs."""
    suite, cases = cfg.suite, cfg.cases
    e = estimate.estimate(suite, cases, cfg.shapes(), estimate.measured_rates(cfg.results))
    keys = [*AXES, "head_layout"]  # a P:D case's head layout sits beside its tp (config/tpcheck.py)
    varied = [k for k in keys if len({str(c.get(k)) for c in cases}) > 1] or ["op", "model", "tokens", "block_size"]
    out = [f"# dry run: suite={suite.name}  ranks={world}  iterations={suite.iters} warmup={suite.warmup} "
           f"check={'all' if suite.check == 'all' else int(bool(suite.check))}  variants={','.join(suite.variants)}  nothing is run or written"]
    if len(cases) <= LISTED:
        out += [case_line(i + 1, c, varied) for i, c in enumerate(cases)]
    else:
        per = Counter(c["transport"] for c in cases)
        out += [f"  {n:<12} {k} cases" for n, k in per.items()]
        out.append(f"  (axes that vary: {', '.join(varied)})")
    for name in e.skipped:
        out.append(f"# {name}: cannot run here (its cases are skipped rows, costing nothing)")
    out.append("# rates: " + "  ".join(f"{n} {g:.2f} GB/s ({w or 'default'})" for n, (g, w) in e.rates.items()))
    out.append(f"# {e.cases} cases, {e.measurements} measurements, {e.words()} here ({e.seconds:.0f} s; "
               "estimate: docs/usage.md, How long a run takes)")
    return out
