"""make gpu-check: argument handling, the closing table, the one-line stop without a GPU, and its guarded steps
on the CPU rehearsal (--device cpu): pydantic missing, a step that raises, a launcher that hangs, an engine that
copies nothing.  Device time is the copy stream's (the fake CUDA driver's streams are queues and its clock only
moves with completed work, so a timer on another stream reads 0 s and a read before the copy stream's sync sees
the poison).  The floors and goals as pure functions, with given numbers.  The whole rehearsal in a fresh venv
(make gpu-check DEVICE=cpu) is too slow for the suite: these run its orchestration in this process or in one
short subprocess."""
import glob
import json
import math
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest

from kvbench.gpucheck import __main__ as G
from kvbench.gpucheck import checks, ipc
from kvbench.gpucheck import floors as F
from kvbench.gpucheck.__main__ import main, parse, table
from kvbench.gpucheck.runner import line, row
from kvbench.memory import copy as C
from kvbench.memory import device, driver

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def test_defaults_and_only():
    a = parse([])
    assert (a.pool_mib, a.block_kib, a.blocks, a.repeats) == (1024, 32, 4096, 5)
    assert a.only == ["copy", "hostdev", "ipc", "pool", "prefill", "staged", "suites"]
    assert a.device == "cuda" and a.deadline == 420
    c = parse(["--device", "cpu"])
    assert (c.pool_mib, c.block_kib, c.blocks, c.repeats) == (16, 32, 64, 2)
    assert parse(["--only", "pool,copy"]).only == ["pool", "copy"]


@pytest.mark.parametrize("argv,needle", [
    (["--only", "pool,nvlink"], "--only nvlink: not one of copy,hostdev,ipc,pool,prefill,staged,suites"),
    (["--repeats", "0"], "--repeats must be 1 or more, not 0"),
    (["--pool-mib", "64", "--blocks", "4096"], "must fit in half of --pool-mib (64 MiB)"),
    (["--blocks", "x"], "invalid int value"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1]


def test_table_prints_rates_with_two_decimals_their_floor_and_clock_and_dashes_for_rows_without_one():
    rows = [F.rate(row("copy", "kernel: 4096 x 32 KiB", 1624.3456, note="wrong 0", clock="copy-stream events"),
                   2030.0, F.DEVICE_COPY),
            row("copy", "batch: 4096 x 32 KiB", status="skipped",
                note="cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one is 12.4)")]
    assert table(rows).splitlines() == [
        "# gpu-check (GB/s = 10^9 B/s)",
        "# of its floor: device copy = torch copy_ device to device, PCIe = the link's generation x width (read from "
        "the device), host tcp = kvbench run -t tcp between host pools, matmul = a plain torch matmul; each measured "
        "in this run",
        "check      what                                   GB/s  of its floor      status   clock                   note",
        "copy       kernel: 4096 x 32 KiB               1624.35  80% device copy   ok       copy-stream events      "
        "wrong 0",
        "copy       batch: 4096 x 32 KiB                      -  -                 skipped  -                       "
        "cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one is 12.4)",
    ]


@pytest.mark.launches
def test_without_a_gpu_it_stops_at_once_with_one_line(capsys, tmp_path):
    if device.probe("cuda") is None:
        pytest.skip("a GPU is present: run make gpu-check")
    assert main(["-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpu-check: no GPU here: no CUDA device (no CUDA driver: libcuda.so.1 does not load)"]
    assert not list(tmp_path.iterdir())  # nothing written
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "kvbench.gpucheck"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and time.time() - t < 20


TINY = ["--device", "cpu", "--pool-mib", "4", "--blocks", "16", "--repeats", "1"]
needs_torch = pytest.mark.skipif(device.probe("torch-cpu") is not None, reason="torch is not installed")


def _result(tmp_path) -> dict:
    (path,) = glob.glob(str(tmp_path / "*" / "*_gpucheck*.json"))
    with open(path) as fh:
        return json.load(fh)


def _status(rows) -> dict:
    return {(r["check"], r["what"]): r["status"] for r in rows}


_BLOCK_PYDANTIC = """
import sys
class _NoPydantic:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "pydantic_core"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a CUDA image has none)")
sys.meta_path.insert(0, _NoPydantic())
sys.argv = ["kvbench.gpucheck", *sys.argv[1:]]
import runpy
runpy.run_module("kvbench.gpucheck", run_name="__main__")
"""


@pytest.mark.launches
@needs_torch
def test_without_pydantic_the_other_steps_run_and_the_model_step_fails_alone(tmp_path):
    """A CUDA image has no pydantic: gpucheck imports without it, only the step that needs the model FAILs
    (one line), the table and the JSON hold every row, the exit code is 1."""
    p = subprocess.run([sys.executable, "-c", _BLOCK_PYDANTIC, *TINY, "--only", "pool,prefill", "-o", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert "REHEARSAL" in p.stdout.splitlines()[0]
    (fail,) = [ln for ln in p.stdout.splitlines() if ln.startswith("prefill") and "FAIL" in ln][-1:]
    assert "ModuleNotFoundError" in fail and "pydantic" in fail
    assert [ln for ln in p.stdout.splitlines() if ln.startswith("pool") and " ok " in ln]
    got = _status(_result(tmp_path)["rows"])
    assert got[("prefill", "step")] == "FAIL" and got[("pool", "fill 4 MiB on cpu")] == "ok"


@pytest.mark.launches
@needs_torch
def test_a_step_that_raises_is_one_fail_row_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBENCH_GPUCHECK_FAULT", "raise:copy,hang:hostdev")
    monkeypatch.setitem(G.BUDGET_S, "hostdev", 2)
    t = time.monotonic()
    assert main([*TINY, "--only", "pool,copy,hostdev", "-o", str(tmp_path)]) == 1
    assert time.monotonic() - t < 60
    out = capsys.readouterr().out
    rows = _result(tmp_path)["rows"]
    got = _status(rows)
    assert got[("copy", "step")] == "FAIL" and got[("hostdev", "step")] == "FAIL"
    assert got[("pool", "fill 4 MiB on cpu")] == "ok" and got[("device", "cpu rehearsal (torch-cpu pools)")] == "ok"
    notes = {r["check"]: r["note"] for r in rows if r["what"] == "step"}
    assert "injected fault in step copy" in notes["copy"] and "over its budget of 2 s" in notes["hostdev"]
    # printed as each step ended, then the whole table again
    assert out.count("injected fault in step copy") == 2 and out.index("\npool ") < out.index("\ncopy ")
    steps = {s["step"]: s for s in _result(tmp_path)["steps"]}
    assert steps["hostdev"]["seconds"] < 10


@pytest.mark.launches
@needs_torch
def test_a_hanging_launcher_is_killed_whole_and_the_other_steps_still_run(tmp_path, monkeypatch, capsys):
    pids = tmp_path / "pids"
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setitem(G.BUDGET_S, "staged", 17)  # the launch gets 7 s of it
    t = time.monotonic()
    assert main([*TINY, "--only", "pool,staged", "--mpirun", str(fake), "-o", str(tmp_path)]) == 1
    assert time.monotonic() - t < 60
    rows = _result(tmp_path)["rows"]
    fails = [r["note"] for r in rows if r["check"] == "staged" and r["status"] == "FAIL"]
    assert any("launch timed out after 7 s: killed whole" in n for n in fails), fails
    assert [r for r in rows if r["check"] == "pool" and r["status"] == "ok"]
    for pid in map(int, pids.read_text().split()):  # the launcher and its child: both gone
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


@needs_torch
def test_ipc_reader_gives_one_row_per_engine_and_repoisons_between_engines(tmp_path, monkeypatch):
    """An engine that copies nothing FAILs (its destination was poisoned again after the previous engine wrote
    the right bytes there), one that raises FAILs alone, and the other engines' rows stay."""
    import torch

    a = parse(TINY)
    n = 4 << 20
    path = str(tmp_path / "shared")
    with open(path, "wb") as fh:
        fh.truncate(n)
    src = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
    device.fill(src, 0)
    monkeypatch.setenv("KVBENCH_GPUCHECK_FAULT", "noop:kernel")
    real = checks.C.copy

    def copy(eng, *args, **kw):
        if eng == "batch":
            raise RuntimeError("batch broke")
        return real(eng, *args, **kw)

    monkeypatch.setattr(checks.C, "copy", copy)
    inbox, out = queue.Queue(), queue.Queue()
    inbox.put(path)
    ipc._reader(inbox, out, n, a, "cpu", 0)
    rows = []
    while (r := out.get(timeout=5)) != ipc.DONE:
        rows.append(r)
    by = {r["what"].split(":")[0]: r for r in rows}
    assert list(by) == ["pull memcpy", "pull kernel", "pull batch", "pull batch-overlap", "pull batch-any"]  # C.ENGINES
    for eng in ("memcpy", "batch-overlap", "batch-any"):
        assert by[f"pull {eng}"]["status"] == "ok" and "wrong 0" in by[f"pull {eng}"]["note"]
        assert by[f"pull {eng}"]["clock"] == "host clock"  # host memory: done when the call returns
    assert by["pull kernel"]["status"] == "FAIL" and "wrong 524288;" in by["pull kernel"]["note"]  # every byte
    assert by["pull batch"]["status"] == "FAIL" and "batch broke" in by["pull batch"]["note"]


def test_blocks_are_distinct_and_inside_their_halves():
    d = checks.blocks(parse(TINY), 2 << 20)
    assert d.dtype == np.int64 and d.flags.c_contiguous and len(np.unique(d[:, 0])) == 16
    assert (d[:, 0] + d[:, 2] <= 2 << 20).all() and (d[:, 1] >= 2 << 20).all()


# what a stock CUDA image ships (docs/gpu.md#make-gpu-check): gpucheck's import closure must stay inside it
IMAGE = {"numpy", "pandas", "pyarrow", "yaml", "psutil", "tqdm", "mpi4py", "torch", "cupy", "cuda"}


def test_gpucheck_imports_only_what_a_cuda_image_ships():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import layout
    finally:
        sys.path.pop(0)
    heavy = layout.closure_heavy(layout.modules())
    for mod in ("kvbench.gpucheck.__main__", "kvbench.gpucheck.checks", "kvbench.gpucheck.ipc",
                "kvbench.gpucheck.launched", "kvbench.gpucheck.runner", "kvbench.gpucheck.floors"):
        extra = {h for h in heavy[mod] if h not in layout.LAZY_C} - IMAGE
        assert not extra, f"{mod} loads {extra} at import, which a CUDA image lacks"


@pytest.mark.launches
@needs_torch
@pytest.mark.parametrize("fake", ["absent", "stub", "checkout"])
def test_rehearsal_cuda_paths_are_skipped_or_checked_through_the_fake_never_given_a_rate(tmp_path, monkeypatch,
                                                                                         capsys, fake):
    """The engines' CUDA paths on the rehearsal go through tests/fakes/cuda_driver.py where it installs (bytes
    checked, the timer held to the fake's model, no rate); without one (or where it cannot stand in: a stub with
    no driver to read a clock from) each is a SKIP row saying why."""
    stub = tmp_path / "cuda_driver.py"
    stub.write_text("def install():\n    pass\n\n\ndef cuda_tensor(t):\n    return t\n")
    if fake != "checkout":
        monkeypatch.setattr(checks, "FAKE_DRIVER", str(stub) if fake == "stub" else str(tmp_path / "none.py"))
    assert main([*TINY, "--only", "copy", "-o", str(tmp_path)]) == 0
    rows = _result(tmp_path)["rows"]
    assert ("fake CUDA driver installed" in rows[0]["note"]) == (fake != "absent")
    cuda = [r for r in rows if "CUDA path" in r["what"]]
    assert len(cuda) == len(C.ENGINES) and all(r["gbps"] != r["gbps"] for r in cuda)  # nan: a fake has no rate
    if fake == "checkout":  # every engine, the kernel's launch included, through the fake
        assert all(r["status"] == "ok" and r["clock"] == "fake copy-stream events" and
                   "timer = the fake's model" in r["note"] for r in cuda), cuda
    else:
        assert all(r["status"] == "SKIP" and r["note"].startswith("(cpu rehearsal: ") for r in cuda)


# ----- device time is the copy stream's: the fake driver's queues and clock ----------------------------------------
def _fake_pool(monkeypatch):
    """The checkout's fake driver (undone after the test), a torch-cpu pool filled, its blocks and its fake view."""
    from fakes import cuda_driver

    fake = cuda_driver.install(monkeypatch)
    pool = device.alloc(4 << 20, "torch-cpu")
    t = pool.tensor
    device.fill(t, 0)
    descs = checks.blocks(parse(TINY), pool.nbytes // 2)
    return fake, pool, t, descs, cuda_driver.cuda_tensor(t)


@needs_torch
@pytest.mark.parametrize("eng", C.ENGINES)
def test_an_engine_row_is_timed_by_events_on_the_copy_stream_and_checked_after_its_sync(monkeypatch, eng):
    """gpucheck's engine timing (the same code on a GPU) through the fake: the timer reads exactly what the fake's
    clock advances for the copies (a driver call's overhead per cuMemcpyAsync, or for the one launch or batched
    call, plus the bytes at its rate); before the copy stream's sync every destination byte is still poison,
    after it none is wrong, and nothing stays queued."""
    fake, pool, t, descs, ct = _fake_pool(monkeypatch)
    sz = int(descs[:, 2].sum())
    calls = len(descs) if eng == "memcpy" else 1
    got = checks.measure_copy(eng, t, ct, ct, descs, 3, early=True)
    assert got.clock == "copy-stream events"
    assert got.seconds == pytest.approx(calls * fake.overhead + sz / fake.rate, rel=1e-9)
    assert got.early == sz and got.wrong == 0 and fake.pending() == 0
    r = checks.fake_row(fake, eng, t, ct, descs, f"{eng} CUDA path")
    assert r["status"] == "ok" and math.isnan(r["gbps"]) and r["clock"] == "fake copy-stream events", r


@needs_torch
def test_events_on_another_stream_than_the_copies_bracket_nothing_and_the_row_fails(monkeypatch):
    """What the H200 run timed: events on a stream other than the copy stream (there torch's) while the engine
    copies on the copy stream.  Two streams do not order each other, so the timer reads 0 s of the copies and the
    row FAILs its bracket check; the copies still land and none stays queued."""
    fake, pool, t, descs, ct = _fake_pool(monkeypatch)
    driver.ensure_context(0)
    other = int(fake.cuStreamCreate(0)[1])
    got = checks.measure_copy("kernel", t, ct, ct, descs, 2, timer_stream=other)
    assert got.seconds == 0.0 and got.wrong == 0 and fake.pending() == 0
    r = checks.fake_row(fake, "kernel", t, ct, descs, "kernel CUDA path", timer_stream=other)
    assert r["status"] == "FAIL" and "timer read 0 s" in r["note"] and "do not bracket them" in r["note"]


@needs_torch
@pytest.mark.parametrize("eng", ["memcpy", "kernel", "batch"])
def test_a_check_that_reads_before_the_copy_stream_sync_sees_poison(monkeypatch, eng):
    """The H200 run's check waited for torch's stream, not the copy stream: its read came before the copies
    landed.  With copy.sync waiting for nothing the same check finds every destination byte poisoned (the row
    FAILs); gpucheck's own check (wrong) waits for the copy stream first and finds none."""
    fake, pool, t, descs, ct = _fake_pool(monkeypatch)
    sz = int(descs[:, 2].sum())
    device.poison(t, descs, 0, 0)
    checks.engine_copy(eng, ct, ct, descs)
    assert fake.pending() and checks.wrong(t, descs, buf=ct) == 0 and fake.pending() == 0
    monkeypatch.setattr(checks.C, "sync", lambda *bufs, **kw: None)  # a wait on some other stream
    r = checks.fake_row(fake, eng, t, ct, descs, f"{eng} CUDA path")
    assert r["status"] == "FAIL" and f"after: wrong {sz} " in r["note"], r


# ----- floors and goals, pure --------------------------------------------------------------------------------------
def test_pcie_link_rate_from_generation_and_width():
    assert F.pcie_gbps(5, 16) == pytest.approx(63.008)
    assert F.pcie_gbps(4, 16) == pytest.approx(31.504)
    assert F.pcie_gbps(3, 8) == pytest.approx(7.88)
    assert F.pcie_gbps(6, 16) == pytest.approx(121.008)
    assert F.Link(5, 16, "NVML max").text() == "gen5 x16 (NVML max): 63.0 GB/s per direction"
    for gen, width in ((7, 16), (5, 0)):
        with pytest.raises(ValueError):
            F.pcie_gbps(gen, width)
    speeds = {"32.0 GT/s PCIe": 5, "16.0 GT/s PCIe": 4, "8 GT/s": 3, "2.5 GT/s PCIe": 1, "64.0 GT/s PCIe": 6,
              "Unknown": None, "": None}
    assert {k: F.gen_of_speed(k) for k in speeds} == speeds


def _sysfs(tmp_path, gpu=("32.0 GT/s PCIe", "16"), port=("16.0 GT/s PCIe", "16"), now=("2.5 GT/s PCIe", "16")):
    """A sysfs tree: the GPU 0000:1b:00.0 under its upstream port, devices/ linking to it as the kernel does."""
    up = tmp_path / "pci0000:00" / "0000:00:01.0"
    dev = up / "0000:1b:00.0"
    dev.mkdir(parents=True)
    for where, (speed, width) in ((dev, gpu), (up, port)):
        (where / "max_link_speed").write_text(speed + "\n")
        (where / "max_link_width").write_text(width + "\n")
    (dev / "current_link_speed").write_text(now[0] + "\n")
    (dev / "current_link_width").write_text(now[1] + "\n")
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "0000:1b:00.0").symlink_to(dev)
    return str(tmp_path / "devices")


def test_the_link_from_sysfs_is_the_lower_of_the_gpu_and_its_upstream_port(tmp_path, monkeypatch):
    """A gen5 GPU in a gen4 slot runs gen4; a GPU at rest reads gen1 now, so the rate is the link's maximum.
    Without pynvml, read_link falls back to sysfs; with neither it says why."""
    root = _sysfs(tmp_path)
    link = F.link_from_sysfs("0000:1b:00.0", root)
    assert (link.gen, link.width, link.current) == (4, 16, "gen1 x16") and link.gbps == pytest.approx(31.504)
    assert "upstream port" in link.source
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    got, why = F.read_link("0000:1b:00.0", root)
    assert (got.gen, got.width, why) == (4, 16, "")
    got, why = F.read_link("0000:99:00.0", root)
    assert got is None and "NVML: ModuleNotFoundError" in why and "sysfs: FileNotFoundError" in why
    assert F.norm_bus("00000000:1B:00.0") == "0000:1b:00.0"


def test_ratios_and_goals_from_given_rates():
    """Each row's share of its floor, and its goal: met, below (still ok: FAIL is for wrong bytes and errors), not
    judged without a floor or on the rehearsal."""
    assert F.ratio(1500.0, 2000.0) == 0.75 and math.isnan(F.ratio(math.nan, 2000.0))
    assert math.isnan(F.ratio(1.0, 0.0)) and math.isnan(F.ratio(1.0, math.nan))
    met = F.rate(row("copy", "kernel", 1600.0, note="wrong 0"), 2000.0, F.DEVICE_COPY, F.KERNEL)
    assert (met["ratio"], met["floor"], met["status"]) == (0.8, "device copy", "ok")
    assert met["note"] == "wrong 0; goal >= 75% of the device copy: met"
    assert "80% device copy" in line(met)
    below = F.rate(row("copy", "kernel", 1400.0, note="wrong 0"), 2000.0, F.DEVICE_COPY, F.KERNEL)
    assert below["status"] == "ok" and below["note"] == "wrong 0; below goal (>= 75% of the device copy)"
    assert F.goal_note(F.CHECK, 99.9, math.nan, True) == ("below goal (>= 100 GB/s)", True)
    assert F.goal_note(F.CHECK, 100.0, math.nan, True) == ("goal >= 100 GB/s: met", False)
    assert F.goal_note(F.STAGED, 2.0, 3.0, True) == ("below goal (>= 80% of host tcp)", True)
    assert F.goal_note(F.STAGED, 2.5, 3.0, True) == ("goal >= 80% of host tcp: met", False)
    assert F.goal_note(F.STAGED, 2.0, math.nan, True) == ("goal >= 80% of host tcp: not judged (no rate or no floor)",
                                                          False)
    assert F.goal_note(F.STAGED, 1.0, 3.0, False) == ("goal >= 80% of host tcp (not judged on the rehearsal)", False)
    bare = F.rate(row("host<->dev", "H2D pinned", 55.0), math.nan, F.PCIE)
    assert math.isnan(bare["ratio"]) and bare["floor"] == "" and "-" in line(bare).split()
    # streaming exposes 4 ms of a 90 ms prefill over 32 layers: 1.42 layers' compute; 10 ms: 3.56
    assert F.exposed_note(0.004, 0.090, 32, True) == ("exposed 1.42 layers' compute; goal <= 2: met", False)
    assert F.exposed_note(0.010, 0.090, 32, True) == ("exposed 3.56 layers' compute; below goal (<= 2)", True)
    assert F.exposed_note(0.010, 0.090, 32, False)[1] is False
    assert F.exposed_note(math.nan, 0.090, 32, True)[1] is False
