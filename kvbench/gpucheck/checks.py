"""gpu-check's one-process steps: the pool's fill and check, the three copy engines against the device's own
copy, and host<->device copies, on a GPU or (the rehearsal) on torch-cpu pools.

Each returns table rows (runner.row).  Every copy is verified where the pool lives against the fill pattern,
its destination poisoned first, so an engine that copies nothing fails.  Times are medians of ``repeats``
runs: CUDA events around stream work on a GPU (on a stream of its own: the batched copy refuses the legacy
default stream), the wall clock on the CPU.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass

import numpy as np

from kvbench.memory import copy as C
from kvbench.memory import device as D

from .runner import faults, one_line, row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_DRIVER = os.path.join(ROOT, "tests", "fakes", "cuda_driver.py")


@dataclass
class Target:
    """Where the check runs: ``cuda`` (a GPU) or ``cpu`` (the rehearsal, torch-cpu pools)."""

    device: str
    fake: str = ""  # on the rehearsal: what became of the fake CUDA driver
    driver: object = None  # that fake's module, where it installed

    @property
    def rehearsal(self) -> bool:
        return self.device != "cuda"

    @property
    def kind(self) -> str:
        return "torch-cpu" if self.rehearsal else "cuda"

    def skip(self, check: str, what: str, why: str) -> dict:
        return row(check, what, status="SKIP", note=f"(cpu rehearsal: {why})")


def install_fake_driver(target: Target) -> None:
    """The rehearsal's stand-in for the CUDA driver (tests/fakes/cuda_driver.py, install()), where the checkout
    has it: ``target.driver`` is its module, ``target.fake`` says what happened, in words."""
    if not os.path.exists(FAKE_DRIVER):
        target.fake = "no fake CUDA driver in this checkout: CUDA-only steps skip"
        return
    try:
        spec = importlib.util.spec_from_file_location("kvbench_fake_cuda_driver", FAKE_DRIVER)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.install()
    except Exception as exc:  # the rehearsal goes on without it, saying so
        target.fake = f"fake CUDA driver did not install ({one_line(exc, 80)})"
        return
    target.driver, target.fake = mod, "fake CUDA driver installed (tests/fakes/cuda_driver.py)"


def stream(target: Target):
    """A context in which torch's current stream is one of its own (a GPU), or nothing (the CPU)."""
    if target.rehearsal:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream())


def timed(target: Target, fn, repeats: int) -> float:
    """Median seconds of ``fn`` (one warm-up first): CUDA events on the current stream, or the wall clock."""
    import torch

    fn()
    out = []
    for _ in range(repeats):
        if target.rehearsal:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return float(np.median(out))


def blocks(a, half: int, seed=1) -> np.ndarray:
    """``a.blocks`` random blocks of ``a.block_kib`` from the lower half to the upper half, (n, 3) int64."""
    bb = a.block_kib << 10
    nb = half // bb
    rng = np.random.default_rng(seed)
    s, d = rng.choice(nb, a.blocks, replace=False), rng.choice(nb, a.blocks, replace=False)
    return np.ascontiguousarray(np.stack([s * bb, half + d * bb, np.full(a.blocks, bb)], 1).astype(np.int64))


def wrong(t, descs, rank=0) -> int:
    """Destination ranges (DST) that differ from the source's pattern at SRC (epoch 0: the fill)."""
    snap, where = D.snapshot(t, [descs])
    return D.count_wrong(snap, where, rank, 1, 0)


def engine_copy(eng: str, dst, src, descs) -> None:
    """copy.copy with ``eng``, or nothing at all where a test made that engine a no-op (its rows must FAIL)."""
    if eng not in faults().get("noop", ()):
        C.copy(eng, dst, src, descs)


def sync(target: Target) -> None:
    if not target.rehearsal:
        import torch

        torch.cuda.current_stream().synchronize()


def device_row(target: Target) -> dict:
    import torch

    if target.rehearsal:
        return row("device", "cpu rehearsal (torch-cpu pools)", note=f"torch {torch.__version__}; {target.fake}")
    return row("device", torch.cuda.get_device_name(0), note=f"torch {torch.__version__}, CUDA {torch.version.cuda}"
               f", {torch.cuda.device_count()} GPU(s)")


def pool_rows(a, target: Target) -> list[dict]:
    pool = D.alloc(a.pool_mib << 20, target.kind)
    try:
        t = pool.tensor
        with stream(target):
            s = timed(target, lambda: D.fill(t, 0), a.repeats)
            rows = [row("pool", f"fill {pool.nbytes >> 20} MiB on {t.device}", pool.nbytes / s / 1e9)]
            same = blocks(a, pool.nbytes // 2)
            same[:, 1] = same[:, 0]  # the source ranges against themselves: the fill must verify
            sz = int(same[:, 2].sum())
            s = timed(target, lambda: wrong(t, same), a.repeats)
            bad = wrong(t, same)
            t[int(same[0, 0])] ^= 0x5A  # one flipped byte must be found
            caught = wrong(t, same)
        ok = bad == 0 and caught == 1
        rows.append(row("pool", f"verify {sz >> 20} MiB of blocks", sz / s / 1e9, "ok" if ok else "FAIL",
                        f"wrong {bad}, after one flipped byte {caught}"))
        return rows
    finally:
        pool.release()


def copy_rows(a, target: Target) -> list[dict]:
    pool = D.alloc(a.pool_mib << 20, target.kind)
    try:
        t = pool.tensor
        half = pool.nbytes // 2
        descs = blocks(a, half)
        sz = int(descs[:, 2].sum())
        what = f"{a.blocks} x {a.block_kib} KiB"
        with stream(target):
            D.fill(t, 0)
            s = timed(target, lambda: t[half : 2 * half].copy_(t[:half]), a.repeats)
            rows = [row("copy", f"device copy_ of {half >> 20} MiB (reference)", half / s / 1e9)]
            for eng in C.ENGINES:
                why = C.probe(eng, target.device)
                if why:
                    rows.append(row("copy", f"{eng}: {what}", status="skipped", note=why))
                    continue
                try:
                    D.fill(t, 0)
                    D.poison(t, descs, 0, 0)  # what must land, complemented: a copy that moves nothing fails
                    sync(target)
                    engine_copy(eng, t, t, descs)  # once, checked; then timed
                    sync(target)
                    bad = wrong(t, descs)
                    s = timed(target, lambda e=eng: engine_copy(e, t, t, descs), a.repeats)
                except Exception as exc:  # one engine's failure is its own row
                    rows.append(row("copy", f"{eng}: {what}", status="FAIL", note=one_line(exc, 100)))
                    continue
                rows.append(row("copy", f"{eng}: {what}", sz / s / 1e9, "ok" if bad == 0 else "FAIL", f"wrong {bad}"
                                + (" (host path of torch-cpu)" if target.rehearsal else "")))
            if target.rehearsal:
                rows += fake_rows(target, t, descs, what)
        return rows
    finally:
        pool.release()


def fake_rows(target: Target, t, descs, what: str) -> list[dict]:
    """The rehearsal: each engine's CUDA path on the torch-cpu pool seen as device memory through the fake driver
    (its bytes really move, so they are checked; a fake has no rate), or a SKIP row saying why not."""
    rows = []
    for eng in C.ENGINES:
        label = f"{eng} CUDA path: {what}"
        make = getattr(target.driver, "cuda_tensor", None)
        why = "no fake CUDA driver with cuda_tensor()" if make is None else C.probe(eng, "cuda")
        if eng == "kernel" and not why:  # a GPU kernel (cupy, or torch's CUDA indexing): no driver call to fake
            why = "the kernel engine runs GPU code, which no fake driver stands in for"
        if why:
            rows.append(target.skip("copy", label, why))
            continue
        try:
            D.fill(t, 0)
            D.poison(t, descs, 0, 0)
            ct = make(t)
            engine_copy(eng, ct, ct, descs)
            C.sync(ct)
            bad = wrong(t, descs)
        except Exception as exc:
            rows.append(row("copy", label, status="FAIL", note=one_line(exc, 100)))
            continue
        rows.append(row("copy", label, status="ok" if bad == 0 else "FAIL",
                        note=f"wrong {bad} (cpu rehearsal: through the fake CUDA driver; bytes checked, no rate)"))
    return rows


def one_way(target: Target, label: str, src, dst, repeats: int, note: str) -> dict:
    """The host<->dev row of copying ``src`` into ``dst`` (uint8 tensors of one size): its rate, and ok when the
    7s of ``src`` landed in ``dst``."""
    s = timed(target, lambda: dst.copy_(src, non_blocking=True), repeats)
    sync(target)
    ok = bool((dst[:: 1 << 20] == 7).all())
    return row("host<->dev", label, dst.numel() / s / 1e9, "ok" if ok else "FAIL", note)


def hostdev_rows(a, target: Target) -> list[dict]:
    import torch

    n = min(a.pool_mib << 20, 256 << 20)
    pool = D.alloc(n, target.kind)
    try:
        dev, rows = pool.tensor, []
        for kind in ("pinned", "pageable"):
            if kind == "pinned" and target.rehearsal:
                for d in ("H2D", "D2H"):
                    rows.append(target.skip("host<->dev", f"{d} pinned {n >> 20} MiB",
                                            "page-locked memory needs a CUDA device"))
                continue
            host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
            host.fill_(7)
            note = "host to host on the CPU" if target.rehearsal else ""
            with stream(target):
                rows.append(one_way(target, f"H2D {kind} {n >> 20} MiB", host, dev, a.repeats, note))
                host.fill_(0)  # D2H must bring the 7s back
                rows.append(one_way(target, f"D2H {kind} {n >> 20} MiB", dev, host, a.repeats, note))
        return rows
    finally:
        pool.release()
