"""gpu-check's two-rank steps through ``kvbench run`` under an MPI launcher: staged over tcp against host tcp
between host pools (both launched here, same sizes), real-prefill streaming against serial with the kernel engine
(exposed time in layers' compute), plus the real prefill's rate against a plain matmul in this process, and the
real suites on device pools (cuda_ipc and staged, each engine, push and pull, bulk and paged at 16-256-token
blocks) beside host tcp with the same sizes.  Rows carry kvbench run's own columns (GB/s at p50, p50, #wrong:
report/tables.py's summarize, as a host run's table) and their share of their floor.

Each launch is bounded (job/launch.py: past its time the launcher and its ranks are killed whole, and the row
says so).  pandas and the model (which needs pydantic) are imported inside the step that needs them: a
missing package fails that step only.
"""
from __future__ import annotations

import glob
import math
import os
import shutil
import sys
import time

import numpy as np

from kvbench.job.launch import launch

from . import floors as F
from .checks import Target, timed
from .runner import HOST, HOST_AFTER_SYNC, RUN, one_line, row

TINY = ["--layers", "8", "--kv-heads", "2", "--head-dim", "64"]  # the rehearsal's model: CPU matmuls in seconds


def launcher(a) -> str | None:
    """The MPI launcher: --mpirun, else mpiexec/mpirun beside this Python, else on PATH."""
    if a.mpirun:
        return a.mpirun
    for name in ("mpiexec", "mpirun"):
        here = os.path.join(os.path.dirname(sys.executable), name)
        if os.path.exists(here):
            return here
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _run(a, args: list[str], out: str, until: float, check: str, what: str):
    """``kvbench run ARGS`` on 2 ranks, ended by ``until`` (time.monotonic); (results table, None) or (None, rows
    saying why not)."""
    timeout = until - time.monotonic()
    if timeout < 5:
        return None, [row(check, what, status="FAIL", note="not launched: the step's budget is spent")]
    mpirun = launcher(a)
    if not mpirun:
        return None, [row(check, what, status="skipped", note="no MPI launcher (make gpu-wheels carries mpich's)")]
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", *args, "-o", out]
    t0 = time.monotonic()
    rc, text = launch(cmd, timeout, grace=3.0)
    took = time.monotonic() - t0
    if rc == 124:
        return None, [row(check, what, status="FAIL", note=f"launch timed out after {timeout:.0f} s: killed whole")]
    found = sorted(glob.glob(os.path.join(out, "**", "*.parquet"), recursive=True), key=os.path.getmtime)
    if rc not in (0, 2, 3) or not found:
        last = [x for x in text.strip().splitlines() if x.strip()]
        return None, [row(check, what, status="FAIL", note=f"exit {rc}: {last[-1] if last else 'no output'}"[:160])]
    import pandas as pd

    df = pd.read_parquet(found[-1])
    df.attrs["path"], df.attrs["seconds"] = found[-1], took
    return df, None


def _cases(df):
    """kvbench run's one line per case (GB/s at p50, p50, #wrong), as its own table computes them."""
    from kvbench.report.tables import summarize

    return summarize(df)


def _label(r) -> str:
    blk = f" b{int(r['block_size'])}" if r["variant"] != "bulk" else ""
    return f"{r['transport']} {r['op']} {r['variant']}{blk}" + (f" {r['copy']}" if r["transport"] != "tcp" else "")


def case_rows(check: str, st, floor_of, judged: bool, note: str = "") -> list[dict]:
    """One row per measured case of summary ``st``: GB/s at p50, p50 and #wrong (FAIL when any byte is wrong or
    the case did not finish), its share of ``floor_of(case) -> (GB/s, floor name, goal or None)``; then one
    skipped row per transport and reason."""
    rows = []
    for _, r in st[st["status"] != "skipped"].iterrows():
        w = r["nwrong_checked"]
        bad = (w == w and w > 0) or r["status"] != "ok"
        said = "" if r["status"] == "ok" else f"{r['status']}: {str(r['reason'])[:80]}; "
        wrong = "-" if w != w else str(int(w))
        one = row(check, _label(r), r["gbps"], "FAIL" if bad else "ok",
                  f"{said}p50 {r['p50'] * 1e3:.3f} ms, #wrong {wrong}{note}", clock=RUN)
        floor, name, goal = floor_of(r)
        rows.append(F.rate(one, floor, name, goal, judged))
    skipped = st[st["status"] == "skipped"].drop_duplicates(["transport", "reason"])
    for _, r in skipped.iterrows():
        rows.append(row(check, f"{r['transport']} (every case)", status="skipped", note=str(r["reason"])[:120]))
    return rows


def _tcp_floor(a, target: Target, out: str, until: float, check: str, same: list[str]):
    """kvbench run -t tcp between host pools with the sizes ``same``: ({(op, variant, block): GB/s}, rows, the
    results' path)."""
    df, fail = _run(a, ["-t", "tcp", "--memory", "host", *same, "--name", f"gpucheck-{check}-tcp"],
                    os.path.join(out, f"{check}-tcp"), until, check, "host tcp (the floor of staged)")
    if fail:
        return {}, fail, ""
    st = _cases(df)
    ok = st[(st["status"] == "ok") & st["gbps"].notna()]
    tcp = {_key(r): float(r["gbps"]) for _, r in ok.iterrows()}
    rows = case_rows(check, st, lambda r: (math.nan, "", None), not target.rehearsal, "; the floor of staged")
    return tcp, rows, f"; host tcp: {df.attrs['path']} ({df.attrs['seconds']:.0f} s)"


def _key(r) -> tuple:
    return r["op"], r["variant"], int(r["block_size"])


def staged_rows(a, target: Target, out: str, until: float, fl: F.Floors | None = None) -> list[dict]:
    """staged (device -> bounce -> tcp -> bounce -> device) between two ranks, each engine, push and pull, against
    host tcp between host pools with the same sizes (launched after it, in this step)."""
    fl = fl or F.Floors()
    size = ["-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1"] if target.rehearsal else \
        ["-m", "llama-3-8b", "--tokens", "4096", "-n", "5", "-w", "1"]
    same = ["--op", "push,pull", "--variants", "bulk,paged", *size]
    args = ["-t", "staged", "-O", "inner=tcp", "--memory", target.kind, "--copy", "memcpy,kernel,batch", *same,
            "--name", "gpucheck-staged"]
    # the measurement first, its floor after: a step out of time keeps the staged rows without their ratio
    df, fail = _run(a, args, os.path.join(out, "staged"), until, "staged", "kvbench run -t staged (tcp)")
    tcp, rows, where = _tcp_floor(a, target, out, until, "staged", same)
    fl.host_tcp.update(tcp)
    if fail:
        return fail + rows
    note = " (cpu rehearsal: torch-cpu pools)" if target.rehearsal else ""
    got = case_rows("staged", _cases(df), lambda r: (tcp.get(_key(r), math.nan), F.HOST_TCP, F.STAGED),
                    not target.rehearsal, note)
    if not got:
        got.append(row("staged", "kvbench run -t staged (tcp)", status="FAIL", note="no row measured"))
    return got + rows + [row("staged", "results", note=f"{df.attrs['path']} ({df.attrs['seconds']:.0f} s){where}")]


def suite_args(target: Target) -> list[str]:
    """The real suites' axes: cuda_ipc and staged on device pools (torch-cpu on the rehearsal, where cuda_ipc
    says itself why it cannot run), each engine, push and pull, bulk and paged at 16, 64 and 256-token blocks."""
    size = ["--tokens", "256", "-n", "3", "-w", "1"] if target.rehearsal else ["--tokens", "1024", "-n", "5", "-w", "1"]
    return ["--op", "push,pull", "--variants", "bulk,paged", "-b", "16", "-e", "256", "-f", "4", "-m", "llama-3-8b",
            *size]


def suite_rows(a, target: Target, out: str, until: float, fl: F.Floors | None = None) -> list[dict]:
    """The real suites on device pools through kvbench run, each case a row with kvbench run's columns: cuda_ipc
    against the device copy, staged against host tcp of the same sizes (launched after it, in this step)."""
    fl = fl or F.Floors()
    same = suite_args(target)
    args = ["-t", "cuda_ipc,staged", "-O", "staged.inner=tcp", "--memory", target.kind, "--copy", "kernel,batch,memcpy",
            *same, "--name", "gpucheck-suites"]
    df, fail = _run(a, args, os.path.join(out, "suites"), until, "suites", "kvbench run -t cuda_ipc,staged")
    tcp, rows, where = _tcp_floor(a, target, out, until, "suites", same)
    if fail:
        return fail + rows

    def floor_of(r):
        if r["transport"] == "staged":
            return tcp.get(_key(r), math.nan), F.HOST_TCP, F.STAGED
        return fl.device_copy, F.DEVICE_COPY, None

    got = case_rows("suites", _cases(df), floor_of, not target.rehearsal)
    if not [r for r in got if r["status"] != "skipped"]:
        got.append(row("suites", "kvbench run -t cuda_ipc,staged", status="FAIL", note="no case measured"))
    return got + rows + [row("suites", "results", note=f"{df.attrs['path']} ({df.attrs['seconds']:.0f} s){where}")]


def matmul_tflops(target: Target, repeats: int) -> tuple[float, str, str]:
    """(TFLOP/s of a plain torch matmul in the real prefill's dtype, its clock, what it was): the floor of the real
    prefill's rate, measured here."""
    import torch

    n, dev, dt = (1024, "cpu", torch.float32) if target.rehearsal else (8192, "cuda", torch.bfloat16)
    x = torch.randn(n, n, device=dev, dtype=dt)
    y = torch.randn(n, n, device=dev, dtype=dt)
    s, clock = timed(target, lambda: x @ y, repeats)
    return 2.0 * n ** 3 / s / 1e12, clock, f"{n}^3 {str(dt).removeprefix('torch.')}"


def prefill_rows(a, target: Target, out: str, until: float, fl: F.Floors | None = None) -> list[dict]:
    """Real prefill here (the model's layer matmuls, per-layer events in order) against a plain matmul, then
    streaming against serial with the kernel engine on two ranks through kvbench run: streaming's exposed time
    must be below serial's, every byte right, and it should expose at most two layers' compute."""
    from kvbench.harness import prefill as P  # the model needs pydantic: imported here, failing this step only
    from kvbench.model import shapes as M

    fl = fl or F.Floors()
    judged = not target.rehearsal
    if target.rehearsal:
        shape, tokens, dev, name = M.ModelShape("rehearsal", 8, 2, 64), 4096, "cpu", "8-layer toy"
        model, transport = TINY, ["-t", "staged", "-O", "inner=tcp", "--memory", "torch-cpu"]
        runs = ["-n", "5", "-w", "1", "--rounds", "1"]
    else:
        shape, tokens, dev, name = M.get_model("llama-3-8b"), 4096, "cuda:0", "llama-3-8b"
        model, transport = ["-m", "llama-3-8b"], ["-t", "cuda_ipc", "--memory", "cuda"]
        runs = ["-n", "10"]
    fl.matmul_tflops, clock, mm = matmul_tflops(target, a.repeats)
    rows = [row("prefill", f"plain torch matmul {mm}", clock=clock,
                note=f"{fl.matmul_tflops:.2f} TFLOP/s: the floor of the real prefill")]
    rp = P.RealPrefill(shape, tokens, shape.layers, dev, "bf16")
    took, ordered = [], True
    for _ in range(1 + a.repeats):  # the first one warms the matmul libraries up
        rp.start()
        rp.wait_all()
        ordered &= all(x < y for x, y in zip(rp.times, rp.times[1:]))
        took.append(rp.measured_s)
    s = float(np.median(took[1:]))
    tflops = P.layer_flops(shape, tokens) * shape.layers / s / 1e12
    r = row("prefill", f"real {name} {tokens} tok, {shape.layers} events", status="ok" if ordered else "FAIL",
            note=f"{s * 1e3:.1f} ms, {tflops:.2f} TFLOP/s achieved; per-layer events "
            f"{'in order' if ordered else 'OUT OF ORDER'}", clock=HOST if target.rehearsal else HOST_AFTER_SYNC)
    r["ratio"], r["floor"] = F.ratio(tflops, fl.matmul_tflops), F.MATMUL
    rows.append(r)
    what = "real prefill: exposed streaming/serial"
    args = [*transport, "--copy", "kernel", "--prefill", "real", "--overlap", "serial,streaming", "--op", "push",
            *model, "--tokens", str(tokens), "--variants", "paged", *runs, "--name", "gpucheck-prefill"]
    try:
        df, fail = _run(a, args, os.path.join(out, "prefill"), until, "prefill", what)
    except Exception as exc:
        return rows + [row("prefill", what, status="FAIL", note=one_line(exc))]
    if fail:
        return rows + fail
    ok = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    dec = ok[ok["role"] == "decode"]
    exp = dec.groupby("overlap")["exposed_s"].median()
    pre = dec[dec["overlap"] == "streaming"]["prefill_s"].median()
    wrong = int(df[df["iter"] == -1]["nwrong"].fillna(0).sum())
    good = wrong == 0 and exp.get("streaming", np.inf) < exp.get("serial", 0)
    goal, _ = F.exposed_note(exp.get("streaming", np.nan), pre, shape.layers, judged)
    rows.append(row("prefill", what, status="ok" if good else "FAIL", clock=RUN,
                    note=f"{exp.get('streaming', np.nan) * 1e3:.2f} / {exp.get('serial', np.nan) * 1e3:.2f} ms, "
                    f"copy kernel; #wrong {wrong}; {goal}" + (" (cpu rehearsal: staged on torch-cpu)" if
                                                             target.rehearsal else "")))
    return rows
