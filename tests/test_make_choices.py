"""`make install MPI=site` after `make bench` re-installs (issue 46 item 5): the venv remembers what it was installed
with, and a change of MPI or ENGINES runs the install again; the same choices again leave it alone.  The venv's
python here is a stand-in that logs what make asks of it (pip is never run)."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
[ "$1" = "-c" ] && exit 1
exit 0
"""


def install(venv: Path, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """make install with ``args``: (its output, the python calls it made)."""
    log = venv / "calls.log"
    before = log.read_text().splitlines() if log.exists() else []
    env = dict(os.environ, PATH=f"{tmp / 'bin'}:{os.environ['PATH']}")
    r = subprocess.run(["make", "-C", str(ROOT), f"VENV={venv}", "install", *args], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr, (log.read_text().splitlines() if log.exists() else [])[len(before):]


def test_a_change_of_mpi_or_engines_reinstalls_and_the_same_choices_do_not(tmp_path):
    venv, bins = tmp_path / "venv", tmp_path / "bin"
    for d, name in ((venv / "bin", "python"), (bins, "mpirun"), (bins, "mpicc")):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(FAKE if name == "python" else "#!/bin/sh\nexit 0\n")
        (d / name).chmod(stat.S_IRWXU)
    _, calls = install(venv, tmp_path)
    assert any("pip install -q mpi4py mpich" in c for c in calls), calls
    assert (venv / ".kvbench-choices").read_text() == "MPI=wheel ENGINES=1\n"
    _, calls = install(venv, tmp_path)
    assert calls == []  # make bench after make install: nothing to do
    out, calls = install(venv, tmp_path, "MPI=site")
    assert "install: MPI=wheel ENGINES=1 -> MPI=site ENGINES=1: re-installing" in out, out
    assert any("pip uninstall -q -y mpich" in c for c in calls), calls
    assert any("--force-reinstall --no-cache-dir --no-binary mpi4py mpi4py" in c for c in calls), calls
    assert install(venv, tmp_path, "MPI=site")[1] == []
    assert any("ucxx" in c for c in calls)  # engines came with it; ENGINES=0 drops them
    assert not any("ucxx" in c for c in install(venv, tmp_path, "MPI=site", "ENGINES=0")[1])
