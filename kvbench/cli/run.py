"""`kvbench run`: suite + flags -> validated cases on rank 0 -> broadcast -> harness -> table and files."""
from __future__ import annotations

import os
import sys
import time

from kvbench import __version__
from kvbench.cli import progress
from kvbench.cli.preamble import cpu_lines, estimate_line, preamble, same_host_warnings
from kvbench.config import runconfig as config
from kvbench.config import suite as S
from kvbench.harness import carriage, placing
from kvbench.harness.loop import Harness
from kvbench.harness.state import UserError
from kvbench.job import cleanup, comm, faults, reaper
from kvbench.job import status as ST
from kvbench.job.guard import GUARD, describe, env_rank
from kvbench.memory.cachestate import SAYS
from kvbench.memory.placement import PlacementError
from kvbench.model import shapes as M
from kvbench.model.layout import preamble as layout_lines
from kvbench.model.schemes import make_pairs
from kvbench.results import bounds, costs, export, wire
from kvbench.results.lock import LockHeld, ResultLock
from kvbench.results.sidecar import record_for_rank0


def bind_cpus(mode: str, rank: int, hosts: list[str]) -> list[int]:
    """``--bind core``: pin this rank (and every thread it starts later) to one CPU of those it may
    use, chosen by its index among its host's ranks; returns the CPUs it may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    if mode == "core":
        local = [r for r, h in enumerate(hosts) if h == hosts[rank]].index(rank)
        os.sched_setaffinity(0, {allowed[local % len(allowed)]})
    return sorted(os.sched_getaffinity(0))


STARTUP_S = 120.0  # MPI start, validation on rank 0, the broadcast: no run needs longer before its setup
FINISH_S = 60.0  # the last barrier and MPI's finalisation
FINISH_MIN_S = 10.0  # ... or --timeout when shorter, but never less than this


def run(a, argv: list[str]) -> int:
    """Entry point of `kvbench run` on every rank."""
    GUARD.install()  # signals and the watchdog, before MPI or any library starts a thread
    GUARD.reaper = reaper.start(env_rank())  # before MPI: cleans up after a kill from outside (the launcher's SIGHUP)
    names = list(a.transport or [])
    if a.suite:
        try:
            names += S.load(a.suite).axes.transport
        except Exception:  # any reader's failure
            pass  # rank 0 reports it below
    if "staged" in names and any(o in ("inner=ucx", "staged.inner=ucx") for o in a.option or []):
        names.append("ucx")  # staged over ucx: ucxx's UCX loads before MPI's as well
    # MPI_Init would fail inside UCX on every rank with no word of the limit; a fault switch that is not one fires none
    if why := comm.open_files_short() or faults.ERROR:
        if env_rank() == 0:  # one line for the job
            print(f"kvbench: error: {why}", file=sys.stderr, flush=True)
        return 1
    comm.preload(names)
    with GUARD.deadline("start-up (MPI, validation on rank 0)", STARTUP_S):
        c = comm.get()
        GUARD.attach(c)
        payload = None
        if c.rank == 0:
            payload = config.door(a, argv, c.size)  # never raises: a line for every rank, or the config
            if payload[1] is None:  # the writer and live table load pandas (seconds on a loaded machine): now, before
                import kvbench.report  # noqa: F401  (any step has a --timeout deadline; other ranks never load it)
                import kvbench.results.store  # noqa: F401
        cfg_d, err = c.bcast(payload)
    if err:
        return finish(c, ST.INPUT_ERROR, err)
    # the suite names models made on rank 0 (--layers ..., a YAML file): they exist here before it is validated
    M.PRESETS.update({n: M.ModelShape(**f) for n, f in cfg_d["models"].items()})
    cfg = config.RunConfig.model_validate(cfg_d)
    suite, cases = cfg.suite, cfg.cases
    opts = cfg.options()
    with GUARD.deadline("start-up (run id, orphan sweep, memory preflight)", STARTUP_S):
        if suite.workload is not None:  # many requests, bounded decode pool, back-pressure
            from kvbench.harness.load import LoadHarness

            h = LoadHarness(c, opts, suite.workload, cfg.trace_plan())
        else:
            h = Harness(c, opts)
        GUARD.run_id = h.run_id
        GUARD.reaper.tell("run", h.run_id)
        GUARD.cleanups += [lambda: cleanup.unlink_mpich(cleanup.mapped_mpich()), lambda: cleanup.unlink_run(h.run_id)]
        swept = cleanup.sweep_orphans()
        cleanup.record_mpich(h.run_id, c.rank)
        hosts = c.allgather(c.hostname)
        cpus = c.allgather(bind_cpus(cfg.bind, c.rank, hosts))
        mpich = c.gather(cleanup.mapped_mpich())
        swept = c.gather(swept)
        try:
            h.placement = placing.place(c, cases, cfg.gpu_map, cfg.nic)  # each rank's GPU bound before any pool
            h.preflight(cases, suite.scheme)
            err = None
        except (UserError, PlacementError) as exc:
            err = str(exc)
        lock = None
        if err is None and c.rank == 0 and cfg.resume:
            err = same_machine(cfg.resume, hosts)
            if err is None:
                lock, err = lock_resumed(cfg.resume)
        err = c.bcast(err)
    if err:
        return finish(c, ST.INPUT_ERROR, err)
    # from here on no step waits without a deadline: the gaps between armed steps get --timeout as well
    GUARD.between("the steps between cases (--timeout)", opts.timeout)
    writer = printer = bar = None
    done: list[str] = []
    if c.rank == 0:
        GUARD.case = "opening the result files"
        try:
            writer, printer, done = open_results(c, cfg, argv, hosts, cpus, mpich, swept, h, lock, a.compact)
        except Exception as exc:  # rank 0's own file error ends the job like any rank's failure
            GUARD.fail("ERROR", describe(exc), exc)
        GUARD.writer, GUARD.case = writer, ""
        GUARD.reaper.tell("meta", writer.meta_path)
        bar = progress.start(cfg.progress, [k for k in cases if k["transport"] not in done], suite.variants)
        if bar:  # table lines go above the bar
            printer.out = bar.write

        def sink(rows):  # stored before printed: a case on the screen is a case on disk
            writer.add(rows)
            if all(r["row_kind"] == "setup" for r in rows):  # a transport's setup rows no case took: no line
                return
            printer.add(rows)
            if bar and rows:
                bar.tick(f"{rows[0]['transport']} {rows[0]['op']}")

        def group_done(name):  # every case of a transport is stored: print them, with their references
            writer.group_done(name)
            printer.flush()

        h.set_sink(sink)
        h.on_group_done = group_done
    done, h.case_no, meta_path = c.bcast((done, h.case_no, writer.meta_path if writer else None))
    if c.rank:  # rank 0 stopped or hung: the rank that times out records it in the sidecar in its place
        GUARD.stand_in = lambda status, line: record_for_rank0(meta_path, status, line)
    try:
        h.run([k for k in cases if k["transport"] not in done], suite.scheme)
    except Exception as exc:  # a failed rank ends the job, with its error printed once
        GUARD.fail_from(exc)
    code = 0
    end_s = max(FINISH_MIN_S, min(FINISH_S, opts.timeout))  # the footer, and the steps after it
    try:
        if c.rank == 0:
            if bar:
                bar.close()
            GUARD.case = "the footer and the sidecar's last write"
            with GUARD.deadline("the footer and the sidecar's end", end_s):
                code = footer(cfg, writer, printer, h, a)
            GUARD.case = ""
        with GUARD.deadline("the end of the run (last barrier)", end_s):
            if c.rank:  # the other ranks wait here while rank 0 writes the footer
                faults.at("sidecar-finish", c.rank)
            code = c.bcast(code)
    except Exception as exc:
        GUARD.fail("ERROR", describe(exc), exc)
    return finish(c, code, seconds=end_s)


def lock_resumed(path: str):
    """Rank 0: (the lock of the result set ``--resume`` continues, None) or (None, why not): a set that a live
    run writes (its own first run, or another resume) is refused."""
    try:
        lock = ResultLock(path)
    except LockHeld as exc:
        return None, f"--resume {path}: {exc}: wait for it to end, or end it"
    except OSError as exc:
        return None, f"--resume {path}: cannot lock it: {exc}"
    try:
        status = config.read_sidecar(path).get("status")  # again, under the lock: it may have ended meanwhile
    except config.ConfigError as exc:
        lock.release()
        return None, str(exc)
    if status not in config.RESUMABLE:
        lock.release()
        return None, f"--resume {path}: the run ended by itself ({status}): nothing to resume"
    GUARD.cleanups.append(lock.release)
    return lock, None


def open_results(c, cfg, argv, hosts, cpus, mpich, swept, h, lock, compact=False):
    """Rank 0, after validation and preflight: the preamble, the result files, the live table."""
    from kvbench.config.memauto import memory_lines
    from kvbench.report import LivePrinter
    from kvbench.report.compact import live_table
    from kvbench.results.store import ResultWriter, git_commit, library_versions, system_description

    suite, cases = cfg.suite, cfg.cases
    pairs = make_pairs(suite.scheme, c.size, suite.matrix)
    for line in (preamble(c, suite, argv, hosts) + cpu_lines(cfg.bind, hosts, cpus) + same_host_warnings(cases, pairs, hosts)
                 + placing.preamble(h.placement, cases, pairs) + memory_lines(suite, cases) + h.route_lines + h.path_lines(cfg) + cfg.workload_lines(c.size)
                 + layout_lines(cases) + [estimate_line(cfg)]):
        print(line)
    gone = sorted({p for part in swept for p in part})
    if gone:
        print(f"# removed {len(gone)} shared-memory leftover(s) of earlier kvbench jobs whose processes are gone")
    meta = {"kvbench_version": __version__, "name": cfg.name, "suite": suite.model_dump(), "cases": cases,
            "models": cfg.models, "argv": argv, "transport_options": cfg.transport_options,
            "git_commit": git_commit(), "libraries": library_versions(), "mpi": c.library(),
            "system": system_description(), "hosts": hosts, "world_size": c.size,
            "cpu_bind": cfg.bind, "cpus": cpus, "run_id": h.run_id, "gpu_map": cfg.gpu_map, "nic": cfg.nic,
            "placement": h.placement,  # per rank: host, local rank, GPU (-1: none) and its PCI bus, nearest NIC
            "shm_segments": {"kvbench": f"{cleanup.SHM_DIR}/kvbench_{h.run_id}_*",
                             "mpich": sorted({p for part in mpich for p in part})},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "trace": cfg.trace_plan().facts() if cfg.trace else None}
    if cfg.resume:
        writer = ResultWriter.reopen(cfg.resume, meta, lock)
        done = list(writer.meta.get("groups_done", []))
        h.case_no = writer.last_case()
        print(f"# resuming {cfg.resume}: transports done {', '.join(done) or 'none'}; the rest run now")
    else:
        writer, done = ResultWriter(cfg.results, cfg.name, meta), []
    GUARD.cleanups.append(writer.close)  # the exit path: no write after it, no .tmp left, the lock released
    print(f"# run id: {h.run_id}   results: {writer.path}")
    if cfg.suite.cache != "as-is":  # every row of the run: said once here, per row in the table's cache column
        print(f"# cache {cfg.suite.cache}: {SAYS[cfg.suite.cache]}")
    columns, header = live_table(cases, compact)  # the full table, --compact's, or the exposed-time table
    printer = LivePrinter(lambda s: print(s, flush=True), columns)
    for line in header:
        print(line)
    sys.stdout.flush()
    return writer, printer, done


def same_machine(path: str, hosts: list[str]) -> str | None:
    """A resumed run must continue on the machine (hosts, CPU) that started it."""
    from kvbench.results.store import system_description

    meta = config.read_sidecar(path)
    if meta.get("hosts") != hosts:
        return f"--resume {path}: it ran on hosts {meta.get('hosts')}, this launch is on {hosts}: start a new run"
    then, now = meta.get("system", {}), system_description()
    for key in ("cpu_model", "cpus", "mem_total_bytes"):
        if then.get(key) != now.get(key):
            return f"--resume {path}: the machine changed ({key}: {then.get(key)} then, {now.get(key)} now)"
    return None


def footer(cfg, writer, printer, h, a=None) -> int:
    """Rank 0: the footer over every row of the result set (a resumed run's earlier rows too), then its exports."""
    import pandas as pd

    from kvbench.report import fabric, setup
    from kvbench.results.store import transfer_rows

    whole = pd.concat(writer.frames, ignore_index=True) if writer.frames else None
    df = transfer_rows(whole) if whole is not None else None  # the setup rows have a table of their own
    st = printer.summary_of(df) if df is not None else None  # the last flush's (the same rows) or anew
    for line in setup.table_lines(whole, st) + fabric.table_lines(whole) if whole is not None else []:
        print(line)
    cases = 0 if st is None else len(st)
    skipped = 0 if st is None else int((st["status"] == "skipped").sum())
    wrong = (0 if df is None else int(df["nwrong"].fillna(0).sum())) + getattr(h, "violations", 0)
    # beyond physics or too noisy to say (results/bounds.py), or fewer bytes on the wire than moved (wire.py)
    sus, loud = bounds.split(bounds.verdicts(df, st) + wire.short(df))
    status = ST.verdict(cases - skipped, cfg.suite.check, wrong, len(sus), len(h.judge_paths(df, cfg)))
    for line in check_lines(df, cfg.suite.check, getattr(h, "check_cost", None)) + carriage.footer_lines(df):
        print(line)
    for line in [bounds.line(s) for s in sus + loud] + bounds.skew_lines(st) + h.fallbacks:
        print(f"# {line}")
    print(f"# wrong elements: {wrong if cfg.suite.check else '-'}   cases: {cases} ({skipped} skipped)   {status}")
    print(f"# results: {writer.path}")
    cost = getattr(h, "check_cost", None)
    writer.finish(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), total_wrong=wrong, status=status,
                  check={"level": cfg.suite.check, "verify_s": [round(c, 4) for c, _ in cost or []],
                         "timed_s": [round(t, 4) for _, t in cost or []]},
                  clocks=pair_clocks(df),
                  reason=bounds.line(sus[0]) if status == "SUSPECT" else h.status_reason(status),
                  suspects=[bounds.line(s) for s in sus], noisy=[bounds.line(s) for s in loud],
                  skew=bounds.skew_lines(st), harness_overhead_us=overhead_us(printer),
                  layer_cost_us=costs.sidecar(df), carriers=carriage.sidecar(df),  # costs.py, carriage.py
                  transports=h.transport_info, resources=h.resources, **getattr(h, "extra_meta", {}))
    for line in export.write(whole, a):  # --json, --csv: every row of the set, beside the parquet (export.py)
        print(line)
    return ST.exit_code(status)


def check_lines(df, level, cost) -> list[str]:
    """The footer's account of the check: what it cost (seconds verifying on the slowest rank, outside the timed
    windows, beside that rank's timed seconds), then one line per case with wrong elements, naming its
    iterations (-1 is the check pass after timing)."""
    out = []
    if level and cost:
        check_s, timed_s = max(cost)
        out.append(f"# check {'all' if level == 'all' else '1'}: {check_s:.2f} s "
                   f"verifying, outside the timed windows (slowest rank; its timed windows: {timed_s:.2f} s)")
    if df is None or "nwrong" not in df:
        return out
    bad = df[df["nwrong"].fillna(0) > 0]
    for case, g in bad.groupby("case"):
        r = g.iloc[0]
        its = sorted(int(i) for i in g["iter"].unique())
        named = ", ".join("the check pass" if i < 0 else str(i) for i in its[:12]) + (" ..." if len(its) > 12 else "")
        what = "bulk" if r["variant"] != "paged" else f"{r['allocation']} {r['block_size']}-token blocks"
        out.append(f"# FAILED case {int(case)} ({r['transport']} {r['op']} {r['model']} {r['tokens']} tokens, {what}, "
                   f"{r['variant']}): {int(g['nwrong'].sum())} wrong elements in iteration{'s' if len(its) > 1 else ''} "
                   f"{named}")
    return out


def pair_clocks(df) -> dict:
    """Per case and pair, from the destinations' rows: the barrier-exit skew (median, largest) and the bound
    on the clock correction, in microseconds (one clock: clocks.py)."""
    if df is None or "skew_s" not in df:
        return {}
    d = df[(df["iter"] >= 0) & df["skew_s"].notna() & (df["role"] == "decode")]
    out: dict = {}
    for (case, pair), g in d.groupby(["case", "pair"]):
        out.setdefault(str(int(case)), {})[str(int(pair))] = {
            "offset_us": round(float(g["clock_offset_s"].median()) * 1e6, 1),
            "skew_p50_us": round(float(g["skew_s"].median()) * 1e6, 1),
            "skew_max_us": round(float(g["skew_s"].abs().max()) * 1e6, 1),
            "clock_err_us": round(float(g["clock_err_s"].max()) * 1e6, 1)}
    return out


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


def finish(c, code: int, err: str | None = None, seconds: float = FINISH_S) -> int:
    """The way out of a run that ended by itself (or refused its input on every rank alike)."""
    if err and c.rank == 0:
        print(f"kvbench: error: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    GUARD.between(None)
    with GUARD.deadline("the end of the run (last barrier, MPI's finalisation)", seconds):
        faults.hit("stall-finalize", c.rank)
        c.barrier()
        if GUARD.writer is not None:
            GUARD.writer.close()
        if GUARD.run_id:
            cleanup.unlink_run(GUARD.run_id)
        GUARD.reaper.done()
        GUARD.detach()
        c.finalize()
    return code
