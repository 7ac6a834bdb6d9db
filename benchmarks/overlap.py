#!/usr/bin/env python3
"""make bench-overlap: measured exposed time against the seeds' model, over several P/T ratios.

For each transport: a bulk-only run measures T, the request's transfer time
at the bulk ceiling, and a short launch of the sweep at those P measures it
again the way the sweep will (its bulk rows take turns with idle prefill
waits, which slows them: docs/evidence.md); that T sets P = ratio x T for the first launch of the sweep of
prefill times, serial and streaming, push and pull, and the median T of the
launches so far sets it for each later one.  Every row is checked against
the model from its launch's own bulk rows:

  streaming, T <= P   exposed within 20% (or 0.5 ms) of T/L
  streaming, T >  P   exposed within 20% of T - P + T/L
  serial              exposed within 20% of T

Blocks are large and coalesced so the paged transfer runs at the bulk
ceiling the model assumes.  The sweep is launched --repeats times; a row's
verdict (rows grouped by the ratio asked for; P and P/T shown are medians) is
the median over the launches of exposed minus the model computed from the
same launch's T (min..max of exposed shown), so one launch that
lands in a slow phase of a shared machine does not decide it.  Exit code 1 when a row fails, or when a
launch flags a row SUSPECT (faster than its path's bound; its lines are printed at the end).
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import pandas as pd  # noqa: E402
from jobs import launch  # noqa: E402

from kvbench.report import read, summarize  # noqa: E402

# --bind core: unbound, the scheduler wakes a receiver onto its sender's CPU after the idle waits of a
# long prefill, which slowed an isolated tcp layer (docs/evidence.md)
BASE = ["-m", "llama-3-8b", "--alloc", "contiguous", "--coalesce", "on", "-b", "256", "-e", "256", "--bind", "core"]
# tcp busy-polls its control messages (a pull's layer-ready signals and requests; payload receives
# sleep as in block mode), as an engine's progress thread would: a receiver asleep in the kernel pays
# a wake-up per message after an idle gap, and a streaming pull sends three per layer (signal,
# request, data), which put tcp pull at long prefills past the 0.5 ms tolerance with poll=block
# (docs/evidence.md).  --kvbench-args "-O poll=block" (or spin) measures the others.
PER_TRANSPORT = {"tcp": ["-O", "poll=control"]}


SUSPECT_RC = 6  # kvbench's exit code for a row beyond its path's bound (kvbench/job/status.py)
suspects: list[str] = []  # the SUSPECT lines of every launch, printed with the verdict


def run(mpirun: str, args: list[str], out: str) -> str:
    """One kvbench launch; its result set's path.  A SUSPECT launch (a row faster than its path's bound, which
    a loaded machine's slow bound copy can cause) still measured every row: its lines are kept for the footer."""
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", out, *args]
    rc, text = launch(cmd, 900)
    if rc not in (0, SUSPECT_RC):
        sys.exit(f"kvbench failed ({rc}): {' '.join(cmd)}\n{text[-3000:]}")
    suspects.extend(ln.strip() for ln in text.splitlines() if ln.lstrip("# ").startswith("SUSPECT:"))
    return sorted(glob.glob(os.path.join(out, "*", "*.parquet")), key=os.path.getmtime)[-1]


KEYS = ["op", "overlap", "ratio"]


def bulk_ms(st: pd.DataFrame) -> float:
    """The slower op's bulk transfer time (ms) in one summarized launch."""
    st = st[st["variant"] == "bulk"]
    return float((st["payload_bytes"] / (st["gbps"] * 1e9)).max() * 1e3)


def prefill(ratios: str, t_ms: float) -> list[str]:
    """--prefill-ms at each P/T ratio (at least 0.1 ms, two decimals: as the rows will carry them)."""
    return ["--prefill-ms", ",".join(f"{max(0.1, float(r) * t_ms):.2f}" for r in ratios.split(","))]


def by_ratio(st: pd.DataFrame, ratios: str, p_arg: list[str]) -> pd.DataFrame:
    """The launch's paged rows, each with the ratio its P was set for and its own P/T."""
    st = st[st["variant"] == "paged"].copy()
    rs, ps = ratios.split(","), [float(p) for p in p_arg[1].split(",")]
    st["ratio"] = [rs[min(range(len(ps)), key=lambda i: abs(ps[i] - p * 1e3))] for p in st["prefill_s"]]
    st["pt"] = st["prefill_s"] * 1e3 / st["T_ms"]
    return st


def tolerance(overlap: str, t: float, p: float, want: float) -> float:
    """Allowed error (ms): 20% of the model, and at least 0.5 ms for streaming's last-layer term (T <= P)."""
    return max(0.2 * want, 0.5) if overlap == "streaming" and t <= p else 0.2 * want


def combine(runs: list) -> pd.DataFrame:
    """Per (op, overlap, ratio) over launches (``by_ratio`` rows): medians of P, P/T, T, exposed p50
    and the model, the exposed range, and the median of each launch's error against the model from
    that launch's own T (summarize's diff_ms; paired: a launch in a slow phase moves T and exposed
    together)."""
    out = pd.concat(runs).groupby(KEYS, sort=False).agg(
        prefill_s=("prefill_s", "median"), pt=("pt", "median"), T_ms=("T_ms", "median"),
        exposed_ms=("exposed_ms", "median"), lo=("exposed_ms", "min"), hi=("exposed_ms", "max"),
        want=("model_ms", "median"), err_ms=("diff_ms", "median")).reset_index()
    out["tol"] = [tolerance(r.overlap, r.T_ms, r.prefill_s * 1e3, r.want) for r in out.itertuples()]
    out["ok"] = out["err_ms"].abs() <= out["tol"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    ap.add_argument("-t", "--transports", default="shm,tcp")
    ap.add_argument("--tokens", default="1024")
    ap.add_argument("--ratios", default="0.25,0.5,2,4", help="P/T ratios to sweep")
    ap.add_argument("--kvbench-args", default="", help="extra kvbench run flags, added after the defaults "
                    "(a repeated -O key overrides them), e.g. \"-O poll=block\"")
    ap.add_argument("-n", "--iters", default="24")
    ap.add_argument("--repeats", type=int, default=5, help="launches of the sweep; rows are their medians")
    ap.add_argument("--rounds", default="6", help="cases take turns (kvbench --rounds): T and exposed see the same noise")
    a = ap.parse_args()
    failed, extra, rounds = 0, shlex.split(a.kvbench_args), min(int(a.rounds), int(a.iters))
    with tempfile.TemporaryDirectory() as tmp:
        print("# bench-overlap: exposed ms (decode's clock) vs the model; GB = 10^9 B; "
              f"llama-3-8b, {a.tokens} tokens, 256-token blocks, contiguous + coalesced")
        print(f"# {a.iters} iterations in {rounds} rounds per launch; T, exp p50 and err "
              f"are medians over {a.repeats} launches; range = each launch's exp p50; want = the model at T;")
        print("# err = exp p50 - the model at that launch's own T; PASS when |err| <= tol")
        print(f"# {'transport':>9} {'op':>4} {'overlap':>9} {'P/T':>5} {'P(ms)':>8} {'T(ms)':>8} {'exp p50':>8} "
              f"{'range':>13} {'want':>8} {'err':>7} {'tol':>6}  verdict")
        for transport in a.transports.split(","):
            # T that sets P, so that the rows sit at the ratios asked for (near 1, T - P is all noise)
            mine = [*BASE, *PER_TRANSPORT.get(transport, []), *extra]
            bulk_args = ["-t", transport, "--op", "push,pull", "--variants", "bulk", "--tokens", a.tokens,
                         "-n", a.iters, *mine]
            t_bulk = bulk_ms(summarize(read(run(a.mpirun, bulk_args, tmp))[0]))
            sweep = ["-t", transport, "--op", "push,pull", "--overlap", "serial,streaming", "--tokens", a.tokens,
                     "--variants", "bulk,paged", *mine]  # T from bulk, exposed from paged: no chunk rows
            # a short calibration sweep (as many iterations per turn as the measuring launches) sets the
            # first launch's P; each later launch's P comes from the median T of the launches before it:
            # one calibration launch in a slow phase of the machine had put the tcp rows far from the
            # P/T ratios asked for (docs/evidence.md)
            cal_rounds = max(1, rounds // 2)
            cal = [*sweep, "-n", str(cal_rounds * (int(a.iters) // rounds)), "--rounds", str(cal_rounds)]
            t_ms = bulk_ms(summarize(read(run(a.mpirun, cal + prefill(a.ratios, t_bulk), tmp))[0]))
            print(f"# {transport}: {shlex.join(mine)}; first P from T = {t_ms:.2f} ms in a calibration sweep "
                  f"({t_bulk:.2f} bulk-only), then from the median T of the launches so far")
            sweep += ["-n", a.iters, "--rounds", str(rounds)]
            runs, ts = [], []
            for _ in range(a.repeats):  # each launch sets P from the median T of the launches before it
                p_arg = prefill(a.ratios, float(pd.Series(ts).median()) if ts else t_ms)
                st = summarize(read(run(a.mpirun, sweep + p_arg, tmp))[0])
                ts.append(bulk_ms(st))
                runs.append(by_ratio(st, a.ratios, p_arg))
            st = combine(runs)
            for _, r in st.iterrows():
                failed += not r.ok
                print(f"  {transport:>9} {r.op:>4} {r.overlap:>9} {r.pt:5.2f} "
                      f"{r.prefill_s * 1e3:8.2f} {r.T_ms:8.2f} {r.exposed_ms:8.2f} {f'{r.lo:.2f}..{r.hi:.2f}':>13} "
                      f"{r.want:8.2f} {r.err_ms:+7.2f} {r.tol:6.2f}  {'PASS' if r.ok else 'FAIL'}")
    for line in suspects:
        print(line if line.startswith("#") else f"# {line}")
    print(f"# {failed} row(s) outside the tolerance, {len(suspects)} SUSPECT row(s) in the launches: "
          f"{'OK' if failed == 0 and not suspects else 'FAILED'}")
    return 1 if failed or suspects else 0


if __name__ == "__main__":
    sys.exit(main())
