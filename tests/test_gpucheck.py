"""make gpu-check: argument handling, the closing table, the one-line stop without a GPU, and its guarded steps
on the CPU rehearsal (--device cpu): pydantic missing, a step that raises, a launcher that hangs, an engine that
copies nothing.  The whole rehearsal in a fresh venv (make gpu-check DEVICE=cpu) is too slow for the suite: these
run its orchestration in this process or in one short subprocess."""
import glob
import json
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest

from kvbench.gpucheck import __main__ as G
from kvbench.gpucheck import checks, ipc
from kvbench.gpucheck.__main__ import main, parse, table
from kvbench.memory import device

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def test_defaults_and_only():
    a = parse([])
    assert (a.pool_mib, a.block_kib, a.blocks, a.repeats) == (1024, 32, 4096, 5)
    assert a.only == ["copy", "hostdev", "ipc", "pool", "prefill", "staged"]
    assert a.device == "cuda" and a.deadline == 420
    c = parse(["--device", "cpu"])
    assert (c.pool_mib, c.block_kib, c.blocks, c.repeats) == (16, 32, 64, 2)
    assert parse(["--only", "pool,copy"]).only == ["pool", "copy"]


@pytest.mark.parametrize("argv,needle", [
    (["--only", "pool,nvlink"], "--only nvlink: not one of copy,hostdev,ipc,pool,prefill,staged"),
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


def test_table_prints_rates_with_two_decimals_and_dashes_for_rows_without_one():
    rows = [{"check": "copy", "what": "kernel: 4096 x 32 KiB", "gbps": 812.3456, "status": "ok", "note": "wrong 0"},
            {"check": "copy", "what": "batch: 4096 x 32 KiB", "gbps": float("nan"), "status": "skipped",
             "note": "cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one is 12.4)"}]
    assert table(rows).splitlines() == [
        "# gpu-check (GB/s = 10^9 B/s)",
        "check      what                                   GB/s  status   note",
        "copy       kernel: 4096 x 32 KiB                812.35  ok       wrong 0",
        "copy       batch: 4096 x 32 KiB                      -  skipped  cuMemcpyBatchAsync needs a CUDA 12.8 "
        "driver or newer (this one is 12.4)",
    ]


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
    assert out.count("injected fault in step copy") == 2 and out.index("pool ") < out.index("copy ")
    steps = {s["step"]: s for s in _result(tmp_path)["steps"]}
    assert steps["hostdev"]["seconds"] < 10


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
    got = {(r["check"], r["status"]): r["note"] for r in _result(tmp_path)["rows"]}
    assert "launch timed out after 7 s: killed whole" in got[("staged", "FAIL")]
    assert ("pool", "ok") in got
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
    assert list(by) == ["pull memcpy", "pull kernel", "pull batch"]
    assert by["pull memcpy"]["status"] == "ok" and "wrong 0" in by["pull memcpy"]["note"]
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
                "kvbench.gpucheck.launched", "kvbench.gpucheck.runner"):
        extra = {h for h in heavy[mod] if h not in layout.LAZY_C} - IMAGE
        assert not extra, f"{mod} loads {extra} at import, which a CUDA image lacks"


@needs_torch
@pytest.mark.parametrize("fake", ["absent", "stub"])
def test_rehearsal_cuda_paths_are_skipped_or_checked_through_the_fake_never_given_a_rate(tmp_path, monkeypatch,
                                                                                         capsys, fake):
    """The engines' CUDA paths on the rehearsal go through tests/fakes/cuda_driver.py where it installs (bytes
    checked, no rate); without one (or where it cannot stand in) each is a SKIP row saying why."""
    stub = tmp_path / "cuda_driver.py"
    stub.write_text("def install():\n    pass\n\n\ndef cuda_tensor(t):\n    return t\n")
    monkeypatch.setattr(checks, "FAKE_DRIVER", str(stub) if fake == "stub" else str(tmp_path / "none.py"))
    assert main([*TINY, "--only", "copy", "-o", str(tmp_path)]) == 0
    rows = _result(tmp_path)["rows"]
    assert ("fake CUDA driver installed" in rows[0]["note"]) == (fake == "stub")
    cuda = [r for r in rows if "CUDA path" in r["what"]]
    assert len(cuda) == 3 and all(r["gbps"] != r["gbps"] for r in cuda)  # nan: a fake has no rate
    assert all(r["status"] == "SKIP" and r["note"].startswith("(cpu rehearsal: ") or
               r["status"] == "ok" and "fake CUDA driver" in r["note"] for r in cuda)
