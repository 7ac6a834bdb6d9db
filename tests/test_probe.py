"""`kvbench probe`: the sizes it tries (doubling, then bisecting), the rows it reads back from each launch, a
size whose launch dies by a signal (a row, and the probe goes on), and every bad input as one line and exit 1."""
from __future__ import annotations

import csv
import dataclasses
import glob
import os
import re
import signal
import subprocess
import sys

import pytest
from helpers.launch import ROOT, launch, mpiexec

from kvbench import memory
from kvbench.cli import main as cli
from kvbench.harness import probe as P
from kvbench.harness.probe_attempt import Attempt, Request
from kvbench.job import cleanup
from kvbench.model.layout import BlockAllocator, Layout
from kvbench.results.store import claim_path

KiB, MiB = 2**10, 2**20
TINY = "name: tiny\nlayers: 2\nkv_heads: 1\nhead_dim: 64\n"  # 8 KiB per block id; 1024 tokens = 512 KiB


def fake(works_below: int):
    """An attempt that works for sizes under ``works_below``, and the sizes it was asked, in order."""
    asked = []

    def attempt(size):
        asked.append(size)
        return size < works_below

    return attempt, asked


def test_doubling_to_max_then_nothing_to_bisect():
    attempt, asked = fake(10**12)
    assert P.search(attempt, 512 * KiB, 3 * MiB, 8 * KiB, 3) == [512 * KiB, MiB, 2 * MiB, 3 * MiB] == asked


def test_bisects_between_the_last_working_and_the_first_failing_size():
    attempt, asked = fake(1536 * KiB + 1)  # up to 1.5 MiB works
    tried = P.search(attempt, 512 * KiB, 4 * MiB, 8 * KiB, 3)
    assert tried == [512 * KiB, MiB, 2 * MiB, 1536 * KiB, 1792 * KiB, 1664 * KiB] == asked
    attempt, _ = fake(520 * KiB)  # the gap closes at one step: bisecting stops there
    assert P.search(attempt, 512 * KiB, 4 * MiB, 8 * KiB, 10) == [512 * KiB, MiB, 768 * KiB, 640 * KiB, 576 * KiB,
                                                                  544 * KiB, 528 * KiB, 520 * KiB]
    attempt, _ = fake(0)
    assert P.search(attempt, 512 * KiB, 4 * MiB, 8 * KiB, 3) == [512 * KiB]  # nothing works: nothing to bisect


def test_the_request_takes_the_pools_last_blocks_and_so_its_last_page(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    req = Request("shm", model=str(model))
    assert (req.stride, req.nbytes, req.smallest) == (8 * KiB, 512 * KiB, 512 * KiB)
    size = 768 * KiB
    lay = Layout.fit("layer-major", 2, 2, 2 * KiB, size)
    ids = BlockAllocator(lay.nblocks).allocate(64, "tail")
    assert int(lay.offsets(1, 1, ids[-1:])[0]) + lay.block_bytes == size
    odd = dataclasses.replace(req, tokens=1000)
    cmd = Attempt(odd, size).command(str(tmp_path))
    assert cmd[cmd.index("--tokens") + 1] == "1008"  # whole blocks: the last one is sent to its end
    assert cmd[cmd.index("--alloc") + 1] == "tail"
    factor = float(cmd[cmd.index("--pool-factor") + 1])  # the run's pool: requests.pool_bytes of the request
    assert -(-int(odd.nbytes * factor) // memory.PAGE) * memory.PAGE == size


@pytest.mark.parametrize("rc,text,status,sig,why", [
    (11, "=   EXIT CODE: 11\nYOUR APPLICATION TERMINATED WITH THE EXIT STRING: Segmentation fault (signal 11)",
     "SIGNAL", "SIGSEGV", "a rank died by SIGSEGV"),
    (-9, "", "SIGNAL", "SIGKILL", "a rank died by SIGKILL"),
    (124, "(timed out after 30 s)", "TIMEOUT", "", "no end within 30 s"),
    # its own deadline killed the launch: the ranks' SIGTERM is the probe's doing, the row is TIMEOUT
    (124, "=   EXIT STRING: Terminated (signal 15)\n(timed out after 30 s)", "TIMEOUT", "", "no end within 30 s"),
    (5, "kvbench: timeout: rank 1: setup of nixl\n", "TIMEOUT", "", "timeout: rank 1: setup of nixl"),
    (4, "kvbench: error: rank 0: TransportError: boom\n", "ERROR", "", "error: rank 0: TransportError: boom"),
])
def test_a_launch_that_failed_is_a_row_that_says_how(tmp_path, rc, text, status, sig, why):
    row = Attempt(Request("shm"), MiB, 30).read(rc, text, str(tmp_path))
    assert (row.status, row.signal) == (status, sig) and row.reason.startswith(why)


def test_a_probes_file_never_overwrites_another(tmp_path):
    a, b = (claim_path(str(tmp_path), "probe", ".csv") for _ in range(2))  # within one second: b is a's -1
    assert a != b and os.path.isfile(a) and os.path.isfile(b)
    assert all(re.search(r"/\d{8}-\d{6}_probe(-1)?\.csv$", p) for p in (a, b))


def probe(*args) -> tuple[int, str]:
    try:
        return cli.main(["probe", *args]), ""
    except SystemExit as exc:  # argparse's own --help and the like
        return int(exc.code or 0), ""


@pytest.mark.parametrize("args,says", [
    (["-t", "shm", "--max", "1KiB"], "--max 1KiB is below one request"),
    (["-t", "nope", "--max", "1GiB"], "transport 'nope' is not one of"),
    (["-t", "shm", "--max", "lots"], "size 'lots' is not a number with a unit"),
    (["-t", "shm", "--max", "4096TiB"], "of RAM, but MemAvailable is"),
    (["-t", "shm", "--max", "1GiB", "-m", "no-such-model"], "model 'no-such-model' is not one of"),
    (["-t", "shm", "--max", "1GiB", "--memory", "hbm"], "argument --memory: invalid choice: 'hbm'"),
    (["-t", "shm", "--max", "1GiB", "--memory", "cuda"], "--memory cuda: shm moves host memory, not cuda"),
    (["-t", "shm", "--max", "1GiB", "--deadline", "nan"], "--deadline a number of seconds above 0"),
    (["-t", "shm", "--max", "1GiB", "--mpiexec", "/nonexistent"], "--mpiexec /nonexistent: no such program"),
])
def test_bad_input_is_one_line_and_exit_1(capfd, args, says):
    assert probe(*args)[0] == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench: error: ") and says in err[0], err


def test_a_fault_switch_that_is_not_one_is_refused(capfd, monkeypatch):
    monkeypatch.setenv("KVBENCH_PROBE_FAULT", "garbage")
    assert probe("-t", "shm", "--max", "1GiB")[0] == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KVBENCH_PROBE_FAULT='garbage': give <pool bytes>:<KVBENCH_FAULT spec>" in err[0], err


@pytest.mark.launches
def test_sigterm_keeps_the_rows_says_so_in_one_line_and_leaves_no_scratch(tmp_path):
    """SIGTERM after the first size: exit 130, a kvbench: line with the rows kept, nothing left under -o but them."""
    if mpiexec() is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "kvbench", "probe", "-t", "shm", "--max", "64MiB", "-n", "2", "-m",
                          str(model), "-o", str(tmp_path / "res")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env, start_new_session=True)
    try:
        lines = []
        for ln in p.stdout:  # the first size's row: one size done, the next one's launch starting
            lines.append(ln)
            if re.match(r"^\s+\d+KiB\s+OK", ln):
                break
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, "".join(lines) + out + err
    (path,) = glob.glob(str(tmp_path / "res" / "*" / "*_probe.csv"))
    kept = list(csv.DictReader(open(path)))
    assert len(kept) >= 1 and kept[0]["status"] == "OK"
    assert [ln for ln in err.splitlines() if ln.startswith("kvbench: ")] == [
        f"kvbench: probe interrupted by SIGTERM: {len(kept)} sizes kept in {path}"]
    assert not os.path.exists(tmp_path / "res" / "scratch")  # each size's run, removed
    assert sorted(os.listdir(tmp_path / "res")) == [os.path.basename(os.path.dirname(path))]


def test_a_transport_unavailable_here_says_why(capfd, monkeypatch):
    monkeypatch.setattr(P.transports, "probe", lambda name: "no RDMA device (the reason kvbench list gives)")
    assert probe("-t", "verbs", "--max", "1GiB")[0] == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["kvbench: error: verbs is unavailable here: no RDMA device (the reason kvbench list gives)"]


@pytest.mark.launches
def test_a_size_that_dies_by_a_signal_is_its_row_and_the_probe_goes_on(tmp_path):
    """Three launches on shm: 512 KiB works, 1 MiB's rank 1 takes a SIGSEGV (injected), 768 KiB (the bisection,
    after the crash) works; the rows go to a CSV that names every size, and nothing stays in /dev/shm."""
    if mpiexec() is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    env = dict(os.environ, PYTHONPATH=ROOT, KVBENCH_PROBE_FAULT=f"{MiB}:segv@connect:1")
    rc, out, err = launch([sys.executable, "-m", "kvbench", "probe", "-t", "shm", "--max", "1MiB", "--bisect", "1",
                            "-n", "2", "-m", str(model), "-o", str(tmp_path / "res")], 120, env)
    assert rc == 0, out + err
    (path,) = glob.glob(str(tmp_path / "res" / "*" / "*_probe.csv"))
    rows = list(csv.DictReader(open(path)))
    assert [int(r["pool_bytes"]) for r in rows] == [512 * KiB, MiB, 768 * KiB]  # doubling, then bisecting
    assert [r["status"] for r in rows] == ["OK", "SIGNAL", "OK"]
    assert rows[1]["signal"] == "SIGSEGV" and rows[1]["gbps"] == ""
    for r in (rows[0], rows[2]):
        assert float(r["gbps"]) > 0 and r["nwrong"] == "0" and float(r["register_s"]) >= 0
    assert "# largest pool that works: 768KiB" in out
    assert "# by pool size:" in out  # bisected: the rows again in size order, 768 KiB before 1 MiB
    assert "# first that fails: 1MiB SIGNAL: a rank died by SIGSEGV" in out
    assert all(not cleanup.leftovers(r["run_id"]) for r in rows if r["run_id"])
    assert all(r["run_id"] for r in rows)
