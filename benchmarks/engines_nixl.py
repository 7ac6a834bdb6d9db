"""nixl in engines.py: nixl_reference.py (nixlbench's way; nixlbench is not in the wheel) as its own tool, and
kvbench's nixl bulk rows against it by page size (4k, thp) on the same scattered blocks."""
from __future__ import annotations

import os
import re
import sys

import numpy as np
from engines_common import PAGES_TARGET, fmt_size, judge, pair_ratios, pair_stats, pool_bytes, tail
from jobs import launch

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = None  # the tool is benchmarks/nixl_reference.py, always here


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
    note = None if rc == 0 and rows else f"failed (exit {rc}): {tail(out, 3)}"
    return {int(size): float(g) for size, g in rows}, shares, note


def tools(a, mpirun):
    """nixl_reference WRITE and READ on one buffer (against the hot row) and cycling over LAYERS regions where
    kvbench's bulk layers sit (against the bulk row): {(op, size, tool): GB/s}, and notes (failures)."""
    got, notes = {}, []
    for op in ("write", "read"):
        for regions in (1, a.layers):
            tool = f"nixl_reference {op.upper()}" + (f" x{regions}" if regions > 1 else "")
            per, _, note = nixl_reference(a, mpirun, op, a.sizes, regions, pool_bytes(a.sizes, a.layers), "4k")
            if note:
                notes.append(f"{tool} {note}")
            for size, gbps in per.items():
                got[("push" if op == "write" else "pull", size, tool)] = gbps
    return got, notes


def describe(a, i: dict) -> None:
    """The header's lines on what differs between nixl_reference and kvbench's nixl rows (i: rank 0's info())."""
    L = a.layers
    print("#   nixl_reference (--pages 4k): one prepared transfer of size re-posted serially, no barrier, GB/s over"
          " the loop, ends when rank 1 has the last notification; same buffer every time (nixlbench's way: from"
          " 256 KiB up it sits in the CPU caches; compare hot with it);")
    print(f"#   'x{L}': cycles over {L} regions at the offsets of kvbench's bulk layers (one every pool/{L} bytes of"
          " a pool of kvbench's size): the same scattered blocks, compare bulk with it")
    print(f"#   nixl kvbench: prep={i.get('prep')} progress_thread={i.get('progress_thread')}: one WRITE/READ with a"
          " notification per layer (prep=on: make_prepped_xfer per post; nixl_reference re-posts one handle)")


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
                k, n, med, rng = pair_stats(pg_kv.get((pg, op, size), {}), pg_ref.get((pg, op, size), {}))
                print(f"{pg:>6} {op:>4} {fmt_size(size):>8} {k:>12.3f} {n:>11.3f} {med:>5.2f} {rng:>11}"
                      f" {_shares(pg_share.get((pg, 'kvbench'), [])):>18} {_shares(pg_share.get((pg, 'script'), [])):>17}")
                if not np.isnan(med):
                    o = pg_over.get((pg, op, size), {})
                    cost = ""
                    if med < PAGES_TARGET and o:
                        cost = (f", harness {np.median([v[0] for v in o.values()]):.0f} us/request ="
                                f" {100 * np.median([v[0] / v[1] for v in o.values()]):.1f}% of p50")
                    pairs = pair_ratios(pg_kv.get((pg, op, size), {}), pg_ref.get((pg, op, size), {}))
                    verdict.append(f"{pg} {op} {fmt_size(size)} {judge(pairs, PAGES_TARGET, len(pairs))}{cost}")
    print(f"# pages: kvbench / script (target {PAGES_TARGET}): " + ("; ".join(verdict) or "-"))
    for n in pg_notes:
        print(f"# pages: {n}")
