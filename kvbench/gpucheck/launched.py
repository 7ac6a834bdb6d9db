"""gpu-check's two-rank steps through ``kvbench run`` under an MPI launcher: staged over tcp, and real-prefill
streaming against serial (exposed time against the model), plus the real prefill's own rate in this process.

Each launch is bounded (job/launch.py: past its time the launcher and its ranks are killed whole, and the row
says so).  pandas and the model (which needs pydantic) are imported inside the step that needs them: a
missing package fails that step only.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
import time

import numpy as np

from kvbench.job.launch import launch

from .checks import Target
from .runner import one_line, row

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


def staged_rows(a, target: Target, out: str, until: float) -> list[dict]:
    """staged (device -> bounce -> tcp -> bounce -> device) between two ranks, each engine, push and pull."""
    mem = target.kind
    size = ["-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1"] if target.rehearsal else \
        ["-m", "llama-3-8b", "--tokens", "4096", "-n", "5"]
    args = ["-t", "staged", "-O", "inner=tcp", "--memory", mem, "--copy", "memcpy,kernel,batch", "--op", "push,pull",
            "--variants", "bulk,paged", *size, "--name", "gpucheck-staged"]
    df, fail = _run(a, args, os.path.join(out, "staged"), until, "staged", "kvbench run -t staged (tcp)")
    if fail:
        return fail
    ok = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    keys = ["transport", "copy", "op", "variant"]
    wrong = df[df["iter"] == -1].groupby(keys)["nwrong"].sum()
    t = ok.groupby([*keys, "iter"])["seconds"].max().groupby(keys).median()
    pay = ok.groupby(keys)["payload_bytes"].first()
    note = " (cpu rehearsal: torch-cpu pools)" if target.rehearsal else ""
    rows = []
    for key, sec in t.items():
        w = int(wrong.get(key, 0))
        rows.append(row("staged", f"{key[2]} {key[3]} copy={key[1]}", pay[key] / sec / 1e9,
                        "ok" if w == 0 else "FAIL", f"#wrong {w}{note}"))
    for _, r in df[df["status"] == "skipped"].drop_duplicates(["transport", "copy"]).iterrows():
        rows.append(row("staged", f"copy={r['copy']}", status="skipped", note=str(r["reason"])[:100]))
    if not rows:
        rows.append(row("staged", "kvbench run -t staged (tcp)", status="FAIL", note="no row measured"))
    rows.append(row("staged", "results", note=f"{df.attrs['path']} ({df.attrs['seconds']:.0f} s)"))
    return rows


def prefill_rows(a, target: Target, out: str, until: float) -> list[dict]:
    """Real prefill here (the model's layer matmuls, per-layer events in order), then streaming against serial
    on two ranks through kvbench run: streaming's exposed time must be below serial's, every byte right."""
    from kvbench.harness import prefill as P  # the model needs pydantic: imported here, failing this step only
    from kvbench.model import shapes as M

    if target.rehearsal:
        shape, tokens, dev, name = M.ModelShape("rehearsal", 8, 2, 64), 4096, "cpu", "8-layer toy"
        model, transport = TINY, ["-t", "staged", "-O", "inner=tcp", "--memory", "torch-cpu"]
        runs = ["-n", "5", "-w", "1", "--rounds", "1"]
    else:
        shape, tokens, dev, name = M.get_model("llama-3-8b"), 4096, "cuda:0", "llama-3-8b"
        model, transport = ["-m", "llama-3-8b"], ["-t", "cuda_ipc", "--memory", "cuda"]
        runs = ["-n", "10"]
    rows = []
    rp = P.RealPrefill(shape, tokens, shape.layers, dev, "bf16")
    took, ordered = [], True
    for _ in range(1 + a.repeats):  # the first one warms the matmul libraries up
        rp.start()
        rp.wait_all()
        ordered &= all(x < y for x, y in zip(rp.times, rp.times[1:]))
        took.append(rp.measured_s)
    s = float(np.median(took[1:]))
    tflops = P.layer_flops(shape, tokens) * shape.layers / s / 1e12
    rows.append(row("prefill", f"real {name} {tokens} tok, {shape.layers} events", status="ok" if ordered else "FAIL",
                    note=f"{s * 1e3:.1f} ms, {tflops:.2f} TFLOP/s achieved; per-layer events "
                    f"{'in order' if ordered else 'OUT OF ORDER'}"))
    what = "real prefill: exposed streaming/serial"
    args = [*transport, "--prefill", "real", "--overlap", "serial,streaming", "--op", "push", *model, "--tokens",
            str(tokens), "--variants", "paged", *runs, "--name", "gpucheck-prefill"]
    try:
        df, fail = _run(a, args, os.path.join(out, "prefill"), until, "prefill", what)
    except Exception as exc:
        return rows + [row("prefill", what, status="FAIL", note=one_line(exc))]
    if fail:
        return rows + fail
    ok = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    dec = ok[ok["role"] == "decode"]
    exp = dec.groupby("overlap")["exposed_s"].median()
    wrong = int(df[df["iter"] == -1]["nwrong"].fillna(0).sum())
    good = wrong == 0 and exp.get("streaming", np.inf) < exp.get("serial", 0)
    rows.append(row("prefill", what, status="ok" if good else "FAIL",
                    note=f"{exp.get('streaming', np.nan) * 1e3:.2f} / {exp.get('serial', np.nan) * 1e3:.2f} ms "
                    f"(model: serial/L = {exp.get('serial', np.nan) / shape.layers * 1e3:.2f}); #wrong {wrong}" + (" (cpu rehearsal: staged on torch-cpu)" if target.rehearsal else "")))
    return rows
