"""kvbench selftest: kvbench's rates and exposed time against a veth link of known rate.

A prefill rank in namespace a and a decode rank in namespace b (one MPMD
mpiexec launch per measurement) move one request over the shaped veth; the
link's byte counters prove the bytes crossed it; the bulk rate is judged
against iperf3 on the same link (or the shaped rate without iperf3) and a
streaming row's exposed time against the model max(0, T - P) + T/L.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from kvbench.job.launch import LIVE, kill_tree, launch

from . import netns as N
from .judge import (
    BLOCK,
    TARGET_S,
    Row,
    bulk_rate,
    choose_tokens,
    exposed_median,
    judge_exposed,
    judge_rate,
    print_tables,
    results_path,
    transfers,
)

MODEL, DTYPE = "llama-3-8b", "fp16"
P_OVER_T = 2.0  # the streaming row's prefill clock is this many times the transfer time at the shaped rate
IPERF_PORT, IPERF_S, IPERF_OMIT_S = 5201, 4, 1
GRACE_S = 5.0  # a launch past its timeout: SIGTERM, this long for its ranks to leave by their own exit path

# what keeps the MPI ranks on the veth.  MPICH carries ranks of one host over shared memory (its ch4 shm,
# and UCX's own shm/cma transports): NOLOCAL makes MPICH treat every rank as remote (without it 0 bytes
# crossed the veth), UCX_TLS=tcp keeps UCX off shared memory (without it, 0 bytes too), UCX_NET_DEVICES
# names the veth.  With --netmod ofi (the wheel has both): libfabric's tcp provider on the veth.
MPI_ENV = {
    "ucx": {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp", "UCX_NET_DEVICES": N.IFNAME},
    "ofi": {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": N.IFNAME},
}
# tcp's data connections: the veth has the same name in both namespaces, so one value fits both ranks
TCP_ENV = {"KVBENCH_SOCKET_IFNAME": "=" + N.IFNAME}


# ---------------------------------------------------------------- processes

def default_mpiexec() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


def rank_env(extra: dict) -> dict:
    """The environment of the launch: ours, this kvbench first on PYTHONPATH, and the veth pinning."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def iperf3(link: N.Link, timeout: float) -> tuple[float | None, str]:
    """Goodput a -> b in bits/s (server in a, client in b with -R so the server sends), or (None, why)."""
    if shutil.which("iperf3") is None:
        return None, "iperf3 not installed"
    server = subprocess.Popen(link.prefix("a") + ["iperf3", "-s", "-1", "-B", N.ADDR_A, "-p", str(IPERF_PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    LIVE.add(server.pid)
    try:
        why = ""
        for _ in range(10):  # the server needs a moment to listen
            time.sleep(0.2)
            rc, out = launch(link.prefix("b") + ["iperf3", "-c", N.ADDR_A, "-p", str(IPERF_PORT), "-R",
                                                 "-t", str(IPERF_S), "-O", str(IPERF_OMIT_S), "-J"], timeout,
                             grace=GRACE_S)
            try:
                doc = json.loads(out)
            except ValueError:
                doc = {}
            if rc == 0 and "end" in doc:
                return float(doc["end"]["sum_received"]["bits_per_second"]), ""
            why = doc.get("error") or out.strip()[-200:] or f"exit {rc}"
            if "connect" not in why or rc == 124:
                break
        return None, f"iperf3 failed: {why}"
    finally:
        kill_tree(server.pid)
        server.wait()
        LIVE.discard(server.pid)


# ---------------------------------------------------------------- the selftest


def kvbench_cmd(mpiexec: str, link: N.Link, args: list[str]) -> list[str]:
    """One MPMD launch: rank 0 (prefill) in namespace a, rank 1 (decode) in namespace b."""
    run = [sys.executable, "-m", "kvbench", "run", *args]
    return [mpiexec, "-n", "1", *link.prefix("a"), *run, ":", "-n", "1", *link.prefix("b"), *run]


def measure(mpiexec: str, env: dict, link: N.Link, args: list[str], transport: str, warmup: int, payload: int,
            timeout: float, outdir: str, log) -> tuple[object | None, dict, str]:
    """One kvbench launch for one transport: (results table or None, counter cells, failure reason)."""
    import pandas as pd

    before = N.counters(link)
    cmd = kvbench_cmd(mpiexec, link, ["-t", transport, "-o", outdir, "--timeout", f"{timeout:g}", *args])
    t0 = time.monotonic()
    rc, out = launch(cmd, timeout + 30, rank_env(env), grace=GRACE_S)
    moved = N.counters(link) - before
    log(f"# {transport}: kvbench exit {rc} after {time.monotonic() - t0:.1f} s; a->b {moved.a_to_b / 1e6:.1f} MB "
        f"(b received {moved.b_rx / 1e6:.1f} MB), b->a {moved.b_to_a / 1e6:.2f} MB, tbf drops {moved.drops}")
    path = results_path(out)
    if rc != 0 or not path or not os.path.exists(path):
        tail = "\n".join("#   " + ln for ln in out.strip().splitlines()[-25:])
        return None, {}, f"kvbench exit {rc}\n{tail}"
    df = pd.read_parquet(path)
    if int(df["nwrong"].fillna(0).sum()) != 0:
        return None, {}, "kvbench's check found wrong bytes"
    n = transfers(df, transport, warmup)
    want = n * payload
    cells = {"xfers": n, "crossed(MB)": moved.a_to_b / 1e6, "wire/pay": moved.a_to_b / want if want else math.nan}
    if moved.a_to_b < want or moved.b_rx < want:
        return None, cells, (f"only {moved.a_to_b:,} B left a and {moved.b_rx:,} B reached b over the veth, "
                             f"fewer than {n} x {payload:,} B of payload: the ranks did not talk over the link")
    return df, cells, ""


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="kvbench selftest",
        description="Prove kvbench's timing against a link of known rate: two network namespaces joined by a veth "
                    "shaped with tc tbf, one prefill rank in each side's namespace (MPICH), byte counters that show "
                    "the payload crossed the link, bulk GB/s against iperf3 (or the shaped rate) and a streaming "
                    "row's exposed time against max(0, T-P) + T/L. Needs root.")
    ap.add_argument("--rate", default="1gbit", help="tbf rate on both directions (tc units: 1gbit, 500mbit; default 1gbit)")
    ap.add_argument("--transports", default="tcp,mpi", help="network transports to measure (default tcp,mpi)")
    ap.add_argument("--streaming", default="tcp",
                    help="transports that also get a streaming row (default tcp; 'none' for none)")
    ap.add_argument("--tokens", type=int, help=f"prompt tokens of the {MODEL} request (default: ~{TARGET_S:g} s at the rate)")
    ap.add_argument("-n", "--iters", type=int, default=3, help="timed iterations per launch (default 3)")
    ap.add_argument("-w", "--warmup", type=int, default=1, help="warm-up iterations per launch (default 1)")
    ap.add_argument("--mpiexec", default=default_mpiexec(), help="MPICH's mpiexec (default: the venv's)")
    ap.add_argument("--netmod", choices=sorted(MPI_ENV), default="ucx",
                    help="MPICH netmod that carries MPI over the veth (default ucx; the mpich wheel has ucx and ofi)")
    ap.add_argument("--no-iperf", action="store_true", help="judge against the shaped rate even if iperf3 is installed")
    ap.add_argument("-o", "--results", help="keep kvbench's result files here (default: a temporary folder, removed)")
    a = ap.parse_args(argv)
    a.rate_bits = N.parse_rate(a.rate)
    a.transports = [t for t in a.transports.split(",") if t]
    a.streaming = [] if a.streaming in ("", "none") else [t for t in a.streaming.split(",") if t]
    for t in a.transports + a.streaming:
        if t not in ("tcp", "mpi", "mpi-sendrecv"):
            ap.error(f"transport '{t}': the selftest measures network transports tcp, mpi, mpi-sendrecv")
    if a.iters < 1 or a.warmup < 0:
        ap.error("--iters >= 1 and --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"kvbench selftest: error: {exc}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("kvbench selftest: needs root (it creates network namespaces, a veth pair and tc qdiscs)",
              file=sys.stderr)
        return 2
    if missing := N.missing_tools():
        print(f"kvbench selftest: needs {' and '.join(missing)} (iproute2)", file=sys.stderr)
        return 2
    if not a.mpiexec:
        print("kvbench selftest: no mpiexec (pip install mpich)", file=sys.stderr)
        return 2

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C, SIGTERM and SIGHUP end the run through the tear-down (a signal ignored at start, as in a
    # background job or under nohup, stays ignored)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) is not signal.SIG_IGN}
    link, tmp = N.Link(N.new_run_id(), a.rate_bits), None  # torn down whatever set-up got to
    try:
        for ns in N.sweep_leftovers():
            print(f"# removed leftover namespace {ns} (its selftest is not running)")
        link = N.setup(link.run_id, a.rate_bits)
        outdir = a.results or (tmp := tempfile.mkdtemp(prefix="kvbench-selftest-"))
        return selftest(a, link, outdir)
    except KeyboardInterrupt:
        print("# selftest: INTERRUPTED", flush=True)
        return 130
    except N.NetnsError as exc:
        print(f"kvbench selftest: {exc}\n# selftest: FAILED", flush=True)
        return 1
    finally:
        for s in old:  # a second Ctrl-C must not skip the tear-down
            signal.signal(s, signal.SIG_IGN)
        for pid in list(LIVE):
            kill_tree(pid)
        N.teardown(link)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def selftest(a, link: N.Link, outdir: str) -> int:
    from kvbench.model import shapes as M

    def log(s: str) -> None:
        print(s, flush=True)

    bpt = M.bytes_per_token(M.get_model(MODEL), DTYPE)
    tokens = a.tokens or choose_tokens(a.rate_bits, bpt)
    payload = bpt * tokens
    t_shaped = payload * 8 / a.rate_bits
    p_s = P_OVER_T * t_shaped
    per_xfer = max(t_shaped, 0.05)
    env = {**MPI_ENV[a.netmod], **TCP_ENV}
    n_xfer = a.warmup + a.iters + 1
    base = ["-m", MODEL, "--dtype", DTYPE, "--tokens", str(tokens), "--op", "push", "-n", str(a.iters),
            "-w", str(a.warmup), "--rounds", "1", "--bind", "core", "--name", "selftest"]  # one warm-up: counted
    log(f"# kvbench selftest  run {link.run_id}: namespaces {link.ns_a} ({N.ADDR_A}/{N.PREFIX}) and {link.ns_b} "
        f"({N.ADDR_B}/{N.PREFIX}), veth {N.IFNAME} on both")
    log(f"# link: tbf rate {N.fmt_rate(a.rate_bits)} ({a.rate_bits / 8e9:.4f} GB/s) burst {link.burst:,} B "
        f"limit {link.limit:,} B, each direction; TCP goodput at MTU 1500 is at most 1448/1514 = 0.956 of it")
    log(f"# ranks: mpiexec -n 1 ip netns exec {link.ns_a} (prefill) : -n 1 ip netns exec {link.ns_b} (decode); env "
        + " ".join(f"{k}={v}" for k, v in env.items()))
    log(f"# request: {MODEL} {tokens} tokens {DTYPE} = {payload:,} B, push; T at the shaped rate {t_shaped * 1e3:.1f} "
        f"ms; {a.warmup} warm-up + {a.iters} timed + check per launch; GB = 10^9 B")

    iperf_bits, why = (None, "--no-iperf") if a.no_iperf else iperf3(link, 30)
    log(f"# iperf3 a->b: {iperf_bits / 1e9:.3f} Gbit/s ({IPERF_S} s, first {IPERF_OMIT_S} s omitted)"
        if iperf_bits else f"# iperf3: {why}; judging against the shaped rate")

    rows: list[Row] = []
    measured: dict[str, float] = {}
    for t in a.transports:
        timeout = 60 + 3 * n_xfer * per_xfer
        df, cells, fail = measure(a.mpiexec, env, link, [*base, "--variants", "bulk"], t, a.warmup, payload, timeout,
                                  outdir, log)
        if df is None:
            rows.append(Row("bulk", t, False, cells, fail))
            continue
        bps, sec = bulk_rate(df, t)
        measured[t] = bps
        v = judge_rate(bps, a.rate_bits, iperf_bits)
        rows.append(Row("bulk", t, v.ok, {**cells, "GB/s": bps / 1e9, "Gbit/s": bps * 8 / 1e9,
                                          "/shaped": bps * 8 / a.rate_bits,
                                          "/iperf3": bps * 8 / iperf_bits if iperf_bits else math.nan,
                                          "want": f"{v.lo:.2f}-{v.hi:.2f} of {v.basis}"}))
    for t in a.streaming:
        t_s = payload / measured[t] if t in measured else t_shaped
        timeout = 60 + 3 * n_xfer * (p_s + per_xfer)
        args = [*base, "--variants", "paged", "--alloc", "contiguous", "--coalesce", "on", "-b", str(BLOCK),
                "-e", str(BLOCK), "--overlap", "streaming", "--prefill-ms", f"{p_s * 1e3:.2f}"]
        df, cells, fail = measure(a.mpiexec, env, link, args, t, a.warmup, payload, timeout, outdir, log)
        if df is None:
            rows.append(Row("streaming", t, False, cells, fail))
            continue
        exp, layers, n = exposed_median(df, t)
        v = judge_exposed(exp, t_s, p_s, layers)
        rows.append(Row("streaming", t, v.ok, {**cells, "L": layers, "P(ms)": p_s * 1e3, "T(ms)": t_s * 1e3,
                                               "exp p50(ms)": exp * 1e3, "model(ms)": v.model_s * 1e3,
                                               "diff(ms)": v.diff_s * 1e3, "tol(ms)": v.tol_s * 1e3},
                        "" if t in measured else "T at the shaped rate (no bulk row)"))
    print_tables(rows)
    for r in rows:
        if not r.ok:
            c = r.cells
            why = (f"{c['/iperf3' if 'iperf3' in c['want'] else '/shaped']:.3f} is outside {c['want']}" if "want" in c
                   else f"exposed {c['exp p50(ms)']:.2f} ms is {c['diff(ms)']:+.2f} ms from the model "
                        f"(tolerance {c['tol(ms)']:.2f})" if "diff(ms)" in c else "no measurement (above)")
            log(f"# FAIL: {r.kind} {r.transport}: {why}")
    ok = bool(rows) and all(r.ok for r in rows)
    log(f"# selftest: {'PASS' if ok else 'FAILED'}")
    return 0 if ok else 1
