"""Engines stay optional, and the ones that share a process with MPI really do."""
import subprocess
import sys

import pytest
from helpers.asserts import assert_clean
from helpers.launch import ROOT, unavailable

BLOCKED = {"nixl": "nixl", "ucx": "ucxx", "mooncake": "mooncake"}


@pytest.mark.launches
@pytest.mark.parametrize("name,module", sorted(BLOCKED.items()))
def test_missing_extra_says_how_to_install(name, module):
    # a process where the engine's package cannot be imported, as on a machine without the extra
    code = (f"import sys; sys.modules[{module!r}] = None; from kvbench import transports; "
            f"print(transports.probe({name!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"install kvbench[{name}]" in out.stdout


def test_unavailable_engine_rows_are_skipped_with_the_hint(kvrun, tmp_path):
    # sitecustomize blocks the import in every rank, the way a missing package would
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['nixl'] = None\n")
    r = kvrun(["-t", "nixl,shm", "--tokens", "64", "-n", "2", "-w", "0"], env={"PYTHONPATH": str(tmp_path)})
    assert r.code == 0, r.out + r.err
    df = r.table()
    sk = df[df.transport == "nixl"]
    assert (sk.status == "skipped").all()
    assert sk.reason.str.contains("install kvbench\\[nixl\\]").all()
    assert_clean(r, "shm")


def test_ucx_and_mpi_in_one_process(kvrun):
    """ucxx's UCX must load before MPI's (docs/pitfalls.md#ucx-first): kvbench preloads it; both transports work."""
    for name in ("ucx", "mpi"):
        reason = unavailable(name)
        if reason:
            pytest.skip(f"unavailable: {reason}")
    r = kvrun(["-t", "mpi,ucx,nixl", "--op", "push", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2", "-w", "1"],
              timeout=180)
    assert_clean(r, "mpi")
    assert_clean(r, "ucx")
    if not unavailable("nixl"):
        assert_clean(r, "nixl")  # and NIXL's UCX beside both, exiting cleanly (code 0, nothing left in /dev/shm)


@pytest.mark.parametrize("progress,says", [("event", "sleep on the worker's event fd"), ("poll", "polled")])
def test_ucx_waits_by_event_or_by_polling_move_the_same_bytes(kvrun, progress, says):
    """ucx's wait either sleeps on the worker's event fd between progress calls (the default) or spins: both
    complete every request, push and pull, one range per layer (bulk) and packed (paged), with the bytes
    checked; the sidecar says which the run used."""
    if reason := unavailable("ucx"):
        pytest.skip(f"unavailable: {reason}")
    r = kvrun(["-t", "ucx", "--op", "push,pull", "--variants", "bulk,paged", "--tokens", "64", "-b", "16", "-e", "16",
               "-n", "2", "-w", "1", "-O", f"ucx.progress={progress}"], timeout=180)
    assert_clean(r, "ucx")
    assert all(says in i["progress"] for i in r.meta()["transports"]["ucx"] if i)
