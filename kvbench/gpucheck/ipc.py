"""gpu-check's cuda_ipc step: two processes it starts itself, one pool exported once, pulled with each engine.

The source fills a pool and exports it once (a CUDA IPC handle; on the CPU rehearsal a shared file mapping
stands in for it); the reader opens it and pulls a layer of blocks with each copy engine, its destination
poisoned again before each engine so that an engine that copies nothing fails.  The copies run on the reader's
GPU, on its copy stream, and are timed by events on that stream and checked after it is synchronised
(checks.measure_copy); on the rehearsal, the host clock.  Each engine's row comes back as it ends, and one
engine's failure is that engine's row only; the parent gives each row its share of the device copy.  Both
processes are killed whole when the step's time is up.
"""
from __future__ import annotations

import os
import queue
import tempfile
import time
import uuid

from kvbench.job.launch import kill_tree
from kvbench.memory import copy as C
from kvbench.memory import device as D

from . import floors as F
from .checks import Target, blocks, measure_copy
from .runner import one_line, row

DONE = "done"


def _shared_file(nbytes: int) -> str:
    """A file for the rehearsal's shared mapping: /dev/shm when it has room, else the temporary folder."""
    folder = "/dev/shm"
    try:
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < 2 * nbytes:
            folder = tempfile.gettempdir()
    except OSError:
        folder = tempfile.gettempdir()
    return os.path.join(folder, f"kvbench-gpucheck-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _source(to_reader, from_reader, nbytes: int, device: str, path: str):
    """Rank 0: a filled pool, exported once; alive until the reader is done."""
    import torch

    if device == "cuda":
        pool = D.alloc(nbytes, "cuda", device=0)
        t = pool.tensor
        D.fill(t, 0)
        D.sync(pool)
        to_reader.put(t.untyped_storage()._share_cuda_())
    else:
        with open(path, "wb") as fh:
            fh.truncate(nbytes)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        D.fill(t, 0)
        to_reader.put(path)
    from_reader.get()


def _open(share, nbytes: int, device: str):
    import torch

    if device == "cuda":
        storage = torch.UntypedStorage._new_shared_cuda(*share)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))
    return torch.from_file(share, shared=True, size=nbytes, dtype=torch.uint8)


def _reader(from_source, out, nbytes: int, a, device: str, gpu: int):
    """Rank 1 (on GPU ``gpu``): opens rank 0's pool once and pulls a layer of blocks from it with each engine,
    one row per engine put on ``out`` as it ends, then DONE."""
    import torch

    target = Target(device)
    try:
        if device == "cuda":
            torch.cuda.set_device(gpu)
            if gpu:
                try:  # the kernel engine reads GPU 0's memory from GPU 1: peer access (cupy, when present)
                    import cupy

                    cupy.cuda.runtime.deviceEnablePeerAccess(0)
                except Exception:
                    pass
        there = _open(from_source.get(), nbytes, device)
        mine = D.alloc(nbytes, target.kind)
        descs = blocks(a, nbytes // 2)
        descs[:, 1] -= nbytes // 2  # into the lower half of this rank's pool
        sz = int(descs[:, 2].sum())
    except Exception as exc:
        out.put(row("cuda_ipc", "open the peer's pool", status="FAIL", note=one_line(exc)))
        out.put(DONE)
        return
    how = "cpu rehearsal: a shared file mapping stands in for the IPC handle; " if target.rehearsal else ""
    for eng in C.ENGINES:
        what = f"pull {eng}: {a.blocks} x {a.block_kib} KiB"
        why = C.probe(eng, device)
        if why:
            out.put(row("cuda_ipc", what, status="skipped", note=why))
            continue
        try:
            # again for each engine (measure_copy poisons first): the last one's bytes must not pass
            got = measure_copy(eng, mine.tensor, mine.tensor, there, descs, a.repeats, dev=gpu)
            out.put(row("cuda_ipc", what, sz / got.seconds / 1e9, "ok" if got.wrong == 0 else "FAIL",
                        f"{how}wrong {got.wrong}; 2 processes, one handle", got.clock))
        except Exception as exc:  # this engine's row; the next engine still runs
            out.put(row("cuda_ipc", what, status="FAIL", note=one_line(exc, 100)))
    out.put(DONE)


def ipc_rows(a, target: Target, timeout: float, fl: F.Floors | None = None) -> list[dict]:
    """cuda_ipc between two processes started here (on one GPU when there is one, else GPUs 0 and 1); what came
    back within ``timeout`` s, each rate against the device copy, then a FAIL row if the reader did not finish."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    to_reader, to_source, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    nbytes = min(a.pool_mib, 512) << 20
    path = _shared_file(nbytes) if target.rehearsal else ""
    gpu = 0
    if not target.rehearsal:
        import torch

        gpu = 1 if torch.cuda.device_count() > 1 else 0
    procs = [ctx.Process(target=_source, args=(to_reader, to_source, nbytes, target.device, path)),
             ctx.Process(target=_reader, args=(to_reader, results, nbytes, a, target.device, gpu))]
    rows: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while True:
            left = deadline - time.monotonic()
            try:
                got = results.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                if left <= 0 or not procs[1].is_alive():
                    why = f"no answer within {timeout:.0f} s" if left <= 0 else \
                        f"the reader died (exit {procs[1].exitcode})"
                    rows.append(row("cuda_ipc", "pull between 2 processes", status="FAIL", note=why))
                    break
                continue
            if got == DONE:
                break
            rows.append(F.rate(got, fl.device_copy, F.DEVICE_COPY) if fl is not None else got)
        to_source.put(DONE)
        for p in procs:
            p.join(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
    finally:
        for p in procs:  # still running (a hang, or the step's budget): killed with whatever they started
            if p.pid is not None and p.is_alive():
                kill_tree(p.pid)
                p.join(timeout=5)
        if path and os.path.exists(path):
            os.unlink(path)
    return rows
