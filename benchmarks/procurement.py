"""`make procurement`: the buyer's two sweeps, then the report and the plan beside their results.

1. suites/procurement.yaml (bandwidth: every transport, push/pull, 16-256-token blocks, fp16/fp8, three
   models) and suites/procurement-overlap.yaml (exposed time: serial vs streaming after a prefill), each
   one `kvbench run` launch, their tables streamed to this terminal (a progress bar on stderr when it
   is one);
2. `kvbench report` over both result files and `kvbench plan` for the three models on the measured
   paths and on nominal 100GbE / 400G IB NDR, written into the results' folder (results/runs/<machine>/)
   as <stamp>_procurement.report.txt, the page <stamp>_procurement.report/ (report.md with plots/, a
   self-contained report.html, report.csv) and <stamp>_procurement.plan.txt (never overwriting).

The set's state is <stamp>_procurement.set.json beside its first result file: each suite's result file and status.
Ctrl-C (or SIGTERM) lets the current launch end (its finished cases kept), writes the report and plan of what was
kept and exits 130; the next `make procurement` resumes the newest set when it is incomplete (--resume SET.json
names one, --fresh starts a new one): `kvbench run --resume` for an interrupted suite, a launch for one not started.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = "llama-3-70b,llama-3-8b,deepseek-v3"
# QUICK=1: a first answer in minutes: one model, fp16, 16- and 256-token blocks (the per-suite flags before ARGS)
QUICK = {"procurement": ["-m", "llama-3-8b", "--dtype", "fp16", "-b", "16", "-e", "256", "-f", "16"],
         "procurement-overlap": ["-m", "llama-3-8b"]}
# a chat-like prompt mix for the plan: median 1k, tail 4k and 8k (edit for your traffic, or use --histogram)
PROMPTS = "50:1024,95:4096,99:8192"
NOMINAL = ("100GbE", "400G IB NDR")
GRACE_S = 60  # after Ctrl-C, how long a launch may take to store its finished cases before it is terminated
# the result file's path: the footer's line, or the first line of a run that may never reach its footer
RESULTS = re.compile(r"^# (?:run id: \S+\s+)?results: (.+)$")
sys.path.insert(0, ROOT)  # run as a script from make: kvbench's own status list, from this checkout
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from procset import NOT_STARTED, SUITES, action, at, choose, load, new_set, rows_in, save, sidecar_status, stem_of  # noqa: E402,F401

from kvbench.job import status as ST  # noqa: E402
from kvbench.job.status import worst  # noqa: E402

INTERRUPTED = ST.exit_code("INTERRUPTED")


class Stop:
    """The signal that stopped the set (None while it runs) and the launch running when it came."""
    sig: int | None = None
    child: subprocess.Popen | None = None


def on_signal(sig: int, _frame) -> None:
    first = Stop.sig is None
    Stop.sig = Stop.sig or sig
    p = Stop.child
    if p is None or p.poll() is not None:
        return
    if sig == signal.SIGTERM:  # a kill names this process alone; Ctrl-C reached the whole process group already
        p.send_signal(sig)
    if first:  # the launch keeps its finished cases as it ends; one that does not end is ended
        for delay, end in ((GRACE_S, p.terminate), (GRACE_S + 10, p.kill)):
            t = threading.Timer(delay, end)
            t.daemon = True
            t.start()


def kvbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvbench", *args]


def run_launch(cmd: list[str], on_path) -> tuple[int, str | None]:
    """One launch; its stdout is echoed as it comes, the result file read from its results lines."""
    print(f"# make procurement: {' '.join(cmd)}", flush=True)
    p = Stop.child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, bufsize=1)
    path = None
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = RESULTS.match(line.rstrip("\n"))
        if m and path is None:
            path = m.group(1).strip()
            on_path(path)
    code = p.wait()
    Stop.child = None
    return code, path


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


def launch_cmd(a, state: dict, entry: dict) -> list[str]:
    """A fresh launch with the set's flags, or a resume (no suite or flags: the stored ones are used)."""
    head = [a.mpirun, "-n", str(state["np"])]
    if entry["results"] is not None:
        return [*head, *kvbench("run", "--resume", entry["results"], "--progress", a.progress)]
    out = ["-o", state["out"]] if state.get("out") else []
    quick = QUICK[entry["suite"]] if state.get("quick") else []
    return [*head, *kvbench("run", entry["suite"], "--progress", a.progress, *out), *quick,
            *state["kvbench_args"].split()]


def found(state: dict, entry: dict, path: str) -> None:
    """The launch named its result file: the set's state file exists from the first one on."""
    entry["results"] = path
    if state["file"] is None:
        state["file"] = free_name(at(stem_of(path)), ".set.json")
    save(state)


def run_set(a, state: dict) -> tuple[list[int], bool]:
    """Each suite of the set that has not ended, launched: the exit codes (a finished one's from its sidecar), and
    False after a launch that wrote nothing (an input error: no report to make)."""
    codes = []
    for entry in state["suites"]:
        if Stop.sig:
            break
        if action(entry) == "skip":
            codes.append(ST.exit_code(entry["status"]) if entry["status"] in ST.STATUSES else 1)
            continue
        code, path = run_launch(launch_cmd(a, state, entry), lambda p, e=entry: found(state, e, p))
        entry["status"] = sidecar_status(entry["results"])
        if state["file"]:
            save(state)
        if Stop.sig:
            break
        if path is None or code == 1:  # an input error or a launch that wrote nothing: no report to make
            print(f"# make procurement: {entry['suite']} ended with exit code {code} and no result file",
                  file=sys.stderr)
            return codes + [code or 1], False
        codes.append(code)
        if code:  # its rows are kept and reported; the plan leaves its failed and SUSPECT cases out
            print(f"# make procurement: {entry['suite']} ended {status_of(code)} (exit code {code}): its report and "
                  "plan say so at the top; make procurement exits with the worst of its runs' codes", file=sys.stderr)
    return codes, True


def write_outputs(files: list[str], first: str, label: str, quick: bool = False) -> tuple[str, str, str, int]:
    """The report (text and page) and the plan over ``files``, beside the set's first result file."""
    stem = at(stem_of(first))
    report = free_name(stem, ".report.txt")
    plan = free_name(stem, ".plan.txt")
    bad = write(kvbench("report", *files), report, label)
    page = free_name(stem, ".report")  # the page: report.md (+ plots/), a self-contained report.html, report.csv
    bad |= subprocess.run(kvbench("report", *files, "-o", page), cwd=ROOT).returncode
    models, dtypes = ("llama-3-8b", "fp16") if quick else (MODELS, "fp16,fp8-e4m3")
    bad |= write(kvbench("plan", "-m", models, "--percentiles", PROMPTS, "--dtype", dtypes,
                         "--fabric", files[0], *[x for n in NOMINAL for x in ("--fabric", n)]), plan, label)
    return report, page, plan, bad


def nothing_kept(state: dict) -> str:
    """Why there is no report, and what the next make procurement does."""
    if not Stop.sig:
        return "no rows to report"
    if state["file"] is None:
        return "INTERRUPTED before any result file was written: nothing kept; make procurement starts anew"
    return (f"INTERRUPTED before any case was stored: no report; the set is incomplete ({state['file']}); "
            "`make procurement` again resumes it")


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("--np", type=int, default=2)
    # a terminal gets the bar (the ranks' stderr is a pipe, so say on); a pipe or log a '# progress:' line every 30 s
    ap.add_argument("--progress", choices=("on", "auto", "off"), default="on" if sys.stderr.isatty() else "auto")
    ap.add_argument("--kvbench-args", default="", help="extra `kvbench run` flags for both launches, e.g. "
                    "'--tokens 4096 -n 20' on a cluster pair")
    ap.add_argument("--label", default="", help="what the machine is, in words, written at the top of the report "
                    "and the plan (e.g. '2 x H100 nodes, 400G NDR, rail-optimized')")
    ap.add_argument("--out", type=os.path.abspath, help="results directory, passed to both launches as -o "
                    "(default: kvbench's, results/runs/)")
    ap.add_argument("--resume", metavar="SET.json", help="finish this set (default: the newest set under the results "
                    "directory, when it is incomplete)")
    ap.add_argument("--fresh", action="store_true", help="start a new set even when the newest one is incomplete")
    ap.add_argument("--quick", action="store_true", help="a first answer in minutes: llama-3-8b, fp16, 16- and "
                    "256-token blocks (make procurement QUICK=1)")
    return ap.parse_args()


def main() -> int:
    a = parse()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    state = choose(a)
    if state is None:
        return 1
    codes, reportable = run_set(a, state)
    if not reportable:
        return worst(codes)
    state["complete"] = not Stop.sig
    kept = [e["results"] for e in state["suites"] if rows_in(e["results"])]
    if not kept:
        if state["file"]:
            save(state)
        print(f"# make procurement: {nothing_kept(state)}", file=sys.stderr)
        return INTERRUPTED if Stop.sig else worst(codes) or 1
    report, page, plan, bad = write_outputs(kept, state["suites"][0]["results"], a.label or state.get("label", ""),
                                            state.get("quick", False))
    state["reports"].append({"report": report, "page": page, "plan": plan, "complete": state["complete"]})
    save(state)
    code = worst(codes)
    print(f"# make procurement: {time.monotonic() - t0:.0f} s; results {', '.join(kept)}\n"
          f"# report {report} and {page}/report.html\n# plan {plan}"
          + (f"\n# make procurement: NOT OK: {status_of(code)} (exit code {code})" if code and not Stop.sig else ""))
    if Stop.sig:
        print(f"# make procurement: INTERRUPTED: the set is incomplete ({state['file']}; its report and plan cover "
              f"what was kept); `make procurement` again resumes it", flush=True)
        return INTERRUPTED
    return code or (1 if bad else 0)


def status_of(code: int) -> str:
    return next((s for s, (c, _) in ST.STATUSES.items() if c == code), f"exit code {code}")


if __name__ == "__main__":
    sys.exit(main())
