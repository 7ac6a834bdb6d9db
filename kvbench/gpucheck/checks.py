"""gpu-check's measurements (CUDA only; none of this has run on these machines, docs/gpu.md says so).

Each returns table rows (dict: check, what, gbps, status, note).  Every copy is verified on the device against
the fill pattern; a wrong byte makes the row FAIL.  Times are medians of ``repeats`` runs, CUDA events around
stream work.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from kvbench.memory import copy as C

from ..memory import device as D


def _row(check, what, gbps=float("nan"), status="ok", note=""):
    return {"check": check, "what": what, "gbps": float(gbps), "status": status, "note": note}


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` between CUDA events (one warm-up first)."""
    import torch

    fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return float(np.median(out))


def _blocks(a, half: int, seed=1) -> np.ndarray:
    bb = a.block_kib << 10
    nb = half // bb
    rng = np.random.default_rng(seed)
    s, d = rng.choice(nb, a.blocks, replace=False), rng.choice(nb, a.blocks, replace=False)
    return np.ascontiguousarray(np.stack([s * bb, half + d * bb, np.full(a.blocks, bb)], 1).astype(np.int64))


def _wrong(t, descs, rank=0) -> int:
    """Destination ranges (DST) that differ from the source's pattern at SRC (epoch 0: the fill)."""
    copy, where = D.snapshot(t, [descs])
    return D.count_wrong(copy, where, rank, 1, 0)


def pool_rows(a, pool) -> list[dict]:
    t = pool.tensor
    s = _time(lambda: D.fill(t, 0), a.repeats)
    rows = [_row("pool", f"fill {pool.nbytes >> 20} MiB on {t.device}", pool.nbytes / s / 1e9)]
    same = _blocks(a, pool.nbytes // 2)
    same[:, 1] = same[:, 0]  # the source ranges against themselves: the fill must verify
    sz = int(same[:, 2].sum())
    s = _time(lambda: _wrong(t, same), a.repeats)
    bad = _wrong(t, same)
    t[int(same[0, 0])] ^= 0x5A  # one flipped byte must be found
    caught = _wrong(t, same)
    D.fill(t, 0)
    ok = bad == 0 and caught == 1
    rows.append(_row("pool", f"verify {sz >> 20} MiB of blocks", sz / s / 1e9, "ok" if ok else "FAIL",
                     f"wrong {bad}, after one flipped byte {caught}"))
    return rows


def copy_rows(a, pool) -> list[dict]:
    t = pool.tensor
    half = pool.nbytes // 2
    descs = _blocks(a, half)
    sz = int(descs[:, 2].sum())
    s = _time(lambda: t[half : 2 * half].copy_(t[:half]), a.repeats)
    rows = [_row("copy", f"device copy_ of {half >> 20} MiB (reference)", half / s / 1e9)]
    for eng in C.ENGINES:
        why = C.probe(eng, "cuda")
        if why:
            rows.append(_row("copy", f"{eng}: {a.blocks} x {a.block_kib} KiB", status="skipped", note=why))
            continue
        D.fill(t, 0)
        try:
            s = _time(lambda e=eng: C.copy(e, t, t, descs), a.repeats)
        except Exception as exc:
            rows.append(_row("copy", f"{eng}: {a.blocks} x {a.block_kib} KiB", status="FAIL", note=str(exc)[:80]))
            continue
        wrong = _wrong(t, descs)
        rows.append(_row("copy", f"{eng}: {a.blocks} x {a.block_kib} KiB", sz / s / 1e9,
                         "ok" if wrong == 0 else "FAIL", f"wrong {wrong}"))
    return rows


def hostdev_rows(a, pool) -> list[dict]:
    import torch

    n = min(pool.nbytes, 256 << 20)
    dev = pool.tensor[:n]
    rows = []
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        host.fill_(7)
        s = _time(lambda h=host: dev.copy_(h, non_blocking=True), a.repeats)
        rows.append(_row("host<->dev", f"H2D {kind} {n >> 20} MiB", n / s / 1e9))
        s = _time(lambda h=host: h.copy_(dev, non_blocking=True), a.repeats)
        rows.append(_row("host<->dev", f"D2H {kind} {n >> 20} MiB", n / s / 1e9))
    return rows


def _ipc_source(q_out, q_in, nbytes):
    """Rank 0 of the IPC check: a filled pool, exported once; alive until the reader is done."""
    pool = D.alloc(nbytes, "cuda")
    D.fill(pool.tensor, 0)
    D.sync(pool)
    q_out.put(pool.tensor.untyped_storage()._share_cuda_())
    q_in.get()


def _ipc_reader(q_in, q_out, nbytes, a, dev):
    """Rank 1 (on GPU ``dev``): opens rank 0's pool once and pulls a layer of blocks from it with each engine."""
    import torch

    try:
        torch.cuda.set_device(dev)
        if dev:
            try:  # the kernel engine reads GPU 0's memory from GPU 1: peer access (cupy, when present)
                import cupy

                cupy.cuda.runtime.deviceEnablePeerAccess(0)
            except Exception:
                pass
        share = q_in.get()
        storage = torch.UntypedStorage._new_shared_cuda(*share)
        there = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))
        mine = D.alloc(nbytes, "cuda")
        descs = _blocks(a, nbytes // 2)
        descs[:, 1] -= nbytes // 2  # into the lower half of this rank's pool
        sz = int(descs[:, 2].sum())
        rows = []
        for eng in C.ENGINES:
            why = C.probe(eng, "cuda")
            if why:
                rows.append(_row("cuda_ipc", f"pull {eng}", status="skipped", note=why))
                continue
            s = _time(lambda e=eng: C.copy(e, mine.tensor, there, descs), a.repeats)
            wrong = _wrong(mine.tensor, descs)
            rows.append(_row("cuda_ipc", f"pull {eng}: {a.blocks} x {a.block_kib} KiB", sz / s / 1e9,
                             "ok" if wrong == 0 else "FAIL", f"wrong {wrong}; 2 processes, one handle"))
        q_out.put(rows)
    except Exception as exc:
        q_out.put([_row("cuda_ipc", "pull between 2 processes", status="FAIL", note=f"{type(exc).__name__}: {exc}")])


def ipc_rows(a) -> list[dict]:
    """cuda_ipc between two processes started here (on one GPU when there is one, else GPUs 0 and 1)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    to_reader, to_source, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    nbytes = min(a.pool_mib, 512) << 20
    src = ctx.Process(target=_ipc_source, args=(to_reader, to_source, nbytes))
    src.start()
    rd = ctx.Process(target=_ipc_reader, args=(to_reader, results, nbytes, a, 1 if _count() > 1 else 0))
    rd.start()
    try:
        rows = results.get(timeout=240)
    except Exception:
        rows = [_row("cuda_ipc", "pull between 2 processes", status="FAIL", note="no answer within 240 s")]
    to_source.put("done")
    for p in (rd, src):
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return rows


def _count() -> int:
    import torch

    return torch.cuda.device_count()


def harness_rows(a) -> list[dict]:
    """cuda_ipc and staged through kvbench run on 2 ranks, where an MPI launcher exists."""
    mpirun = a.mpirun or shutil.which("mpiexec") or shutil.which("mpirun")
    if not mpirun:
        return [_row("harness", "kvbench run -t cuda_ipc,staged", status="skipped",
                     note="no MPI launcher (mpiexec/mpirun) on PATH")]
    out = os.path.join(a.results, "gpucheck-runs")
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-t", "cuda_ipc,staged", "--memory", "cuda",
           "--copy", "memcpy,kernel,batch", "--op", "push,pull", "--tokens", "4096", "-n", "10",
           "--variants", "bulk,paged", "-o", out, "--name", "gpucheck"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode not in (0, 2):
        return [_row("harness", "kvbench run -t cuda_ipc,staged", status="FAIL",
                     note=(p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:100])]
    import pandas as pd

    path = max(glob.glob(os.path.join(out, "*", "*.parquet")), key=os.path.getmtime)
    df = pd.read_parquet(path)
    ok = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    wrong = df[df["iter"] == -1].groupby(["transport", "copy", "op", "variant"])["nwrong"].sum()
    t = ok.groupby(["transport", "copy", "op", "variant", "iter"])["seconds"].max().groupby(
        ["transport", "copy", "op", "variant"]).median()
    pay = ok.groupby(["transport", "copy", "op", "variant"])["payload_bytes"].first()
    rows = []
    for key, sec in t.items():
        w = int(wrong.get(key, 0))
        rows.append(_row("harness", f"{key[0]} {key[2]} {key[3]} copy={key[1]}", pay[key] / sec / 1e9,
                         "ok" if w == 0 else "FAIL", f"#wrong {w}"))
    for _, r in df[df["status"] == "skipped"].drop_duplicates(["transport", "copy"]).iterrows():
        rows.append(_row("harness", f"{r['transport']} copy={r['copy']}", status="skipped", note=r["reason"][:80]))
    rows.append(_row("harness", "results", note=f"{path} ({time.time() - t0:.0f} s)"))
    return rows


def run_all(a) -> list[dict]:
    import torch

    pool = D.alloc(a.pool_mib << 20, "cuda")
    D.fill(pool.tensor, 0)
    torch.cuda.synchronize()
    rows = [_row("device", torch.cuda.get_device_name(0), note=f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                 f"{torch.cuda.device_count()} GPU(s)")]
    steps = [("pool", lambda: pool_rows(a, pool)), ("copy", lambda: copy_rows(a, pool)),
             ("hostdev", lambda: hostdev_rows(a, pool))]
    for name, fn in steps:
        if name in a.only:
            try:
                rows += fn()
            except Exception as exc:  # one failed check is a row, the others still run
                rows.append(_row(name, "error", status="FAIL", note=f"{type(exc).__name__}: {exc}"[:100]))
    pool.release()
    torch.cuda.empty_cache()
    if "ipc" in a.only:
        rows += ipc_rows(a)
    if "harness" in a.only:
        rows += harness_rows(a)
    if "prefill" in a.only:
        rows += prefill_rows(a)
    return rows


def prefill_rows(a) -> list[dict]:
    """Real prefill on the GPU: llama-3-8b's layer matmuls for 4096 tokens (events per layer, prefill.py), then,
    where an MPI launcher exists, streaming against serial through kvbench run (exposed time vs the model)."""
    from kvbench.harness import prefill as P
    from kvbench.model import shapes as M

    shape, tokens = M.get_model("llama-3-8b"), 4096
    rows = []
    try:
        rp = P.RealPrefill(shape, tokens, shape.layers, "cuda:0", "bf16")
        took = []
        for _ in range(1 + a.repeats):  # the first one warms cuBLAS up
            rp.start()
            rp.wait_all()
            ordered = all(x < y for x, y in zip(rp.times, rp.times[1:]))
            took.append(rp.measured_s)
        s = float(np.median(took[1:]))
        tflops = P.layer_flops(shape, tokens) * shape.layers / s / 1e12
        rows.append(_row("prefill", f"real llama-3-8b {tokens} tok, {shape.layers} events", status="ok" if ordered
                         else "FAIL", note=f"{s * 1e3:.1f} ms, {tflops:.0f} TFLOP/s achieved; per-layer events "
                         f"{'in order' if ordered else 'OUT OF ORDER'}"))
    except Exception as exc:
        return [_row("prefill", "real prefill", status="FAIL", note=f"{type(exc).__name__}: {exc}"[:100])]
    mpirun = a.mpirun or shutil.which("mpiexec") or shutil.which("mpirun")
    if not mpirun:
        return rows + [_row("prefill", "real prefill streaming (kvbench run)", status="skipped",
                            note="no MPI launcher (mpiexec/mpirun) on PATH")]
    out = os.path.join(a.results, "gpucheck-runs")
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "kvbench", "run", "-t", "cuda_ipc", "--memory", "cuda",
           "--prefill", "real", "--overlap", "serial,streaming", "--op", "push", "-m", "llama-3-8b", "--tokens",
           str(tokens), "-n", "10", "--variants", "bulk,paged", "-o", out, "--name", "gpucheck-prefill"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode not in (0, 2):
        return rows + [_row("prefill", "real prefill streaming (kvbench run)", status="FAIL",
                            note=(p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:100])]
    import pandas as pd

    path = max(glob.glob(os.path.join(out, "*", "*.parquet")), key=os.path.getmtime)
    df = pd.read_parquet(path)
    ok = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    bulk = ok[ok["variant"] == "bulk"].groupby("iter")["seconds"].max().median()
    dec = ok[(ok["variant"] == "paged") & (ok["role"] == "decode")]
    exp = dec.groupby("overlap")["exposed_s"].median()
    wrong = int(df[df["iter"] == -1]["nwrong"].fillna(0).sum())
    model = bulk / shape.layers  # streaming: the last layer's share when the prefill outlasts the transfer
    good = wrong == 0 and exp.get("streaming", np.inf) < exp.get("serial", 0)
    rows.append(_row("prefill", "real prefill: exposed streaming/serial", status="ok" if good else "FAIL",
                     note=f"{exp.get('streaming', np.nan) * 1e3:.2f} / {exp.get('serial', np.nan) * 1e3:.2f} ms "
                     f"(model T/L {model * 1e3:.2f} ms, T {bulk * 1e3:.2f}); #wrong {wrong}"))
    return rows
