"""Engines next to their own tools: kvbench's nixl, ucx and mooncake bulk and hot rows vs each engine's benchmark.

For each engine that ``kvbench list`` says is available, one repeat runs
kvbench's bulk and hot rows (LAYERS layers per request, push and pull; bulk:
one descriptor of SIZE bytes per layer, each at the start of its layer's span
of the pool; hot: every layer's descriptor points at layer 0's range, one
layer-sized buffer re-sent, as the tools below do) and the engine's own tool
at the same sizes, back to back, kvbench first on even repeats and the tool
first on odd ones:

* nixl: ``benchmarks/nixl_reference.py`` (nixlbench's way; nixlbench is not in
  the wheel) WRITE and READ, once as nixlbench runs it (the same SIZE bytes
  every time: against the hot row) and once cycling over LAYERS regions spread
  over a pool of kvbench's size, where kvbench's bulk rows put their layers
  (the same scattered blocks: against the bulk row);
* ucx: ``ucx_perftest`` tag_bw (two-sided, what kvbench's ucx transport does),
  ucp_put_bw and ucp_get (one-sided);
* mooncake: ``transfer_engine_bench`` write and read over tcp, batch = LAYERS
  requests of SIZE at distinct offsets (one kvbench request), 1 thread.

Then, for nixl, per page size in ``--pages`` (default 4k,thp): kvbench's bulk
rows with ``--pages P`` and nixl_reference with ``--pages P`` cycling over the
same LAYERS scattered blocks of a pool of the same size, at ``--pages-sizes``
(default 1 MiB), order alternating as above; the table shows the share of each
rank's pool the kernel put on huge pages (kvbench: the sidecar's
``transports.nixl[rank].pages``; the script: /proc/self/smaps).

kvbench's nixl rows run with ``-O prep=on`` unless ``--nixl-prep off`` (lists
prepared once, as serving engines and nixl_reference do); the other engines
with their defaults.  ``--kvbench-args "ENGINE:FLAGS"`` adds flags for one engine.

The model is MLA with a 512-wide fp16 latent and no RoPE part: 1 KiB per token
per layer, so a request of SIZE/1024 tokens has SIZE bytes per layer (a YAML
file: the --layers flag path fails on 2 ranks).  The ratio is kvbench / tool
per back-to-back pair, median over repeats (the machine is noisy).  The verdict per engine and tool pools
the pairs' ratios at sizes >= 256 KiB: their median with its 95% order-statistic interval; ``meets`` when
the interval is at or above the target, ``MISSES`` when below it, ``not decided`` when it straddles the
target or fewer than 5 pairs ran.

    python benchmarks/engines.py [--mpirun .venv/bin/mpiexec] [--engines nixl,ucx,mooncake] [--repeat 5]
           [--sizes 65536,262144,1048576,4194304] [--layers 16] [-n 20] [-w 3]
           [--pages 4k,thp] [--pages-sizes 1048576] [--parts tools,pages]
           [--nixl-prep on|off] [--kvbench-args "mooncake:-O notify=mpi"] [--variants bulk,hot|hot|bulk]

Per engine: engines_nixl.py, engines_ucx.py, engines_mooncake.py (its tool, what the header says
differs); kvbench's side and the ratios: engines_common.py; the tables: engines_report.py.

This process never imports MPI or an engine; every child runs with a timeout
and is killed (with its process tree) if it outlives it.  Exit code 0 when
every run finished (the targets are reported, not enforced), 1 otherwise.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # kvbench's own stats code, when run from a checkout without install
sys.path.insert(0, HERE)

from engines_common import ENGINES, KIB, MODEL_YAML, kill_live, kvbench_run, native_missing, pool_bytes  # noqa: E402
from engines_nixl import nixl_reference, pages_report  # noqa: E402
from engines_report import BY_ENGINE, header, report  # noqa: E402
from jobs import availability, kvbench_exe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                    help="MPI launcher, may carry flags (default: the venv's mpiexec)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="engines to compare (nixl, ucx, mooncake)")
    ap.add_argument("--sizes", default="65536,262144,1048576,4194304",
                    help="bytes per message (per layer), multiples of 1024 (comma-separated)")
    ap.add_argument("--layers", type=int, default=16, help="layers of the model = messages per kvbench request")
    ap.add_argument("-n", "--iters", type=int, default=20, help="kvbench timed iterations per case (default 20)")
    ap.add_argument("-w", "--warmup", type=int, default=3, help="kvbench warm-up iterations per case (default 3)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="kvbench/tool pairs per engine, interleaved (default 5: the fewest a verdict is given from)")
    ap.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="kvbench's byte check (default 1)")
    ap.add_argument("--ref-iters", type=int, default=300, help="nixl_reference transfers per size (default 300)")
    ap.add_argument("--ucx-budget", type=float, default=5e8, help="bytes per ucx_perftest run (sets -n)")
    ap.add_argument("--tls", default="sm", help="UCX_TLS for ucx_perftest (default sm)")
    ap.add_argument("--mc-duration", type=int, default=1, help="seconds per transfer_engine_bench run (default 1)")
    ap.add_argument("--case-timeout", type=float, default=60, help="kvbench --timeout per case, seconds")
    ap.add_argument("--launch-timeout", type=float, default=150, help="seconds one mpiexec launch may take")
    ap.add_argument("--nixl-prep", choices=("on", "off"), default="on",
                    help="kvbench nixl -O prep= (default on: lists prepared once, as serving engines and "
                         "nixl_reference do; off: initialize_xfer per post, kvbench's default)")
    ap.add_argument("--kvbench-args", action="append", default=[], metavar="ENGINE:ARGS",
                    help="extra kvbench run flags for one engine, e.g. \"nixl:-O prep=on\" (repeatable)")
    ap.add_argument("--pages", default="4k,thp",
                    help="page sizes for the nixl comparison by page size (4k, thp; empty: skip it; default 4k,thp)")
    ap.add_argument("--pages-sizes", default="1048576",
                    help="bytes per message (per layer) for the comparison by page size (default 1048576)")
    ap.add_argument("--parts", default="tools,pages",
                    help="what to run: tools (kvbench bulk and hot rows against each engine's own tool), pages"
                         " (nixl by page size against nixl_reference); comma-separated, default both")
    ap.add_argument("--variants", default="bulk,hot", choices=("bulk,hot", "hot", "bulk"),
                    help="kvbench's rows beside the tools (default bulk,hot; hot: the tools' own pattern only)")
    ap.add_argument("--keep", metavar="DIR", help="keep kvbench's result files under DIR (default: discarded)")
    a = ap.parse_args()
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    a.pages_sizes = [int(s) for s in a.pages_sizes.split(",") if s]
    if not a.sizes or any(s <= 0 or s % KIB for s in a.sizes + a.pages_sizes) or not a.pages_sizes:
        ap.error("--sizes, --pages-sizes: positive multiples of 1024")
    a.pages = [p for p in a.pages.split(",") if p]
    a.parts = [p for p in a.parts.split(",") if p]
    if not a.parts or any(p not in ("tools", "pages") for p in a.parts):
        ap.error("--parts: tools, pages (comma-separated)")
    if "pages" not in a.parts:
        a.pages = []
    if any(p not in ("4k", "thp") for p in a.pages):
        ap.error("--pages: 4k, thp (comma-separated)")
    engines = [e for e in a.engines.split(",") if e]
    if any(e not in ENGINES for e in engines):
        ap.error(f"--engines: {', '.join(ENGINES)}")
    if a.layers < 1 or a.repeat < 1:
        ap.error("--layers and --repeat must be >= 1")
    mpirun = shlex.split(a.mpirun)
    kv = kvbench_exe()
    start, load0 = time.monotonic(), os.getloadavg()
    atexit.register(kill_live)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    a.work = a.keep or tempfile.mkdtemp(prefix="kvbench-engines-")
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "engines-mla512.yaml")
    with open(model, "w") as fh:
        fh.write(MODEL_YAML.format(layers=a.layers))

    skipped = {e: r for e, r in availability(kv, engines).items() if r}
    for e in engines:
        if e not in skipped and native_missing(BY_ENGINE[e].TOOL):
            skipped[e] = f"native tool missing: {native_missing(BY_ENGINE[e].TOOL)}"
    kvb: dict = {}  # (engine, variant, op, size) -> {repeat: GB/s}
    over: dict = {}  # (engine, variant, op, size) -> {repeat: (harness us per request, p50 us)}
    nat: dict = {}  # (engine, op, size, tool) -> {repeat: GB/s}
    pg_kv: dict = {}  # (pages, op, size) -> {repeat: GB/s}, kvbench's nixl bulk rows
    pg_ref: dict = {}  # (pages, op, size) -> {repeat: GB/s}, nixl_reference
    pg_over: dict = {}  # (pages, op, size) -> {repeat: (harness us, p50 us)}
    pg_share: dict = {}  # (pages, "kvbench"|"script") -> [[huge share per rank], ...]
    pg_notes: list = []
    infos: dict = {}
    notes: dict = {}
    failed = False

    def note(where: list, msg: str) -> None:
        nonlocal failed
        failed = True
        if msg not in where:
            where.append(msg)

    def main_pair(rep: int, e: str) -> None:
        for what in (["kvbench", "native"] if rep % 2 == 0 else ["native", "kvbench"]):
            if what == "kvbench":
                try:
                    got = kvbench_run(a, kv, mpirun, e, model, os.path.join(a.work, f"{e}-{rep}"), a.sizes,
                                      variants=a.variants)
                except RuntimeError as exc:
                    note(notes.setdefault(e, []), str(exc).splitlines()[0])
                    print(f"engines: {exc}", file=sys.stderr)
                    continue
                infos[e] = got["infos"][0] if got["infos"] else {}
                if e == "nixl" and got["pool"] and got["pool"] != pool_bytes(a.sizes, a.layers):
                    note(notes.setdefault(e, []), f"kvbench's pool was {got['pool']} B, nixl_reference x{a.layers}'s"
                         f" {pool_bytes(a.sizes, a.layers)} B: the blocks are not at the same offsets")
                for key, g in got["gbps"].items():
                    kvb.setdefault((e, *key), {})[rep] = g
                    if key in got["over_us"]:
                        over.setdefault((e, *key), {})[rep] = (got["over_us"][key], got["p50_us"][key])
            else:
                per, msgs = BY_ENGINE[e].tools(a, mpirun)
                for m in msgs:
                    note(notes.setdefault(e, []), m)
                for (op, size, tool), g in per.items():
                    nat.setdefault((e, op, size, tool), {})[rep] = g

    def pages_pair(rep: int, pg: str) -> None:
        pool = pool_bytes(a.pages_sizes, a.layers)
        for what in (["kvbench", "script"] if rep % 2 == 0 else ["script", "kvbench"]):
            if what == "kvbench":
                try:
                    got = kvbench_run(a, kv, mpirun, "nixl", model, os.path.join(a.work, f"pages-{pg}-{rep}"),
                                      a.pages_sizes, variants="bulk", pages=pg)
                except RuntimeError as exc:
                    note(pg_notes, f"{pg}: " + str(exc).splitlines()[0])
                    print(f"engines: {exc}", file=sys.stderr)
                    continue
                if got["pool"] and got["pool"] != pool:
                    note(pg_notes, f"{pg}: kvbench's pool was {got['pool']} B, the script's {pool} B")
                pg_share.setdefault((pg, "kvbench"), []).append(
                    [(i.get("pages") or {}).get("huge_share") or 0.0 for i in got["infos"]])
                for (v, op, size), g in got["gbps"].items():
                    pg_kv.setdefault((pg, op, size), {})[rep] = g
                    if (v, op, size) in got["over_us"]:
                        pg_over.setdefault((pg, op, size), {})[rep] = (got["over_us"][(v, op, size)],
                                                                        got["p50_us"][(v, op, size)])
            else:
                for op in ("write", "read"):
                    per, shares, msg = nixl_reference(a, mpirun, op, a.pages_sizes, a.layers, pool, pg)
                    if msg:
                        note(pg_notes, f"{pg}: nixl_reference {op.upper()} x{a.layers} {msg}")
                    pg_share.setdefault((pg, "script"), []).append(shares)
                    for size, g in per.items():
                        pg_ref.setdefault((pg, "push" if op == "write" else "pull", size), {})[rep] = g

    live = [e for e in engines if e not in skipped]
    try:
        for rep in range(a.repeat):
            for e in (live if "tools" in a.parts else []):
                main_pair(rep, e)
                print(f"# repeat {rep + 1}/{a.repeat} {e} done ({time.monotonic() - start:.0f} s)", file=sys.stderr,
                      flush=True)
            if "nixl" in live:
                for pg in a.pages:
                    pages_pair(rep, pg)
                    print(f"# repeat {rep + 1}/{a.repeat} nixl pages={pg} done ({time.monotonic() - start:.0f} s)",
                          file=sys.stderr, flush=True)
    finally:
        kill_live()
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)

    if "tools" in a.parts:
        header(a, infos, live, load0)
        report(a, engines, kvb, nat, over, skipped, notes)
    if "nixl" in live and a.pages:
        print()
        pages_report(a, pg_kv, pg_ref, pg_share, pg_over, pg_notes)
    load1 = os.getloadavg()
    print(f"# load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; total {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
