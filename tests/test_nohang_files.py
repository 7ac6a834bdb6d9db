"""rank 0's own file errors end the job like any rank's failure (one line, the status, nothing left), and a
resume is safe: locked against a live writer, a damaged table refused, a first-setup kill continued, -o refused,
and a killed write's .tmp files removed."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers.asserts import assert_one_line
from helpers.launch import ROOT, kill_group, leftovers_of, mpiexec

from kvbench.job import cleanup
from kvbench.results.lock import LockHeld, ResultLock, lock_path, sweep_stale

ONE = ["-t", "shm", "-b", "16", "-e", "16", "--variants", "bulk", "--tokens", "256", "-n", "2", "-w", "0"]
TWO = ["-t", "shm", "-b", "16", "-e", "16", "--variants", "bulk,paged", "--tokens", "256", "-n", "2", "-w", "0",
       "--rounds", "1"]


def shm_now() -> set[str]:
    return set(os.listdir(cleanup.SHM_DIR))


def orphans_since(before: set[str]) -> list[str]:
    """The /dev/shm files that appeared since ``before`` and that no live process owns or maps (a run
    that failed before its sidecar existed has no run id to find its files by)."""
    mapped = cleanup._mapped_anywhere()
    out = []
    for name in sorted(shm_now() - before):
        m = cleanup._OWNED.fullmatch(name)
        if m and not cleanup._alive(int(m["pid"])):
            out.append(name)
        elif name.startswith("mpich_shm_") and os.path.join(cleanup.SHM_DIR, name) not in mapped:
            out.append(name)
    return out


def files_in(folder) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(folder), "**", "*"), recursive=True)
                  if os.path.isfile(p))


def set_status(parquet: str, status: str, **more) -> None:
    path = parquet.replace(".parquet", ".meta.json")
    meta = json.load(open(path))
    meta.update(status=status, **more)
    json.dump(meta, open(path, "w"))


# ----- 1. rank 0's own file errors ----------------------------------------------------------------------------
def test_a_name_too_long_for_a_file_is_an_input_error(kvrun, tmp_path):
    """Checked at the door against the file system's NAME_MAX: one line, exit 1, nothing written."""
    before, t0 = shm_now(), time.monotonic()
    r = kvrun([*ONE, "--name", "x" * 300], timeout=60)
    assert time.monotonic() - t0 < 30
    assert_one_line(r, "kvbench: error: --name: 'xxx", "(300 characters) is too long for a result file's name",
                    "at most 213", code=1)
    assert files_in(tmp_path / "results") == []
    assert orphans_since(before) == []
    ok = kvrun([*ONE, "--name", "y" * 213], timeout=60)  # the longest allowed name makes every file of the run
    assert ok.code == 0, ok.err
    assert os.path.basename(ok.results).endswith("_" + "y" * 213 + ".parquet")


def test_a_result_folder_that_cannot_be_made_ends_the_job_with_one_line(kvrun, tmp_path):
    """The machine's folder is a file: refused at the door (job/folder.py) with one line, exit 1, before any rank
    allocates or writes anything (it used to be found late, by rank 0 opening its files: exit 4)."""
    from kvbench.results.store import machine_name

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / machine_name()).write_text("not a folder")
    before, t0 = shm_now(), time.monotonic()
    r = kvrun(ONE, timeout=60)
    assert time.monotonic() - t0 < 30
    assert_one_line(r, f"{machine_name()} is not a directory", code=1)
    assert files_in(tmp_path / "results") == [machine_name()]
    assert orphans_since(before) == []


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a folder on a tmpfs of that size (root only), unmounted after the test."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    mounted = []

    def mount(size: str):
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)]).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)])


def test_a_full_filesystem_before_the_sidecar_ends_the_job_with_one_line(kvrun, small_fs):
    full = small_fs("4k")
    before, t0 = shm_now(), time.monotonic()
    r = kvrun(ONE, out_dir=full, timeout=60)
    assert time.monotonic() - t0 < 30
    assert_one_line(r, "rank 0 on ", "opening the result files", "No space left on device", code=4)
    assert files_in(full) == []  # not the claimed sidecar, its lock or a .tmp
    assert orphans_since(before) == []


def test_a_full_filesystem_at_the_first_table_write_ends_the_job_and_records_it(kvrun, small_fs):
    full = small_fs("24k")  # the sidecar fits, the first case's table does not
    t0 = time.monotonic()
    r = kvrun(ONE, out_dir=full, timeout=60)
    assert time.monotonic() - t0 < 30
    line = assert_one_line(r, "rank 0 on ", "case 1 (shm push", "No space left on device", code=4)
    assert r.meta()["status"] == "ERROR" and r.meta()["reason"] == line
    assert [f for f in files_in(full) if not f.endswith(".meta.json")] == []  # no .tmp, no .lock
    assert leftovers_of(r.results) == []


# ----- 3. resume that is safe ----------------------------------------------------------------------------------
@pytest.fixture
def stopped(kvrun):
    """A run whose sidecar says ERROR, its table of one case kept: what --resume continues."""
    r = kvrun(TWO, env={"KVBENCH_FAULT": "post:1:2"}, timeout=60)
    assert r.code == 4 and r.meta()["status"] == "ERROR", r.err
    assert not os.path.exists(lock_path(r.results))  # the failed run let its set go
    return r


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resume_of_a_damaged_table_is_one_line(kvrun, stopped, damage):
    data = open(stopped.results, "rb").read()
    with open(stopped.results, "wb") as fh:
        fh.write(data[: len(data) // 2] if damage == "truncated" else b"not a parquet file\n" * 100)
    t0 = time.monotonic()
    assert_one_line(kvrun(["--resume", stopped.results], timeout=60), "the table cannot be read (truncated or corrupt)")
    assert time.monotonic() - t0 < 30
    assert stopped.meta()["status"] == "ERROR"  # refused before anything was touched
    assert not os.path.exists(lock_path(stopped.results))


def test_resume_with_another_results_folder_is_refused(kvrun, stopped, tmp_path):
    r = kvrun(["--resume", stopped.results, "-o", str(tmp_path / "other")], timeout=60)
    assert_one_line(r, "-o ", "continues its own result set", "leave -o out")
    assert not (tmp_path / "other").exists()


def test_resume_removes_the_tmp_files_a_kill_left(kvrun, stopped):
    folder = os.path.dirname(stopped.results)
    for tmp in (stopped.results + ".tmp", stopped.results.replace(".parquet", ".meta.json.tmp"),
                os.path.join(folder, "killed.parquet.tmp"), os.path.join(folder, "killed.lock")):
        open(tmp, "w").write("half a write")
    r = kvrun(["--resume", stopped.results], timeout=60)
    assert r.code == 0, r.out + r.err
    assert [f for f in os.listdir(os.path.dirname(stopped.results)) if f.endswith((".tmp", ".lock"))] == []


def test_the_next_run_into_a_folder_removes_a_killed_runs_tmp_files(kvrun, tmp_path):
    from kvbench.results.store import machine_name

    folder = tmp_path / "results" / f"not-{machine_name()}"
    folder.mkdir(parents=True)
    for name in ("old.parquet.tmp", "old.meta.json.tmp", "old.lock"):
        (folder / name).write_text("a kill -9's")
    mine = tmp_path / "results" / machine_name()
    mine.mkdir(exist_ok=True)
    for name in ("old.parquet.tmp", "old.meta.json.tmp", "old.lock"):
        (mine / name).write_text("a kill -9's")
    r = kvrun(ONE, timeout=60)
    assert r.code == 0, r.err
    assert [f for f in os.listdir(mine) if f.startswith("old")] == []
    assert len(os.listdir(folder)) == 3  # another machine's folder is not this run's to sweep


def _start(args, out, env=None):
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    cmd = [exe, "-n", "2", sys.executable, "-m", "kvbench", "run", *args] + ([] if "--resume" in args else ["-o", str(out)])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def _wait_for(pred, proc, seconds=40):
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not reached (launch rc={proc.poll()})")


def _locked_set(out) -> str | None:
    """The parquet path of the result set in ``out`` once its run holds its lock."""
    metas = glob.glob(str(out / "*" / "*.meta.json"))
    path = metas[0].replace(".meta.json", ".parquet") if metas else None
    return path if path and os.path.exists(lock_path(path)) else None


def _kill(proc, parquet=None):
    """SIGKILL the whole launch, then remove the /dev/shm files its sidecar names (a kill -9 leaves them)."""
    kill_group(proc)
    proc.communicate(timeout=30)
    if parquet:
        meta = json.load(open(parquet.replace(".parquet", ".meta.json")))
        cleanup.unlink_run(meta["run_id"])
        cleanup.unlink_mpich(meta.get("shm_segments", {}).get("mpich", []))


def test_a_live_run_is_locked_and_its_first_setup_kill_resumes_cleanly(kvrun, tmp_path):
    """A run stopped in its first setup (no case stored) holds its set: a resume is refused naming it; once
    killed -9, a resume measures every case, ends OK and leaves no lock."""
    out = tmp_path / "results"
    live = _start(TWO, out, env={"KVBENCH_FAULT": "stall-setup:1"})
    path = None
    try:
        path = _wait_for(lambda: _locked_set(out), live)
        r = kvrun(["--resume", path], timeout=60, leftovers_ok=True)
        assert_one_line(r, "another kvbench run holds", "pid ", " on ", "wait for it to end")
    finally:
        _kill(live, path)
    meta = path.replace(".parquet", ".meta.json")
    assert not os.path.exists(path)  # killed before its first case was stored
    # the launcher was killed first (its proxies then SIGKILL the ranks): rank 0's reaper says so
    assert json.load(open(meta))["status"] in ("INCOMPLETE", "INTERRUPTED")
    r = kvrun(["--resume", path], timeout=60)
    assert r.code == 0, r.out + r.err
    assert "# wrong elements: 0   cases: 2 (0 skipped)   OK" in r.out
    assert json.load(open(meta))["status"] == "OK"
    assert sorted(set(r.table().case)) == [1, 2] and r.table()["seconds"].dtype == "float64"
    assert [f for f in os.listdir(os.path.dirname(path)) if f.endswith((".tmp", ".lock"))] == []


def test_a_second_resume_of_one_set_is_refused(kvrun, stopped):
    first = _start(["--resume", stopped.results], None, env={"KVBENCH_FAULT": "stall-setup:1"})
    try:
        _wait_for(lambda: os.path.exists(lock_path(stopped.results)), first)
        r = kvrun(["--resume", stopped.results], timeout=60, leftovers_ok=True)
        assert_one_line(r, "another kvbench run holds", f"on {os.uname().nodename}")
    finally:
        _kill(first, stopped.results)


# ----- the lock and the sweep, without MPI ---------------------------------------------------------------------
def test_lock_names_its_holder_and_release_removes_it(tmp_path):
    p = str(tmp_path / "set.parquet")
    held = ResultLock(p)
    with pytest.raises(LockHeld, match=rf"pid {os.getpid()} on "):
        ResultLock(p)
    held.release()
    assert not os.path.exists(lock_path(p))
    ResultLock(p).release()  # free again
    open(lock_path(p), "w").write("pid 1 on gone\n")  # a kill -9 leaves the file, not the lock
    ResultLock(p).release()


def test_sweep_keeps_a_live_sets_tmp_files(tmp_path):
    live, dead = str(tmp_path / "live.parquet"), str(tmp_path / "dead.parquet")
    held = ResultLock(live)
    for p in (live + ".tmp", dead + ".tmp", str(tmp_path / "dead.meta.json.tmp"), lock_path(dead),
              str(tmp_path / "unrelated.tmp")):
        open(p, "w").write("x")
    sweep_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["live.lock", "live.parquet.tmp", "unrelated.tmp"]
    held.release()
