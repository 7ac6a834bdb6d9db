"""job/launch.py: a launch killed at its deadline takes the MPICH segments its tree made since its last look."""
import os
import subprocess
import sys
import time
import uuid

import pytest

from kvbench.job.launch import kill_tree, launch, starttime

pytestmark = pytest.mark.launches  # python processes only (no MPI): seconds

# A parent that starts a child after a moment; the child opens a segment (not mapped: MPICH opens before it maps)
# and sleeps: killed from outside, the file stays.
TREE = """
import os, subprocess, sys, time
time.sleep(float(sys.argv[2]))
subprocess.Popen([sys.executable, "-c",
    "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
    "open(sys.argv[1] + '.ready', 'w').close(); time.sleep(60)", sys.argv[1]])
time.sleep(60)
"""


def _segment() -> str:
    return f"/dev/shm/mpich_shm_kvbtest{uuid.uuid4().hex[:8]}_0"


def _wait_ready(path: str) -> None:
    end = time.monotonic() + 20
    while not os.path.exists(path + ".ready") and time.monotonic() < end:
        time.sleep(0.02)
    os.unlink(path + ".ready")


@pytest.fixture
def tree():
    """A parent whose child holds a fresh segment open, ready: (parent, segment path); both gone after."""
    seg = _segment()
    p = subprocess.Popen([sys.executable, "-c", TREE, seg, "0"])
    try:
        _wait_ready(seg)
        yield p, seg
    finally:
        p.kill()
        if os.path.exists(seg):
            os.unlink(seg)


def test_kill_tree_stops_the_tree_and_names_what_it_holds_open_even_a_child_started_since(tree):
    p, seg = tree
    seen: set[str] = set()
    kill_tree(p.pid, tree={}, seen=seen)  # an empty tree: the child is found as kill_tree stops the root
    p.wait(timeout=10)
    assert seen == {os.path.basename(seg)}


def test_kill_tree_without_seen_names_nothing_and_kills_the_child_too(tree):
    p, _ = tree
    kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
    kill_tree(p.pid)
    p.wait(timeout=10)
    end = time.monotonic() + 10
    while any(starttime(k) is not None for k in kids) and time.monotonic() < end:
        time.sleep(0.05)
    assert kids and all(starttime(k) is None for k in kids)


def test_a_launch_past_its_deadline_removes_a_segment_made_after_its_last_look():
    seg = _segment()
    # the child opens its segment 0.6 s in; the launch's looks back off to every 250 ms, its deadline is at 1.5 s
    rc, _ = launch([sys.executable, "-c", TREE, seg, "0.6"], timeout=1.5)
    try:
        assert rc == 124
        assert not os.path.exists(seg)
    finally:
        for f in (seg, seg + ".ready"):
            if os.path.exists(f):
                os.unlink(f)
