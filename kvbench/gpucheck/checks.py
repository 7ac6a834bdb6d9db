"""gpu-check's one-process steps: the reference (the device's own copy, its PCIe link), the pool's fill and check,
the copy engines, and host<->device copies, on a GPU or (the rehearsal) on torch-cpu pools.

Device time is the time of the stream that carries the work.  The copy engines queue on the driver door's copy
stream (copy.copy), so their rows are timed by two events recorded on that stream (copy.Timer); torch's own ops
(the reference ``copy_``, the fill, host<->device ``copy_``) run on torch's current stream, the default one, and
are timed by torch events there; the check is timed by the host clock after the streams it reads behind are
waited for.  No step moves torch to a stream of its own: the copy stream (blocking) is ordered with its default one.
Every check reads after the copy stream is synchronised (copy.sync), in place
(device.count_now), its destination poisoned first, so an engine that copies nothing fails.  Each row names its
clock; times are medians of ``repeats`` samples.  On the CPU rehearsal host work is done when its call returns
(the host clock); the engines' CUDA paths run through the fake driver, where the timer must read the fake's model
of the copies it brackets and a read before the sync must see the poison (no rate: a fake has none)."""
from __future__ import annotations

import importlib.util
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from kvbench.memory import copy as C
from kvbench.memory import device as D

from . import floors as F
from .runner import COPY_EVENTS, FAKE_EVENTS, HOST, HOST_AFTER_SYNC, TORCH_EVENTS, faults, one_line, row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_DRIVER = os.path.join(ROOT, "tests", "fakes", "cuda_driver.py")


@dataclass
class Target:
    """Where the check runs: ``cuda`` (a GPU) or ``cpu`` (the rehearsal, torch-cpu pools)."""

    device: str
    fake: str = ""  # on the rehearsal: what became of the fake CUDA driver
    driver: object = None  # that fake's module, where it installed
    api: object = None  # the fake driver it installed (its clock and model), where install() returned one

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
    has it: ``target.driver`` is its module, ``target.api`` the driver it installed, ``target.fake`` says what
    happened, in words."""
    if not os.path.exists(FAKE_DRIVER):
        target.fake = "no fake CUDA driver in this checkout: CUDA-only steps skip"
        return
    try:
        spec = importlib.util.spec_from_file_location("kvbench_fake_cuda_driver", FAKE_DRIVER)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        api = mod.install()
    except Exception as exc:  # the rehearsal goes on without it, saying so
        target.fake = f"fake CUDA driver did not install ({one_line(exc, 80)})"
        return
    target.driver, target.api, target.fake = mod, api, "fake CUDA driver installed (tests/fakes/cuda_driver.py)"


# ----- clocks -------------------------------------------------------------------------------------------------
def _on_device(buf) -> bool:
    return getattr(getattr(buf, "device", None), "type", "cpu") == "cuda"


def copy_seconds(fn, repeats: int, dev: int, stream=None) -> float:
    """Median device seconds of ``fn`` (engine copies) by copy.Timer's events on the copy stream (``stream``: a
    test's other stream).  Each sample follows an untimed ``fn()`` that keeps the stream busy while the host
    issues the timed one, so the events bracket the copies rather than the host's call; a copy that takes longer
    to issue than to run still shows that gap, as it would back to back.  The kernel engine without cupy copies
    with torch's ops on torch's default stream: the copy stream, a blocking stream, orders its events around
    those too."""
    timer = C.Timer(dev, stream=stream)
    try:
        out = []
        for _ in range(repeats):
            fn()
            timer.start()
            fn()
            out.append(timer.stop())
        return float(np.median(out))
    finally:
        timer.close()


def torch_seconds(fn, repeats: int) -> float:
    """Median device seconds of ``fn`` (torch ops) by torch events on torch's current stream, which carries them;
    each sample after an untimed ``fn()``, as copy_seconds."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        fn()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return float(np.median(out))


def host_seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on the host clock (one warm-up first): ``fn`` must end waiting for its work."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def timed(target: Target, fn, repeats: int) -> tuple[float, str]:
    """(median seconds of torch work ``fn``, the clock): torch events on a GPU, the host clock on the CPU."""
    if target.rehearsal:
        return host_seconds(fn, repeats), HOST
    return torch_seconds(fn, repeats), TORCH_EVENTS


def torch_sync(target: Target) -> None:
    """Wait for torch's current stream, the one that carries torch's own ops."""
    if not target.rehearsal:
        import torch

        torch.cuda.current_stream().synchronize()


# ----- copies and their check ----------------------------------------------------------------------------------
def blocks(a, half: int, seed=1) -> np.ndarray:
    """``a.blocks`` random blocks of ``a.block_kib`` from the lower half to the upper half, (n, 3) int64."""
    bb = a.block_kib << 10
    nb = half // bb
    rng = np.random.default_rng(seed)
    s, d = rng.choice(nb, a.blocks, replace=False), rng.choice(nb, a.blocks, replace=False)
    return np.ascontiguousarray(np.stack([s * bb, half + d * bb, np.full(a.blocks, bb)], 1).astype(np.int64))


def count(t, descs, rank=0) -> int:
    """Destination bytes (DST) of ``t`` that differ from the source's pattern at SRC (epoch 0: the fill), compared
    in place on torch's stream (the read of the count is its one wait): for bytes no copy engine wrote."""
    return int(D.count_now(t, descs, rank, 1, 0))


def wrong(t, descs, rank=0, buf=None) -> int:
    """count() after the copy stream of ``buf`` (the copies' destination as the engines saw it; default ``t``) is
    synchronised: before that the copies may not have landed."""
    C.sync(t if buf is None else buf)
    return count(t, descs, rank)


def engine_copy(eng: str, dst, src, descs, **kw) -> None:
    """copy.copy with ``eng``, or nothing at all where a test made that engine a no-op (its rows must FAIL)."""
    if eng not in faults().get("noop", ()):
        C.copy(eng, dst, src, descs, **kw)


@dataclass
class Copied:
    """One engine's checked copy and its time."""

    wrong: int  # destination bytes wrong, read after the copy stream's sync
    early: int | None  # the same read before that sync (the fake only: on a GPU it races the copy)
    seconds: float
    clock: str


def measure_copy(eng: str, t, dst, src, descs, repeats: int, dev: int = 0, early: bool = False,
                 timer_stream=None) -> Copied:
    """Poison ``descs``' destination in pool ``t``, copy once with ``eng`` and check it after the copy stream's
    sync, then time it: on the copy stream when ``dst`` is device memory (events there), else the host clock.
    ``dst``/``src`` are what the engine takes (``t`` itself, a peer's pool, or the fake's view of ``t``)."""
    D.poison(t, descs, 0, 0)  # what must land, complemented: a copy that moves nothing fails
    kw = {"device": dev} if _on_device(dst) else {}
    engine_copy(eng, dst, src, descs, **kw)
    before = int(D.count_now(t, descs, 0, 1, 0)) if early else None
    bad = wrong(t, descs, buf=dst)
    fn = lambda: engine_copy(eng, dst, src, descs, **kw)  # noqa: E731
    if _on_device(dst):
        s, clock = copy_seconds(fn, repeats, dev, timer_stream), COPY_EVENTS
        C.sync(dst)  # a timer on another stream (a test's) leaves the copies queued: none outlives the row
    else:
        s, clock = host_seconds(fn, repeats), HOST
    return Copied(bad, before, s, clock)


def modelled_seconds(api, eng: str, descs: np.ndarray) -> float:
    """What the fake driver's clock advances for one ``eng`` copy of ``descs``: its overhead per driver call (one
    cuMemcpyAsync per descriptor; one kernel launch or one batched call for the rest) plus the bytes at its rate."""
    calls = len(descs) if eng == "memcpy" else 1
    return calls * api.overhead + int(descs[:, 2].sum()) / api.rate


def fake_row(api, eng: str, t, ct, descs, label: str, timer_stream=None) -> dict:
    """An engine's CUDA path through the fake driver on pool ``t`` (``ct``: ``t`` seen as device memory): ok when
    the bytes land, a read before the copy stream's sync still sees the poison, and the timer reads exactly the
    fake's model of the copies it brackets (0 s when its events are on another stream than the copies')."""
    D.fill(t, 0)
    got = measure_copy(eng, t, ct, ct, descs, 1, early=True, timer_stream=timer_stream)
    expect = modelled_seconds(api, eng, descs)
    sz = int(descs[:, 2].sum())
    brackets = math.isclose(got.seconds, expect, rel_tol=1e-6)
    poisoned = got.early == sz
    notes = ["timer = the fake's model of the copies it brackets" if brackets else
             f"timer read {got.seconds:.3g} s, the fake's model of the copies says {expect:.3g} s: its events do "
             f"not bracket them",
             f"read before sync: {got.early} of {sz} bytes poison" + ("" if poisoned else " (the read did not wait)"),
             f"after: wrong {got.wrong} (cpu rehearsal: the fake has no rate)"]
    ok = brackets and poisoned and got.wrong == 0
    return row("copy", label, status="ok" if ok else "FAIL", note="; ".join(notes), clock=FAKE_EVENTS)


def fake_rows(target: Target, t, descs, what: str, timer_stream=None) -> list[dict]:
    """The rehearsal: each engine's CUDA path on the torch-cpu pool seen as device memory through the fake driver
    (fake_row), or a SKIP row saying why not."""
    rows = []
    make = getattr(target.driver, "cuda_tensor", None)
    for eng in C.ENGINES:
        label = f"{eng} CUDA path: {what}"
        why = "no fake CUDA driver with cuda_tensor()" if make is None else \
            "the fake driver's install() gave no driver with a clock" if target.api is None else C.probe(eng, "cuda")
        if why:
            rows.append(target.skip("copy", label, why))
            continue
        try:
            rows.append(fake_row(target.api, eng, t, make(t), descs, label, timer_stream))
        except Exception as exc:
            rows.append(row("copy", label, status="FAIL", note=one_line(exc, 100), clock=FAKE_EVENTS))
    return rows


# ----- the steps -------------------------------------------------------------------------------------------------
def device_row(target: Target) -> dict:
    import torch

    if target.rehearsal:
        return row("device", "cpu rehearsal (torch-cpu pools)", note=f"torch {torch.__version__}; {target.fake}")
    return row("device", torch.cuda.get_device_name(0), note=f"torch {torch.__version__}, CUDA {torch.version.cuda}"
               f", {torch.cuda.device_count()} GPU(s)")


def bus_id(dev: int = 0) -> str:
    """GPU ``dev``'s PCI address as sysfs names it: from the driver door, else torch's device properties."""
    try:
        from kvbench.memory import driver

        return driver.pci_bus_id(dev)
    except Exception:  # no cuda-bindings: torch knows the address too
        import torch

        p = torch.cuda.get_device_properties(dev)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def reference_rows(a, target: Target, fl: F.Floors) -> list[dict]:
    """The floors measured first: the device's own copy (a large torch copy_ device to device) and the PCIe link
    (generation x width, read from the device)."""
    pool = D.alloc(a.pool_mib << 20, target.kind)
    try:
        t = pool.tensor
        half = pool.nbytes // 2
        # five samples at least: every ratio in the table divides by this one
        s, clock = timed(target, lambda: t[half : 2 * half].copy_(t[:half]), max(a.repeats, 5))
        fl.device_copy = half / s / 1e9
        rows = [row("reference", f"device copy_ of {half >> 20} MiB", fl.device_copy, clock=clock,
                    note="the floor of the copies and the check")]
    finally:
        pool.release()
    if target.rehearsal:
        rows.append(target.skip("reference", "PCIe link", "no GPU, so no link to read"))
        return rows
    bus = bus_id(0)
    fl.link, why = F.read_link(bus)
    if fl.link is None:
        rows.append(row("reference", f"PCIe link of {bus}", status="skipped", note=f"not read ({why}): host<->dev "
                        "rows have no floor"))
    else:
        rows.append(row("reference", f"PCIe link of {bus}", note=f"{fl.link.text()}, read, not measured: the floor "
                        "of host<->dev"))
    return rows


def check_seconds(target: Target, t, descs, repeats: int) -> tuple[float, str]:
    """(median seconds of the check of ``descs`` in ``t``, the clock): the host clock from after every stream of
    the device is idle to the count read back (the check's one wait)."""
    def run():
        count(t, descs)

    if target.rehearsal:
        return host_seconds(run, repeats), HOST
    import torch

    out = []
    run()
    for _ in range(repeats):
        torch.cuda.synchronize()
        s = time.perf_counter()
        run()
        out.append(time.perf_counter() - s)
    return float(np.median(out)), HOST_AFTER_SYNC


def pool_rows(a, target: Target, fl: F.Floors) -> list[dict]:
    judged = not target.rehearsal
    pool = D.alloc(a.pool_mib << 20, target.kind)
    try:
        t = pool.tensor
        s, clock = timed(target, lambda: D.fill(t, 0), a.repeats)
        rows = [F.rate(row("pool", f"fill {pool.nbytes >> 20} MiB on {t.device}", pool.nbytes / s / 1e9, clock=clock),
                       fl.device_copy, F.DEVICE_COPY)]
        same = blocks(a, pool.nbytes // 2)
        same[:, 1] = same[:, 0]  # the source ranges against themselves: the fill must verify
        sz = int(same[:, 2].sum())
        s, clock = check_seconds(target, t, same, a.repeats)
        bad = count(t, same)  # torch's ops only, on torch's stream: the copy stream holds nothing of this pool
        t[int(same[0, 0])] ^= 0x5A  # one flipped byte must be found
        caught = count(t, same)
        ok = bad == 0 and caught == 1
        rows.append(F.rate(row("pool", f"check {sz >> 20} MiB of blocks", sz / s / 1e9, "ok" if ok else "FAIL",
                               f"wrong {bad}, after one flipped byte {caught}", clock=clock),
                           fl.device_copy, F.DEVICE_COPY, F.CHECK, judged))
        return rows
    finally:
        pool.release()


def copy_rows(a, target: Target, fl: F.Floors) -> list[dict]:
    pool = D.alloc(a.pool_mib << 20, target.kind)
    try:
        t = pool.tensor
        descs = blocks(a, pool.nbytes // 2)
        sz = int(descs[:, 2].sum())
        what = f"{a.blocks} x {a.block_kib} KiB"
        D.fill(t, 0)
        rows = []
        for eng in C.ENGINES:
            why = C.probe(eng, target.device)
            if why:
                rows.append(row("copy", f"{eng}: {what}", status="skipped", note=why))
                continue
            try:
                got = measure_copy(eng, t, t, t, descs, a.repeats, dev=t.device.index or 0)
            except Exception as exc:  # one engine's failure is its own row
                rows.append(row("copy", f"{eng}: {what}", status="FAIL", note=one_line(exc, 100)))
                continue
            r = row("copy", f"{eng}: {what}", C.gbps(sz, got.seconds), "ok" if got.wrong == 0 else "FAIL",
                    f"wrong {got.wrong}" + (" (host path of torch-cpu)" if target.rehearsal else ""), got.clock)
            rows.append(F.rate(r, fl.device_copy, F.DEVICE_COPY, F.KERNEL if eng == "kernel" else None,
                               not target.rehearsal))
        if target.rehearsal:
            rows += fake_rows(target, t, descs, what)
        return rows
    finally:
        pool.release()


def one_way(target: Target, label: str, src, dst, repeats: int, note: str, fl: F.Floors) -> dict:
    """The host<->dev row of copying ``src`` into ``dst`` (uint8 tensors of one size): its rate on torch's stream
    (which carries copy_), and ok when the 7s of ``src`` landed in ``dst`` (read after that stream)."""
    s, clock = timed(target, lambda: dst.copy_(src, non_blocking=True), repeats)
    torch_sync(target)
    ok = bool((dst[:: 1 << 20] == 7).all())
    return F.rate(row("host<->dev", label, dst.numel() / s / 1e9, "ok" if ok else "FAIL", note, clock), fl.pcie,
                  F.PCIE)


def hostdev_rows(a, target: Target, fl: F.Floors) -> list[dict]:
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
            rows.append(one_way(target, f"H2D {kind} {n >> 20} MiB", host, dev, a.repeats, note, fl))
            host.fill_(0)  # D2H must bring the 7s back
            rows.append(one_way(target, f"D2H {kind} {n >> 20} MiB", dev, host, a.repeats, note, fl))
        return rows
    finally:
        pool.release()
