"""kvbench command line: run, size, list, env, report.

A user mistake is one line on rank 0 and exit code 1 from every rank; a
failed rank aborts the whole job; only rank 0 prints tables.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from . import __version__, comm, transports
from . import model as M
from . import options as O
from . import suite as S
from .cachestate import HELP as CACHE_HELP
from .cachestate import MODES
from .config import custom_model
from .guard import env_rank
from .schedule import SCHEME_HELP

EPILOG_RUN = """\
vocabulary:
  block      block_size tokens of one layer (one region: K, V or an MLA latent); -b/-e/-f sweep it
  descriptor one contiguous copy (src offset, dst offset, bytes); paged = one per block per region
  coalesce   merge descriptors adjacent on both sides (on/off)
  alloc      how blocks are picked from the pool: contiguous, random, fragmented:<run>
  push/pull  push = prefill writes into decode's pool; pull = decode reads from prefill's pool
  bulk       the payload as one descriptor per layer (the link model's reference)
  ceiling    the best of bulk and the payload as contiguous 64 KiB-4 MiB chunks, measured alongside
  bulk%      this row's GB/s / the ceiling's (* = above it by more than both rows' spreads: noise)
  hot        one layer's buffer re-sent for every layer (what perftest-style tools measure)

exit codes: 0 OK or UNCHECKED, 1 a mistake in the input (nothing written), 2 FAILED (wrong elements),
  3 NOTHING MEASURED, 4 ERROR (a rank failed), 5 TIMEOUT, 130 INTERRUPTED (README: when things go wrong)

examples:
  mpirun -np 2 kvbench run suites/quick.yaml
  mpirun -np 2 kvbench run -t shm --op push -b 16 -e 256 -f 4
  mpirun -np 2 kvbench run -t shm,tcp -m llama-3-70b --tokens 4096 --alloc random,contiguous --coalesce on,off
"""


class ArgError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse that raises (one line, exit 1) instead of printing usage on every rank."""

    def error(self, message):
        raise ArgError(message)


def say_error(msg: str) -> int:
    if env_rank() == 0:
        print(f"kvbench: error: {msg}", file=sys.stderr, flush=True)
    return 1


def csv(kind):
    """argparse type: comma-separated list of ``kind``."""
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of {kind.__name__}") from None
    parse.__name__ = f"list of {kind.__name__}"
    return parse


def _ms(text: str):
    return text if text == "auto" else float(text)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, a YAML file, or a shape from flags)")
    g.add_argument("-m", "--model", type=csv(str), help=f"presets: {', '.join(M.PRESETS)}; or path/to/model.yaml")
    g.add_argument("--layers", type=int, help="custom model: number of layers")
    g.add_argument("--kv-heads", type=int, help="custom model: KV heads (GQA groups; 1 = MQA)")
    g.add_argument("--head-dim", type=int, help="custom model: head dimension")
    g.add_argument("--attention", choices=M.ATTENTION, help="custom model: attention kind")
    g.add_argument("--kv-lora-rank", type=int, default=0, help="custom MLA model: latent width")
    g.add_argument("--rope-dim", type=int, default=0, help="custom MLA model: decoupled RoPE width")
    g.add_argument("--tp", type=csv(int), help="tensor parallel degree: divides KV heads (replicates when heads < tp)")
    g.add_argument("--pp", type=csv(int), help="pipeline parallel degree: divides layers")
    g.add_argument("--prefix-hit", type=csv(int), help="prompt tokens already cached at decode (not transferred)")


def build_parser() -> Parser:
    p = Parser(prog="kvbench", description="KV-cache transfer microbenchmarks (prefill -> decode), nccl-tests style.")
    p.add_argument("--version", action="version", version=f"kvbench {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)

    r = sub.add_parser("run", help="measure transfers (launch with mpirun -np 2 or more)", epilog=EPILOG_RUN,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("suite", nargs="?", help="suite YAML or a name from suites/ (flags below override its axes)")
    r.add_argument("-t", "--transport", type=csv(str), help=f"transports: {', '.join(transports.names())}")
    r.add_argument("-b", "--minblock", type=int, help="smallest block size in tokens (power of two)")
    r.add_argument("-e", "--maxblock", type=int, help="largest block size in tokens")
    r.add_argument("-f", "--stepfactor", type=int, default=2, help="block size multiplication factor (default 2)")
    r.add_argument("-n", "--iters", type=int, help="timed iterations per case (default 20)")
    r.add_argument("-w", "--warmup", type=int, help="untimed warm-up iterations per case (default 3)")
    r.add_argument("--bind", choices=("none", "core"), default="none",
                   help="core: pin each rank to one CPU (by its index on its host) before anything starts, so the "
                        "scheduler cannot wake a receiver onto its sender's CPU; none (default): as launched")
    r.add_argument("--rounds", type=int, metavar="R",
                   help="interleave: a transport's cases take turns R times, iters/R iterations each, so a slow "
                        "phase of a shared machine hits every row alike (default min(5, iterations), 1 under --cache warm; "
                        "1: each case runs to the end)")
    r.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on rank 0's stderr: auto (when it is a terminal; MPI launchers usually give "
                   "ranks pipes, so say on), on, off")
    r.add_argument("-c", "--check", type=int, choices=(0, 1), help="verify every byte after timing (default 1)")
    r.add_argument("--tokens", type=csv(int), help="prompt tokens per request (default 1024)")
    r.add_argument("--op", type=csv(str), help="push, pull (or both: push,pull)")
    r.add_argument("--coalesce", type=csv(str), help="off, on (merge descriptors adjacent on both sides)")
    r.add_argument("--alloc", type=csv(str), help="contiguous, random, fragmented:<run>")
    r.add_argument("--layout", type=csv(str), help="auto, layer-major, block-major, mla")
    r.add_argument("--dtype", type=csv(str), help=f"KV dtype: {', '.join(M.DTYPES)}, nvfp4")
    r.add_argument("--memory", type=csv(str), help="where the pools live: host (numpy, default), torch-cpu (torch "
                   "CPU tensors: the device layer without a GPU), pinned (page-locked host), cuda (GPU memory); "
                   "docs/gpu.md")
    r.add_argument("--copy", type=csv(str), help="copy engine for device bytes: memcpy (one cuMemcpyAsync per "
                   "descriptor), kernel (one gather/scatter launch), batch (cuMemcpyBatchAsync; default)")
    r.add_argument("--scheme", help="pairing of ranks: " + SCHEME_HELP)
    r.add_argument("--inflight", type=csv(int), help="requests of each pair in flight at once (default 1)")
    r.add_argument("--seed", type=int, help="seed of the block allocator (runs are reproducible)")
    r.add_argument("--pool-factor", type=float, help="pool size as a multiple of the largest request (default 2)")
    r.add_argument("--timeout", type=float, help="seconds one case (warm-up, iterations, check) may take before the "
                   "job ends with status TIMEOUT (default 600; a positive finite number)")
    r.add_argument("--setup-timeout", type=float, help="seconds one transport's setup (allocate and fill the pool, "
                   "register, connect) may take (default: 120 + pool bytes / 100 MB/s)")
    r.add_argument("--pages", choices=("4k", "thp", "huge"), help="page size of the host pools kvbench allocates: "
                   "4k (default), thp (transparent huge pages, madvise) or huge (the kernel's reserved huge pages; "
                   "vm.nr_hugepages); the sidecar records what the kernel gave")
    r.add_argument("--cache", choices=MODES, help=CACHE_HELP)
    r.add_argument("--codec", type=csv(str), help="wire encodings, pool unchanged (docs/codecs.md): none (default), "
                   "exp-split (lossless: bf16, fp16, fp8-e5m2), cast-fp8-e4m3, cast-fp8-e5m2 (lossy, from fp16/bf16), "
                   "zstd, lz4; on tcp and shm, push")
    r.add_argument("--scales", type=csv(str), help="fp8 scale planes beside the values: none (default), tensor, "
                   "block:<n>; --dtype nvfp4 has its own (fp8 per 16 values, fp32 per tensor; docs/codecs.md)")
    r.add_argument("--fill", help="pool contents: pattern (default: the check pattern), realistic (KV values with a "
                   "modelled exponent distribution, docs/codecs.md), file:<dump.npy|.safetensors> (your KV dump)")
    r.add_argument("--resume", metavar="RESULTS.parquet", help="continue an interrupted run in the same result set: "
                   "the transports it finished are kept, the rest run now (same suite, schema and machine, or a "
                   "refusal); give no suite or flags to reuse the stored ones")
    ov = r.add_argument_group("overlap with prefill and the control plane (exposed time)")
    ov.add_argument("--overlap", type=csv(str), help="serial (send after prefill ends) or streaming (send layer i "
                    "as soon as it is final)")
    ov.add_argument("--prefill-ms", type=csv(_ms), help="prefill time P in ms, or 'auto' = FLOPs / --prefill-tflops")
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
    wl.add_argument("--prompt", help="prompt lengths: N, a,b,c (cycled), uniform:lo:hi, lognormal:median:sigma")
    wl.add_argument("--decode-ms", type=float, help="how long a request holds its decode blocks after landing")
    wl.add_argument("--alloc-timeout", type=float, help="ms a request may wait for decode blocks before it is dropped")
    wl.add_argument("--decode-pool-tokens", type=int, help="decode pool capacity in tokens (0: unbounded)")
    r.add_argument("--variants", type=csv(str), help="what each payload is measured as: bulk (one descriptor per "
                   "layer), ceiling (contiguous 64K-4M chunks), hot (one layer's buffer re-sent), paged (the block "
                   "table); default bulk,ceiling,paged")
    r.add_argument("-O", "--option", action="append", metavar="[TRANSPORT.]KEY=VALUE",
                   help="transport option, repeatable; KEY=VALUE applies to every transport of the run that has it, "
                   "tcp.KEY=VALUE to tcp alone; unknown keys and bad values are refused. " + O.help_text())
    r.add_argument("-o", "--results", default="results", help="results directory (default: results/)")
    r.add_argument("--name", help="name used in the result file (default: the suite's name)")
    r.add_argument("--inject-corruption", type=int, default=0, metavar="N",
                   help="fault injection: flip N destination bytes before the check (proves the check works)")
    add_model_flags(r)

    s = sub.add_parser("size", help="KV bytes of a request, blocks, descriptors and time at named link rates")
    s.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    s.add_argument("--dtype", default="fp16", help=f"KV dtype: {', '.join(M.DTYPES)}, nvfp4")
    s.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    s.add_argument("--scales", default="none", help="fp8 scale planes: none (default), tensor, block:<n>; "
                   "dtype nvfp4 has its own (docs/codecs.md)")
    add_model_flags(s)

    sub.add_parser("list", help="transports (with availability), models, suites")
    sub.add_parser("env", help="what this machine is: CPU, memory, MPI, GPUs, NICs, library versions")
    sub.add_parser("selftest", help="(root) kvbench's tcp/mpi rates and exposed time against a tc-shaped veth "
                   "between two network namespaces; options: kvbench selftest --help")
    rep = sub.add_parser("report", help="print the table of result files, or (-o DIR) write a report: Markdown, "
                         "one self-contained HTML page with plots, and CSV")
    rep.add_argument("files", nargs="+", help="results/<machine>/<stamp>_<suite>.parquet (any mix of bandwidth, "
                     "exposed-time and workload results)")
    rep.add_argument("-o", "--out", metavar="DIR", help="write DIR/report.md (+ DIR/plots/), DIR/report.html and "
                     "DIR/report.csv instead of printing the table (docs/report.md)")
    rep.add_argument("--link-gbps", metavar="GBPS|TRANSPORT=GBPS,...", help="the link rate %%line divides by, in "
                     "GB/s (10^9 B/s), for every row or per transport; default: the NIC's reported speed across "
                     "hosts, the best host copy measured in the run within a host, 'unknown' otherwise")
    cmp_ = sub.add_parser("compare", help="the same cases in two result sets: p50/p95 ratio, a Mann-Whitney test "
                          "over the iterations, regressions flagged; exit 2 with --fail-above when one is beyond it")
    cmp_.add_argument("a", metavar="A", help="baseline: a result file (.parquet) or a folder of them")
    cmp_.add_argument("b", metavar="B", help="candidate: a result file or a folder of them")
    cmp_.add_argument("--fail-above", metavar="PCT", help="exit 2 when a case of B is slower than A at p50 by more "
                      "than PCT percent (e.g. 5%%) and the difference is significant (for CI); default: report only")
    cmp_.add_argument("--alpha", type=float, default=0.05, help="significance level of the Mann-Whitney U test "
                      "(default 0.05)")
    from .cli_plan import add_parsers  # kvbench fit, kvbench plan

    add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["selftest"]:  # its own parser (kvbench/selftest/run.py): every option passes through
        from .selftest import main as selftest_main

        return selftest_main(argv[1:])
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
            from .runner import run

            return run(a, argv)
        if a.cmd in ("fit", "plan"):
            from .cli_plan import COMMANDS

            return COMMANDS[a.cmd](a)
        return {"size": cmd_size, "list": cmd_list, "env": cmd_env, "report": cmd_report,
                "compare": cmd_compare}[a.cmd](a)
    except (ValueError, S.SuiteError, OSError) as exc:
        return say_error(str(exc))


def _first(v, default):
    return v[0] if v else default


def cmd_size(a) -> int:
    name = custom_model(a) or _first(a.model, "llama-3-8b")
    shape0 = M.get_model(name)
    tp, pp, hit = _first(a.tp, 1), _first(a.pp, 1), _first(a.prefix_hit, 0)
    shape = M.shard(shape0, tp, pp)
    M.check_block_size(a.block_size)
    if a.dtype == "nvfp4" or a.scales != "none":  # a format with scale planes (formats.py)
        return size_scaled(a, shape0, shape, tp, pp, hit)
    db = M.dtype_bytes(a.dtype)
    ntok = M.transferred_tokens(a.tokens, hit)
    bpt = M.bytes_per_token(shape, a.dtype)
    req = M.request_bytes(shape, a.dtype, a.tokens, hit)
    bb = M.block_bytes(shape, a.block_size, a.dtype)
    nb = M.num_blocks(ntok, a.block_size)
    kind = (f"mla, latent {shape.kv_lora_rank}+{shape.rope_dim}" if shape.attention == "mla"
            else f"{shape.attention}, {shape.kv_heads} KV heads x {shape.head_dim}")
    print(f"# {shape.name}: {shape.layers} layers, {kind}, {a.dtype} ({db} B/element), tp={tp} pp={pp}"
          f"{'  [per rank]' if tp > 1 or pp > 1 else ''}")
    if shape0.source:
        print(f"# source: {shape0.source}")
    print(f"{bpt:>16,} B per token")
    print(f"{M.layer_bytes_per_token(shape, a.dtype):>16,} B per token per layer")
    print(f"{ntok:>16,} tokens transferred ({a.tokens:,} prompt - {hit:,} prefix hit)")
    print(f"{req:>16,} B per request ({req / 1e9:.3f} GB, {req / 2**30:.3f} GiB)")
    print(f"{req // shape.layers:>16,} B per layer per request")
    print(f"{bb:>16,} B per block ({a.block_size} tokens, one region; {shape.regions} region(s) per layer)")
    print(f"{nb:>16,} blocks per layer")
    print(f"{nb * shape.regions * shape.layers:>16,} descriptors per request uncoalesced "
          f"({shape.regions} x {shape.layers} layers x {nb} blocks)")
    print("# transfer time at line rate (GB = 10^9 B; achieved bandwidth is lower: measure it with kvbench run)")
    for link, gbps in M.LINKS.items():
        ms = req / (gbps * 1e9) * 1e3
        print(f"  {link:<18} {gbps:8.1f} GB/s {ms:12.2f} ms")
    return 0


def size_scaled(a, shape0, shape, tp: int, pp: int, hit: int) -> int:
    """`kvbench size` of a format with scale planes: values, block scales and tensor scales apart."""
    from .formats import Format, size_lines

    fmt = Format(a.dtype, a.scales)
    ntok = M.transferred_tokens(a.tokens, hit)
    print(f"# {shape.name}: {shape.layers} layers, tp={tp} pp={pp}{'  [per rank]' if tp > 1 or pp > 1 else ''}")
    if shape0.source:
        print(f"# source: {shape0.source}")
    print(f"{ntok:>16,} tokens transferred ({a.tokens:,} prompt - {hit:,} prefix hit)")
    for line in size_lines(shape, fmt, ntok, a.block_size):
        print(line)
    return 0


def cmd_list(a) -> int:
    comm.preload(transports.names())  # ucxx must load before mpi4py does (PLATFORM pitfall 7)
    print("# transports (name: status)")
    for name in transports.names():
        reason = transports.probe(name)
        print(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print("# models")
    for m in M.PRESETS.values():
        desc = (f"mla {m.kv_lora_rank}+{m.rope_dim}" if m.attention == "mla"
                else f"{m.attention} {m.kv_heads}x{m.head_dim}")
        print(f"  {m.name:<16} {m.layers:>4} layers  {desc:<16} {M.bytes_per_token(m, 'fp16'):>9,} B/token (fp16)")
    print("# suites")
    for name in S.list_suites():
        try:
            desc = S.load(name).description
        except S.SuiteError as exc:
            desc = f"invalid: {exc}"
        print(f"  {name:<16} {desc}")
    return 0


def cmd_env(a) -> int:
    from . import hwfacts
    from .results import library_versions, system_description

    sysd = system_description()
    print(f"# kvbench {__version__}")
    for k in ("hostname", "platform", "cpu_model", "cpus"):
        print(f"{k:<16} {sysd.get(k, '-')}")
    print(f"{'memory':<16} {sysd.get('mem_total_bytes', 0) / 2**30:.1f} GiB")
    venv_mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = shutil.which("mpirun") or (venv_mpiexec if os.path.exists(venv_mpiexec) else None)
    print(f"{'mpirun':<16} {launcher or '- (none on PATH)'}")
    try:
        from mpi4py import MPI

        print(f"{'MPI':<16} {MPI.Get_library_version().strip().splitlines()[0]}")
    except Exception as exc:  # no libmpi: say so, do not crash
        print(f"{'MPI':<16} unavailable: {exc}")
    print(f"{'GPUs':<16} {', '.join(sysd['gpus']) or 'none (nvidia-smi absent or no devices)'}")
    print(f"{'RDMA devices':<16} {', '.join(sysd['rdma_devices']) or 'none (/sys/class/infiniband absent)'}")
    print(f"{'NICs':<16} {', '.join(sysd['nics']) or '-'}")
    for line in hwfacts.lines(sysd.get("gpu_rdma") or hwfacts.facts()):  # GPU issue: GPUs, RDMA ports, GPUDirect
        print(line)
    for k, v in library_versions().items():
        print(f"{k:<16} {v}")
    return 0


def cmd_report(a) -> int:
    from .report.build import main as report_main

    return report_main(a.files, a.out, a.link_gbps)


def cmd_compare(a) -> int:
    from .report.compare import main as compare_main

    return compare_main(a.a, a.b, a.fail_above, a.alpha)
