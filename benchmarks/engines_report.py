"""engines.py's tables: the header (what is measured, what differs per engine) and the rows with their verdicts."""
from __future__ import annotations

import os
import re
import socket

import engines_mooncake
import engines_nixl
import engines_ucx
import numpy as np
from engines_common import (
    ENGINES,
    HOT_TARGET,
    TARGET_RATIO,
    TARGET_SIZE,
    fmt_size,
    pair_ratios,
    pair_stats,
    pool_bytes,
    tool_order,
    verdict,
)

BY_ENGINE = {"nixl": engines_nixl, "ucx": engines_ucx, "mooncake": engines_mooncake}


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
    for e in ENGINES:  # always in this order, whatever --engines says
        if e in engines:
            BY_ENGINE[e].describe(a, infos.get(e, {}))


def report(a, engines, kvb, nat, over, skipped, notes):
    """Rows, then the closing lines per engine: bulk and hot against the tools, and the harness's own time."""
    print(f"{'engine':>8} {'op':>4} {'size':>8} {'bulk GB/s':>9} {'hot GB/s':>8} {'tool GB/s':>9}  {'tool':<30}"
          f" {'bulk/tool':>9} {'(min..max)':>11} {'hot/tool':>8} {'(min..max)':>11}")
    for e in engines:
        if e in skipped:
            print(f"{e:>8} unavailable: {skipped[e]}")
            continue
        tools = sorted({t for (ee, _, _, t) in nat if ee == e}, key=lambda t: (tool_order(t), t))
        bulk_tool: dict[str, list[float]] = {}
        hot_tool: dict[str, list[float]] = {}
        for t in tools:
            hot_ok = not re.search(r" x\d+$", t)  # a tool cycling over kvbench's scattered blocks is bulk's peer
            for size in a.sizes:
                op = next((o for (ee, o, s, tt) in nat if ee == e and tt == t), None)
                ns = nat.get((e, op, size, t), {})
                b, n, bmed, brng = pair_stats(kvb.get((e, "bulk", op, size), {}), ns)
                h, _, hmed, hrng = pair_stats(kvb.get((e, "hot", op, size), {}), ns)
                hcol = f"{hmed:>8.2f} {hrng:>11}" if hot_ok else f"{'-':>8} {'-':>11}"
                print(f"{e:>8} {op:>4} {fmt_size(size):>8} {b:>9.3f} {h:>8.3f} {n:>9.3f}  {t:<30}"
                      f" {bmed:>9.2f} {brng:>11} {hcol}")
                if size >= TARGET_SIZE:  # every pair's ratio at the target's sizes: the verdict's samples
                    bulk_tool.setdefault(t, []).extend(pair_ratios(kvb.get((e, "bulk", op, size), {}), ns))
                    if hot_ok:
                        hot_tool.setdefault(t, []).extend(pair_ratios(kvb.get((e, "hot", op, size), {}), ns))
        print(f"# {e}: bulk/tool at >= {fmt_size(TARGET_SIZE)} (target {TARGET_RATIO}; median of the pairs' ratios"
              " [its 95% interval]): " + verdict({t: v for t, v in bulk_tool.items() if v}, TARGET_RATIO, a.repeat))
        print(f"# {e}: hot/tool at >= {fmt_size(TARGET_SIZE)} (target {HOT_TARGET}): "
              + verdict({t: v for t, v in hot_tool.items() if v}, HOT_TARGET, a.repeat))
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
