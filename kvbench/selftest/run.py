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
from dataclasses import dataclass, field

from kvbench.job.launch import descendants, mpich_segments, remove_orphan_segments, starttime

from . import netns as N

MODEL, DTYPE = "llama-3-8b", "fp16"
BLOCK = 256  # tokens per block of the streaming row (contiguous + coalesced: it runs at the bulk ceiling)
TARGET_S = 1.0  # a bulk transfer lasts about this long at the shaped rate
P_OVER_T = 2.0  # the streaming row's prefill clock is this many times the transfer time at the shaped rate
RATE_BAND_IPERF = (0.90, 1.05)
RATE_BAND_SHAPED = (0.85, 1.05)
EXPOSED_TOL = (0.20, 0.002)  # the streaming row passes within max(20% of T/L, 2 ms) of the model
IPERF_PORT, IPERF_S, IPERF_OMIT_S = 5201, 4, 1

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


# ---------------------------------------------------------------- pure parts (unit-tested)

@dataclass
class RateVerdict:
    ok: bool
    ratio: float  # measured / basis
    basis: str  # "iperf3" or "shaped"
    lo: float
    hi: float


def judge_rate(measured_bytes_s: float, shaped_bits: float, iperf_bits: float | None = None) -> RateVerdict:
    """kvbench's bulk rate against iperf3 on the same link (0.90-1.05), or the shaped rate without it (0.85-1.05)."""
    bits = measured_bytes_s * 8
    if iperf_bits:
        (lo, hi), basis, ref = RATE_BAND_IPERF, "iperf3", iperf_bits
    else:
        (lo, hi), basis, ref = RATE_BAND_SHAPED, "shaped", shaped_bits
    ratio = bits / ref if ref > 0 else math.nan
    return RateVerdict(bool(lo <= ratio <= hi), ratio, basis, lo, hi)


@dataclass
class ExposedVerdict:
    ok: bool
    model_s: float
    diff_s: float
    tol_s: float


def exposed_model(t_s: float, p_s: float, layers: int) -> float:
    """The seeds' model of streaming exposed time: max(0, T - P) + T/L."""
    return max(0.0, t_s - p_s) + t_s / layers


def judge_exposed(exposed_s: float, t_s: float, p_s: float, layers: int) -> ExposedVerdict:
    """Within max(20% of T/L, 2 ms) of the model."""
    model = exposed_model(t_s, p_s, layers)
    tol = max(EXPOSED_TOL[0] * t_s / layers, EXPOSED_TOL[1])
    diff = exposed_s - model
    return ExposedVerdict(bool(abs(diff) <= tol), model, diff, tol)


def choose_tokens(rate_bits: float, bytes_per_token: int, seconds: float = TARGET_S, block: int = BLOCK) -> int:
    """Prompt tokens (a multiple of ``block``) whose KV takes about ``seconds`` at the shaped rate."""
    want = rate_bits / 8 * seconds / bytes_per_token
    return max(block, math.ceil(want / block) * block)


def results_path(output: str) -> str | None:
    """The parquet file kvbench names on its ``# results:`` line."""
    for ln in output.splitlines():
        if ln.startswith("# results:"):
            return ln.split(":", 1)[1].strip()
    return None


def bulk_rate(df, transport: str) -> tuple[float, float]:
    """(bytes/s, seconds): payload / the median over timed iterations of the pair's slower rank (kvbench's GB/s)."""
    d = df[(df["transport"] == transport) & (df["variant"] == "bulk") & (df["iter"] >= 0) & (df["status"] == "ok")]
    if d.empty:
        raise ValueError(f"no timed bulk rows for {transport}")
    sec = float(d.groupby("iter")["seconds"].max().median())
    return float(d["payload_bytes"].iloc[0]) / sec, sec


def exposed_median(df, transport: str) -> tuple[float, int, int]:
    """(median exposed_s over the decode rank's timed iterations, layers, iterations)."""
    d = df[(df["transport"] == transport) & (df["role"] == "decode") & (df["iter"] >= 0) & (df["status"] == "ok")]
    if d.empty:
        raise ValueError(f"no timed decode rows for {transport}")
    return float(d["exposed_s"].median()), int(d["layers"].iloc[0]), len(d)


def transfers(df, transport: str, warmup: int) -> int:
    """Transfers of the request in a launch: warm-up + timed iterations + check passes (iter -1)."""
    d = df[(df["transport"] == transport) & (df["role"] == "decode")]
    return warmup + int((d["iter"] >= 0).sum()) + int((d["iter"] == -1).sum())


# ---------------------------------------------------------------- processes

def _signal_all(procs: dict[int, str | None], sig: int) -> None:
    for pid, st in procs.items():
        if st is not None and starttime(pid) == st:  # still the same process (pids are reused)
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def kill_tree(p: subprocess.Popen, grace: float = 0.0) -> None:
    """End a launch and its process tree.  With ``grace``, SIGTERM first: kvbench's ranks then leave through
    their own exit path (one line, their segments removed); whatever is left after ``grace`` s is SIGKILLed.
    The tree is taken before anything is signalled: once mpiexec is gone its ranks are nobody's children."""
    procs = {pid: starttime(pid) for pid in [*descendants(p.pid), p.pid]}
    if grace > 0 and p.poll() is None:
        _signal_all(procs, signal.SIGTERM)
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(starttime(q) == st for q, st in procs.items() if st):
            time.sleep(0.05)
    _signal_all(procs, signal.SIGKILL)


GRACE_S = 5.0
LIVE: list[subprocess.Popen] = []  # launches in flight, killed on the way out


def launch(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run a command (with its process tree) for at most ``timeout`` s; (exit code, stdout+stderr); 124 = timeout.

    MPICH leaves /dev/shm/mpich_shm_* behind when a rank dies without MPI_Finalize (PLATFORM pitfall 8):
    the segments this launch's processes map are noted while it runs, and those still there and mapped
    by nobody once it has ended are removed.  Other jobs' segments are never touched."""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env=env)
    except OSError as exc:
        return 127, f"cannot start {cmd[0]}: {exc.strerror}"
    LIVE.append(p)
    tree: dict[int, str | None] = {}
    mine: set[str] = set()
    deadline, tail = time.monotonic() + timeout, ""
    try:
        while True:
            tree.update({q: starttime(q) for q in descendants(p.pid) if q not in tree})
            mine |= mpich_segments(tree)
            try:
                out, _ = p.communicate(timeout=0.25)
                rc = p.returncode
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    kill_tree(p, GRACE_S)
                    out, rc, tail = p.communicate()[0], 124, f"\n(timed out after {timeout:g} s)"
                    break
    except BaseException:
        kill_tree(p, GRACE_S)
        p.wait()
        raise
    finally:
        LIVE.remove(p)
        if p.returncode != 0:
            _signal_all(tree, signal.SIGKILL)  # what a dead launcher left behind (no longer its children)
        remove_orphan_segments(mine)
    return rc, (out or "") + tail


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
    LIVE.append(server)
    try:
        why = ""
        for _ in range(10):  # the server needs a moment to listen
            time.sleep(0.2)
            rc, out = launch(link.prefix("b") + ["iperf3", "-c", N.ADDR_A, "-p", str(IPERF_PORT), "-R",
                                                 "-t", str(IPERF_S), "-O", str(IPERF_OMIT_S), "-J"], timeout)
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
        kill_tree(server)
        server.wait()
        LIVE.remove(server)


# ---------------------------------------------------------------- the selftest

@dataclass
class Row:
    kind: str
    transport: str
    ok: bool
    cells: dict = field(default_factory=dict)
    note: str = ""


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
    rc, out = launch(cmd, timeout + 30, rank_env(env))
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
        for p in list(LIVE):
            kill_tree(p)
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


BULK_COLS = [("xfers", "{:d}", 5), ("crossed(MB)", "{:.1f}", 11), ("wire/pay", "{:.3f}", 8), ("GB/s", "{:.4f}", 7),
             ("Gbit/s", "{:.3f}", 7), ("/shaped", "{:.3f}", 7), ("/iperf3", "{:.3f}", 7), ("want", "{}", 18)]
STREAM_COLS = [("xfers", "{:d}", 5), ("crossed(MB)", "{:.1f}", 11), ("L", "{:d}", 3), ("P(ms)", "{:.1f}", 8),
               ("T(ms)", "{:.1f}", 8), ("exp p50(ms)", "{:.2f}", 11), ("model(ms)", "{:.2f}", 9),
               ("diff(ms)", "{:+.2f}", 8), ("tol(ms)", "{:.2f}", 7)]


def _cell(v, fmt: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{fmt.format(v):>{width}}"


def print_tables(rows: list[Row]) -> None:
    for kind, cols, what in (("bulk", BULK_COLS, "bulk rate: GB/s = payload / p50 time; /shaped and /iperf3 in bits"),
                             ("streaming", STREAM_COLS, "streaming: exposed = prefill end -> decode knows the last "
                              "byte (median); model = max(0, T-P) + T/L, T = payload / this transport's bulk GB/s")):
        mine = [r for r in rows if r.kind == kind]
        if not mine:
            continue
        print(f"# {what}")
        print(f"#{'row':>9} {'transport':>9} " + " ".join(f"{c:>{w}}" for c, _, w in cols) + "  verdict")
        for r in mine:
            print(f" {r.kind:>9} {r.transport:>9} " + " ".join(_cell(r.cells.get(c), f, w) for c, f, w in cols)
                  + f"  {'PASS' if r.ok else 'FAIL'}")
            for ln in r.note.splitlines():
                print(f"#   {r.transport}: {ln}" if not ln.startswith("#") else ln)
