"""Engines next to their own tools: kvbench's nixl, ucx and mooncake bulk rows vs each engine's benchmark.

For each engine that ``kvbench list`` says is available, one repeat runs
kvbench's bulk rows (one descriptor of SIZE bytes per layer, LAYERS layers
per request, push and pull) and the engine's own tool at the same sizes,
back to back, kvbench first on even repeats and the tool first on odd ones:

* nixl: ``benchmarks/nixl_reference.py`` (nixlbench's way; nixlbench is not in
  the wheel) WRITE and READ, once as nixlbench runs it (the same SIZE bytes
  every time) and once cycling over LAYERS regions (kvbench's working set);
* ucx: ``ucx_perftest`` tag_bw (two-sided, what kvbench's ucx transport does),
  ucp_put_bw and ucp_get (one-sided);
* mooncake: ``transfer_engine_bench`` write and read over tcp, batch = LAYERS
  requests of SIZE at distinct offsets (one kvbench request), 1 thread.

kvbench's nixl rows run with ``-O prep=on`` unless ``--nixl-prep off`` (lists
prepared once, as serving engines and nixl_reference do); the other engines
with their defaults.  ``--kvbench-args "ENGINE:FLAGS"`` adds flags for one engine.

The model is MLA with a 512-wide fp16 latent and no RoPE part: 1 KiB per token
per layer, so a request of SIZE/1024 tokens has SIZE bytes per layer (a YAML
file: the --layers flag path fails on 2 ranks).  The ratio is kvbench / tool
per back-to-back pair, median over repeats (the machine is noisy).

    python benchmarks/engines.py [--mpirun .venv/bin/mpiexec] [--engines nixl,ucx,mooncake] [--repeat 3]
           [--sizes 65536,262144,1048576,4194304] [--layers 16] [-n 20] [-w 3]
           [--nixl-prep on|off] [--kvbench-args "mooncake:-O notify=mpi"]

This process never imports MPI or an engine; every child runs with a timeout
and is killed (with its process tree) if it outlives it.  Exit code 0 when
every run finished (the target is reported, not enforced), 1 otherwise.
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
from jobs import LIVE, descendants, kill_tree, launch  # noqa: E402

from kvbench.results import case_stats  # noqa: E402  (pandas only; no MPI)

KIB = 1024
ENGINES = ("nixl", "ucx", "mooncake")
MODEL_YAML = "name: engines-mla512\nlayers: {layers}\nattention: mla\nkv_lora_rank: 512\nrope_dim: 0\n"
TARGET_SIZE, TARGET_RATIO = 256 * KIB, 0.9


# ----- processes and leftovers --------------------------------------------------------------
def _kill_live() -> None:
    for root in list(LIVE):
        kill_tree(root, descendants(root))
    LIVE.clear()
    nt._kill_all()


# ----- availability -------------------------------------------------------------------------
def availability(kv: list[str], engines: list[str]) -> dict[str, str | None]:
    """engine -> None when kvbench can run it here, else the reason (from ``kvbench list``)."""
    rc, out = launch(kv + ["list"], 60)
    got: dict[str, str | None] = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\S+)\s+(available|unavailable: .*)$", line)
        if m and m.group(1) in engines:
            got[m.group(1)] = None if m.group(2) == "available" else m.group(2).split(": ", 1)[1]
    return {e: got.get(e, f"kvbench list failed (exit {rc})" if rc else "not listed by kvbench list")
            for e in engines}


def native_missing(engine: str) -> str | None:
    site = nt._site()
    exe = {"nixl": None, "ucx": os.path.join(site, "libucx", "bin", "ucx_perftest"),
           "mooncake": os.path.join(site, "mooncake", "transfer_engine_bench")}[engine]
    if exe and not os.access(exe, os.X_OK):
        return f"{os.path.basename(exe)} not found under {site}"
    return None


# ----- one side of a repeat -----------------------------------------------------------------
def kvbench_run(a, kv, mpirun, engine, model, outdir):
    """kvbench's bulk rows: {(op, size): GB/s}, and rank 0's transport info()."""
    import pandas as pd

    extra = [x.split(":", 1)[1] for x in a.kvbench_args if x.split(":", 1)[0] == engine]
    if engine == "nixl":
        extra.insert(0, f"-O prep={a.nixl_prep}")
    cmd = mpirun + ["-n", "2"] + kv + [
        "run", "-t", engine, "--op", "push,pull", "--variants", "bulk", "-m", model, "--dtype", "fp16",
        "--tokens", ",".join(str(s // KIB) for s in a.sizes), "-n", str(a.iters), "-w", str(a.warmup),
        "-c", str(a.check), "--timeout", str(a.case_timeout), "-o", outdir, "--name", f"engines-{engine}",
    ] + [w for x in extra for w in shlex.split(x)]
    rc, out = launch(cmd, a.launch_timeout)
    paths = glob.glob(os.path.join(outdir, "*", "*.parquet"))
    if rc != 0 or len(paths) != 1:
        raise RuntimeError(f"kvbench {engine} failed (exit {rc}): {shlex.join(cmd)}\n" + _tail(out))
    with open(paths[0][: -len(".parquet")] + ".meta.json") as fh:
        meta = json.load(fh)
    st = case_stats(pd.read_parquet(paths[0]))
    st = st[(st["status"] == "ok") & (st["variant"] == "bulk")]
    info = next(iter(meta.get("transports", {}).values()), [{}])[0] or {}
    return {(r.op, int(r.tokens) * KIB): float(r.gbps) for r in st.itertuples()}, info


def native_run(a, mpirun, engine):
    """The engine's own tool: {(op, size, tool): GB/s}, and notes (failures)."""
    got, notes = {}, []
    sizes = ",".join(map(str, a.sizes))
    if engine == "nixl":
        for op in ("write", "read"):
            for regions in (1, a.layers):
                cmd = mpirun + ["-n", "2", sys.executable, os.path.join(HERE, "nixl_reference.py"), "--sizes", sizes,
                                "--op", op, "--regions", str(regions), "--iters", str(a.ref_iters),
                                "--warmup", str(max(10, a.ref_iters // 10))]
                rc, out = launch(cmd, a.launch_timeout)
                tool = f"nixl_reference {op.upper()}" + (f" x{regions}" if regions > 1 else "")
                rows = [ln.split(",") for ln in out.splitlines() if re.match(r"^\d+,[\d.]+$", ln.strip())]
                if rc != 0 or not rows:
                    notes.append(f"{tool} failed (exit {rc}): {_tail(out, 3)}")
                for size, gbps in rows:
                    got[("push" if op == "write" else "pull", int(size), tool)] = float(gbps)
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


# ----- the table ----------------------------------------------------------------------------
def header(a, infos, engines, load0):
    L = a.layers
    print(f"# kvbench engines vs their own tools, 2 ranks on {socket.gethostname()}; load average at start "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (1/5/15 min, {os.cpu_count()} CPUs)")
    print(f"# repeats={a.repeat} (kvbench and tool back to back, order alternating); kvbench iterations={a.iters} "
          f"warmup={a.warmup} check={a.check}; GB = 10^9 B; size = bytes per message (per layer)")
    print("# columns: engine, op (push = initiator writes, pull = initiator reads), size;")
    print(f"#   kvbench GB/s: payload ({L} x size) / p50 of kvbench's bulk row (--variants bulk: one descriptor per layer,"
          f" {L} layers at distinct offsets). One request = barrier, {L} posts at once, then waits until the")
    print("#   destination knows the last byte landed (max over both ranks); median over repeats")
    print("#   native GB/s: the engine's own tool at the same message size, median over repeats; native tool: which;")
    print("#   ratio: kvbench / native of each back-to-back pair, median over repeats (min..max)")
    print("# what differs (native tools stream back to back; kvbench times whole requests until the destination knows):")
    if "nixl" in engines:
        print(f"#   nixl_reference: one prepared transfer of size re-posted serially, no barrier, GB/s over the loop, ends when"
              f" rank 1 has the last notification; same buffer every time (nixlbench's way: from 256 KiB up it sits in the"
              f" CPU caches); 'xN': cycles over N={L} regions = kvbench's working set")
        i = infos.get("nixl", {})
        print(f"#   nixl kvbench: prep={i.get('prep')} progress_thread={i.get('progress_thread')}: one WRITE/READ with a"
              " notification per layer (prep=on: make_prepped_xfer per post; nixl_reference re-posts one handle)")
    if "ucx" in engines:
        i = infos.get("ucx", {})
        lanes = next(iter(i.get("lanes", {}).values()), {}).get("tag_send", [])
        print(f"#   ucx_perftest (UCX_TLS={a.tls}, one buffer, back to back, -n from {a.ucx_budget:.0e} B): tag_bw is"
              " two-sided like kvbench's ucx transport (compare push with it; kvbench adds a 32 B header message per")
        print("#   layer); put_bw/get are one-sided (ucxx has none); kvbench's ucx pull is two-sided (a request, then"
              " the source tag-sends), shown against ucp_get as the tool's read")
        if lanes:
            print(f"#   ucx kvbench: UCX_TLS={i.get('UCX_TLS')}, tag protocol for large messages: {lanes[-1]}")
    if "mooncake" in engines:
        i = infos.get("mooncake", {})
        print(f"#   transfer_engine_bench: tcp, --batch_size={L} (= descriptors of one kvbench request, at distinct"
              f" offsets: the same working set) --threads=1, {a.mc_duration} s, busy-polls each task, no notification;")
        print(f"#   mooncake kvbench: protocol={i.get('protocol')}, one batch of 1 descriptor per layer ({L} batches"
              f" submitted, then waited); notify={i.get('notify', '?').split()[0]} (socket: the initiator sends the tag"
              " per layer on a TCP socket the destination sleeps on; mpi: the harness's MPI message)")


def report(a, engines, kvb, nat, skipped, notes):
    """Rows, then one closing line per engine."""
    print(f"{'engine':>8} {'op':>4} {'size':>8} {'kvbench GB/s':>12} {'native GB/s':>11}  {'native tool':<30}"
          f" {'ratio':>5} {'(min..max)':>11}")
    for e in engines:
        if e in skipped:
            print(f"{e:>8} unavailable: {skipped[e]}")
            continue
        tools = sorted({t for (ee, _, _, t) in nat if ee == e}, key=lambda t: (_tool_order(t), t))
        per_tool: dict[str, list[float]] = {}
        for t in tools:
            for size in a.sizes:
                op = next((o for (ee, o, s, tt) in nat if ee == e and tt == t), None)
                ks, ns = kvb.get((e, op, size), {}), nat.get((e, op, size, t), {})
                ratios = [ks[r] / ns[r] for r in ks if r in ns and ns[r] > 0]
                k = np.median(list(ks.values())) if ks else float("nan")
                n = np.median(list(ns.values())) if ns else float("nan")
                med = float(np.median(ratios)) if ratios else float("nan")
                rng = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-"
                print(f"{e:>8} {op:>4} {fmt_size(size):>8} {k:>12.3f} {n:>11.3f}  {t:<30} {med:>5.2f} {rng:>11}")
                if size >= TARGET_SIZE and ratios:
                    per_tool.setdefault(t, []).append(med)
        parts = [f"{np.median(v):.2f} vs {t} ({'meets' if np.median(v) >= TARGET_RATIO else 'MISSES'})"
                 for t, v in per_tool.items()]
        print(f"# {e}: median ratio at >= {fmt_size(TARGET_SIZE)} (target {TARGET_RATIO}): " + ("; ".join(parts) or "-"))
        for n in notes.get(e, []):
            print(f"# {e}: {n}")


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
    ap.add_argument("--keep", metavar="DIR", help="keep kvbench's result files under DIR (default: discarded)")
    a = ap.parse_args()
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    if not a.sizes or any(s <= 0 or s % KIB for s in a.sizes):
        ap.error("--sizes: positive multiples of 1024")
    engines = [e for e in a.engines.split(",") if e]
    if any(e not in ENGINES for e in engines):
        ap.error(f"--engines: {', '.join(ENGINES)}")
    if a.layers < 1 or a.repeat < 1:
        ap.error("--layers and --repeat must be >= 1")
    mpirun = shlex.split(a.mpirun)
    exe = os.path.join(os.path.dirname(sys.executable), "kvbench")
    kv = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "kvbench"]
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
    kvb: dict = {}  # (engine, op, size) -> {repeat: GB/s}
    nat: dict = {}  # (engine, op, size, tool) -> {repeat: GB/s}
    infos: dict = {}
    notes: dict = {}
    failed = False
    try:
        for rep in range(a.repeat):
            for e in [e for e in engines if e not in skipped]:
                steps = ["kvbench", "native"] if rep % 2 == 0 else ["native", "kvbench"]
                for what in steps:
                    if what == "kvbench":
                        try:
                            per, infos[e] = kvbench_run(a, kv, mpirun, e, model, os.path.join(a.work, f"{e}-{rep}"))
                        except RuntimeError as exc:
                            notes.setdefault(e, []).append(str(exc).splitlines()[0])
                            print(f"engines: {exc}", file=sys.stderr)
                            failed = True
                            continue
                        for (op, size), g in per.items():
                            kvb.setdefault((e, op, size), {})[rep] = g
                    else:
                        per, msgs = native_run(a, mpirun, e)
                        failed |= bool(msgs)
                        for m in msgs:
                            if m not in notes.get(e, []):
                                notes.setdefault(e, []).append(m)
                        for (op, size, tool), g in per.items():
                            nat.setdefault((e, op, size, tool), {})[rep] = g
                print(f"# repeat {rep + 1}/{a.repeat} {e} done ({time.monotonic() - start:.0f} s)", file=sys.stderr,
                      flush=True)
    finally:
        _kill_live()
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)

    header(a, infos, [e for e in engines if e not in skipped], load0)
    report(a, engines, kvb, nat, skipped, notes)
    load1 = os.getloadavg()
    print(f"# load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; total {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
