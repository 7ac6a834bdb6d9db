"""make bench-descriptors: the cost of building and coalescing one request's descriptors (control plane, untimed).

One llama-3-70b-like request: 80 layers x K and V x 6250 blocks of 16 tokens
(32 KiB per block and region, 100,000 tokens, a partial last block) = 1M
descriptors before coalescing, in a pool with 4x as many blocks.  Two paths,
the same run, medians of 7 repeats:

* old: ``request_descs`` builds every row, then ``coalesce`` sorts and merges
  each layer;
* new: ``coalesced_descs`` finds the runs once from the block tables (one
  argsort of 6250 block ids, layer 0's rows; "coalesce" column) and shifts
  them to every layer (one add; "build" column).

Both paths must give identical arrays (checked).  Target: build + coalesce
under 50 ms for the random allocation.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvbench.model.descriptors import _layer0_coalesced, _shift_layers, coalesce, coalesced_descs, request_descs  # noqa: E402
from kvbench.model.layout import BlockAllocator, Layout  # noqa: E402

LAYERS, BLOCK_TOKENS, TOKEN_BYTES = 80, 16, 8 * 128 * 2  # llama-3-70b: 8 KV heads x 128 dims x bf16, per region
TARGET_MS = 50.0


def old(lay, sb, db, last):
    a = time.perf_counter()
    per_layer = request_descs(lay, lay, sb, db, last)
    b = time.perf_counter()
    out = [coalesce(d) for d in per_layer]
    return b - a, time.perf_counter() - b, out


def new(lay, sb, db, last):
    a = time.perf_counter()
    base = _layer0_coalesced(lay, lay, sb, db, last)
    b = time.perf_counter()
    out = _shift_layers(base, lay, lay)
    return time.perf_counter() - b, b - a, out


def median_ms(fn, repeats, *args):
    runs = [fn(*args) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs) * 1e3, statistics.median(r[1] for r in runs) * 1e3, \
        statistics.median((r[0] + r[1]) for r in runs) * 1e3, runs[-1][2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=99_990, help="prompt tokens (default 99,990: 6250 blocks)")
    ap.add_argument("-r", "--repeats", type=int, default=7)
    a = ap.parse_args()
    nb = -(-a.tokens // BLOCK_TOKENS)
    last = (a.tokens - (nb - 1) * BLOCK_TOKENS) * TOKEN_BYTES
    bb = BLOCK_TOKENS * TOKEN_BYTES
    cases = [("layer-major", "random"), ("layer-major", "fragmented:16"), ("layer-major", "contiguous"),
             ("block-major", "random"), ("mla", "random")]
    print(f"# {LAYERS} layers, {nb} blocks of {BLOCK_TOKENS} tokens ({bb} B per region), {a.tokens} tokens; "
          f"medians of {a.repeats} runs, ms")
    print(f"# {'layout':<12} {'alloc':<14} {'path':<4} {'descs in':>9} {'descs out':>9} {'build':>7} "
          f"{'coalesce':>8} {'total':>7}")
    ok, totals = True, {}
    for kind, alloc in cases:
        regions = 1 if kind == "mla" else 2
        lay = Layout(kind, LAYERS, regions, bb, 4 * nb)
        sb = BlockAllocator(lay.nblocks, 1).allocate(nb, alloc)
        db = BlockAllocator(lay.nblocks, 2).allocate(nb, alloc)
        rows = {name: median_ms(fn, a.repeats, lay, sb, db, last) for name, fn in (("old", old), ("new", new))}
        same = all(x.tobytes() == y.tobytes() for x, y in zip(rows["old"][3], rows["new"][3], strict=True))
        same &= all(x.tobytes() == y.tobytes()
                    for x, y in zip(coalesced_descs(lay, lay, sb, db, last), rows["new"][3], strict=True))
        ok &= same
        totals[(kind, alloc)] = rows["new"][2]
        for name, (build, co, total, out) in rows.items():
            print(f"  {kind:<12} {alloc:<14} {name:<4} {LAYERS * regions * nb:>9,} {sum(len(d) for d in out):>9,} "
                  f"{build:>7.1f} {co:>8.1f} {total:>7.1f}")
        if not same:
            print(f"# {kind} {alloc}: the two paths differ")
    main_total = totals[("layer-major", "random")]
    fast = main_total < TARGET_MS
    print(f"# identical outputs, old and new: {'yes' if ok else 'NO'}; new path, layer-major random: "
          f"{main_total:.1f} ms (target < {TARGET_MS:.0f} ms): {'PASS' if fast else 'FAIL'}")
    ok &= fast
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
