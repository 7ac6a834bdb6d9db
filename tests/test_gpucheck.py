"""make gpu-check's front: argument handling, the closing table, and the one-line stop without a GPU."""
import subprocess
import sys
import time

import pytest

from kvbench.gpucheck.__main__ import main, parse, table
from kvbench.memory import device

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def test_defaults_and_only():
    a = parse([])
    assert (a.pool_mib, a.block_kib, a.blocks, a.repeats) == (1024, 32, 4096, 5)
    assert a.only == ["copy", "harness", "hostdev", "ipc", "pool", "prefill"]
    assert parse(["--only", "pool,copy"]).only == ["pool", "copy"]


@pytest.mark.parametrize("argv,needle", [
    (["--only", "pool,nvlink"], "--only nvlink: not one of copy,harness,hostdev,ipc,pool,prefill"),
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
