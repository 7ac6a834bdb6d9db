"""`kvbench trace FILE`: a request trace's arrivals and lengths, and what a decode-side prefix cache saves."""
from __future__ import annotations

import argparse

from kvbench.cli.args import csv
from kvbench.model import layers as L
from kvbench.model import shapes as M
from kvbench.model import trace as T

EPILOG = f"""\
what each number means:
  requests        lines in the trace (one request each)
  duration        first arrival to last, in seconds (timestamps are ms)
  arrival rate    requests / duration, in requests per second
  input, output   prompt and generated tokens per request: p50/p90/p99 (nearest rank: a length some request
                  has), mean, and the trace's total
  cache           the decode side's prefix cache, in blocks of --trace-block tokens: 'unbounded' (nothing is
                  evicted) or an LRU of N blocks.  A request's hit is its longest run of leading blocks already
                  cached; then all its blocks are cached, touched from the last to the first (a prompt's tail
                  is evicted before its head)
  hit blocks      the requests' hit blocks, summed; block hit % = hit blocks / all blocks of all requests
  hit tokens      the requests' hit tokens, summed: a request's are min(hit blocks x block, input length),
                  as its last block may be partial; token hit % = hit tokens / all prompt tokens
  tokens moved    prompt tokens not cached at decode: their KV must move from prefill
  B/token         the model's KV bytes per token over its full-attention layers (all layers of an
                  attention-only model; -m, --dtype; as `kvbench size` prints it)
  B moved         per request as `kvbench size` counts it, summed: tokens moved x B/token, plus a hybrid
                  model's sliding windows and linear states; exact, and in GB (10^9 B)
  GB/s            B moved / duration: the average KV egress the trace asks of the prefill side

named traces (shipped with kvbench, Apache-2.0, Mooncake FAST'25; NOTICE in kvbench/model/traces/):
  {', '.join(T.NAMED)}

examples:
  kvbench trace mooncake-conversation -m llama-3-8b
  kvbench trace mooncake-conversation -m llama-3-8b,llama-3-70b --cache-blocks unbounded,20000
  kvbench trace my_trace.jsonl.gz --trace-block 16
"""


def cache_sizes(text: str) -> list[int | None]:
    """--cache-blocks: 'unbounded' or positive block counts, comma-separated."""
    out = []
    for item in text.split(","):
        item = item.strip()
        out.append(None if item == "unbounded" else positive(item, "blocks (or 'unbounded')"))
    return out


def positive(text: str, what: str = "tokens") -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive number of {what}")
    return n


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="a request trace (Mooncake JSONL): arrivals, lengths, prefix-cache hits at "
                       "decode and the KV bytes that must move", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("file", metavar="FILE", help=f"a .jsonl or .jsonl.gz trace, or a named one: {', '.join(T.NAMED)}")
    t.add_argument("--trace-block", type=positive, default=T.BLOCK, metavar="N",
                   help=f"tokens per hash id in the trace (default {T.BLOCK}, Mooncake's)")
    t.add_argument("--cache-blocks", type=cache_sizes, default=[None], metavar="N[,N..]",
                   help="the decode prefix cache's capacity in blocks (LRU), one row each; 'unbounded' "
                        "(default): nothing evicted")
    t.add_argument("-m", "--model", type=csv(str), default=[], help=f"models whose bytes to print: presets "
                   f"{', '.join(M.PRESETS)}; or path/to/model.yaml")
    t.add_argument("--dtype", default="fp16", help=f"KV dtype for the bytes: {', '.join(M.DTYPES)} (default fp16)")


def cmd_trace(a) -> int:
    models = [M.get_model(name) for name in a.model]  # an unknown model is refused before the trace is read
    M.dtype_bytes(a.dtype)
    tr = T.read(a.file, a.trace_block)
    for line in summary_lines(tr):
        print(line)
    stats = [T.replay(tr, cap) for cap in a.cache_blocks]
    for line in cache_lines(tr, stats):
        print(line)
    for line in bytes_lines(tr, stats, models, a.dtype):
        print(line)
    return 0


def _cap(s: T.CacheStats) -> str:
    return "unbounded" if s.capacity is None else f"{s.capacity:,}"


def summary_lines(tr: T.Trace) -> list[str]:
    dur = tr.duration_s
    rate = f"{tr.requests / dur:16.3f}" if dur > 0 else f"{'-':>16}"
    lines = [f"# trace {tr.name}: {tr.block}-token blocks, {len(tr.ids):,} of them",
             f"{tr.requests:>16,} requests",
             f"{dur:>16,.3f} s duration (first arrival to last)",
             f"{rate} req/s arrival rate (requests / duration)",
             f"# {'tokens':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>12}{'total':>16}"]
    for label, vals in (("input", tr.input_len), ("output", tr.output_len)):
        p = T.percentiles(vals)
        lines.append(f"  {label:<8}{p[50]:>10,}{p[90]:>10,}{p[99]:>10,}{vals.mean():>12,.1f}{int(vals.sum()):>16,}")
    return lines


def cache_lines(tr: T.Trace, stats: list[T.CacheStats]) -> list[str]:
    lines = [f"# decode prefix cache (LRU over {tr.block}-token blocks): hit = leading blocks already cached",
             f"# {'cache blocks':>12}{'hit blocks':>14}{'block hit %':>12}{'hit tokens':>16}{'token hit %':>12}"
             f"{'tokens moved':>16}"]
    for s in stats:
        lines.append(f"  {_cap(s):>12}{int(s.hit_blocks.sum()):>14,}{100 * s.block_hit_rate:>12.2f}"
                     f"{s.hit_tokens:>16,}{100 * s.token_hit_rate:>12.2f}{s.moved_tokens:>16,}")
    return lines


def bytes_lines(tr: T.Trace, stats: list[T.CacheStats], models: list[M.ModelShape], dtype: str) -> list[str]:
    if not models:
        return ["# KV bytes that move: give -m MODEL"]
    dur = tr.duration_s
    lines = [f"# KV bytes that move ({dtype}, whole model, tp=1): tokens moved x B per token (and a hybrid's "
             "windows and states per request)",
             f"# {'cache blocks':>12}  {'model':<18}{'B/token':>10}{'B moved':>22}{'GB moved':>12}{'GB/s':>9}"]
    for s in stats:
        for m in models:
            bpt = M.bytes_per_token(m, dtype)
            # per request as `kvbench size` counts it: a hybrid's windows and states are not tokens x B/token
            moved = L.moved_bytes(m, dtype, tr.input_len - s.hit_tokens_each(tr.input_len))
            gbps = f"{moved / 1e9 / dur:9.3f}" if dur > 0 else f"{'-':>9}"
            lines.append(f"  {_cap(s):>12}  {m.name:<18}{bpt:>10,}{moved:>22,}{moved / 1e9:>12,.1f}{gbps}")
    return lines
