"""The readers' commands that turn results into decisions: `kvbench fit` (the link model) and `kvbench plan`.

Kept out of main.py so the command line stays one short file; main.py adds these parsers and dispatches here.
"""
from __future__ import annotations

import argparse

from kvbench.cli.args import add_model_flags, csv
from kvbench.model import shapes as M

EPILOG_PLAN = """\
fabrics: a named line rate (nominal: what the link is rated, not what it achieves), a rate such as
  '40 GB/s' or '200 Gb/s' (nominal), or a result file (measured: one fabric per transport and op in
  it, from the link model fitted to its rows when the sweep allows, else from its paged rows' GB/s)
  named rates: """ + ", ".join(f"{k} ({v:g} GB/s)" for k, v in M.LINKS.items()) + """

examples:
  kvbench plan -m llama-2-70b --tokens 4096 --fabric 100GbE
  kvbench plan -m llama-3-70b,llama-3-8b --percentiles 50:1024,95:6000,99:12000 --dtype fp16,fp8-e4m3 \\
      --fabric 100GbE --fabric "400G IB NDR" --fabric results/runs/<machine>/<stamp>_procurement.parquet
  kvbench plan -m deepseek-v3 --histogram prompts.csv --rate 20 --ttft-ms 500
"""


def add_parsers(sub) -> None:
    """`kvbench fit` (the link model of a sweep) and `kvbench plan` (does disaggregation pay)."""

    f = sub.add_parser("fit", help="fit t = L·γ + n·α + bytes/β per path to a sweep; predicted vs measured")
    f.add_argument("files", nargs="+", help="results/runs/<machine>/<stamp>_<suite>.parquet (a block-size sweep)")
    f.add_argument("--leave-out", type=csv(int), default=[], metavar="B,B",
                   help="block sizes (tokens) whose paged cases are not fitted but predicted: the model's test")
    f.add_argument("--predict", type=csv(int), default=[], metavar="B,B",
                   help="also predict these block sizes for -m/--tokens/--dtype (default llama-3-70b, 4096, fp16)")
    f.add_argument("-m", "--model", default="llama-3-70b", help="model for --predict")
    f.add_argument("--tokens", type=int, default=4096, help="prompt tokens for --predict")
    f.add_argument("--dtype", default="fp16", help="KV dtype for --predict")

    p = sub.add_parser("plan", help="does disaggregation pay: bytes, transfer and exposed ms, TTFT share, "
                       "break-even per fabric, for p50/p95/p99 prompts", epilog=EPILOG_PLAN,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("prompt lengths (one of)")
    g.add_argument("--tokens", type=csv(int), help="one length (fixed) or a comma-separated sample of lengths "
                   "(default 4096)")
    g.add_argument("--percentiles", metavar="50:N,95:N,99:N", help="prompt tokens at given percentiles")
    g.add_argument("--histogram", metavar="FILE", help="lines 'tokens count' (CSV or spaces; a header is allowed)")
    p.add_argument("--dtype", type=csv(str), help=f"KV dtypes, comma-separated: {', '.join(M.DTYPES)} (default fp16)")
    p.add_argument("--fabric", action="append", metavar="NAME|RATE|RESULTS.parquet",
                   help="repeatable; default: every named line rate")
    p.add_argument("--prefill-tflops", type=float, default=400.0, help="achieved prefill TFLOP/s per rank (10^12 "
                   "FLOP/s; default 400): P = (2 x active params x tokens + causal attention) / rate")
    p.add_argument("--ttft-ms", type=float, default=200.0, help="time-to-first-token budget, ms (default 200)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second per prefill instance (its tp x "
                   "pp ranks serve each request together), for the bandwidth and the egress needed (default 1)")
    p.add_argument("--saving", type=float, default=0.5, help="share of the prefill time that disaggregation saves "
                   "by removing interference with decode (default 0.5: the seeds' 51 ms transfer pays above "
                   "~100 ms of prefill)")
    p.add_argument("--overlap", choices=("serial", "streaming"), default="streaming", help="which exposure the net "
                   "gain and verdict use: serial (send after prefill: T) or streaming (layer by layer: max(0, T - P) "
                   "+ T/L; default)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block, for a measured fabric's link "
                   "model (default 16)")
    add_model_flags(p)


def cmd_fit(a) -> int:
    from kvbench.report import linkmodel, read, summarize

    for path in a.files:
        df, meta = read(path)
        fits, cases = linkmodel.fit_cases(summarize(df), set(a.leave_out))
        print(f"# {path}  suite={meta.get('suite', {}).get('name', '?')}  host="
              f"{meta.get('system', {}).get('hostname', '?')}")
        for line in linkmodel.lines(fits, cases, set(a.leave_out)):
            print(line)
        if a.predict:
            shape = M.get_model(a.model)
            print(f"# predicted: {shape.name} {a.tokens} tokens {a.dtype}, one descriptor per block")
            for fit in (f for f in fits if f.path.get("kind") == "paged"):  # a request moves as paged blocks
                for b in a.predict:
                    p = linkmodel.predict_request(fit, shape, a.tokens, M.check_block_size(b), a.dtype)
                    print(f"  {fit.label():<26} blk {b:>5} tok  {p['descriptors']:>8} descs  {p['bytes']:>14,} B  "
                          f"{p['seconds'] * 1e3:>10.2f} ms  {p['gbps']:>7.2f} GB/s")
    return 0


def cmd_plan(a) -> int:
    from kvbench.config.runconfig import custom_model
    from kvbench.report import plan

    if a.layers is not None:
        a.model = [custom_model(a)]
    return plan.main(a)


COMMANDS = {"fit": cmd_fit, "plan": cmd_plan}
