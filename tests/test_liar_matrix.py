"""Every lie, in every mode: a transport that lies in one way (tests/liars.py) is caught, in each way the harness
moves bytes, and the same transport without the lie passes.

Lies: none (the control), the wrong block, completion before the bytes land, a read before the layer is final
(pull), one timed iteration skipped, one block written outside the ranges, and the forger (an eighth of each range
carried, the rest written from the public fill; over shm and tcp).  Modes: serial, streaming, handshake, in-flight
4, many-to-one on 4 ranks, a codec, staged device pools (torch-cpu), the hot and chunk references, pull, two-sided
tcp, the workload harness (many requests through a decode pool, one of them skipped by the skip lie), every liar
again under ``--fill realistic`` (shm and tcp), and each engine's own completion (nixl, ucx, mooncake, mpi) where
installed.  Every launch runs ``-c all`` with several cases (one per liar and mode), tiny sizes, 2 timed
iterations; a cell reads its own rows.  Every cell is strict.  A landing stamp is no lie here: the headline is the
harness's own time (tests/test_timed_window.py), a stamp that leads it is judged in tests/test_bounds.py.
"""
from __future__ import annotations

import pytest
from helpers.launch import Run, kvbench_run, liar_env, mpiexec

ENV = liar_env(root=True)
TINY = ["--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--tokens", "128", "-b", "16", "-e", "16", "-n", "2",
        "-w", "0", "--rounds", "1", "-c", "all", "--alloc", "random"]
# the lies every mode meets, beside the control; early last: where its early stamp is an error (ERROR ends the run,
# the one line names it) the other lies have run
LIES = ["nothing", "wrong-block", "skip", "outside", "early"]
# the forger (an eighth of each range carried, the rest written from the public fill) exists over shm and tcp
FORGE = ["forge"]
# where the destination's wait is the transport's own (a codec, staged, tcp), a transport that moves nothing returns
# at once: its stamp may precede the source's post, an error that ends the run, so it runs in a launch of its own
REST = LIES[1:]
SOLO = {"codec", "staged", "tcp", "tcp-realistic"}


def shm(*lies):
    return ",".join(["shm", *(f"lie-{x}" for x in lies)])


def tcp(*lies):
    return ",".join(["tcp", *(f"lie-{x}-tcp" for x in lies)])


REALISTIC = ["--fill", "realistic"]  # every liar again on content drawn like a real KV cache


ENGINES = ["nixl", "ucx", "mooncake", "mpi"]  # each engine's own completion, early (liars_engines.py)
# launch -> (ranks, arguments)
LAUNCHES = {
    "push": (2, ["-t", shm(*FORGE, *LIES), "--op", "push", "--overlap", "serial,streaming", "--handshake", "off,serial",
                 "--variants", "paged"]),
    "inflight": (2, ["-t", shm(*FORGE, *LIES), "--op", "push", "--inflight", "4", "--variants", "paged"]),
    "pull": (2, ["-t", shm("read-early", *FORGE, *LIES), "--op", "pull", "--overlap", "serial,streaming",
                 "--prefill-ms", "4", "--variants", "paged"]),  # streaming: a layer is final well after it is read
    "many-to-one": (4, ["-t", shm(*FORGE, *LIES), "--op", "push", "--scheme", "many-to-one", "--variants", "paged"]),
    "codec": (2, ["-t", shm(*REST), "--op", "push", "--codec", "lz4", "--variants", "paged"]),
    "codec-nothing": (2, ["-t", shm("nothing"), "--op", "push", "--codec", "lz4", "--variants", "paged"]),
    "references": (2, ["-t", shm(*FORGE, *LIES), "--op", "push", "--variants", "hot,ceiling"]),
    "staged": (2, ["-t", ",".join(["staged", *(f"lie-{x}-staged" for x in REST)]), "--memory", "torch-cpu",
                   "--op", "push", "--variants", "paged"]),
    "staged-nothing": (2, ["-t", "staged,lie-nothing-staged", "--memory", "torch-cpu", "--op", "push", "--variants", "paged"]),
    "tcp": (2, ["-t", tcp(*FORGE, *REST), "--op", "push", "--variants", "paged"]),
    "tcp-nothing": (2, ["-t", tcp("nothing"), "--op", "push", "--variants", "paged"]),
    "realistic": (2, ["-t", shm(*FORGE, *LIES), "--op", "push", *REALISTIC, "--variants", "paged"]),
    "tcp-realistic": (2, ["-t", tcp(*FORGE, *REST), "--op", "push", *REALISTIC, "--variants", "paged"]),
    "tcp-realistic-nothing": (2, ["-t", tcp("nothing"), "--op", "push", *REALISTIC, "--variants", "paged"]),
    # many requests into a decode pool held 20 ms each: every request has its epoch, its copy at completion
    "workload": (2, ["-t", shm(*FORGE, *LIES), "--op", "push", "--arrival", "interval:2", "--requests", "12", "--prompt", "64",
                     "--decode-ms", "20", "--prefill-ms", "1", "--decode-pool-tokens", "0", "--variants", "paged"]),
    "engines": (2, ["-t", ",".join(y for x in ENGINES for y in (x, f"lie-early-{x}")), "--op", "push",
                    "--variants", "paged"]),  # each honest engine beside its liar (and "ucx" has ucxx load first)
}
# mode -> (launch, rows of the mode, the transport name a lie takes there)
MODES = {
    "serial": ("push", "overlap == 'serial' and handshake == 'off'", "lie-{}"),
    "streaming": ("push", "overlap == 'streaming'", "lie-{}"),
    "handshake": ("push", "handshake == 'serial'", "lie-{}"),
    "in-flight 4": ("inflight", "inflight == 4", "lie-{}"),
    "pull": ("pull", "op == 'pull'", "lie-{}"),
    "many-to-one on 4 ranks": ("many-to-one", "world_size == 4", "lie-{}"),
    "codec lz4": ("codec", "codec == 'lz4'", "lie-{}"),
    "hot": ("references", "variant == 'hot'", "lie-{}"),
    "chunks": ("references", "variant.str.startswith('chunk')", "lie-{}"),
    "staged torch-cpu": ("staged", "memory == 'torch-cpu'", "lie-{}-staged"),
    "tcp": ("tcp", "op == 'push'", "lie-{}-tcp"),
    "workload": ("workload", "workload == 'interval:2'", "lie-{}"),
    "realistic fill": ("realistic", "fill == 'realistic'", "lie-{}"),
    "tcp, realistic fill": ("tcp-realistic", "fill == 'realistic'", "lie-{}-tcp"),
}
# the modes whose launch carries the forger (a codec's frames and staged's bounce buffers have none)
FORGED = {"serial", "streaming", "handshake", "in-flight 4", "pull", "many-to-one on 4 ranks", "hot", "chunks", "tcp",
          "workload", "realistic fill", "tcp, realistic fill"}
# `make check` reads two launches: push (every lie and the forger; serial, streaming, handshake) and pull
CHECK = {"push", "pull"}
CELLS = [pytest.param(lie, mode, id=f"{lie}/{mode}", marks=[pytest.mark.check] if MODES[mode][0] in CHECK else [])
         for mode in MODES for lie in ["none", *LIES]]
CELLS += [pytest.param("forge", mode, id=f"forge/{mode}", marks=[pytest.mark.check] if MODES[mode][0] in CHECK else [])
          for mode in MODES if mode in FORGED]
CELLS += [pytest.param("read-early", "pull", id="read-early/pull", marks=pytest.mark.check)]
_RUNS: dict[str, Run] = {}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(name) -> the Run of that launch, made once for the module."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")

    def get(name: str) -> Run:
        if name not in _RUNS:
            n, args = LAUNCHES[name]
            res = str(tmp_path_factory.mktemp(name.replace(" ", "-")))
            _RUNS[name] = kvbench_run(exe, [*TINY, *args], res, n, 300, ENV)  # none of its /dev/shm files left
        return _RUNS[name]

    return get


@pytest.mark.parametrize("lie,mode", CELLS)
def test_each_lie_is_caught_in_each_mode_and_the_honest_transport_passes(launched, lie, mode):
    launch, where, named = MODES[mode]
    r = launched(f"{launch}-nothing" if lie == "nothing" and launch in SOLO else launch)
    assert r.code in (2, 4) and r.meta()["status"] in ("FAILED", "ERROR"), r.out[-3000:] + r.err[-3000:]
    assert "Traceback" not in r.out + r.err
    control = {"lie-{}": "shm", "lie-{}-staged": "staged", "lie-{}-tcp": "tcp"}[named]
    name = control if lie == "none" else ("lie-read-early" if lie == "read-early" else named.format(lie))
    line = r.meta().get("reason", "")
    if r.code == 4 and f"({name} " in line:  # the lie was an error: its one line names its case and the cause
        assert lie in ("early", "nothing") and "before the source posted" in line, line
        return
    rows = r.transfers().query(f"transport == '{name}' and role != 'prefill'").query(where)
    assert len(rows) and (rows.status == "ok").all(), (name, mode, r.out[-2000:])
    wrong = rows.groupby("case")["nwrong"].sum()
    if mode == "workload":  # a write into a block nobody held is a violation of its case, counted like a wrong element
        wrong += wrong.index.map(lambda c: r.meta()["load"][str(c)]["violations"])
    if lie == "none":
        assert (wrong == 0).all(), (name, mode, wrong)
    else:
        assert (wrong > 0).all(), (name, mode, wrong)  # every case of the mode caught it


@pytest.mark.check
def test_the_skipped_iteration_is_the_one_named(launched):
    """The skip lie drops iteration 1 only: its rows, and no other timed row, carry wrong elements."""
    t = launched("push").transfers().query("transport == 'lie-skip' and role == 'decode'")
    bad = t[t.nwrong > 0]
    assert set(bad["iter"]) == {1}


@pytest.mark.alone  # microseconds early: beside another test file's ranks the destination's copy can come late
@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_whose_completion_comes_early_is_caught(launched, engine):
    """The engine's own completion path (NIXL's notification, UCX's request completion, Mooncake's notice, MPI's
    note and Win.Sync) says a push is complete a few microseconds before its bytes start to land: the
    destination's copy at that completion holds what had not landed; the honest engine passes."""
    from kvbench import transports

    if transports.probe(engine) is not None:
        pytest.skip(f"{engine}: {transports.probe(engine)}")
    r = launched("engines")
    t = r.transfers().query("role != 'prefill'")
    rows, honest = t.query(f"transport == 'lie-early-{engine}'"), t.query(f"transport == '{engine}'")
    assert len(rows) and (rows.status == "ok").all(), r.out[-2000:] + r.err[-2000:]
    # caught: an engine that moves the bytes at memory speed (MPICH's Put within a node) may land them all
    # before a descheduled destination's copy in one iteration, not in all of them
    assert rows["nwrong"].sum() > 0, rows[["iter", "nwrong"]]
    assert len(honest) and (honest.status == "ok").all() and (honest["nwrong"] == 0).all(), honest[["iter", "nwrong"]]
