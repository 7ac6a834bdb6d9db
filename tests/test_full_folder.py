"""A results folder that cannot take a run's first files (a full disk): the run's claimed sidecar and its lock go
again, so no empty sidecar (invalid JSON) or empty lock naming no holder stays behind (issue 45, item 5)."""
from __future__ import annotations

import errno
import os

import pytest

from kvbench.results import lock as L
from kvbench.results import store


def full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["lock", "sidecar"])
def test_a_full_folder_leaves_no_empty_files(tmp_path, monkeypatch, where):
    if where == "lock":
        monkeypatch.setattr(L.os, "write", full)
    else:
        monkeypatch.setattr(store.ResultWriter, "_write_meta", full)
    with pytest.raises(OSError, match="No space left"):
        store.ResultWriter(str(tmp_path), "cli", {"run_id": "abc"})
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert left == [], left


def test_the_lock_is_written_when_there_is_room(tmp_path):
    w = store.ResultWriter(str(tmp_path), "cli", {"run_id": "abc"})
    try:
        assert open(w.lock.path).read().startswith(f"pid {os.getpid()} on ")
    finally:
        w.lock.release()
