"""Proof that `make check` guards the honesty mechanisms: take each one out, run `make check`, expect it to fail.

`make check-mutants` (or `python tools/mutants.py [--only NAME,..] [--pytest-args "..."]`) runs `make check` on
the tree as it is (it must pass: a failing one would "kill" every mutant), then edits one line of this checkout at
a time (each mechanism below, its text found exactly once), runs `make check` on it, and puts the line back (also
on Ctrl-C, SIGTERM, SIGHUP or an error; the running `make check` gets SIGINT first, so that its fixtures end the
ranks they started).  A mutant is *killed* when `make check` exits non-zero; one it survives is a mechanism the
quick tier no longer guards.  The table gives each mutant's exit code, time and first failing test; the exit code
is 0 only when every mutant was killed.  It refuses to start when a file it edits has uncommitted changes: the
edit and the restore are plain writes of that file's text.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the mechanism taken out, in words
    path: str  # relative to the repository root
    old: str  # found exactly once
    new: str


MUTANTS = [
    Mutant("every-iteration", "-c all's check of every timed iteration (checkpass.Every is never made)",
           "kvbench/harness/loop.py", 'if self.opts.check == "all" and s.pools:', "if False:"),
    Mutant("path-bound", "GB/s judged against the copy measured beside each iteration (SUSPECT/NOISY)",
           "kvbench/results/bounds.py", "if ratio > 1 + COPY_MARGIN + sp:", "if False:"),
    Mutant("wake-bound", "a landing stamp judged against the rank's p99 wake-up bound",
           "kvbench/results/bounds.py", "if np.isfinite(bound) and least > bound * (1 + sp):", "if False:"),
    Mutant("exit-deadline", "the exit path's own deadline (a cleanup that hangs is cut off)",
           "kvbench/job/guard.py", "t = threading.Timer(EXIT_BACKSTOP_S, os._exit, args=(code,))",
           "return"),
    Mutant("poison", "the destination's poison before a checked transfer (complement of what must land)",
           "kvbench/memory/verify.py",
           '    """Destination: every byte of the ranges becomes the complement of what it must hold."""\n',
           '    """Destination: every byte of the ranges becomes the complement of what it must hold."""\n'
           "    return\n"),
]


def locate(m: Mutant) -> tuple[Path, str, int]:
    """(file, its text, the mutated line's number); SystemExit when the text is not there exactly once."""
    f = ROOT / m.path
    text = f.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutants: {m.name}: {m.path} holds its line {n} times, not once: update tools/mutants.py")
    return f, text, text[:text.index(m.old)].count("\n") + 1


def dirty(paths: list[str]) -> list[str]:
    p = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *paths], capture_output=True,
                       text=True, check=False)
    return [ln[3:] for ln in p.stdout.splitlines()]


def first_failure(out: str) -> str:
    """The first test pytest named FAILED or ERROR, else the last line of its output."""
    for ln in out.splitlines():
        hit = re.match(r"^(FAILED|ERROR) (\S+)", ln)
        if hit:
            return f"{hit.group(1)} {hit.group(2)}"
    tail = [ln for ln in out.splitlines() if ln.strip()]
    return tail[-1][:100] if tail else "-"


SELF = "tests/test_mutants.py"  # checks each mutant's line is in the tree: it fails under every mutant, proving nothing
GRACE_S = 15.0  # after SIGINT, for pytest's fixtures to end the ranks they started in sessions of their own


def _interrupted(signum, _frame):
    raise SystemExit(f"mutants: signal {signum}: the mutated file is put back")


def make_check(pytest_args: str, timeout_s: float) -> tuple[int, str]:
    """`make check` with PYTEST_ARGS (its own session: a timeout or an interrupt reaches pytest, whose fixtures
    end the ranks they started, before anything is killed)."""
    p = subprocess.Popen(["make", "-s", "check", f"PYTEST_ARGS={pytest_args} --ignore={SELF}"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
        return p.returncode, out
    except BaseException as exc:
        os.killpg(p.pid, signal.SIGINT)
        try:
            out, _ = p.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return 124, (out or "") + f"\nmake check ran past {timeout_s:.0f} s"


def run(m: Mutant | None, pytest_args: str, timeout_s: float, log: Path) -> tuple[int, float, str]:
    """`make check` on the tree with ``m`` taken out (None: as it is); (exit code, seconds, first failure)."""
    t0 = time.monotonic()
    f, text = (None, None) if m is None else locate(m)[:2]
    try:
        if f is not None:
            f.write_text(text.replace(m.old, m.new))
        code, out = make_check(pytest_args, timeout_s)
    finally:
        if f is not None:
            f.write_text(text)
    log.write_text(out)
    return code, time.monotonic() - t0, first_failure(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="mutants by name, comma-separated (default: all): "
                    + ", ".join(m.name for m in MUTANTS))
    ap.add_argument("--pytest-args", default="-x", help="PYTEST_ARGS of each `make check` (default: %(default)s: "
                    f"each stops at its first failure; {SELF} is always left out)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per `make check` (default: %(default)s)")
    ap.add_argument("--logs", default=str(ROOT / "results" / "runs" / "mutants"),
                    help="where each mutant's make output is kept (default: %(default)s)")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        ap.error(f"unknown mutant(s) {', '.join(unknown)}: the names are " + ", ".join(m.name for m in MUTANTS))
    chosen = [m for m in MUTANTS if not names or m.name in names]
    for m in chosen:
        locate(m)
    busy = dirty(sorted({m.path for m in chosen}))
    if busy:
        raise SystemExit(f"mutants: uncommitted changes in {', '.join(busy)}: commit or stash them first")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"# make check PYTEST_ARGS='{a.pytest_args} --ignore={SELF}', on the tree as it is, then once per mutant; "
          f"logs: {logs}/{stamp}-<mutant>.log", flush=True)
    print(f"{'mutant':16} {'where':34} {'make check':>10} {'s':>5}  first failure", flush=True)
    # a make check that fails on the tree as it is would "kill" every mutant and prove nothing
    code, secs, first = run(None, a.pytest_args, a.timeout, logs / f"{stamp}-none.log")
    print(f"{'(none)':16} {'-':34} {'exit ' + str(code):>10} {secs:5.0f}  {first if code else 'passes'}", flush=True)
    if code:
        print("# make check fails on the tree as it is: no mutant can be judged", flush=True)
        return 1
    survived = []
    for m in chosen:
        _, _, line = locate(m)
        code, secs, first = run(m, a.pytest_args, a.timeout, logs / f"{stamp}-{m.name}.log")
        print(f"{m.name:16} {m.path + ':' + str(line):34} {'exit ' + str(code):>10} {secs:5.0f}  "
              f"{first if code else 'SURVIVED: ' + m.what}", flush=True)
        if code == 0:
            survived.append(m.name)
    print(f"# killed {len(chosen) - len(survived)} of {len(chosen)}"
          + (f"; survived: {', '.join(survived)}" if survived else ""), flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
