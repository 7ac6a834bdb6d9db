"""`kvbench probe -t T --max SIZE`: the largest pool that registers, moves and checks; bandwidth against pool size."""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
import signal
import sys
import time

from kvbench import transports
from kvbench.cli.args import text
from kvbench.harness import probe as P
from kvbench.harness.preflight import device_reason
from kvbench.harness.probe_attempt import FAULT_ENV, Request, default_mpiexec
from kvbench.model import shapes as M
from kvbench.transports import options as O

HEAD = f"{'pool':>10} {'status':>8} {'GB/s':>8} {'reg(s)':>8} {'#wrong':>6} {'took(s)':>7}  why"


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="the largest pool a transport registers, moves and checks (grown by doubling, "
                       "then bisecting; one two-rank launch per size), and bandwidth against pool size")
    p.add_argument("-t", "--transport", required=True, type=text, help=f"one of: {', '.join(transports.names())}")
    p.add_argument("--max", required=True, type=text, metavar="SIZE", help="the largest pool per rank to try "
                   "(e.g. 8GiB); refused when two ranks' pools do not fit this host's memory")
    p.add_argument("--start", type=text, metavar="SIZE", help="the first size (default: the smallest pool that "
                   "holds the request)")
    p.add_argument("--bisect", type=int, default=3, metavar="N", help="halvings of the gap between the largest "
                   "size that worked and the first that failed (default 3)")
    p.add_argument("--memory", default="host", choices=("host", "torch-cpu", "pinned", "cuda"),
                   help="where the pools live (default host; docs/gpu.md)")
    p.add_argument("-m", "--model", default="llama-3-8b", help="the request's model: a preset or a model .yaml "
                   "(default llama-3-8b)")
    p.add_argument("--tokens", type=int, default=1024, help="the request's tokens (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--dtype", default="fp16", help=f"KV dtype: {', '.join(M.DTYPES)} (default fp16)")
    p.add_argument("--op", choices=("push", "pull"), default="push", help="push (default) or pull")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed transfers of the request per size (default 5)")
    p.add_argument("--deadline", type=float, metavar="S", help="seconds one size may take before its launch is "
                   "killed and its row says TIMEOUT (default: 60 + 4 x pool bytes / 100 MB/s)")
    p.add_argument("-O", "--option", action="append", type=text, default=[], metavar="KEY=VALUE",
                   help="transport option, passed to each size's run (kvbench run -O)")
    p.add_argument("--mpiexec", default=default_mpiexec(), help="the launcher (default: the venv's mpiexec)")
    p.add_argument("-o", "--results", default="results/runs", help="where the rows go: <dir>/<machine>/"
                   "<stamp>_probe.csv (default results/runs)")


def validate(a) -> tuple[Request, int, int]:
    """(the request, the first size, the largest size), or ValueError with the one line."""
    if a.transport not in transports.names():
        raise ValueError(f"transport '{a.transport}' is not one of: {', '.join(transports.names())}")
    why = transports.probe(a.transport)
    if why:
        raise ValueError(f"{a.transport} is unavailable here: {why}")
    cls = transports.load(a.transport)
    if a.op not in cls.caps.ops:
        raise ValueError(f"{a.transport} supports only {', '.join(cls.caps.ops)}, not --op {a.op}")
    why = device_reason(cls, {"memory": a.memory, "copy": "batch"})
    if why:
        raise ValueError(f"--memory {a.memory}: {why}")
    if a.iters < 1 or a.bisect < 0 or (a.deadline is not None and not (math.isfinite(a.deadline) and a.deadline > 0)):
        raise ValueError("-n must be at least 1, --bisect at least 0, --deadline a number of seconds above 0")
    fault = os.environ.get(FAULT_ENV)
    if fault is not None and not re.fullmatch(r"\d+:\S+", fault):
        raise ValueError(f"{FAULT_ENV}={fault[:80]!r}: give <pool bytes>:<KVBENCH_FAULT spec> (docs/reliability.md), "
                         "or unset it")
    M.check_block_size(a.block_size)
    if a.tokens < 1:
        raise ValueError("--tokens must be at least 1")
    if a.dtype not in M.DTYPES:
        raise ValueError(f"dtype '{a.dtype}' is not one of: {', '.join(M.DTYPES)}")
    if not a.mpiexec:
        raise ValueError("no mpiexec here: install MPICH (make install) or give --mpiexec")
    if not shutil.which(a.mpiexec):
        raise ValueError(f"--mpiexec {a.mpiexec}: no such program (the launcher each size runs under)")
    req = Request(a.transport, a.memory, a.model, a.tokens, a.block_size, a.dtype, a.op, a.iters,
                  tuple(a.option), a.mpiexec)
    req.shape  # an unknown model is refused here  # noqa: B018
    top = P.parse_size(a.max) // req.step * req.step
    if top < req.smallest:
        raise ValueError(f"--max {a.max} is below one request: {a.tokens} tokens of {a.model} take "
                         f"{P.fmt_size(req.smallest)} of pool (raise --max, or lower --tokens)")
    start = req.smallest if a.start is None else -(-P.parse_size(a.start) // req.step) * req.step
    if not req.smallest <= start <= top:
        raise ValueError(f"--start {a.start} is not between one request ({P.fmt_size(req.smallest)}) and --max")
    why = P.shortfall(req, top, O.parse(a.option, [a.transport]).get(a.transport, {}))
    if why:
        raise ValueError(why.removeprefix("probe: "))
    return req, start, top


def line(r) -> str:
    def num(v, fmt):
        return format("-" if v is None else format(v, fmt), f">{fmt.split('.')[0].rstrip('df')}")

    return (f"{P.fmt_size(r.pool_bytes):>10} {r.status:>8} {num(r.gbps, '8.2f')} {num(r.register_s, '8.3f')} "
            f"{num(r.nwrong, '6d')} {r.seconds:7.1f}  {r.reason}")


def _stop(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_probe(a) -> int:
    req, start, top = validate(a)
    from kvbench.results.store import claim_path

    path = claim_path(a.results, "probe", ".csv")  # claimed first: a probe's rows never overwrite a file
    t0 = time.monotonic()
    print(f"# kvbench probe: {req.transport} {req.op}, --memory {req.memory}, pools of {P.fmt_size(start)} to "
          f"{P.fmt_size(top)} per rank (2 ranks), request {req.tokens} tokens of {req.model} "
          f"({P.fmt_size(req.nbytes)}, its blocks at the pools' end); one launch per size")
    print("# GB/s = 10^9 B/s of the request at p50; reg(s) = seconds to register the pool (slowest rank)")
    print(HEAD, flush=True)
    rows = P.CsvRows(path)

    def say(r):
        rows.add(r)
        print(line(r), flush=True)

    scratch = os.path.join(a.results, "scratch")  # each size's run, under -o (results/*/scratch/ is ignored)
    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        out = P.run_probe(req, start, top, a.bisect, a.deadline, say, scratch)
    except KeyboardInterrupt as exc:  # the launch in flight was killed whole; the sizes that ended are in the file
        name = exc.args[0] if exc.args else "SIGINT"
        print(f"# interrupted; rows so far: {path}", flush=True)
        print(f"kvbench: probe interrupted by {name}: {rows.count} sizes kept in {path}", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for d in [*glob.glob(os.path.join(scratch, "kvbench-probe-*")), scratch]:
            try:  # empty once every size's run was removed (an interrupt mid-removal leaves an empty one); another
                os.rmdir(d)  # probe's, in use, is not empty and stays
            except OSError:
                pass
    by_size = sorted(out.rows, key=lambda r: r.pool_bytes)
    if by_size != out.rows:  # bisected: the rows again, by pool size (where a cliff shows)
        print("# by pool size:")
        print(HEAD)
        for r in by_size:
            print(line(r))
    f = out.failed
    print(f"# largest pool that works: {P.fmt_size(out.best) if out.best else 'none'}")
    print(f"# first that fails: {P.fmt_size(f.pool_bytes)} {f.status}: {f.reason}" if f
          else f"# first that fails: none up to --max {P.fmt_size(top)}")
    print(f"# {len(out.rows)} sizes in {time.monotonic() - t0:.0f} s; rows: {path}")
    return 0 if out.best else 2
