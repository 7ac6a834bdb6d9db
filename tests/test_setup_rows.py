"""Setup rows (harness/setuprows.py, schema 6): each rank's allocate, fill, register, exchange and connect per
transport, the --pool-sizes registration sweep, and each case's first transfer against its steady p50; their table
in `kvbench run`; older result files still read; bad sizes refused in one line."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from helpers.asserts import assert_one_line
from helpers.launch import ROOT, kvbench_cli, mpiexec

from kvbench.cli.main import build_parser
from kvbench.config import runconfig
from kvbench.harness import preflight
from kvbench.harness.setuprows import PHASES
from kvbench.report import setup as S
from kvbench.report import summarize
from kvbench.report.tables import read
from kvbench.results.store import ROW_COLUMNS, SCHEMA_VERSION, SETUP_DEFAULTS, ResultWriter

GiB, MiB = 2**30, 2**20
SIZES = (MiB, 2 * MiB)


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """One run of shm (no registration) and mpi (windows), two pool sizes: every check below reads it."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    out = tmp_path_factory.mktemp("lifecycle")
    cmd = [exe, "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", str(out), "-t", "shm,mpi", "--tokens", "16",
           "-n", "2", "-w", "1", "--rounds", "1", "-b", "16", "-e", "16", "--variants", "bulk,paged",
           "--pool-sizes", "1MiB,2MiB", "--progress", "off", "--timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = next(out.glob("*/*.parquet"))
    meta = json.loads(path.with_suffix("").with_suffix(".meta.json").read_text())
    return r.stdout, pd.read_parquet(path), dict(meta, path=str(path))


def test_each_rank_times_each_phase_once_per_region_peer_and_pool_size(lifecycle):
    _, df, meta = lifecycle
    assert meta["schema_version"] == SCHEMA_VERSION >= 6  # 6 added the setup rows
    s = df[df["row_kind"] == "setup"]
    assert (s["world_size"] == 2).all()  # the rank count: connection scale compares runs by it (bench-connect)
    assert (s["iter"] == -2).all() and set(s["phase"]) <= set(PHASES)
    assert (df[df["row_kind"] == "transfer"]["phase"] == "").all()
    for name in ("shm", "mpi"):
        t = s[s["transport"] == name]
        got = t[t["phase"] != "first"].groupby(["rank", "phase"]).size().to_dict()
        want = {"alloc": 1, "fill": 1, "register": 1, "exchange": 1, "connect": 1}
        want |= {"pool-register": 2, "pool-deregister": 2} if name == "mpi" else {"pool-register": 2}
        assert got == {(r, p): n for r in (0, 1) for p, n in want.items()}, (name, got)
        conn = t[t["phase"] == "connect"]
        assert sorted(zip(conn["rank"], conn["peer"])) == [(0, 1), (1, 0)]
        pools = t[t["phase"] == "pool-register"]
        assert sorted(pools["region_bytes"]) == sorted(2 * SIZES)
        region = t[t["phase"].isin(["alloc", "fill", "register"])]["region_bytes"]
        assert (region > 0).all() and (t[t["phase"] != "first"]["seconds"].dropna() >= 0).all()
    mpi, shm = s[s["transport"] == "mpi"], s[s["transport"] == "shm"]
    # mpi registers (a window per pool): every register and pool-register row took time
    assert (mpi[mpi["phase"].isin(["register", "pool-register"])]["seconds"] > 0).all()
    # shm registers nothing, and its rows say so; the sweep did not pretend to measure it
    assert shm[shm["phase"] == "register"]["reason"].str.contains("registers nothing").all()
    swept = shm[shm["phase"] == "pool-register"]
    assert (swept["status"] == "none").all() and swept["seconds"].isna().all()


def test_every_case_has_its_first_transfer_per_rank_and_request(lifecycle):
    _, df, _ = lifecycle
    timed = df[(df["row_kind"] == "transfer") & (df["iter"] >= 0)]
    first = df[df["phase"] == "first"]
    assert set(first["case"]) == set(timed["case"])
    per = first.groupby(["case", "rank", "pair", "req"]).size()
    assert (per == 1).all() and len(per) == timed.groupby(["case", "rank", "pair", "req"]).ngroups
    assert (first["seconds"] > 0).all()
    # setup rows go under a case number the run has: a reader counting cases sees no extra one
    assert set(df["case"]) == set(timed["case"]) and len(summarize(df)) == timed["case"].nunique()


def test_the_run_prints_the_setup_table_after_the_bandwidth_table(lifecycle):
    out, df, _ = lifecycle
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("# setup:"))
    head = lines[at + 1].split()
    assert head[:6] == ["#", "transport", "mem", "alloc(s)", "fill(s)", "reg(s)"] and "reg@1M" in head
    assert head[-4:] == ["conn(s)/peer", "first(ms)", "p50(ms)", "first/p50"]
    rows = {ln[1:].split()[0]: ln[1:].split() for ln in lines[at + 2:at + 4]}
    assert set(rows) == {"shm", "mpi"} and rows["shm"][5:7] == ["-", "-"]  # no sweep on shm: no numbers
    assert all(float(x) >= 0 for x in rows["mpi"][5:7])  # a number (a window over 1 MiB may take under 50 us: 0.0000)
    assert float(rows["mpi"][-1]) > 0 and any("shm registers nothing" in ln for ln in lines[at:])
    bw = [i for i, ln in enumerate(lines) if ln.split()[:1] in (["shm"], ["mpi"]) and "push" in ln]
    assert bw and max(bw) < at
    t = S.per_transport(df)
    fvs = S.first_vs_steady(df)
    assert np.allclose(fvs["ratio"], fvs["first_ms"] / fvs["p50_ms"]) and set(t["transport"]) == {"shm", "mpi"}


def test_the_report_has_the_setup_table_and_section_with_the_registration_plot(lifecycle, tmp_path):
    _, _, meta = lifecycle
    term = kvbench_cli("report", meta["path"])
    assert term.returncode == 0 and "# setup: each phase on the slowest rank" in term.stdout, term.stderr
    page = kvbench_cli("report", meta["path"], "-o", str(tmp_path), timeout=120)
    assert page.returncode == 0, page.stderr
    md = (tmp_path / "report.md").read_text()
    section = md[md.index("## Setup"):]
    assert "*setup per transport*" in section and "| reg@1M | reg@2M |" in section
    assert "*first transfer against steady p50, per case*" in section
    assert "![Seconds to register one pool of each --pool-sizes size" in section
    assert "![Each case's first transfer (its first warm-up" in section  # the first-vs-steady plot
    shown = [ln for ln in section.splitlines() if ln.startswith("![")]
    assert len(shown) == 2 and all((tmp_path / ln.split("](", 1)[1].rstrip(")")).stat().st_size > 0 for ln in shown)


def _old_file(tmp_path, schema: int) -> str:
    """A result set as a schema-``schema`` kvbench left it: no setup columns, nor setup rows."""
    w = ResultWriter(str(tmp_path), "old", {"suite": {"name": "old"}, "hosts": ["h", "h"]})
    base = {c: np.nan for c in ROW_COLUMNS} | dict(
        transport="shm", op="push", memory="host", model="m", tokens=16, prefix_hit=0.0, block_size=16,
        block_bytes=4096, layout="layer-major", allocation="random", coalesce="off", dtype="fp16", codec="none",
        overlap="serial", scheme="pairwise", tp=1, pp=1, world_size=2, inflight=1, handshake="off",
        prefill_ms_set="0", workload="none", layers=2, variant="paged", pair=0, req=0, round=0, status="ok",
        reason="", payload_bytes=MiB, wire_bytes=MiB, descriptors=8, case=1)
    w.add([base | dict(rank=r, role=("prefill", "decode")[r], iter=i, seconds=1e-3 * (1 + i)) for i in range(5)
           for r in (0, 1)])
    w.close()
    pd.read_parquet(w.path).drop(columns=list(SETUP_DEFAULTS)).to_parquet(w.path)
    meta = json.load(open(w.meta_path)) | {"schema_version": schema}
    json.dump(meta, open(w.meta_path, "w"))
    return w.path


def test_a_schema_5_file_still_reads_with_its_rows_as_transfers(tmp_path):
    df, meta = read(_old_file(tmp_path, 5))
    assert meta["schema_version"] == 5 and (df["row_kind"] == "transfer").all() and (df["phase"] == "").all()
    assert len(summarize(df)) == 1 and S.setup_rows(df).empty and S.table_lines(df) == []


@pytest.mark.parametrize("sizes, needle", [
    ("0", "'0': a pool size must be positive"),
    ("1GiB,0", "'0': a pool size must be positive"),
    ("1,,2", "comma-separated"),
    ("4PiB", "'4PiB' is not a size"),
    ("1GiB,1GiB", "listed twice"),
    ("900TiB", "more than this machine's memory"),
    ("100000TiB", "'100000TiB' in bytes is 1.09951e\\+17: give 0 to 1,125,899,906,842,624"),
])
def test_bad_pool_sizes_are_refused_in_one_line(sizes, needle):
    a = build_parser().parse_args(["run", "-t", "shm", "--pool-sizes", sizes])
    with pytest.raises(runconfig.ConfigError, match=needle) as exc:
        runconfig.build(a, [], world=2)
    assert "\n" not in str(exc.value)


def test_sizes_with_one_unit_at_the_end_apply_it_to_all():
    a = build_parser().parse_args(["run", "-t", "shm", "--pool-sizes", "0.25,1,4GiB"])
    assert runconfig.build(a, [], world=2).options().pool_sizes == (GiB // 4, GiB, 4 * GiB)


def test_pool_sizes_beyond_the_available_memory_are_refused_before_trying(monkeypatch):
    class Comm:
        rank, hostname = 0, "h"

        def allgather(self, x):
            return [x, x]

    monkeypatch.setattr(preflight.memory, "available_bytes", lambda: 8 * GiB)
    assert preflight.check(Comm(), [("mpi", MiB, 4096)], {}, sweep=3 * GiB) is None
    why = preflight.check(Comm(), [("mpi", MiB, 4096)], {}, sweep=4 * GiB)
    assert why.startswith("mpi: --pool-sizes up to 4.00 GiB needs 8.00 GiB on host h (2 ranks)")
    assert preflight.check(Comm(), [("shm", MiB, 4096)], {}, sweep=4 * GiB) is None  # shm registers nothing


def test_pool_sizes_zero_is_one_line_and_exit_1(kvrun):
    assert_one_line(kvrun(["-t", "shm", "--pool-sizes", "0"], n=1, timeout=60), "pool_sizes", "must be positive")
