"""`kvbench run`: suite + flags -> validated cases on rank 0 -> broadcast -> harness -> table and files."""
from __future__ import annotations

import sys
import time
from collections import Counter

from . import __version__, comm
from . import suite as S
from .harness import Harness, Options, UserError
from .schedule import SchemeError, make_pairs

FLAG_AXES = {"transport": "transport", "op": "op", "model": "model", "tokens": "tokens", "coalesce": "coalesce",
             "alloc": "alloc", "layout": "layout", "dtype": "dtype", "tp": "tp", "pp": "pp",
             "prefix_hit": "prefix_hit", "inflight": "inflight"}


def block_sweep(a) -> list[int] | None:
    """-b/-e/-f (nccl-tests style) -> block sizes in tokens."""
    if a.minblock is None and a.maxblock is None:
        return None
    lo = a.minblock if a.minblock is not None else a.maxblock
    hi = a.maxblock if a.maxblock is not None else lo
    if a.stepfactor < 2:
        raise S.SuiteError(f"-f {a.stepfactor}: the step factor must be 2 or more")
    if lo > hi:
        raise S.SuiteError(f"-b {lo} is larger than -e {hi}")
    out, b = [], lo
    while b <= hi:
        out.append(b)
        b *= a.stepfactor
    return out


def resolve(a) -> tuple[S.Suite, list[dict]]:
    """The suite file (or defaults) with command-line overrides applied, validated and expanded."""
    from .cli import custom_model

    base = S.load(a.suite) if a.suite else S.Suite(name=a.name or "cli")
    data = base.model_dump()
    if a.suite is None:
        data["axes"] = S.Axes().model_dump()
    axes = data["axes"]
    custom = custom_model(a)
    for attr, key in FLAG_AXES.items():
        val = getattr(a, attr, None)
        if val:
            axes[key] = val
    if custom:
        axes["model"] = [custom]
    sweep = block_sweep(a)
    if sweep:
        axes["block_size"] = sweep
    for attr in ("iters", "warmup", "seed", "pool_factor", "timeout", "scheme"):
        if getattr(a, attr) is not None:
            data[attr] = getattr(a, attr)
    if a.check is not None:
        data["check"] = bool(a.check)
    if a.name:
        data["name"] = a.name
    suite = S.validate(data, a.suite or "command line")
    return suite, S.expand(suite)


def preamble(c, suite, argv, hosts) -> list[str]:
    per_host = ", ".join(f"{h}({n})" for h, n in Counter(hosts).items())
    return [
        f"# kvbench {__version__}  suite={suite.name}  ranks={c.size}  scheme={suite.scheme}  hosts={per_host}",
        f"# argv: kvbench {' '.join(argv)}",
        f"# MPI: {c.library()}",
        f"# iterations={suite.iters} warmup={suite.warmup} check={'on' if suite.check else 'off'} seed={suite.seed}",
    ]


def run(a, argv: list[str]) -> int:
    """Entry point of `kvbench run` on every rank."""
    names = list(a.transport or [])
    if a.suite:
        try:
            names += S.load(a.suite).axes.transport
        except S.SuiteError:
            pass  # rank 0 reports it below
    comm.preload(names)
    c = comm.get()
    payload = None
    if c.rank == 0:
        try:
            suite, cases = resolve(a)
            make_pairs(suite.scheme, c.size)
            payload = (suite.model_dump(), cases, None)
        except (S.SuiteError, UserError, SchemeError, ValueError) as exc:
            payload = (None, None, str(exc))
    suite_d, cases, err = c.bcast(payload)
    if err:
        return finish(c, 1, err)
    suite = S.Suite.model_validate(suite_d)
    hosts = c.allgather(c.hostname)
    opts = Options(iters=suite.iters, warmup=suite.warmup, check=suite.check, seed=suite.seed,
                   pool_factor=suite.pool_factor, timeout=suite.timeout, inject_corruption=a.inject_corruption)
    printer = writer = None
    if c.rank == 0:
        from .report import LivePrinter, header_lines
        from .results import ResultWriter, git_commit, library_versions, system_description

        for line in preamble(c, suite, argv, hosts):
            print(line)
        meta = {"kvbench_version": __version__, "suite": suite.model_dump(), "cases": cases, "argv": argv,
                "git_commit": git_commit(), "libraries": library_versions(), "mpi": c.library(),
                "system": system_description(), "hosts": hosts, "world_size": c.size,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        writer = ResultWriter(a.results, a.name or suite.name, meta)
        printer = LivePrinter(lambda s: print(s, flush=True))
        for line in header_lines():
            print(line)
        sys.stdout.flush()

    def sink(rows):
        printer.add(rows)
        writer.add(rows)

    h = Harness(c, opts, sink if c.rank == 0 else None)
    try:
        h.run(cases, suite.scheme)
    except UserError as exc:
        return finish(c, 1, str(exc))
    except Exception as exc:  # a failed rank ends the job, with its error printed once
        from .cli import fail_rank

        fail_rank(exc)
    code = 0
    if c.rank == 0:
        st = printer.summary()
        skipped = int((st["status"] == "skipped").sum()) if st is not None else 0
        ok = h.total_wrong == 0
        print(f"# wrong elements: {h.total_wrong}   cases: {0 if st is None else len(st)} "
              f"({skipped} skipped)   {'OK' if ok else 'FAILED'}")
        print(f"# results: {writer.path}")
        writer.finish(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), total_wrong=h.total_wrong,
                      status="OK" if ok else "FAILED")
        code = 0 if ok else 1
    code = c.bcast(code)
    return finish(c, code)


def finish(c, code: int, err: str | None = None) -> int:
    if err and c.rank == 0:
        print(f"kvbench: error: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    c.barrier()
    c.finalize()
    return code
