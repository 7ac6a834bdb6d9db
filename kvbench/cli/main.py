"""kvbench command line: run, size, trace, list, env, report, compare, fit, plan, probe (selftest and lab parse their own).

A user mistake is one line on rank 0 and exit code 1 from every rank; a
failed rank aborts the whole job; only rank 0 prints tables.
"""
from __future__ import annotations

import argparse
import sys

from kvbench import __version__, transports
from kvbench.cli.args import ArgError, Parser, add_model_flags, csv, ms, say_error, target_pct, text
from kvbench.cli.dryrun import ranks_arg
from kvbench.cli.info import cmd_env, cmd_list, cmd_size
from kvbench.cli.probe import add_parser as add_probe_parser
from kvbench.cli.probe import cmd_probe
from kvbench.cli.tpargs import add_tp_flags
from kvbench.cli.trace import add_parser as add_trace_parser
from kvbench.cli.trace import cmd_trace, positive
from kvbench.config import expectflag
from kvbench.config import suite as S
from kvbench.config.sizes import block_arg
from kvbench.lab import main as lab_main
from kvbench.memory.cachestate import HELP as CACHE_HELP
from kvbench.memory.cachestate import MODES
from kvbench.model import shapes as M
from kvbench.model import trace as T
from kvbench.model.schemes import SCHEME_HELP
from kvbench.results.export import export_files
from kvbench.results.samples import CI_MIN_SAMPLES, DEFAULT_BUDGET_S
from kvbench.selftest import main as selftest_main
from kvbench.transports import options as O

EPILOG_COMPARE = """\
exit codes: 0 every run read ended cleanly (OK, UNCHECKED) and no case regressed beyond --fail-above,
  1 a mistake in the input, 2 a case regressed beyond --fail-above. A run of A or B that did not end
  cleanly gives its own code, with or without --fail-above, and one line naming it: 2 FAILED,
  6 SUSPECT, 5 TIMEOUT, 4 ERROR, 130 INTERRUPTED, 1 INCOMPLETE (killed, or still running); with several,
  the first in that order

p95 is shown from 20 samples a side, '-' with fewer (the tables' rule)
"""

EPILOG_RUN = """\
vocabulary:
  block      block_size tokens of one layer (one region: K, V or an MLA latent); -b/-e/-f sweep it
  descriptor one contiguous copy (src offset, dst offset, bytes); paged = one per block per region
  coalesce   merge descriptors adjacent on both sides (on/off)
  alloc      how blocks are picked from the pool: contiguous, random, fragmented:<run>, tail, aged:<N>
  push/pull  push = prefill writes into decode's pool; pull = decode reads from prefill's pool
  bulk       the payload as one descriptor per layer (the link model's reference)
  ceiling    the best of bulk and the payload as contiguous 64 KiB-4 MiB chunks, measured alongside
  bulk%      this row's GB/s / the ceiling's (* = above it by more than both rows' spreads: noise)
  hot        one layer's buffer re-sent for every layer (what perftest-style tools measure)

exit codes: 0 OK or UNCHECKED, 1 a mistake in the input (nothing written), 2 FAILED (wrong elements),
  3 NOTHING MEASURED, 4 ERROR (a rank failed), 5 TIMEOUT, 6 SUSPECT (a row beyond a physical bound), 7 FALLBACK,
  130 INTERRUPTED (docs/reliability.md)

examples:
  mpirun -np 2 kvbench run suites/quick.yaml
  mpirun -np 2 kvbench run -t shm --op push -b 16 -e 256 -f 4
  mpirun -np 2 kvbench run -t shm,tcp -m llama-3-70b --tokens 4096 --alloc random,contiguous --coalesce on,off
"""


def check_arg(text: str):
    """-c: 0, 1 or all (every); one line naming the choices otherwise."""
    try:
        return S.check_level(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 0, 1, all)") from None


def positive_blocks(text: str) -> int:
    """--cache-blocks of a run: one positive block count."""
    return positive(text, "blocks")


def build_parser() -> Parser:
    p = Parser(prog="kvbench", description="KV-cache transfer microbenchmarks (prefill -> decode), nccl-tests style.")
    p.add_argument("--version", action="version", version=f"kvbench {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)

    r = sub.add_parser("run", help="measure transfers (launch with mpirun -np 2 or more)", epilog=EPILOG_RUN,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("suite", nargs="?", type=text, help="suite YAML or a name from suites/ (flags below override its axes)")
    r.add_argument("-t", "--transport", type=csv(str), help=f"transports: {', '.join(transports.names())}")
    r.add_argument("-b", "--minblock", type=block_arg, help="smallest block size: tokens (a power of two), or the "
                   "bytes of one region's block with a unit (32KiB: the tokens that hold 32 KiB for the model and dtype)")
    r.add_argument("-e", "--maxblock", type=block_arg, help="largest block size: tokens, or bytes with a unit")
    r.add_argument("-f", "--stepfactor", type=int, default=2, help="block size multiplication factor (default 2)")
    r.add_argument("-n", "--iters", type=int, help="timed iterations per case (default 20)")
    r.add_argument("-w", "--warmup", type=int, help="untimed warm-up iterations per case (default 3)")
    r.add_argument("--gpu-map", metavar="0,1,..",
                   help="--memory cuda: the GPU of each rank on a node, by its local rank (default: local rank k "
                        "takes GPU k, modulo the GPUs it sees)")
    r.add_argument("--target-ci", type=target_pct, metavar="PCT",
                   help="adapt each case's iterations (-n is then the least) until its p50's 95%% confidence "
                        "interval is within PCT of the p50 (e.g. 2%%), or --ci-budget runs out; rows say which. A "
                        f"case never stops below {CI_MIN_SAMPLES} samples, the fewest the interval needs (the "
                        "order statistics around the median), even past the budget")
    r.add_argument("--ci-budget", type=float, metavar="S",
                   help=f"seconds of iterations one case may spend reaching --target-ci (default {DEFAULT_BUDGET_S:g})")
    r.add_argument("--bind", choices=("none", "core"), default="none",
                   help="core: pin each rank to one CPU (by its index on its host) before anything starts, so the "
                        "scheduler cannot wake a receiver onto its sender's CPU; none (default): as launched")
    r.add_argument("--expect", type=expectflag.arg, default="auto", metavar="{auto,shm,nvlink,rdma,tcp,any}",
                   help=expectflag.HELP)
    r.add_argument("--rounds", type=int, metavar="R",
                   help="interleave: a transport's cases take turns R times, iters/R iterations each, so a slow "
                        "phase of a shared machine hits every row alike (default min(5, iterations), 1 under --cache warm; "
                        "1: each case runs to the end)")
    r.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on rank 0's stderr: auto (when it is a terminal, else a '# progress:' line "
                   "every 30 s with the time left at the pace so far; MPI launchers usually give ranks pipes), on, off")
    r.add_argument("-c", "--check", type=check_arg, metavar="{0,1,all}",
                   help="0: no check; 1 (default): one more transfer after timing, verified against lies; all (also "
                        "every): every timed iteration verified as well, outside its timed window (README, Checking)")
    r.add_argument("--tokens", type=csv(int), help="prompt tokens per request (default 1024)")
    r.add_argument("--op", type=csv(str), help="push, pull (or both: push,pull)")
    r.add_argument("--coalesce", type=csv(str), help="off, on (merge descriptors adjacent on both sides)")
    r.add_argument("--alloc", type=csv(str), help="contiguous, random, fragmented:<run>, tail (the pool's last "
                   "blocks, as kvbench probe takes them), aged:<N> (decode's free list after N requests)")
    r.add_argument("--layout", type=csv(str), help="auto, layer-major, block-major, mla, cross-layer (one page per "
                   "block holding every layer: docs/layouts.md)")
    r.add_argument("--dtype", type=csv(str), help=f"KV dtype: {', '.join(M.DTYPES)}, nvfp4, fp8-ds-mla")
    r.add_argument("--memory", type=csv(str), help="where the pools live: host (numpy, default), torch-cpu (torch "
                   "CPU tensors: the device layer without a GPU), pinned (page-locked host), cuda (GPU memory), auto (cuda for "
                   "cuda_ipc, staged and verbs where a GPU is, host for the rest); docs/gpu.md")
    r.add_argument("--copy", type=csv(str), help="copy engine for device bytes: auto (default: kernel between "
                   "GPUs, batch between host and GPU), memcpy (one cuMemcpyAsync per descriptor), kernel (one "
                   "gather/scatter launch over many CTAs), batch (cuMemcpyBatchAsync), batch-overlap (the same, "
                   "preferring overlap with compute), batch-any (the source read in any order); docs/gpu.md")
    r.add_argument("--scheme", type=text, help="pairing of ranks: " + SCHEME_HELP)
    r.add_argument("--matrix", type=text, metavar="FILE|NAME", help="--scheme matrix: a CSV or YAML file whose "
                   "cell [i][j] is the tokens (or bytes with a unit, 64MiB) rank i sends rank j, or a scheme's name "
                   "(incast, bidir, many-to-one, ...); each flow runs alone, then all at once (docs/fabric.md)")
    r.add_argument("--nic", type=text, metavar="auto|NAME,..", help="the NIC(s) of each rank: auto = the nearest its "
                   "GPU, else its CPU socket, in NCCL's order PIX, PXB, PHB, NODE, SYS (kvbench env shows the "
                   "matrix); tcp stripes over -O rails=N of them; UCX-based transports get UCX_NET_DEVICES")
    r.add_argument("--inflight", type=csv(int), help="requests of each pair in flight at once (default 1)")
    r.add_argument("--seed", type=int, help="seed of the block allocator (runs are reproducible; 0 to 2^32-1)")
    r.add_argument("--pool-factor", type=float, help="pool size as a multiple of the largest request (default 2)")
    r.add_argument("--timeout", type=float, help="seconds one case (warm-up, iterations, check) may take before the "
                   "job ends with status TIMEOUT (default 600; positive, at most a week: 604800)")
    r.add_argument("--setup-timeout", type=float, help="seconds one transport's setup (allocate and fill the pool, "
                   "register, connect) may take (default: 120 + pool bytes / 100 MB/s)")
    r.add_argument("--pool-sizes", type=text, metavar="SIZES", help="after each transport's setup, register and "
                   "deregister a pool of each size, timed: registration against pool size (e.g. 0.25,1,4GiB)")
    r.add_argument("--register", type=csv(str), help="once (default: each pool registered at setup) or per-request "
                   "(the initiator registers each request's blocks before its transfer and deregisters them after, "
                   "timed: nixl, mooncake); once,per-request for both side by side (docs/methodology.md)")
    r.add_argument("--pages", choices=("4k", "thp", "huge"), help="page size of the host pools kvbench allocates: "
                   "4k (default), thp (transparent huge pages, madvise) or huge (the kernel's reserved huge pages; "
                   "vm.nr_hugepages); the sidecar records what the kernel gave")
    r.add_argument("--cache", choices=MODES, help=CACHE_HELP)
    r.add_argument("--codec", type=csv(str), help="wire encodings, pool unchanged (docs/codecs.md): none (default), "
                   "exp-split (lossless: bf16, fp16, fp8-e5m2), cast-fp8-e4m3, cast-fp8-e5m2 (lossy, from fp16/bf16), "
                   "zstd, lz4; on tcp and shm, push")
    r.add_argument("--scales", type=csv(str), help="fp8 scale planes beside the values: none (default), tensor, "
                   "block:<n>; --dtype nvfp4 has its own (fp8 per 16 values, fp32 per tensor; docs/codecs.md)")
    r.add_argument("--fill", type=text, help="pool contents: pattern (default: the check pattern), realistic (KV values with a "
                   "modelled exponent distribution, docs/codecs.md), file:<dump.npy|.safetensors> (your KV dump)")
    r.add_argument("--resume", metavar="RESULTS.parquet", help="continue an interrupted run in the same result set: "
                   "the transports it finished are kept, the rest run now (same suite, schema and machine, or a "
                   "refusal); give no suite or flags to reuse the stored ones")
    ov = r.add_argument_group("overlap with prefill and the control plane (exposed time)")
    ov.add_argument("--overlap", type=csv(str), help="serial (send after prefill ends) or streaming (send layer i "
                    "as soon as it is final)")
    ov.add_argument("--prefill-ms", type=csv(ms), help="prefill time P in ms, or 'auto' = FLOPs / --prefill-tflops")
    ov.add_argument("--prefill", type=csv(str), help="clock (a timer of --prefill-ms; default) or real: each layer's "
                    "QKV, output and MLP matmuls of the model's sizes for the prompt's tokens, computed where the "
                    "pools live (--memory torch-cpu, pinned or cuda), the layer's transfer posted when they finish "
                    "(docs/gpu.md)")
    ov.add_argument("--prefill-tflops", type=float, help="achieved prefill TFLOP/s for --prefill-ms auto (default 400)")
    ov.add_argument("--handshake", type=csv(str), help="allocate-then-stream round trip: off, serial (before "
                    "prefill starts) or overlap (during the first layer)")
    wl = r.add_argument_group("workload (many requests, bounded decode pool, back-pressure)")
    wl.add_argument("--arrival", type=csv(str), help="none, poisson:<req/s per prefill rank>, interval:<ms>")
    wl.add_argument("--requests", type=int, help="requests per prefill rank (default 100)")
    wl.add_argument("--prompt", type=text, help="prompt lengths: N, a,b,c (cycled), uniform:lo:hi, lognormal:median:sigma")
    wl.add_argument("--decode-ms", type=float, help="how long a request holds its decode blocks after landing")
    wl.add_argument("--alloc-timeout", type=float, help="ms a request may wait for decode blocks before it is dropped")
    wl.add_argument("--decode-pool-tokens", type=int, help="decode pool capacity in tokens (0: unbounded; under "
                    "--trace: 4 x its longest request)")
    wl.add_argument("--trace", type=text, metavar="FILE|NAME", help="replay a request trace (Mooncake JSONL, or "
                    f"{', '.join(T.NAMED)}): its arrivals, prompts and decode prefix-cache hits; --requests per "
                    "prefill rank from its start (docs/usage.md, Replaying a trace)")
    wl.add_argument("--speed", type=csv(float), metavar="X", help="--trace: timestamps divided by X (50: 50 times "
                    "faster; default 1)")
    wl.add_argument("--cache-blocks", type=positive_blocks, metavar="N", help="--trace: the decode prefix cache, an "
                    "LRU of N blocks of the trace (default: unbounded)")
    wl.add_argument("--trace-block", type=positive, metavar="N", help=f"--trace: tokens per hash id in the trace "
                    f"(default {T.BLOCK}, Mooncake's)")
    r.add_argument("--variants", type=csv(str), help="what each payload is measured as: bulk (one descriptor per "
                   "layer), ceiling (contiguous 64K-4M chunks), hot (one layer's buffer re-sent), paged (the block "
                   "table); default bulk,ceiling,paged")
    r.add_argument("-O", "--option", action="append", type=text, metavar="[TRANSPORT.]KEY=VALUE",
                   help="transport option, repeatable; KEY=VALUE applies to every transport of the run that has it, "
                   "tcp.KEY=VALUE to tcp alone; unknown keys and bad values are refused. " + O.help_text())
    r.add_argument("-o", "--results", type=text, help="results directory (default: results/runs/, which git "
                   "ignores; the committed reference runs are in results/reference/; a --resume continues where "
                   "its file is)")
    r.add_argument("--name", type=text, help="name used in the result file (default: the suite's name)")
    r.add_argument("--json", type=text, metavar="FILE", help="also write every row as JSON Lines to FILE at the end "
                   "(the parquet's columns, units in their names; a new file only: docs/usage.md)")
    r.add_argument("--csv", type=text, metavar="FILE", help="also write every row as CSV to FILE at the end (the same "
                   "columns; a new file only)")
    r.add_argument("--compact", action="store_true", help="print the short table: path, op, size, blocks, GB/s, "
                   "Gb/s, p50, n, #wrong, status (every column stays in the result file; a run with a prefill clock "
                   "keeps its exposed-time table)")
    r.add_argument("--dry-run", action="store_true", help="print the cases and an estimate of the run's time here, "
                   "then exit: nothing is run or written, no mpirun needed (docs/usage.md, How long a run takes)")
    r.add_argument("--ranks", type=ranks_arg, default=2, metavar="N", help="--dry-run without mpirun: the ranks "
                   "the run would have (default 2; under mpirun its -np)")
    r.add_argument("--inject-corruption", type=int, default=0, metavar="N",
                   help="fault injection: flip N bytes of the first request in the destination pool as they land, "
                        "before the check (proves the check end to end, from the pool)")
    add_model_flags(r)

    s = sub.add_parser("size", help="KV bytes of a request, blocks, descriptors and time at named link rates")
    s.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    s.add_argument("--dtype", default="fp16", help=f"KV dtype: {', '.join(M.DTYPES)}, nvfp4, fp8-ds-mla")
    s.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    s.add_argument("--scales", default="none", help="fp8 scale planes: none (default), tensor, block:<n>; "
                   "dtype nvfp4 has its own (docs/codecs.md)")
    s.add_argument("--layout", default="auto", help="auto (default: mla for MLA models, else layer-major), "
                   "layer-major, block-major, mla, cross-layer (docs/layouts.md)")
    add_model_flags(s)
    add_tp_flags(s)  # size's --tp P:D and --head-layout
    add_trace_parser(sub)

    lst = sub.add_parser("list", help="transports (with availability), models, suites, and the leftovers of ended "
                         "runs in /dev/shm")
    lst.add_argument("--sweep", action="store_true", help="first remove the /dev/shm files of kvbench runs whose "
                     "processes are gone, as every `kvbench run` does at its start")
    sub.add_parser("env", help="what this machine is: CPU, memory, MPI, GPUs, NICs, library versions")
    sub.add_parser("selftest", help="(root) kvbench's tcp/mpi rates and exposed time against a tc-shaped veth "
                   "between two network namespaces; options: kvbench selftest --help")
    sub.add_parser("lab", help="(root) a fabric of network namespaces: kvbench lab up --nodes N --rails R --rate "
                   "1gbit; kvbench lab run -- <run arguments>; kvbench lab down; options: kvbench lab --help")
    rep = sub.add_parser("report", help="print the table of result files, or (-o DIR) write a report: Markdown, "
                         "one self-contained HTML page with plots, and CSV")
    rep.add_argument("files", nargs="+", help="results/runs/<machine>/<stamp>_<suite>.parquet (any mix of bandwidth, "
                     "exposed-time and workload results)")
    rep.add_argument("-o", "--out", metavar="DIR", help="write DIR/report.md (+ DIR/plots/), DIR/report.html and "
                     "DIR/report.csv instead of printing the table (docs/report.md)")
    rep.add_argument("--link-gbps", metavar="GBPS|TRANSPORT=GBPS,...", help="the link rate %%line divides by, in "
                     "GB/s (10^9 B/s), for every row or per transport; default: the NIC's reported speed across "
                     "hosts, kvbench's own copy of the same bytes beside each case's iterations within a host, 'unknown' "
                     "otherwise")
    rep.add_argument("--json", metavar="FILE", help="write the files' rows as JSON Lines to FILE (a new file), as "
                     "kvbench run --json does, instead of the table (with -o, beside the report)")
    cmp_ = sub.add_parser("compare", help="the same cases in two result sets: p50/p95 ratio, a Mann-Whitney test "
                          "over the iterations, regressions flagged; exit 2 with --fail-above when one is beyond it, "
                          "non-zero when a run read ended FAILED, SUSPECT, TIMEOUT or INCOMPLETE",
                          epilog=EPILOG_COMPARE, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmp_.add_argument("a", metavar="A", help="baseline: a result file (.parquet) or a folder of them")
    cmp_.add_argument("b", metavar="B", help="candidate: a result file or a folder of them")
    cmp_.add_argument("--fail-above", metavar="PCT", help="exit 2 when a case of B is slower than A at p50 by more "
                      "than PCT percent (e.g. 5%%) and the difference is significant (for CI); default: report only "
                      "(a run that did not end cleanly still exits non-zero: exit codes below)")
    cmp_.add_argument("--alpha", type=float, default=0.05, help="significance level of the Mann-Whitney U test "
                      "(default 0.05)")
    from kvbench.cli.plan import add_parsers  # kvbench fit, kvbench plan

    add_parsers(sub)
    add_probe_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["selftest"]:  # its own parser (kvbench/selftest/run.py): every option passes through
        return selftest_main(argv[1:])
    if argv[:1] == ["lab"]:  # its own parser (kvbench/lab/cmd.py): up, run -- <run arguments>, down, status
        return lab_main(argv[1:])
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except ArgError as exc:
        return say_error(str(exc))
    if a.cmd is None:
        parser.print_help()
        return 0
    try:
        if a.cmd == "run":
            if a.dry_run:  # no MPI: the cases and the estimate (kvbench/cli/dryrun.py)
                from kvbench.cli.dryrun import dry_run

                return dry_run(a, argv)
            from kvbench.cli.run import run

            return run(a, argv)
        if a.cmd in ("fit", "plan"):
            from kvbench.cli.plan import COMMANDS

            return COMMANDS[a.cmd](a)
        return {"size": cmd_size, "trace": cmd_trace, "list": cmd_list, "env": cmd_env, "report": cmd_report,
                "compare": cmd_compare, "probe": cmd_probe}[a.cmd](a)
    except OSError as exc:  # a file named on the command line: its name and the system's reason, not a bare path
        return say_error(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    except (ValueError, S.SuiteError) as exc:
        return say_error(str(exc))


def cmd_report(a) -> int:
    from kvbench.report.build import main as report_main

    if a.json:  # the rows themselves, for tools that read no parquet (results/export.py)
        code = export_files(a.files, a.json)
        if not a.out:
            return code
    return report_main(a.files, a.out, a.link_gbps)


def cmd_compare(a) -> int:
    from kvbench.report.compare import main as compare_main

    return compare_main(a.a, a.b, a.fail_above, a.alpha)
