"""`kvbench run`: suite + flags -> validated cases on rank 0 -> broadcast -> harness -> table and files."""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

from . import __version__, comm
from . import suite as S
from .harness import Harness, Options, UserError
from .schedule import SchemeError, make_pairs

FLAG_AXES = {"transport": "transport", "op": "op", "model": "model", "tokens": "tokens", "coalesce": "coalesce",
             "alloc": "alloc", "layout": "layout", "dtype": "dtype", "tp": "tp", "pp": "pp",
             "prefix_hit": "prefix_hit", "inflight": "inflight", "overlap": "overlap", "prefill_ms": "prefill_ms",
             "handshake": "handshake", "arrival": "arrival"}
WORKLOAD_FLAGS = {"requests": "requests", "prompt": "prompt", "decode_ms": "decode_ms",
                  "alloc_timeout": "alloc_timeout_ms", "decode_pool_tokens": "decode_pool_tokens"}


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
    if a.variants:
        data["variants"] = a.variants
    if a.prefill_tflops is not None:
        data["prefill_tflops"] = a.prefill_tflops
    wl = {key: getattr(a, attr) for attr, key in WORKLOAD_FLAGS.items() if getattr(a, attr) is not None}
    if wl or (a.arrival and any(x != "none" for x in a.arrival) and data.get("workload") is None):
        data["workload"] = dict(data.get("workload") or {}, **wl)
    for attr in ("iters", "warmup", "rounds", "seed", "pool_factor", "timeout", "scheme"):
        if getattr(a, attr) is not None:
            data[attr] = getattr(a, attr)
    if a.check is not None:
        data["check"] = bool(a.check)
    if a.name:
        data["name"] = a.name
    suite = S.validate(data, a.suite or "command line")
    return suite, S.expand(suite)


def same_host_warnings(cases: list[dict], pairs, hosts: list[str]) -> list[str]:
    """Network transports whose pairs share a host measure loopback, not the wire: say so."""
    from . import transports

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


def bind_cpus(mode: str, rank: int, hosts: list[str]) -> list[int]:
    """``--bind core``: pin this rank (and every thread it starts later) to one CPU of those it may
    use, chosen by its index among its host's ranks; returns the CPUs it may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    if mode == "core":
        local = [r for r, h in enumerate(hosts) if h == hosts[rank]].index(rank)
        os.sched_setaffinity(0, {allowed[local % len(allowed)]})
    return sorted(os.sched_getaffinity(0))


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
                   "scheduler can wake a receiver onto its sender's CPU and slow an isolated layer (README: CPU binding); "
                   "bind them with --bind core, mpirun -bind-to core or srun --cpu-bind=cores")
    return out


def transport_options(a) -> dict:
    """-O key=value pairs for transports (numbers parsed), e.g. -O window=create -O ifname=eth0."""
    out = {}
    for item in a.option or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise S.SuiteError(f"-O {item}: expected key=value")
        try:
            out[key] = int(val)
        except ValueError:
            try:
                out[key] = float(val)
            except ValueError:
                out[key] = val
    return out


def preamble(c, suite, argv, hosts) -> list[str]:
    per_host = ", ".join(f"{h}({n})" for h, n in Counter(hosts).items())
    return [
        f"# kvbench {__version__}  suite={suite.name}  ranks={c.size}  scheme={suite.scheme}  hosts={per_host}",
        f"# argv: kvbench {' '.join(argv)}",
        f"# MPI: {c.library()}",
        f"# iterations={suite.iters} warmup={suite.warmup} check={'on' if suite.check else 'off'} seed={suite.seed}"
        + (f" rounds={suite.rounds} (a transport's cases take turns, {suite.iters // suite.rounds}+ iterations at a time)"
           if suite.rounds > 1 else ""),
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
            # models travel with the cases: a YAML file or flags exist only on rank 0's side
            from . import model as M

            models = {case["model"]: M.get_model(case["model"]) for case in cases}
            payload = (suite.model_dump(), cases, transport_options(a), models, None)
        except (S.SuiteError, UserError, SchemeError, ValueError) as exc:
            payload = (None, None, None, None, str(exc))
    suite_d, cases, topts, models, err = c.bcast(payload)
    if err:
        return finish(c, 1, err)
    try:
        from . import model as M

        M.PRESETS.update(models or {})
        suite = S.Suite.model_validate(suite_d)
    except Exception as exc:  # rank 0 validated this; a failure here is a broken rank: end the job, never hang
        from .cli import fail_rank

        fail_rank(exc)
    hosts = c.allgather(c.hostname)
    cpus = c.allgather(bind_cpus(a.bind, c.rank, hosts))
    opts = Options(iters=suite.iters, warmup=suite.warmup, rounds=suite.rounds, check=suite.check, seed=suite.seed,
                   pool_factor=suite.pool_factor, timeout=suite.timeout, inject_corruption=a.inject_corruption,
                   variants=tuple(suite.variants), transport_options=topts)
    printer = writer = None
    if c.rank == 0:
        from .report import OVERLAP_COLUMNS, LivePrinter, header_lines, overlap_header_lines, uses_overlap
        from .results import ResultWriter, git_commit, library_versions, system_description

        for line in (preamble(c, suite, argv, hosts) + cpu_lines(a.bind, hosts, cpus)
                     + same_host_warnings(cases, make_pairs(suite.scheme, c.size), hosts)):
            print(line)
        meta = {"kvbench_version": __version__, "suite": suite.model_dump(), "cases": cases, "argv": argv,
                "transport_options": topts,
                "git_commit": git_commit(), "libraries": library_versions(), "mpi": c.library(),
                "system": system_description(), "hosts": hosts, "world_size": c.size,
                "cpu_bind": a.bind, "cpus": cpus,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        writer = ResultWriter(a.results, a.name or suite.name, meta)
        overlap = uses_overlap(cases)
        printer = LivePrinter(lambda s: print(s, flush=True), OVERLAP_COLUMNS if overlap else None)
        for line in overlap_header_lines() if overlap else header_lines():
            print(line)
        sys.stdout.flush()

    def sink(rows):
        printer.add(rows)
        writer.add(rows)

    if suite.workload is not None:  # many requests, bounded decode pool, back-pressure
        from .load import LoadHarness

        h = LoadHarness(c, opts, sink if c.rank == 0 else None, suite.workload)
    else:
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
                      status="OK" if ok else "FAILED", harness_overhead_us=overhead_us(printer),
                      transports=h.transport_info, **getattr(h, "extra_meta", {}))
        code = 0 if ok else 1
    code = c.bcast(code)
    return finish(c, code)


def overhead_us(printer) -> dict:
    """Per case: mean and max over ranks of the time per iteration spent outside the transport (us)."""
    import pandas as pd

    if not printer.frames:
        return {}
    df = pd.concat(printer.frames, ignore_index=True)
    df = df[df["iter"] >= 0]
    per_rank = df.groupby(["case", "rank", "iter"])["harness_seconds"].first().groupby(["case", "rank"]).mean()
    out = {}
    for case, s in per_rank.groupby(level=0):
        out[int(case)] = {"mean_us": round(float(s.mean()) * 1e6, 2), "max_rank_us": round(float(s.max()) * 1e6, 2)}
    return out


def finish(c, code: int, err: str | None = None) -> int:
    if err and c.rank == 0:
        print(f"kvbench: error: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    c.barrier()
    c.finalize()
    return code
