"""kvbench.job.cleanup: leftovers in /dev/shm recognised by owner pid and removed (no MPI needed).

SHM_DIR is a tmp dir in every test, so nothing here can touch the real /dev/shm.
"""
from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys

import pytest

from kvbench.job import cleanup
from kvbench.transports.base import Context, TransportError
from kvbench.transports.shm import ShmTransport


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setattr(cleanup, "SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def touch(path, text="x"):
    path.write_text(text)
    return str(path)


@pytest.fixture
def mapped(shm):
    """map(name) -> path: a file under SHM_DIR that this (live) process maps."""
    held = []

    def make(name):
        path = shm / name
        path.write_bytes(b"\0" * mmap.PAGESIZE)
        with open(path, "r+b") as fh:
            held.append(mmap.mmap(fh.fileno(), mmap.PAGESIZE))
        return str(path)

    yield make
    for m in held:
        m.close()


def test_segment_path_names_run_rank_and_pid(shm):
    assert cleanup.segment_path("ab12", 3) == f"{shm}/kvbench_ab12_r3_p{os.getpid()}"


def test_sweep_removes_dead_pids_files_and_their_unmapped_mpich(shm, dead_pid, mapped):
    live = os.getpid()
    seg_dead = touch(shm / f"kvbench_aa_r0_p{dead_pid}")
    gone = str(shm / "mpich_shm_gone_0")  # listed, already removed: not an error
    free = touch(shm / "mpich_shm_dead_0")  # listed, nobody maps it: goes
    busy = mapped("mpich_shm_busy_0")  # listed, a live process maps it: stays
    reg_dead = touch(shm / f"kvbench_aa_mpich_r0_p{dead_pid}", f"{gone}\n{free}\n{busy}\n")
    outside = touch(shm.parent / f"mpich_shm_outside_{os.getpid()}")  # listed but not in SHM_DIR: never touched
    reg_dead2 = touch(shm / f"kvbench_aa_mpich_r1_p{dead_pid}", outside + "\n")
    keep = [
        touch(shm / f"kvbench_bb_r0_p{live}"),  # a live process's segment
        touch(shm / f"kvbench_bb_mpich_r0_p{live}", free),  # a live process's registry
        touch(shm / "mpich_shm_other_0"),  # another job's MPICH file, in no registry
        touch(shm / f"kvbench_aa_{dead_pid}"),  # not named like ours (old scheme, no pid marker)
        touch(shm / f"kvbench_aa_r0_p{dead_pid}.tmp"),
        touch(shm / "unrelated"),
        busy,
    ]
    try:
        removed = cleanup.sweep_orphans()
        assert sorted(removed) == sorted([seg_dead, free, reg_dead, reg_dead2])
        assert all(os.path.exists(p) for p in [*keep, outside])
        assert not any(os.path.exists(p) for p in removed)
        assert cleanup.sweep_orphans() == []  # a second (or concurrent) sweep finds nothing and does not raise
    finally:
        os.unlink(outside)


def test_sweep_keeps_pids_it_may_not_signal(shm, monkeypatch):
    def kill(pid, sig):
        raise PermissionError(errno.EPERM, "not permitted")

    monkeypatch.setattr(os, "kill", kill)
    f = touch(shm / "kvbench_aa_r0_p1")
    assert cleanup.sweep_orphans() == [] and os.path.exists(f)


def test_unlink_run_removes_only_that_runs_files(shm, dead_pid):
    mine = [touch(shm / f"kvbench_aa_r0_p{dead_pid}"), touch(shm / f"kvbench_aa_r1_p{os.getpid()}"),
            touch(shm / f"kvbench_aa_mpich_r1_p{os.getpid()}")]
    others = [touch(shm / f"kvbench_ab_r0_p{dead_pid}"), touch(shm / f"kvbench_aab_r0_p{dead_pid}"),
              touch(shm / "mpich_shm_x_0"), touch(shm / "aa")]
    assert sorted(cleanup.unlink_run("aa")) == sorted(mine)
    assert all(os.path.exists(p) for p in others) and not any(os.path.exists(p) for p in mine)
    assert cleanup.unlink_run("aa") == []
    assert cleanup.leftovers("aa", [others[2]]) == [others[2]]
    assert cleanup.leftovers("ab") == [others[0]]


def test_mapped_mpich_finds_a_mapped_file_and_record_unlink(shm, mapped):
    path = mapped("mpich_shm_x_0")
    touch(shm / "mpich_shm_unmapped_0")
    assert cleanup.mapped_mpich() == [path]
    reg = cleanup.record_mpich("aa", 0)
    assert reg == f"{shm}/kvbench_aa_mpich_r0_p{os.getpid()}"
    assert open(reg).read().split() == [path]
    assert cleanup.unlink_mpich([path, str(shm / "mpich_shm_gone_0")]) == [path]
    assert cleanup.mapped_mpich() == []  # now " (deleted)" in the maps
    assert cleanup.leftovers("aa", [path]) == [reg]


def test_record_mpich_writes_nothing_without_mpich(shm):
    assert cleanup.record_mpich("aa", 0) is None and os.listdir(shm) == []


def test_shm_free_bytes_is_statvfs(shm):
    st = os.statvfs(shm)
    assert abs(cleanup.shm_free_bytes(str(shm)) - st.f_bavail * st.f_frsize) < 64 * 2**20


def test_shm_alloc_names_segment_by_pid(shm):
    t = ShmTransport(Context(1, 2, "h", "aa"))
    buf = t.alloc(3 * mmap.PAGESIZE)
    try:
        assert t.path == f"{shm}/kvbench_aa_r1_p{os.getpid()}" and os.path.getsize(t.path) == 3 * mmap.PAGESIZE
        assert cleanup.leftovers("aa") == [t.path]
    finally:
        buf.release()
    assert cleanup.leftovers("aa") == []


def test_shm_alloc_refuses_more_than_free_space(shm, monkeypatch):
    monkeypatch.setattr(cleanup, "shm_free_bytes", lambda path=None: 67 * 2**20)
    t = ShmTransport(Context(0, 2, "h", "aa"))
    with pytest.raises(TransportError) as exc:
        t.alloc(256 * 2**20)
    msg = str(exc.value)
    assert "256.0 MiB" in msg and "67.0 MiB" in msg and "shm-size" in msg and "\n" not in msg
    assert os.listdir(shm) == []


def test_shm_alloc_turns_a_failed_reservation_into_an_error(shm, monkeypatch):
    """Another rank may take the space between the check and the fill: ENOSPC, not a SIGBUS in fill."""
    def fallocate(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    t = ShmTransport(Context(0, 2, "h", "aa"))
    with pytest.raises(TransportError, match="shm-size"):
        t.alloc(mmap.PAGESIZE)
    assert os.listdir(shm) == []


def fake_segment(run_id: str, rank: int, pid: int, mib: int = 0) -> str:
    """A pool segment named as the shm transport names it (cleanup.segment_path), owned by ``pid``."""
    path = cleanup.segment_path(run_id, rank).replace(f"_p{os.getpid()}", f"_p{pid}")
    with open(path, "wb") as fh:
        fh.write(os.urandom(mib << 20))  # written, so that its blocks are held like a filled pool's
    return path


def test_survey_tells_leftovers_of_dead_owners_from_files_in_use(shm, dead_pid, mapped):
    segs = [fake_segment("dead1", rank, dead_pid, 2) for rank in (0, 1)]
    free = touch(shm / "mpich_shm_dead_0")  # listed by the dead rank, nobody maps it: the sweep takes it
    busy = mapped("mpich_shm_busy_0")  # listed, but a live process maps it: in use, not a leftover
    reg = touch(shm / f"kvbench_dead1_mpich_r0_p{dead_pid}", f"{free}\n{busy}\n")
    stray = touch(shm / "mpich_shm_stray_0")  # no registry lists it, nobody maps it
    live = fake_segment("live1", 0, os.getpid(), 1)
    s = cleanup.survey()
    assert sorted(s.orphans) == sorted([*segs, reg, free]) and s.orphan_runs == ["dead1"]
    assert s.stray_mpich == [stray]
    assert s.in_use == [live] and s.live_runs == ["live1"]
    assert cleanup.held_bytes(segs) >= 4 << 20
    assert all(os.path.exists(p) for p in [*segs, free, busy, reg, stray, live])  # a survey removes nothing
    assert sorted(cleanup.sweep_orphans()) == sorted(s.orphans)  # it names what the sweep then removes
    assert cleanup.survey() == cleanup.Survey(stray_mpich=[stray], in_use=[live], live_runs=["live1"])


def test_list_says_how_much_the_leftovers_hold_and_what_removes_them(shm, dead_pid):
    from kvbench.cli.info import shm_lines

    assert shm_lines(cleanup.survey())[1:] == ["  no leftovers of kvbench or MPICH"]
    fake_segment("live1", 0, os.getpid(), 1)
    lines = shm_lines(cleanup.survey())
    assert not any("leftovers" in ln for ln in lines)  # a live run's segment is in use, not left over
    assert any(ln.startswith("  in use     1 kvbench file(s)") and "run live1" in ln and "1.0 MiB" in ln for ln in lines)
    for rank in (0, 1):
        fake_segment("dead1", rank, dead_pid, 2)
    touch(shm / "mpich_shm_stray_0")
    text = "\n".join(shm_lines(cleanup.survey()))
    assert "leftovers  2 file(s) of ended kvbench runs (run dead1), 4.0 MiB" in text
    assert "kvbench list --sweep" in text and "next `kvbench run`" in text
    assert "leftovers  1 MPICH segment(s) no live process maps" in text and f"rm {shm}/mpich_shm_*" in text


def test_a_zombie_counts_as_gone():
    """A rank killed and not yet reaped (its proxy gone, init slow to reap) maps nothing: its files are leftovers."""
    import time

    p = subprocess.Popen(["true"])
    try:
        for _ in range(100):  # exited, not waited for: a zombie
            with open(f"/proc/{p.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        assert not cleanup._alive(p.pid)
        assert cleanup._alive(os.getpid())
    finally:
        p.wait()
