"""The fault matrix: SIGSTOP, SIGKILL and an exception on each of 2 ranks at each named phase of a run
(``KVBENCH_FAULT=action@point:rank[:case]``, kvbench/job/faults.py).

Each combination ends within its deadline plus MARGIN_S after the fault fired, with the exit code and the
sidecar's status of docs/reliability.md, exactly one ``kvbench:`` line naming it (none for a SIGKILL: the
launcher kills the other ranks at once, and its own banner names the dead rank), every case stored before the
fault kept, and none of the run's files left in /dev/shm or beside the results (after a SIGKILL the ranks'
reapers remove them: kvbench/job/reaper.py).

The 60 runs are launched together, a few at a time, by one module fixture (each with its own output folder
and run id); the parametrised tests then read their own.  ``KVBENCH_MATRIX_DOC=1`` rewrites the table in
docs/reliability.md from this run.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pandas as pd
import pytest
from helpers.launch import ROOT, kill_group, leftovers_of, mpiexec

from kvbench.cli.run import FINISH_MIN_S
from kvbench.cli.run import FINISH_S as FINISH_MAX_S
from kvbench.job.guard import ACK_WAIT_S as ACK_S
from kvbench.job.guard import GRACE_S  # ranks but 0 fire this much later; a rank waits ACK_S for rank 0's ack

pytestmark = pytest.mark.alone  # its 60 runs go six at a time, a load that would judge the other file's times for it

TIMEOUT_S, SETUP_S = 3, 3  # --timeout and --setup-timeout of every run
FINISH_S = max(FINISH_MIN_S, min(FINISH_MAX_S, TIMEOUT_S))  # the footer's and the last barrier's deadline (cli/run.py)
MARGIN_S = 15  # beyond the deadline, from the fault to the job's end: the exit path on a loaded 2-core machine
PARALLEL = 6  # runs at once (most of a run is a stopped rank and its peer waiting)
BASE = ["-n", "2", "-w", "0", "--tokens", "64", "-b", "16", "-e", "32", "--variants", "bulk,paged", "--rounds", "1",
        "--timeout", str(TIMEOUT_S), "--setup-timeout", str(SETUP_S)]  # 3 cases per transport: bulk, 16, 32

# phase -> (transports, the case the fault is armed for, the deadline that ends a stop there, cases kept)
PHASES = {
    "before-setup": ("shm", None, SETUP_S, [[]]),
    "fill": ("shm", None, SETUP_S, [[]]),
    "connect": ("shm", None, SETUP_S, [[]]),
    "case": ("shm", 2, TIMEOUT_S, [[1]]),
    "check": ("shm", 2, TIMEOUT_S, [[1]]),
    "between-cases": ("shm", 2, TIMEOUT_S, [[1]]),
    "between-transports": ("shm,tcp", None, SETUP_S, [[1, 2, 3]]),
    "after-last": ("shm", None, TIMEOUT_S, [[1, 2, 3]]),
    "table-write": ("shm", 2, TIMEOUT_S, [[1]]),
    "sidecar-finish": ("shm", None, FINISH_S, [[1, 2, 3]]),
}
ACTIONS = ("stop", "kill", "raise")
COMBOS = [(p, a, r) for p in PHASES for a in ACTIONS for r in (0, 1)]
CHECK = ("case", 1)  # `make check`: the matrix at one phase and rank, x stop/kill/raise
STATUS = {"stop": ("TIMEOUT", 5), "kill": ("INCOMPLETE", 9), "raise": ("ERROR", 4)}  # 9: hydra's, the signal's number


def expected_kept(phase: str, action: str, rank: int) -> list[list[int]]:
    """The cases the table may hold: rank 1's table-write point is after its rows of case 2 reached rank 0,
    which stores them unless the job ended first (a kill or an exception races rank 0's write)."""
    if phase == "table-write" and rank == 1:
        return [[1, 2]] if action == "stop" else [[1], [1, 2]]
    return PHASES[phase][3]


def expected_status(phase: str, action: str, rank: int) -> set[str]:
    """A SIGKILL of rank 1 while rank 0 writes the footer races that write: the sidecar may say OK (every case
    was measured and checked) when rank 0 finished it before the launcher killed it."""
    if (phase, action, rank) == ("sidecar-finish", "kill", 1):
        return {"INCOMPLETE", "OK"}
    return {STATUS[action][0]}


def deadline(phase: str, action: str, rank: int) -> float:
    """Seconds from the fault to the job's end, before the margin: a stop waits for a deadline (rank 0 stopped:
    rank 1's, which is later by its grace, then its wait for an ack); a kill or an exception ends it at once."""
    if action != "stop":
        return 0.0
    return PHASES[phase][2] + (GRACE_S + ACK_S if rank == 0 else 0)


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    wall: float  # from the fault (its stamp) to the launcher's exit
    meta: dict
    kept: list[int]
    shm_left: list[str]
    beside: list[str]  # files beside the results other than the table and the sidecar
    lines: list[str] = field(default_factory=list)


def _run(phase: str, action: str, rank: int, base: str) -> Outcome:
    transports, case, _, _ = PHASES[phase]
    out = os.path.join(base, f"{phase}-{action}-{rank}")
    os.makedirs(out)
    stamp = os.path.join(out, "fired")
    fault = f"{action}@{phase}:{rank}" + (f":{case}" if case else "")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVBENCH_FAULT=fault, KVBENCH_FAULT_STAMP=stamp)
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", os.path.join(out, "res"),
           "-t", transports, *BASE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        o, e = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        o, e = "", f"timed out after 120 s: {fault}"
    finally:
        kill_group(proc)
        proc.wait()
    end = time.time()
    fired = float(open(stamp).read().split()[0]) if os.path.exists(stamp) else float("nan")
    metas = glob.glob(os.path.join(out, "res", "*", "*.meta.json"))
    meta = json.load(open(metas[0])) if metas else {}
    parquet = metas[0].replace(".meta.json", ".parquet") if metas else None
    kept = sorted(set(pd.read_parquet(parquet).case)) if parquet and os.path.exists(parquet) else []
    beside = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "res", "*", "*"))
                    if not p.endswith((".parquet", ".meta.json")))
    lines = [ln for ln in e.splitlines() if ln.startswith("kvbench: ")]
    return Outcome(proc.returncode, o, e, end - fired, meta, [int(c) for c in kept],
                   leftovers_of(parquet) if meta else [], beside, lines=lines)


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    if mpiexec() is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    base = str(tmp_path_factory.mktemp("matrix"))
    chosen = {tuple(it.callspec.params[k] for k in ("phase", "action", "rank")) for it in request.session.items
              if it.name.startswith("test_fault[")}  # only what was selected (-k)
    slow_first = sorted(chosen, key=lambda c: -deadline(*c))  # the long waits overlap the short runs
    with ThreadPoolExecutor(PARALLEL) as pool:
        done = dict(zip(slow_first, pool.map(lambda c: _run(*c, base), slow_first)))
    if os.environ.get("KVBENCH_MATRIX_DOC") and len(done) == len(COMBOS):
        write_doc(done)
    return done


def short(line: str) -> str:
    """The line as the doc's table shows it: no host, no case description."""
    line = re.sub(r" on [^,:]+([,:])", r"\1", line)
    return re.sub(r" \(shm [^)]*\)", "", line).replace("|", "\\|")


def write_doc(done: dict) -> None:
    rows = ["| phase | fault | rank | exit | sidecar | the line | cases kept | left behind | s after the fault |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for phase, action, rank in COMBOS:
        o = done[(phase, action, rank)]
        line = short(o.lines[0]) if o.lines else "(none: the launcher's BAD TERMINATION banner)"
        left = ", ".join(sorted({re.sub(r"^\d{8}-\d{6}_cli", "", f) for f in o.beside}
                                | ({"/dev/shm segments"} if o.shm_left else set()))) or "nothing"
        rows.append(f"| {phase} | {action} | {rank} | {o.code} | {o.meta.get('status', '-')} | `{line}` | "
                    f"{','.join(map(str, o.kept)) or '-'} | {left} | {o.wall:.1f} |")
    path = os.path.join(ROOT, "docs", "reliability.md")
    text = open(path).read()
    head, mark, rest = text.partition("<!-- fault-matrix -->\n")
    _, end, tail = rest.partition("<!-- /fault-matrix -->")
    assert mark and end, "docs/reliability.md has no <!-- fault-matrix --> block"
    with open(path, "w") as fh:
        fh.write(head + mark + "\n".join(rows) + "\n" + end + tail)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase,action,rank", [pytest.param(p, a, r, id=f"{a}-{p}-r{r}",
                                                           marks=[pytest.mark.check] if (p, r) == CHECK else [])
                                              for p, a, r in COMBOS])
def test_fault(matrix, phase, action, rank):
    o = matrix[(phase, action, rank)]
    what = f"{action}@{phase}:{rank}\n{o.err}"
    assert o.wall == o.wall, f"the fault never fired: {what}"  # not NaN: the point was reached
    assert o.wall < deadline(phase, action, rank) + MARGIN_S, (o.wall, what)
    status, code = STATUS[action]
    assert o.code == code, (o.code, what)
    assert o.meta.get("status") in expected_status(phase, action, rank), (o.meta.get("status"), what)
    assert o.kept in expected_kept(phase, action, rank), (o.kept, what)
    assert "Traceback" not in o.err + o.out, what
    if action == "kill":  # nobody of kvbench is left to say it: the launcher's banner names the dead rank
        assert o.lines == [] and "BAD TERMINATION" in o.out + o.err and "EXIT CODE: 9" in o.out + o.err, what
        if o.meta.get("status") == "INCOMPLETE":  # rank 0's reaper says why
            assert "was killed from outside" in o.meta.get("reason", ""), (o.meta.get("reason"), what)
    else:
        assert len(o.lines) == 1, what
        check_line(o, phase, action, rank)
    assert o.shm_left == [], (o.shm_left, what)
    assert o.beside == [], (o.beside, what)


def check_line(o: Outcome, phase: str, action: str, rank: int) -> None:
    what = f"{action}@{phase}:{rank}\n{o.err}"
    line = o.lines[0]
    assert o.meta.get("reason") == line, (o.meta.get("reason"), what)
    if action == "raise":
        assert line.startswith(f"kvbench: error: rank {rank} on ") and f"raise@{phase} (KVBENCH_FAULT)" in line, what
    else:  # the peer that waited in vain says it
        assert line.startswith(f"kvbench: timeout: rank {1 - rank} on ") and "did not end within" in line, what
