"""Files in a shared results folder (issue 45, items 2 and 7): a link planted under the name of a file kvbench
writes or sweeps there (a result set's `.lock`, the table's and the sidecar's `.tmp`, a stand-in's or the
reaper's own `.tmp`) is refused in one line and its target is left unchanged; a FIFO or another user's file
under such a name is refused too, without blocking; and kvbench's `git` calls take no lock in the checkout."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers.args import SMALL
from helpers.asserts import assert_one_line

from kvbench.job import cleanup, reaper
from kvbench.job.safefile import UnsafeFile, create_new, open_own
from kvbench.results import lock, machine, sidecar
from kvbench.results.store import ResultWriter, machine_name

SET = "20200101-000000_planted"
PRECIOUS = "precious: must not change\n"


@pytest.fixture
def target(tmp_path):
    """A file the user can write, outside the results folder: what a planted link points at."""
    t = tmp_path / "elsewhere" / "precious.txt"
    t.parent.mkdir()
    t.write_text(PRECIOUS)
    return t


def plant(folder, name: str, target) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / name
    link.symlink_to(target)
    return str(link)


def assert_untouched(target, link: str | None = None):
    assert target.read_text() == PRECIOUS
    if link:
        assert os.path.islink(link)  # refused, not removed: the user sees what was planted


KINDS = [f"{SET}.lock", f"{SET}.parquet.tmp", f"{SET}.meta.json.tmp", f"{SET}.meta.json.12345.tmp"]


@pytest.mark.parametrize("name", KINDS)
def test_the_sweep_refuses_a_planted_link(tmp_path, target, name):
    link = plant(tmp_path / "res", name, target)
    with pytest.raises(UnsafeFile, match="is a symbolic link"):
        lock.sweep_stale(str(tmp_path / "res"))
    assert_untouched(target, link)


def test_the_lock_refuses_a_planted_link(tmp_path, target):
    link = plant(tmp_path / "res", f"{SET}.lock", target)
    with pytest.raises(UnsafeFile, match=f"{SET}.lock is a symbolic link"):
        lock.ResultLock(str(tmp_path / "res" / f"{SET}.parquet"))
    assert_untouched(target, link)


@pytest.mark.parametrize("which", ["table", "sidecar"])
def test_a_whole_write_refuses_a_planted_temporary(tmp_path, target, which):
    final = tmp_path / "res" / (f"{SET}.parquet" if which == "table" else f"{SET}.meta.json")
    link = plant(tmp_path / "res", os.path.basename(cleanup.tmp_of(str(final))), target)
    with pytest.raises(UnsafeFile):
        sidecar.write_json(str(final), {"status": "OK"})
    assert_untouched(target, link)
    assert not final.exists()


def test_a_link_in_place_of_the_file_is_replaced_not_followed(tmp_path, target):
    link = plant(tmp_path / "res", f"{SET}.meta.json", target)
    sidecar.write_json(link, {"status": "OK"})
    assert_untouched(target)
    assert not os.path.islink(link) and json.loads(open(link).read()) == {"status": "OK"}


def test_a_writer_refuses_a_planted_lock_before_writing(tmp_path, target):
    folder = tmp_path / "res" / machine_name()
    link = plant(folder, f"{SET}.lock", target)
    with pytest.raises(UnsafeFile):
        ResultWriter(str(tmp_path / "res"), "x", {})
    assert_untouched(target, link)
    assert sorted(os.listdir(folder)) == [f"{SET}.lock"]  # no claimed name left behind either


@pytest.mark.parametrize("who", ["stand-in", "reaper"])
def test_a_stand_in_or_reaper_does_not_write_through_a_link(tmp_path, target, who):
    folder = tmp_path / "res"
    folder.mkdir()
    meta = folder / f"{SET}.meta.json"
    meta.write_text(json.dumps({"status": "INCOMPLETE"}))
    link = plant(folder, os.path.basename(cleanup.own_tmp_of(str(meta))), target)
    if who == "stand-in":
        assert sidecar.record_for_rank0(str(meta), "TIMEOUT", "why") is False
    else:
        reaper.record(str(meta), False, 0, 1)
    assert_untouched(target, link)
    assert json.loads(meta.read_text())["status"] == "INCOMPLETE"


def test_a_sidecar_that_is_a_link_is_not_read_by_the_reaper(tmp_path, target):
    folder = tmp_path / "res"
    link = plant(folder, f"{SET}.meta.json", target)
    reaper.record(link, False, 0, 1)
    assert_untouched(target, link)


def test_a_fifo_under_a_lock_name_is_refused_without_blocking(tmp_path):
    folder = tmp_path / "res"
    folder.mkdir()
    os.mkfifo(folder / f"{SET}.lock")
    with pytest.raises(UnsafeFile, match="not a regular file"):
        lock.sweep_stale(str(folder))
    with pytest.raises(UnsafeFile, match="not a regular file"):
        open_own(str(folder / f"{SET}.lock"), os.O_RDONLY)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_lock_is_refused(tmp_path):
    folder = tmp_path / "res"
    folder.mkdir()
    theirs = folder / f"{SET}.lock"
    theirs.write_text("pid 1 on elsewhere\n")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeFile, match="belongs to user 65534"):
        lock.sweep_stale(str(folder))
    with pytest.raises(UnsafeFile, match="belongs to user 65534"):
        create_new(str(theirs))
    assert theirs.read_text() == "pid 1 on elsewhere\n"


def test_a_stale_temporary_of_ones_own_is_replaced(tmp_path):
    stale = tmp_path / "x.meta.json.tmp"
    stale.write_text("half written")
    sidecar.write_json(str(tmp_path / "x.meta.json"), {"a": 1})
    assert not stale.exists() and json.loads((tmp_path / "x.meta.json").read_text()) == {"a": 1}


def test_a_run_refuses_a_planted_lock_in_one_line(kvrun, tmp_path, target):
    """On real ranks: the door finds the link in the folder the run would write (<results>/<machine>/),
    refuses the run with one line naming it (exit 1), and the link's target is unchanged."""
    folder = tmp_path / "results" / machine_name()
    link = plant(folder, f"{SET}.lock", target)
    r = kvrun(SMALL + ["-t", "shm"], timeout=60)
    assert_one_line(r, link, "symbolic link")
    assert_untouched(target, link)
    assert sorted(os.listdir(folder)) == [f"{SET}.lock"]


def test_git_takes_no_optional_lock(monkeypatch):
    seen = []

    def run(cmd, **kw):
        seen.append(kw.get("env") or {})
        return subprocess.CompletedProcess(cmd, 0, stdout="abc\n", stderr="")

    monkeypatch.setattr(machine.subprocess, "run", run)
    assert machine.git_commit().startswith("abc")
    assert len(seen) == 2 and all(env.get("GIT_OPTIONAL_LOCKS") == "0" for env in seen)
