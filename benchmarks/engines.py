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
per back-to-back pair, median over repeats (the machine is noisy).

    python benchmarks/engines.py [--mpirun .venv/bin/mpiexec] [--engines nixl,ucx,mooncake] [--repeat 3]
           [--sizes 65536,262144,1048576,4194304] [--layers 16] [-n 20] [-w 3]
           [--pages 4k,thp] [--pages-sizes 1048576] [--parts tools,pages]
           [--nixl-prep on|off] [--kvbench-args "mooncake:-O notify=mpi"] [--variants bulk,hot|hot|bulk]

This process never imports MPI or an engine; every child runs with a timeout
and is killed (with its process tree) if it outlives it.  Exit code 0 when
every run finished (the targets are reported, not enforced), 1 otherwise.
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # kvbench's own stats code, when run from a checkout without install
sys.path.insert(0, HERE)

import native_tools as nt  # noqa: E402  (subprocess only: ucx_perftest, transfer_engine_bench)
from jobs import availability, kvbench_exe, launch  # noqa: E402

from kvbench.job.launch import LIVE, kill_tree  # noqa: E402
from kvbench.results.store import case_stats  # noqa: E402  (pandas only; no MPI)

KIB = 1024
ENGINES = ("nixl", "ucx", "mooncake")
MODEL_YAML = "name: engines-mla512\nlayers: {layers}\nattention: mla\nkv_lora_rank: 512\nrope_dim: 0\n"
TARGET_SIZE, TARGET_RATIO = 256 * KIB, 0.9  # bulk / tool
HOT_TARGET = 0.95  # hot / tool, at >= TARGET_SIZE
PAGES_TARGET = 0.95  # kvbench bulk / nixl_reference on the same pages and scattered blocks
PAGE = 4096


# ----- processes and leftovers --------------------------------------------------------------
def _kill_live() -> None:
    for root in list(LIVE):
        kill_tree(root)
    LIVE.clear()
    nt._kill_all()


# ----- availability -------------------------------------------------------------------------
def native_missing(engine: str) -> str | None:
    site = nt._site()
    exe = {"nixl": None, "ucx": os.path.join(site, "libucx", "bin", "ucx_perftest"),
           "mooncake": os.path.join(site, "mooncake", "transfer_engine_bench")}[engine]
    if exe and not os.access(exe, os.X_OK):
        return f"{os.path.basename(exe)} not found under {site}"
    return None


# ----- one side of a repeat -----------------------------------------------------------------
def pool_bytes(sizes: list[int], layers: int) -> int:
    """kvbench's pool for these bulk cases: --pool-factor 2 x the largest request, rounded up to a page."""
    return -(-2 * max(sizes) * layers // PAGE) * PAGE


def kvbench_run(a, kv, mpirun, engine, model, outdir, sizes, variants="bulk,hot", pages=None):
    """kvbench's rows: {"gbps"|"p50_us"|"over_us": {(variant, op, size): value}, "infos": every rank's
    transport info() (page shares in "pages"), "pool": pool bytes}."""
    import pandas as pd

    extra = [x.split(":", 1)[1] for x in a.kvbench_args if x.split(":", 1)[0] == engine]
    if engine == "nixl":
        extra.insert(0, f"-O prep={a.nixl_prep}")
    cmd = mpirun + ["-n", "2"] + kv + [
        "run", "-t", engine, "--op", "push,pull", "--variants", variants, "-m", model, "--dtype", "fp16",
        "--tokens", ",".join(str(s // KIB) for s in sizes), "-n", str(a.iters), "-w", str(a.warmup),
        "-c", str(a.check), "--timeout", str(a.case_timeout), "-o", outdir, "--name", f"engines-{engine}",
    ] + (["--pages", pages] if pages else []) + [w for x in extra for w in shlex.split(x)]
    rc, out = launch(cmd, a.launch_timeout)
    paths = glob.glob(os.path.join(outdir, "*", "*.parquet"))
    if rc != 0 or len(paths) != 1:
        raise RuntimeError(f"kvbench {engine} failed (exit {rc}): {shlex.join(cmd)}\n" + _tail(out))
    with open(paths[0][: -len(".parquet")] + ".meta.json") as fh:
        meta = json.load(fh)
    st = case_stats(pd.read_parquet(paths[0]))
    st = st[(st["status"] == "ok") & st["variant"].isin(variants.split(","))]
    over = meta.get("harness_overhead_us", {})
    infos = [i or {} for i in next(iter(meta.get("transports", {}).values()), [{}])]
    got: dict = {"gbps": {}, "p50_us": {}, "over_us": {}, "infos": infos,
                 "pool": next((i.get("pool_bytes") for i in infos if i.get("pool_bytes")), None)}
    for r in st.itertuples():
        key = (r.variant, r.op, int(r.tokens) * KIB)
        got["gbps"][key] = float(r.gbps)
        got["p50_us"][key] = float(r.p50) * 1e6
        o = over.get(str(int(r.case)), {}).get("mean_us")
        if o is not None:
            got["over_us"][key] = float(o)
    return got


def nixl_reference(a, mpirun, op, sizes, regions, pool, pages):
    """One nixl_reference launch: ({size: GB/s}, [huge share per rank], failure note or None)."""
    cmd = mpirun + ["-n", "2", sys.executable, os.path.join(HERE, "nixl_reference.py"),
                    "--sizes", ",".join(map(str, sizes)), "--op", op, "--regions", str(regions),
                    "--iters", str(a.ref_iters), "--warmup", str(max(10, a.ref_iters // 10)), "--pages", pages]
    if regions > 1:
        cmd += ["--pool-bytes", str(pool)]
    rc, out = launch(cmd, a.launch_timeout)
    rows = [ln.split(",") for ln in out.splitlines() if re.match(r"^\d+,[\d.]+$", ln.strip())]
    shares = [float(m) for m in re.findall(r"^# pages: rank \d+ requested=\S+ huge_share=([\d.]+)", out, re.M)]
    note = None if rc == 0 and rows else f"failed (exit {rc}): {_tail(out, 3)}"
    return {int(size): float(g) for size, g in rows}, shares, note


def native_run(a, mpirun, engine):
    """The engine's own tool: {(op, size, tool): GB/s}, and notes (failures)."""
    got, notes = {}, []
    if engine == "nixl":
        for op in ("write", "read"):
            for regions in (1, a.layers):
                tool = f"nixl_reference {op.upper()}" + (f" x{regions}" if regions > 1 else "")
                per, _, note = nixl_reference(a, mpirun, op, a.sizes, regions, pool_bytes(a.sizes, a.layers), "4k")
                if note:
                    notes.append(f"{tool} {note}")
                for size, gbps in per.items():
                    got[("push" if op == "write" else "pull", size, tool)] = gbps
    elif engine == "ucx":
        for op, test in (("push", "tag_bw"), ("push", "ucp_put_bw"), ("pull", "ucp_get")):
            for size in a.sizes:
                try:
                    got[(op, size, f"ucx_perftest {test}")] = nt.ucx_run(test, size, a.tls, a.ucx_budget, 60)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    notes.append(f"ucx_perftest {test} {size}: {str(exc).splitlines()[0]}")
    elif engine == "mooncake":
        buffer_size = max(256 << 20, max(a.sizes) * a.layers)
        log = os.path.join(a.work, "mooncake_target.log")
        try:
            _, session = nt.mooncake_target(buffer_size, log)
            for op, mop in (("push", "write"), ("pull", "read")):
                for size in a.sizes:
                    tool = f"transfer_engine_bench {mop}"
                    try:
                        got[(op, size, tool)] = nt.mooncake_run(session, mop, size, a.layers, 1, a.mc_duration,
                                                                buffer_size, 30 + a.mc_duration)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        notes.append(f"{tool} {size}: {str(exc).splitlines()[0]}")
        except RuntimeError as exc:
            notes.append(f"transfer_engine_bench target: {exc}")
        finally:
            nt._kill_all()
    return got, notes


def _tail(out: str, n: int = 12) -> str:
    return "\n".join((out or "").strip().splitlines()[-n:])


def fmt_size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n // KIB} KiB"


# ----- the tables ---------------------------------------------------------------------------
def header(a, infos, engines, load0):
    L = a.layers
    print(f"# kvbench engines vs their own tools, 2 ranks on {socket.gethostname()}; load average at start "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (1/5/15 min, {os.cpu_count()} CPUs)")
    print(f"# repeats={a.repeat} (kvbench and tool back to back, order alternating); kvbench iterations={a.iters} "
          f"warmup={a.warmup} check={a.check}; GB = 10^9 B; size = bytes per message (per layer)")
    print("# columns: engine, op (push = initiator writes, pull = initiator reads), size;")
    print(f"#   bulk GB/s: payload ({L} x size) / p50 of kvbench's bulk row (one descriptor per layer, {L} layers,"
          f" each at the start of its layer's span of a {fmt_size(pool_bytes(a.sizes, L))} pool: scattered)."
          f" One request = barrier, {L} posts at once, then waits until the")
    print("#   destination knows the last byte landed (max over both ranks); median over repeats; pools on kvbench's"
          " default pages (4k)")
    print(f"#   hot GB/s: the same for kvbench's hot row (every layer's descriptor points at layer 0's range: one"
          f" layer-sized buffer re-sent {L} times, as the tools re-send theirs)")
    print("#   tool GB/s: the engine's own tool at the same message size, median over repeats; tool: which;")
    print("#   bulk/tool, hot/tool: kvbench / tool of each back-to-back pair, median over repeats (min..max)")
    print("# what differs (native tools stream back to back; kvbench times whole requests until the destination knows):")
    if "nixl" in engines:
        print("#   nixl_reference (--pages 4k): one prepared transfer of size re-posted serially, no barrier, GB/s over"
              " the loop, ends when rank 1 has the last notification; same buffer every time (nixlbench's way: from"
              " 256 KiB up it sits in the CPU caches; compare hot with it);")
        print(f"#   'x{L}': cycles over {L} regions at the offsets of kvbench's bulk layers (one every pool/{L} bytes of"
              " a pool of kvbench's size): the same scattered blocks, compare bulk with it")
        i = infos.get("nixl", {})
        print(f"#   nixl kvbench: prep={i.get('prep')} progress_thread={i.get('progress_thread')}: one WRITE/READ with a"
              " notification per layer (prep=on: make_prepped_xfer per post; nixl_reference re-posts one handle)")
    if "ucx" in engines:
        i = infos.get("ucx", {})
        lanes = next(iter(i.get("lanes", {}).values()), {}).get("tag_send", [])
        print(f"#   ucx_perftest (UCX_TLS={a.tls}, one buffer, back to back, -n from {a.ucx_budget:.0e} B): tag_bw is"
              " two-sided like kvbench's ucx transport (compare push with it; kvbench adds a 32 B header message per")
        print("#   request, sent when it is prepared); put_bw/get are one-sided (ucxx has none); kvbench's ucx pull is"
              " two-sided (a request, then the source tag-sends), shown against ucp_get as the tool's read")
        if lanes:
            print(f"#   ucx kvbench: UCX_TLS={i.get('UCX_TLS')}, tag protocol for large messages: {lanes[-1]};"
                  f" progress: {i.get('progress')} (ucx_perftest spins)")
    if "mooncake" in engines:
        i = infos.get("mooncake", {})
        print(f"#   transfer_engine_bench: tcp, --batch_size={L} (= descriptors of one kvbench request, at distinct"
              f" offsets, the same {L} every batch: bulk's working set) --threads=1, {a.mc_duration} s, busy-polls"
              " each task, no notification;")
        print(f"#   mooncake kvbench: protocol={i.get('protocol')}, a request's {L} layers as one batch of {L} descriptors,"
              f" one get_batch_transfer_status; notify={i.get('notify', '?').split()[0]} (socket: the initiator sends"
              " the tag per request on a TCP socket the destination sleeps on; mpi: the harness's MPI message); a"
              " rank done early (a pull's source) sleeps in the barrier after the iteration, as the tool's target idles")


def _stats(num: dict, den: dict) -> tuple[float, float, float, str]:
    """(median of num, median of den, median ratio of pairs, 'min..max' of the ratios) over repeats."""
    ratios = [num[r] / den[r] for r in num if r in den and den[r] > 0]
    n = float(np.median(list(num.values()))) if num else float("nan")
    d = float(np.median(list(den.values()))) if den else float("nan")
    med = float(np.median(ratios)) if ratios else float("nan")
    return n, d, med, (f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-")


def _verdict(per_tool: dict, target: float) -> str:
    return "; ".join(f"{np.median(v):.2f} vs {t} ({'meets' if np.median(v) >= target else 'MISSES'})"
                     for t, v in per_tool.items()) or "-"


def report(a, engines, kvb, nat, over, skipped, notes):
    """Rows, then the closing lines per engine: bulk and hot against the tools, and the harness's own time."""
    print(f"{'engine':>8} {'op':>4} {'size':>8} {'bulk GB/s':>9} {'hot GB/s':>8} {'tool GB/s':>9}  {'tool':<30}"
          f" {'bulk/tool':>9} {'(min..max)':>11} {'hot/tool':>8} {'(min..max)':>11}")
    for e in engines:
        if e in skipped:
            print(f"{e:>8} unavailable: {skipped[e]}")
            continue
        tools = sorted({t for (ee, _, _, t) in nat if ee == e}, key=lambda t: (_tool_order(t), t))
        bulk_tool: dict[str, list[float]] = {}
        hot_tool: dict[str, list[float]] = {}
        for t in tools:
            hot_ok = not re.search(r" x\d+$", t)  # a tool cycling over kvbench's scattered blocks is bulk's peer
            for size in a.sizes:
                op = next((o for (ee, o, s, tt) in nat if ee == e and tt == t), None)
                ns = nat.get((e, op, size, t), {})
                b, n, bmed, brng = _stats(kvb.get((e, "bulk", op, size), {}), ns)
                h, _, hmed, hrng = _stats(kvb.get((e, "hot", op, size), {}), ns)
                hcol = f"{hmed:>8.2f} {hrng:>11}" if hot_ok else f"{'-':>8} {'-':>11}"
                print(f"{e:>8} {op:>4} {fmt_size(size):>8} {b:>9.3f} {h:>8.3f} {n:>9.3f}  {t:<30}"
                      f" {bmed:>9.2f} {brng:>11} {hcol}")
                if size >= TARGET_SIZE and not np.isnan(bmed):
                    bulk_tool.setdefault(t, []).append(bmed)
                if size >= TARGET_SIZE and hot_ok and not np.isnan(hmed):
                    hot_tool.setdefault(t, []).append(hmed)
        print(f"# {e}: median ratio at >= {fmt_size(TARGET_SIZE)} (target {TARGET_RATIO}): bulk/tool "
              + _verdict(bulk_tool, TARGET_RATIO))
        print(f"# {e}: hot median ratio at >= {fmt_size(TARGET_SIZE)} (target {HOT_TARGET}): hot/tool "
              + _verdict(hot_tool, HOT_TARGET))
        parts = []
        for op in ("push", "pull"):
            sizes = [s for s in a.sizes if s >= TARGET_SIZE and over.get((e, "hot", op, s))]
            if not sizes:
                continue
            p50 = [float(np.median([v[1] for v in over[(e, "hot", op, s)].values()])) for s in sizes]
            fit = ""
            if len(sizes) >= 2:  # p50 = fixed + request bytes / rate: a per-request cost, or a per-byte one?
                slope, fixed = np.polyfit([a.layers * s for s in sizes], p50, 1)
                fit = f"fixed {fixed:.0f} us + bytes at {1e-3 / slope:.2f} GB/s, " if slope > 0 else ""
            harness = [f"{np.median([v[0] for v in over[(e, 'hot', op, s)].values()]):.0f} us"
                       f" ({100 * np.median([v[0] / v[1] for v in over[(e, 'hot', op, s)].values()]):.1f}%)"
                       f" at {fmt_size(s)}" for s in sizes]
            parts.append(f"{op}: {fit}harness " + ", ".join(harness))
        if parts:
            print(f"# {e}: hot cost per request (p50 medians, least squares over sizes >= {fmt_size(TARGET_SIZE)}:"
                  " fixed + bytes / rate) and the harness's time outside the transport (sidecar harness_overhead_us,"
                  " % of p50): " + "; ".join(parts))
        for n in notes.get(e, []):
            print(f"# {e}: {n}")


def _shares(lists: list[list[float]]) -> str:
    """Huge-page share per rank, the smallest over repeats: 'r0/r1' (the kernel may give fewer than asked)."""
    lists = [x for x in lists if x]
    if not lists:
        return "-"
    return "/".join(f"{min(x[r] for x in lists if len(x) > r):.2f}" for r in range(max(map(len, lists))))


def pages_report(a, pg_kv, pg_ref, pg_share, pg_over, pg_notes):
    """kvbench's nixl bulk rows against nixl_reference on the same pages and scattered blocks."""
    L, pool = a.layers, pool_bytes(a.pages_sizes, a.layers)
    print(f"# nixl by page size: kvbench bulk rows (--pages P: {L} layers of size, one descriptor each at the start of"
          f" its layer's span of a {fmt_size(pool)} pool) vs nixl_reference --pages P --regions {L} --pool-bytes"
          f" {pool} (the same {L} scattered blocks, one every {fmt_size(pool // L)});")
    print("#   GB/s median over repeats; ratio = kvbench / script per back-to-back pair, median (min..max); huge r0/r1:"
          " share of each rank's pool on huge pages, smallest over repeats (kvbench: sidecar"
          " transports.nixl[rank].pages.huge_share; script: AnonHugePages in /proc/self/smaps)")
    print(f"{'pages':>6} {'op':>4} {'size':>8} {'kvbench GB/s':>12} {'script GB/s':>11} {'ratio':>5} {'(min..max)':>11}"
          f" {'kvbench huge r0/r1':>18} {'script huge r0/r1':>17}")
    verdict = []
    for pg in a.pages:
        for op in ("push", "pull"):
            for size in a.pages_sizes:
                k, n, med, rng = _stats(pg_kv.get((pg, op, size), {}), pg_ref.get((pg, op, size), {}))
                print(f"{pg:>6} {op:>4} {fmt_size(size):>8} {k:>12.3f} {n:>11.3f} {med:>5.2f} {rng:>11}"
                      f" {_shares(pg_share.get((pg, 'kvbench'), [])):>18} {_shares(pg_share.get((pg, 'script'), [])):>17}")
                if not np.isnan(med):
                    o = pg_over.get((pg, op, size), {})
                    cost = ""
                    if med < PAGES_TARGET and o:
                        cost = (f", harness {np.median([v[0] for v in o.values()]):.0f} us/request ="
                                f" {100 * np.median([v[0] / v[1] for v in o.values()]):.1f}% of p50")
                    verdict.append(f"{pg} {op} {fmt_size(size)} {med:.2f}"
                                   f" ({'meets' if med >= PAGES_TARGET else 'MISSES'}{cost})")
    print(f"# pages: kvbench / script (target {PAGES_TARGET}): " + ("; ".join(verdict) or "-"))
    for n in pg_notes:
        print(f"# pages: {n}")


def _tool_order(t: str) -> int:
    for i, key in enumerate(("WRITE", "tag_bw", "put_bw", "write", "READ", "get", "read")):
        if key in t:
            return i
    return 99


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
    ap.add_argument("--repeat", type=int, default=3, help="kvbench/tool pairs per engine (default 3)")
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
    atexit.register(_kill_live)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    a.work = a.keep or tempfile.mkdtemp(prefix="kvbench-engines-")
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "engines-mla512.yaml")
    with open(model, "w") as fh:
        fh.write(MODEL_YAML.format(layers=a.layers))

    skipped = {e: r for e, r in availability(kv, engines).items() if r}
    for e in engines:
        if e not in skipped and native_missing(e):
            skipped[e] = f"native tool missing: {native_missing(e)}"
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
                per, msgs = native_run(a, mpirun, e)
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
        _kill_live()
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
