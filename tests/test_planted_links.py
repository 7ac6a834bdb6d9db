"""The planted-link test (issue 45 item 3): for every file kvbench writes or sweeps in a results folder -- the
table, the sidecar, the lock, the temporary files, the --json/--csv exports, the report's pages and plots, the
sweeps' targets -- a link planted in its place is refused (one line; exit 1 for a launch), its target keeps its
content and mtime, and the link stays a link.  And the results folder itself: another user's, or one anyone may
write without the sticky bit, is refused in one line saying how to fix it."""
from __future__ import annotations

import datetime as real_dt
import json
import os
import types

import pandas as pd
import pytest
from helpers.asserts import assert_one_line

from kvbench.config import ConfigError
from kvbench.config.runconfig import results_dir
from kvbench.job import cleanup, folder, reaper
from kvbench.job.safefile import UnsafeFile
from kvbench.report.page import Page
from kvbench.report.writers import write as write_report
from kvbench.results import export, lock, sidecar, store
from kvbench.results.store import ResultWriter, machine_name

STAMP = "20200101-000000"
SET = f"{STAMP}_x"
PRECIOUS = "precious: must not change\n"
TINY = ["-t", "shm", "-m", "llama-3-8b", "--tokens", "16", "-n", "2", "-w", "0"]
NOBODY = 65534


@pytest.fixture
def victim(tmp_path):
    """A file the user can write, outside the results folder, with an mtime in the past: what a link points at."""
    v = tmp_path / "elsewhere" / "precious.txt"
    v.parent.mkdir()
    v.write_text(PRECIOUS)
    os.utime(v, (1_000_000_000, 1_000_000_000))
    return v


@pytest.fixture
def res(tmp_path):
    """The machine's folder of a results folder (<results>/<machine>/), made as a run makes it."""
    d = tmp_path / "results" / machine_name()
    d.mkdir(parents=True)
    return d


def plant(path, victim) -> str:
    os.symlink(victim, path)
    return str(path)


def untouched(victim, link: str) -> None:
    assert victim.read_text() == PRECIOUS and victim.stat().st_mtime == 1_000_000_000
    assert os.path.islink(link), f"{link} was removed or replaced"


def one_line(exc) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


@pytest.fixture
def frozen(monkeypatch):
    """The writer's clock stopped at STAMP, so that a test knows the names a new result set will claim."""
    fixed = real_dt.datetime(2020, 1, 1, 0, 0, 0)
    monkeypatch.setattr(store, "dt", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: fixed)))


def a_set(res, status="INCOMPLETE") -> str:
    """A result set of one stored row, as a killed run leaves it; returns its parquet."""
    parquet = res / f"{SET}.parquet"
    pd.DataFrame([{c: None for c in store.ROW_COLUMNS}]).astype(str).to_parquet(parquet)
    (res / f"{SET}.meta.json").write_text(json.dumps({"status": status, "groups_done": []}))
    return str(parquet)


META = {"started": "now", "argv": [], "git_commit": "abc", "run_id": "r", "shm_segments": {}}


# ----- the table and the sidecar of a new run: a name taken by a link is not claimed
@pytest.mark.parametrize("name", [f"{SET}.parquet", f"{SET}.meta.json"])
def test_a_new_set_does_not_claim_a_name_a_link_holds(res, victim, frozen, name):
    link = plant(res / name, victim)
    w = ResultWriter(str(res.parent), "x", {})
    try:
        w.add([{"case": 1, "transport": "shm"}])
        assert not w.path.startswith(str(res / SET) + ".")  # the next free name (-1), not the planted one
    finally:
        w.close()
    untouched(victim, link)


# ----- a resumed set: a link in place of its table, sidecar or temporary is refused before anything is read
@pytest.mark.parametrize("name", [f"{SET}.parquet", f"{SET}.meta.json", f"{SET}.parquet.tmp", f"{SET}.meta.json.tmp"])
def test_a_resume_refuses_a_link_in_its_set(res, victim, name):
    parquet = a_set(res)
    if os.path.exists(res / name):
        os.unlink(res / name)
    link = plant(res / name, victim)
    lk = lock.ResultLock(parquet)
    try:
        with pytest.raises(UnsafeFile) as exc:
            ResultWriter.reopen(parquet, META, lk)
    finally:
        lk.release()
    assert "symbolic link" in one_line(exc)
    untouched(victim, link)


# ----- the lock
def test_the_lock_refuses_a_link(res, victim):
    link = plant(res / f"{SET}.lock", victim)
    with pytest.raises(UnsafeFile) as exc:
        lock.ResultLock(str(res / f"{SET}.parquet"))
    assert "symbolic link" in one_line(exc)
    untouched(victim, link)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_the_reaper_leaves_another_users_lock(res):
    parquet = a_set(res)
    theirs = res / f"{SET}.lock"
    theirs.write_text("pid 1 on elsewhere\n")
    os.chown(theirs, NOBODY, NOBODY)
    reaper.record(str(res / f"{SET}.meta.json"), False, 0, 1)
    assert theirs.read_text() == "pid 1 on elsewhere\n"
    assert os.path.exists(parquet)


# ----- temporary files: whoever removes them (the writer's close, a stand-in, the reaper, the sweep) leaves a link
@pytest.mark.parametrize("who", ["close", "stand-in", "reaper", "sweep"])
@pytest.mark.parametrize("tail", [".parquet.tmp", ".meta.json.tmp"])
def test_a_temporary_link_is_not_removed(res, victim, frozen, who, tail):
    if who == "close":
        w = ResultWriter(str(res.parent), "x", {})
        link = plant(w.path[: -len(".parquet")] + tail, victim)
        w.close()
    else:
        a_set(res)
        link = plant(res / f"{SET}{tail}", victim)
        if who == "stand-in":
            sidecar.record_for_rank0(str(res / f"{SET}.meta.json"), "TIMEOUT", "why")
        elif who == "reaper":
            reaper.record(str(res / f"{SET}.meta.json"), False, 0, 1)
        else:
            with pytest.raises(UnsafeFile) as exc:
                lock.sweep_stale(str(res))
            assert "symbolic link" in one_line(exc)
    untouched(victim, link)


@pytest.mark.parametrize("who", ["stand-in", "reaper"])
def test_a_lock_link_is_not_removed_after_a_kill(res, victim, who):
    a_set(res)
    link = plant(res / f"{SET}.lock", victim)
    if who == "stand-in":
        sidecar.record_for_rank0(str(res / f"{SET}.meta.json"), "TIMEOUT", "why")
    else:
        reaper.record(str(res / f"{SET}.meta.json"), False, 0, 1)
    untouched(victim, link)


# ----- the /dev/shm sweep: a link named like a dead rank's file is neither read nor removed
@pytest.mark.parametrize("name", ["kvbench_planted_r0_p999999999", "kvbench_planted_mpich_r0_p999999999"])
def test_the_shm_sweep_leaves_a_link(tmp_path, victim, monkeypatch, name):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(cleanup, "SHM_DIR", str(shm))
    link = plant(shm / name, victim)
    assert cleanup.sweep_orphans() == [] and cleanup.unlink_run("planted") == []
    assert cleanup.survey().orphans == []
    untouched(victim, link)


# ----- --json / --csv
@pytest.mark.parametrize("kind", ["json", "csv"])
def test_an_export_refuses_a_link(tmp_path, victim, kind):
    link = plant(tmp_path / f"rows.{kind}", victim)
    with pytest.raises(export.ExportError) as exc:
        export.WRITERS[kind](pd.DataFrame(columns=store.ROW_COLUMNS), link)
    assert "symbolic link" in one_line(exc)
    with pytest.raises(export.ExportError, match="symbolic link"):
        export.check_flags(types.SimpleNamespace(**{kind: link}))
    untouched(victim, link)


def test_a_launch_refuses_an_export_link(kvrun, tmp_path, victim):
    link = plant(tmp_path / "rows.json", victim)
    r = kvrun(TINY + ["--json", link], timeout=90)
    assert_one_line(r, link, "symbolic link")
    untouched(victim, link)


# ----- the report's pages and plots
def a_page() -> Page:
    page = Page("planted")
    page.add_section("S", "text", figures=[("a plot", b"\x89PNG not really")])
    page.add_data("", pd.DataFrame({"a": [1]}))
    return page


@pytest.mark.parametrize("name", ["report.md", "report.html", "report.csv", "plots/fig01-old.png", "plots"])
def test_the_report_refuses_a_link(tmp_path, victim, name):
    out = tmp_path / "page"
    (out / "plots").mkdir(parents=True)
    if name == "plots":
        os.rmdir(out / "plots")
    link = plant(out / name, victim if name != "plots" else victim.parent)
    with pytest.raises(UnsafeFile) as exc:
        write_report(a_page(), str(out))
    assert "symbolic link" in one_line(exc)
    untouched(victim, link)
    assert sorted(os.listdir(victim.parent)) == ["precious.txt"]  # nothing written in the link's folder either


def test_the_report_writes_whole_files_where_nothing_is_planted(tmp_path):
    out = tmp_path / "page"
    paths = write_report(a_page(), str(out))
    assert sorted(os.path.basename(p) for p in paths) == ["report.csv", "report.html", "report.md"]
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


# ----- the results folder itself
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_folder_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as exc:
        results_dir(str(theirs))
    assert f"belongs to user {NOBODY}" in one_line(exc) and "-o" in str(exc.value)
    with pytest.raises(folder.UnsafeFolder):
        ResultWriter(str(theirs), "x", {})
    with pytest.raises(folder.UnsafeFolder):
        write_report(a_page(), str(theirs))
    assert os.listdir(theirs) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_machine_folder_is_refused(tmp_path):
    inner = tmp_path / "results" / machine_name()
    inner.mkdir(parents=True)
    os.chown(inner, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to user {NOBODY}"):
        results_dir(str(tmp_path / "results"))


def test_a_machine_folder_that_is_a_link_is_refused(tmp_path, victim):
    (tmp_path / "results").mkdir()
    link = plant(tmp_path / "results" / machine_name(), victim.parent)
    with pytest.raises(ConfigError) as exc:
        results_dir(str(tmp_path / "results"))
    assert "symbolic link" in one_line(exc)
    with pytest.raises(folder.UnsafeFolder):
        ResultWriter(str(tmp_path / "results"), "x", {})
    assert sorted(os.listdir(victim.parent)) == ["precious.txt"]
    assert os.path.islink(link)


@pytest.mark.parametrize("mode, ok", [(0o777, False), (0o1777, True), (0o775, True)])
def test_a_folder_anyone_may_write_needs_the_sticky_bit(tmp_path, mode, ok):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    for path in (shared, shared / "mine"):  # the folder, and one kvbench would make in it
        if ok:
            assert results_dir(str(path)) == str(path)
            continue
        with pytest.raises(ConfigError) as exc:
            results_dir(str(path))
        line = one_line(exc)
        assert "writable by others without the sticky bit" in line
        assert f"chmod o-w {shared}" in line and f"chmod +t {shared}" in line
    if not ok:
        with pytest.raises(folder.UnsafeFolder):
            ResultWriter(str(shared), "x", {})
        assert os.listdir(shared) == []


def test_a_launch_refuses_a_folder_anyone_may_write(kvrun, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    r = kvrun(TINY, out_dir=shared, timeout=90)
    assert_one_line(r, str(shared), "chmod o-w")
    assert os.listdir(shared) == []
