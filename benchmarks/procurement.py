"""`make procurement`: the buyer's two sweeps, then the report and the plan beside their results.

1. suites/procurement.yaml (bandwidth: every transport, push/pull, 16-256-token blocks, fp16/fp8, three
   models) and suites/procurement-overlap.yaml (exposed time: serial vs streaming after a prefill), each
   one `kvbench run` launch, their tables streamed to this terminal (a progress bar on stderr when it
   is one);
2. `kvbench report` over both result files and `kvbench plan` for the three models on the measured
   paths and on nominal 100GbE / 400G IB NDR, written into the results' folder (results/runs/<machine>/)
   as <stamp>_procurement.report.txt, the page <stamp>_procurement.report/ (report.md with plots/, a
   self-contained report.html, report.csv) and <stamp>_procurement.plan.txt (never overwriting).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = ("procurement", "procurement-overlap")
MODELS = "llama-3-70b,llama-3-8b,deepseek-v3"
# a chat-like prompt mix for the plan: median 1k, tail 4k and 8k (edit for your traffic, or use --histogram)
PROMPTS = "50:1024,95:4096,99:8192"
NOMINAL = ("100GbE", "400G IB NDR")
sys.path.insert(0, ROOT)  # run as a script from make: kvbench's own status list, from this checkout
from kvbench.job import status as ST  # noqa: E402
from kvbench.job.status import worst  # noqa: E402


def kvbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvbench", *args]


def run_suite(mpirun: str, np: int, suite: str, progress: str, extra: list[str]) -> tuple[int, str | None]:
    """One launch; its stdout is echoed as it comes, the result file read from its '# results:' line."""
    cmd = [mpirun, "-n", str(np), *kvbench("run", suite, "--progress", progress), *extra]
    print(f"# make procurement: {' '.join(cmd)}", flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, bufsize=1)
    path = None
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.startswith("# results: "):
            path = line.split(": ", 1)[1].strip()
    return p.wait(), path


def free_name(stem: str, suffix: str) -> str:
    """stem + suffix, or with -1, -2 ... when taken: results are never overwritten."""
    n, cand = 0, stem + suffix
    while os.path.exists(cand):
        n += 1
        cand = f"{stem}-{n}{suffix}"
    return cand


def write(cmd: list[str], path: str, label: str) -> int:
    """Run a reader and keep what it printed in ``path``, under the machine's label."""
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    failed = f"# NOT OK: {r.stderr.strip()}\n" if r.returncode else ""  # the file says why it holds no plan
    with open(path, "w") as fh:
        fh.write((f"# machine: {label}\n" if label else "") + failed
                 + f"# {shlex.join(['kvbench', *cmd[3:]])}\n{r.stdout}")
    if r.returncode:
        print(f"# make procurement: {' '.join(cmd[3:])} failed: {r.stderr.strip()}", file=sys.stderr)
    return r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--progress", choices=("on", "off"), default="on" if sys.stderr.isatty() else "off")
    ap.add_argument("--kvbench-args", default="", help="extra `kvbench run` flags for both launches, e.g. "
                    "'--tokens 4096 -n 20' on a cluster pair")
    ap.add_argument("--label", default="", help="what the machine is, in words, written at the top of the report "
                    "and the plan (e.g. '2 x H100 nodes, 400G NDR, rail-optimized')")
    a = ap.parse_args()
    t0, files, codes = time.monotonic(), [], []
    for suite in SUITES:
        code, path = run_suite(a.mpirun, a.np, suite, a.progress, a.kvbench_args.split())
        if path is None or code == 1:  # an input error or a launch that wrote nothing: no report to make
            print(f"# make procurement: {suite} ended with exit code {code} and no result file", file=sys.stderr)
            return worst(codes + [code or 1])
        files.append(path)
        codes.append(code)
        if code:  # its rows are kept and reported; the plan leaves its failed and SUSPECT cases out
            print(f"# make procurement: {suite} ended {status_of(code)} (exit code {code}): its report and plan say "
                  "so at the top; make procurement exits with the worst of its runs' codes", file=sys.stderr)
    stem = os.path.join(os.path.dirname(files[0]), os.path.basename(files[0]).removesuffix(".parquet"))
    report = free_name(stem, ".report.txt")
    plan = free_name(stem, ".plan.txt")
    bad = write(kvbench("report", *files), report, a.label)
    page = free_name(stem, ".report")  # the page: report.md (+ plots/), a self-contained report.html, report.csv
    bad |= subprocess.run(kvbench("report", *files, "-o", page), cwd=ROOT).returncode
    bad |= write(kvbench("plan", "-m", MODELS, "--percentiles", PROMPTS, "--dtype", "fp16,fp8-e4m3",
                         "--fabric", files[0], *[x for n in NOMINAL for x in ("--fabric", n)]), plan, a.label)
    code = worst(codes)
    print(f"# make procurement: {time.monotonic() - t0:.0f} s; results {', '.join(files)}\n"
          f"# report {report} and {page}/report.html\n# plan {plan}"
          + (f"\n# make procurement: NOT OK: {status_of(code)} (exit code {code})" if code else ""))
    return code or (1 if bad else 0)


def status_of(code: int) -> str:
    return next((s for s, (c, _) in ST.STATUSES.items() if c == code), f"exit code {code}")


if __name__ == "__main__":
    sys.exit(main())
