"""--register once|per-request (schema 7): the initiator registers each request's local blocks inside the timed
request and deregisters them after its landing, on nixl and mooncake; the rows carry the cost per request beside
``once``; transports without a registration of their own are refused (alone) or skipped (in a mix)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers.asserts import assert_nothing_written, assert_one_line
from helpers.launch import ROOT, unavailable

from kvbench.cli.main import build_parser
from kvbench.config import runconfig
from kvbench.model.descriptors import regions
from kvbench.results.store import SCHEMA_VERSION, upgrade

ITERS, WARMUP = 3, 1


def test_regions_merge_what_overlaps_or_touches_and_cover_exactly_the_union():
    got = regions(np.array([10, 0, 4, 30, 20, 21]), np.array([5, 4, 2, 5, 10, 2]))
    assert got.tolist() == [[0, 6], [10, 5], [20, 15]]
    rng = np.random.default_rng(7)
    for _ in range(50):
        starts = rng.integers(0, 4096, 200)
        lens = rng.integers(1, 64, 200)
        got = regions(starts, lens)
        want = np.zeros(4096 + 64, bool)
        for s, n in zip(starts, lens):
            want[s:s + n] = True
        have = np.zeros_like(want)
        for s, n in got:
            assert not have[s:s + n].any()  # no two regions overlap
            have[s:s + n] = True
        assert (have == want).all()
        assert (got[1:, 0] > got[:-1].sum(axis=1)).all()  # sorted, and none touches the next
    assert regions(np.array([], np.int64), np.array([], np.int64)).shape == (0, 2)


def test_per_request_with_only_transports_that_register_nothing_is_one_line_and_exit_1(kvrun, tmp_path):
    r = kvrun(["-t", "shm", "--register", "per-request"], timeout=60)
    assert_one_line(r, "--register per-request: shm registers nothing per request", "nixl, mooncake")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("argv, needle", [
    (["-t", "shm,tcp", "--register", "per-request"], "shm, tcp register nothing per request"),
    (["-t", "loopback", "--register", "once,per-request"], "loopback registers nothing per request"),
    (["-t", "nixl", "--register", "each"], "axes.register.0': Input should be 'once' or 'per-request'"),
    (["-t", "nixl", "--register", "per-request", "--arrival", "poisson:10"], "not under a workload"),
])
def test_bad_register_input_is_refused(argv, needle):
    with pytest.raises(runconfig.ConfigError, match=needle) as exc:
        runconfig.build(build_parser().parse_args(["run", *argv]), [], world=2)
    assert "\n" not in str(exc.value)


def test_older_rows_read_as_registered_once():
    import pandas as pd

    assert SCHEMA_VERSION >= 7  # 8 added wire_counted_bytes (results/schema.py)
    df = upgrade(pd.DataFrame({"case": [1], "seconds": [1.0]}), 6)
    assert df["register"].tolist() == ["once"] and df["register_s"].isna().all() and df["deregister_s"].isna().all()


@pytest.mark.launches
def test_nixl_deregistration_reaches_the_library():
    """In one process: an initiator that registered no pool can prepare its local list only while a request's
    registration stands; after deregister_request the library refuses it again, and the bytes moved meanwhile."""
    if reason := unavailable("nixl"):
        pytest.skip(reason)
    code = r"""
import numpy as np
from kvbench import memory
from kvbench.model.layout import Pool
from kvbench.transports.base import Context
from kvbench.transports.nixl import NixlTransport
a = NixlTransport(Context(0, 2, "h", "rq", register="per-request", reached=False))
b = NixlTransport(Context(1, 2, "h", "rq", register="per-request", reached=True))
pa, pb = Pool(memory.alloc_host(1 << 20)), Pool(memory.alloc_host(1 << 20))
memory.fill(pa.array, 0); memory.fill(pb.array, 1)
ma, mb = a.register(pa), b.register(pb)
a.connect({1: mb}); b.connect({0: ma})
d = np.array([[0, 4096, 8192], [65536, 0, 4096]], dtype=np.int64)
loc = a._entry("push", 1, d)[1]
def prep():
    try:
        a.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM").release()
        return "ok"
    except Exception as exc:
        return type(exc).__name__
before = prep()
h = a.register_request("push", 1, [[d]])
during = prep()
x, s = a.post("push", 1, d, 7), b.serve("push", 0, d, 7)
a.wait(x); b.wait(s)
moved = bytes(pb.array[4096:12288]) == bytes(pa.array[:8192]) and bytes(pb.array[:4096]) == bytes(pa.array[65536:69632])
a.deregister_request(h)
print("RESULT", a.reg is None, b.reg is not None, before, during, prep(), moved, dict(a.counts), len(a.fresh))
a.close(); b.close(); pa.release(); pb.release()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    assert line.split(" ", 1)[1] == ("True True nixlNotFoundError ok nixlNotFoundError True "
                                     "{'registered': 1, 'deregistered': 1} 0"), line


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_per_request_on_two_ranks_registers_each_request_inside_its_time_and_undoes_it(kvrun, engine):
    if reason := unavailable(engine):
        pytest.skip(reason)
    r = kvrun(["-t", engine, "--register", "once,per-request", "--op", "push,pull", "--tokens", "64", "-b", "16",
               "-e", "16", "-n", str(ITERS), "-w", str(WARMUP), "--rounds", "1", "-c", "all",
               "--variants", "bulk,paged", "--progress", "off"], timeout=400)
    assert r.code == 0, r.out[-3000:] + r.err[-3000:]
    df = r.transfers()
    ok = df[df.status == "ok"]
    assert set(ok.register) == {"once", "per-request"} and int(ok.nwrong.fillna(0).sum()) == 0
    every = ok[ok.iter >= 0]
    assert every.nwrong.notna().all()  # -c all: every timed iteration was checked
    timed = every[every.register == "per-request"]
    init = timed[timed.role == np.where(timed.op == "push", "prefill", "decode")]
    target = timed.drop(init.index)
    assert len(init) == len(target) == 2 * 2 * ITERS  # (bulk, paged) x (push, pull) x iterations
    # the initiator's every request registered and deregistered; registration inside the request's seconds
    assert (init.register_s > 0).all() and (init.deregister_s > 0).all()
    assert (init.seconds >= init.register_s).all()
    assert target.register_s.isna().all() and every[every.register == "once"].register_s.isna().all()
    # through the transport: every request registered once and deregistered once, on the initiator alone; the
    # initiator's pool was not registered at setup, the target's was
    per = r.meta()["per_request"]
    runs = 2 * (WARMUP + ITERS + 1)  # (bulk, paged) x (warm-ups, timed, the check pass)
    for op, initiator in (("push", 0), ("pull", 1)):
        counts = per[f"{engine} {op}"]
        assert counts[initiator] == {"registered": runs, "deregistered": runs, "pool_registered": False}, counts
        assert counts[1 - initiator] == {"pool_registered": True}, counts
    assert "reg(us)" in r.out and "dereg(us)" in r.out and "per-request" in r.out
    # the setup table: a line per session, once (both ops) and per-request per op, its register row saying why
    setup = [ln.split() for ln in r.out.splitlines() if ln.startswith(f"#{engine:>12} ")]
    assert sorted((x[3], x[4]) for x in setup) == [("once", "push"), ("per-request", "pull"), ("per-request", "push")]
    assert "# --register per-request: no pool registered at setup" in r.out


def test_a_mix_skips_the_transports_that_register_nothing_with_the_reason(kvrun):
    if reason := unavailable("mooncake"):
        pytest.skip(reason)
    r = kvrun(["-t", "mooncake,shm", "--register", "per-request", "--tokens", "16", "-b", "16", "-e", "16", "-n", "1",
               "-w", "0", "--rounds", "1", "--variants", "paged", "--progress", "off"], timeout=300)
    assert r.code == 0, r.out[-3000:] + r.err[-3000:]
    df = r.transfers()
    shm = df[df.transport == "shm"]
    assert (shm.status == "skipped").all() and shm.reason.str.contains("--register per-request: shm registers "
                                                                      "nothing").all()
    assert (df[df.transport == "mooncake"].status == "ok").all()
